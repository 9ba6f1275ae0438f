"""Multi-turn rollouts with tool calls and interactions: the tools (verl's interface and tool config
files), the parser that finds the calls in a response, and the interactions (verl's simulated user
and its config files). The turn loop that uses them is `agent.loop`."""

from agent.interactions import (
    BaseInteraction,
    Gsm8kInteraction,
    InteractionConfigError,
    InteractionError,
    finalize_interactions,
    interaction_turns,
    load_interactions,
    start_interactions,
)
from agent.tool_parser import FORMATS, ToolCall, check_format, parse_tool_calls
from agent.tools import (
    BaseTool,
    Gsm8kTool,
    ToolConfigError,
    ToolError,
    ToolResponse,
    call_tool,
    check_truncation,
    load_tools,
    message_ids,
    run_tool_calls,
    system_prompt_ids,
    tool_message_ids,
    truncate_tool_text,
    validate_tool_schema,
)

__all__ = [
    "FORMATS",
    "BaseInteraction",
    "BaseTool",
    "Gsm8kInteraction",
    "Gsm8kTool",
    "InteractionConfigError",
    "InteractionError",
    "ToolCall",
    "ToolConfigError",
    "ToolError",
    "ToolResponse",
    "call_tool",
    "check_format",
    "check_truncation",
    "finalize_interactions",
    "interaction_turns",
    "load_interactions",
    "load_tools",
    "message_ids",
    "parse_tool_calls",
    "run_tool_calls",
    "start_interactions",
    "system_prompt_ids",
    "tool_message_ids",
    "truncate_tool_text",
    "validate_tool_schema",
]
