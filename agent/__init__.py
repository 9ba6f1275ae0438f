"""Multi-turn rollouts with tool calls and interactions: the tools (verl's interface and tool config
files), the parser that finds the calls in a response, and the interactions (verl's simulated user
and its config files). The turn loop that uses them is `agent.loop`."""

import importlib

_EXPORTS = {
    "agent.interactions": (
        "BaseInteraction", "Gsm8kInteraction", "InteractionConfigError", "InteractionError", "finalize_interactions",
        "interaction_turn", "interaction_turns", "load_interactions", "start_interactions",
    ),
    "agent.tool_parser": ("FORMATS", "ToolCall", "check_format", "parse_tool_calls"),
    "agent.tools": (
        "BaseTool", "ChatTemplateError", "Gsm8kTool", "ToolConfigError", "ToolError", "ToolResponse", "call_tool",
        "check_message_template", "check_parallel_calls", "check_truncation", "load_tools", "message_ids",
        "run_tool_calls", "select_tools", "system_prompt_ids", "tool_message_ids", "tool_turn", "truncate_tool_text",
        "validate_tool_schema",
    ),
}

__all__ = [
    "FORMATS",
    "BaseInteraction",
    "BaseTool",
    "ChatTemplateError",
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
    "check_message_template",
    "check_parallel_calls",
    "check_truncation",
    "finalize_interactions",
    "interaction_turn",
    "interaction_turns",
    "load_interactions",
    "load_tools",
    "message_ids",
    "parse_tool_calls",
    "run_tool_calls",
    "select_tools",
    "start_interactions",
    "system_prompt_ids",
    "tool_message_ids",
    "tool_turn",
    "truncate_tool_text",
    "validate_tool_schema",
]


def __getattr__(name: str):
    """PEP 562: a name of `__all__` is imported from its module on first use, so that importing one
    light module of `agent` (or `agent` itself) does not load the heavy ones."""
    for module, names in _EXPORTS.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(module), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
