"""Tool calls in a response's text, read the way verl's Hermes parser reads them.

A Hermes-format model (Qwen2.5 and others) writes each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. `parse_tool_calls` finds every such
span (shortest match, across lines), keeps those whose JSON holds a string `name` and an
`arguments` value, and returns the text with every span removed, well-formed or not: the same
calls and content as verl's `HermesToolParser` on the decoded response. A call that does not
parse is dropped, not reported to the model, as in verl.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FORMAT_KEY = "actor_rollout_ref.rollout.multi_turn.format"
FORMATS = ("hermes",)
# the other tool-call formats verl 0.9.1 registers (its ToolParser.register names), none parsed here
VERL_OTHER_FORMATS = ("gpt-oss", "qwen3_coder", "glm", "seed", "minimax", "kimi", "deepseek_v4", "gemma4")

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments as JSON text (the tool gets them decoded)."""

    name: str
    arguments: str


def check_format(fmt: str) -> str:
    """`fmt` if meshppo parses it, else a ValueError naming the config key and the formats there are."""
    if fmt not in FORMATS:
        raise ValueError(f"{FORMAT_KEY}={fmt!r} is not supported; supported: {list(FORMATS)} "
                         f"(verl 0.9.1's other formats, not supported here: {list(VERL_OTHER_FORMATS)})")
    return fmt


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ToolCall]]:
    """The response's content without its tool-call spans, and the calls it makes, in order.

    Without both tags the text has no calls and comes back whole. Each call's arguments are
    re-encoded as JSON with non-ASCII characters kept as they are.
    """
    check_format(fmt)
    if _HERMES_START not in text or _HERMES_END not in text:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError) as err:  # not JSON, not an object, a key missing
            logger.warning("skipping a malformed tool call (%s): %.200r", err, body)
            continue
        if not isinstance(name, str):
            logger.warning("skipping a tool call whose name is not a string: %.200r", body)
            continue
        calls.append(ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
    return _HERMES_CALL.sub("", text), calls
