"""Multi-turn rollouts with tool calls: the tools (verl's interface and tool config files) and the
parser that finds the calls in a response. The turn loop that uses them lives in the trainer."""

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
    run_tool_calls,
    system_prompt_ids,
    tool_message_ids,
    truncate_tool_text,
    validate_tool_schema,
)

__all__ = [
    "FORMATS",
    "BaseTool",
    "Gsm8kTool",
    "ToolCall",
    "ToolConfigError",
    "ToolError",
    "ToolResponse",
    "call_tool",
    "check_format",
    "check_truncation",
    "load_tools",
    "parse_tool_calls",
    "run_tool_calls",
    "system_prompt_ids",
    "tool_message_ids",
    "truncate_tool_text",
    "validate_tool_schema",
]
