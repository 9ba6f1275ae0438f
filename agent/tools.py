"""Tools for multi-turn rollouts: verl's tool interface, its GSM8K tool, its tool config file, and
the steps of one tool turn (run the calls, cut the answers, render them as tokens).

A tool is a `BaseTool` with verl's methods and semantics (`create` an instance per call,
`execute` it, `release` it), so a tool written for verl runs here by subclassing this class
instead of verl's. What differs: the schema is the OpenAI function schema as a plain dict
(checked when the tool is built), `ToolResponse` carries text only (a tool that returns an image
or a video stops the run naming the tool), and `execute` gets no `agent_data` (meshppo's turn
loop has none).

A sample's tool turn is `tool_turn`: its calls of the turn (the first `max_parallel_calls`) run
concurrently; `run_tool_calls` runs a batch of rows' turns at once. Each call is `call_tool`,
verl's `_call_tool`: a call the model got wrong or a tool that raises becomes an answer with
reward 0.0 that the model sees and learns from, in verl 0.9.1's words (`unknown_tool_text`,
`bad_arguments_text`, `tool_failed_text`).
The answers go back to the model as `tool` messages through the chat template,
`tool_message_ids`, after what the template writes after the model's end-of-turn token
(`turn_end_ids`: Qwen's `\\n` after `<|im_end|>`).

The turn loop runs a rollout's tool turns in one event loop (`agent._load.EventLoop`), so a tool
may keep objects bound to it (an `asyncio.Lock`) for the rollout, not from one rollout to the next.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from agent._load import cancelled_from_outside, load_class, read_entries, run
from agent.tool_parser import ToolCall
from rewards import gsm8k
from rewards.registry import real_value

logger = logging.getLogger(__name__)

_MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
TOOL_CONFIG_KEY = f"{_MULTI_TURN}.tool_config_path"
LENGTH_KEY = f"{_MULTI_TURN}.max_tool_response_length"
SIDE_KEY = f"{_MULTI_TURN}.tool_response_truncate_side"
PARALLEL_KEY = f"{_MULTI_TURN}.max_parallel_calls"
TRUNCATE_SIDES = ("left", "right", "middle")


class ToolConfigError(ValueError):
    """A tool config file or a tool's schema that cannot be used; the message names the file,
    the entry and the key."""


class ToolError(RuntimeError):
    """A tool broke its contract (returned media, or a response or reward of the wrong type): a bug in the
    tool, not a mistake of the model, so it stops the run instead of becoming the model's answer."""


@dataclass
class ToolResponse:
    """What a tool answers. Only `text` is supported; `image` and `video` exist so that a tool
    written for verl builds its response unchanged, and `call_tool` refuses one that sets them."""

    text: str | None = None
    image: Any = None
    video: Any = None


# ---- schemas


def validate_tool_schema(schema: Any, where: str) -> dict:
    """`schema` if it is an OpenAI function schema (`type: function`, a non-empty `function.name`,
    `function.parameters` an object schema when given), else a ToolConfigError naming `where` and
    the key. It is handed to the chat template as it is."""
    if not isinstance(schema, dict):
        raise ToolConfigError(f"{where}: must be a mapping (an OpenAI function schema), got {type(schema).__name__}")
    if schema.get("type") != "function":
        raise ToolConfigError(f"{where}.type: must be 'function', got {schema.get('type')!r}")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}.function: must be a mapping with the function's name, description and "
                              f"parameters, got {type(function).__name__}")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolConfigError(f"{where}.function.name: must be a non-empty string, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolConfigError(f"{where}.function.description: must be a string, got {type(description).__name__}")
    params = function.get("parameters")
    if params is None:
        return schema
    key = f"{where}.function.parameters"
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ToolConfigError(f"{key}: must be a JSON object schema (a mapping with type: object), got {params!r}")
    properties = params.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        raise ToolConfigError(f"{key}.properties: must map each parameter's name to its schema, got {properties!r}")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolConfigError(f"{key}.required: must be a list of parameter names, got {required!r}")
    unknown = [r for r in required if r not in properties]
    if unknown:
        raise ToolConfigError(f"{key}.required: {unknown} are not among the properties {list(properties)}")
    return schema


# ---- tools


class BaseTool:
    """verl's tool interface. `create` makes an instance for one call (verl's agent loop passes the
    row's `create_kwargs` as the keyword `create_kwargs`), `execute` runs it on the parsed arguments
    and returns (response, step reward or None, metrics), `calc_reward` scores the instance's state,
    `release` frees it. The base tool answers every call with a fixed text and reward 0.0, as
    verl's does."""

    def __init__(self, config: dict, tool_schema: dict | None):
        self.config = config
        schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if schema is None:
            raise ToolConfigError(f"{type(self).__name__}: no tool_schema given and "
                                  "get_openai_tool_schema() gives none")
        self.tool_schema = validate_tool_schema(schema, f"{type(self).__name__} tool_schema")
        self.name: str = self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict | None:
        """The schema used when the config gives none (none here); once built, the tool's schema."""
        return self.__dict__.get("tool_schema")

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """A new instance's id (`instance_id`, or a fresh one) and the tool's greeting (empty)."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs) -> tuple[ToolResponse | str, float | None, dict]:
        """Run the call: (response, the step's reward or None, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The reward of the instance's current state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Free what the instance holds."""


# verl's calc_gsm8k_reward schema, as its example tool config writes it.
GSM8K_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if "
                       "parsed answer is incorrect or not correctly parsed)",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {"type": "string",
                           "description": "The model's answer to the GSM8K math problem, must be a digits"},
            },
            "required": ["answer"],
        },
    },
}

# A submitted answer that does not raise the instance's score costs this much (verl's value).
GSM8K_NO_IMPROVEMENT_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """verl's `calc_gsm8k_reward`: the model submits an answer and reads back its score.

    `create` keeps the row's ground truth (the keyword `ground_truth`, else
    `create_kwargs["ground_truth"]`). `execute` stores the answer with `#### ` in front unless it has
    it, scores it with `rewards.gsm8k.compute_score` (flexible: the last number, 1.0 if it equals
    the ground truth, else 0.0), and answers `Current parsed answer='…' reward=…`; the step reward is
    0.0 when the score beats the instance's previous one and -0.05 otherwise (a resubmission that
    does not improve). The score prints as a float, 0.0 where verl prints 0 for an answer without a
    number.
    """

    def __init__(self, config: dict, tool_schema: dict | None):
        self._instances: dict[str, dict[str, Any]] = {}
        super().__init__(config, tool_schema)

    def get_openai_tool_schema(self) -> dict:
        return self.__dict__.get("tool_schema") or copy.deepcopy(GSM8K_TOOL_SCHEMA)

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else GSM8K_NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible",
                                   format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instances[instance_id]


def select_tools(tools: dict[str, Any], selection: Any) -> dict[str, Any]:
    """A row's tools, verl 0.9.1's `extra_info.tool_selection`: those of `tools` (by name: the tools,
    or their schemas) that `selection` names, in its order, each once; None or an empty list: all of
    `tools`. A selection that is not a list of names, or that names something not in `tools` (which
    verl drops without a word), is a ValueError saying so (its text follows the field's name)."""
    if selection is None:
        return tools
    if not isinstance(selection, list) or not all(isinstance(name, str) for name in selection):
        raise ValueError(f"must be a list of tool names (strings), got {selection!r}")
    unknown = [name for name in selection if name not in tools]
    if unknown:
        raise ValueError(f"names {unknown[0]!r}, which is not a tool of {TOOL_CONFIG_KEY} (its tools: "
                         f"{list(tools)}); verl 0.9.1 drops such a name, meshppo refuses it")
    return {name: tools[name] for name in selection} if selection else tools


# ---- the tool config file

# verl's class names for the tools meshppo provides, so that verl's tool configs load as written.
VERL_TOOL_CLASSES = {
    "verl.tools.base_tool.BaseTool": BaseTool,
    "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool,
}
_ENTRY_KEYS = ("class_name", "config", "tool_schema")


def load_tools(path: str | os.PathLike) -> list[BaseTool]:
    """The tools of a verl tool config file (`tools:`, a list of `class_name`, `config` with
    `type: native`, and `tool_schema`, the tool's OpenAI function schema or none for the class's
    own), built in order. Every problem is a ToolConfigError naming the file, the entry and the key."""
    path = os.fspath(path)
    entries = read_entries(path, "tools", "tool config", TOOL_CONFIG_KEY, ToolConfigError)
    tools: list[BaseTool] = []
    first_index: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: must be a mapping with {list(_ENTRY_KEYS)}, got {type(entry).__name__}")
        # verl's MCP entries (`config: {type: mcp}` and an `mcp:` key) are told so, before their `mcp` key
        # would be reported as unknown
        config = entry.get("config")
        kind = config.get("type") if isinstance(config, dict) else None
        if kind == "mcp" or "mcp" in entry:
            raise ToolConfigError(f"{where}.{'config.type' if kind == 'mcp' else 'mcp'}: 'mcp' tools are not "
                                  "supported; meshppo runs native tools (type: native) only")
        unknown = [k for k in entry if k not in _ENTRY_KEYS]
        if unknown:
            raise ToolConfigError(f"{where}: unknown keys {unknown}; an entry has {list(_ENTRY_KEYS)}")
        if "class_name" not in entry:
            raise ToolConfigError(f"{where}.class_name: missing (the tool's class, package.module.Class)")
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: must be a mapping with at least 'type: native', got {config!r}")
        if kind != "native":
            raise ToolConfigError(f"{where}.config.type: must be 'native', got {kind!r}")
        schema = entry.get("tool_schema")
        if schema is not None:
            validate_tool_schema(schema, f"{where}.tool_schema")
        cls = load_class(entry["class_name"], f"{where}.class_name", BaseTool, VERL_TOOL_CLASSES, "tools",
                         ToolConfigError)
        try:
            tool = cls(config=config, tool_schema=schema)
        except ToolConfigError as err:
            raise ToolConfigError(f"{where}: {err}") from err
        except Exception as err:
            raise ToolConfigError(f"{where}: {entry['class_name']}(config, tool_schema) failed: "
                                  f"{type(err).__name__}: {err}") from err
        if tool.name in first_index:
            raise ToolConfigError(f"{where}.tool_schema.function.name: {tool.name!r} is also the name of "
                                  f"tools[{first_index[tool.name]}]; tool names must be unique")
        first_index[tool.name] = i
        tools.append(tool)
    return tools


# ---- one tool turn


def check_truncation(limit: int, side: str) -> None:
    """A ValueError naming the key unless `limit` is a positive int and `side` one of TRUNCATE_SIDES."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{LENGTH_KEY} must be a positive integer (characters), got {limit!r}")
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"{SIDE_KEY} must be one of {list(TRUNCATE_SIDES)}, got {side!r}")


def truncate_tool_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters when longer, verl 0.9.1's way: `left` cuts the start, keeping
    the tail after `(truncated)...`; `right` cuts the end, keeping the head before `...(truncated)`;
    `middle` keeps `limit // 2` characters of each end around `...(truncated)...` (with a limit of 1,
    no characters: verl's `text[-0:]` would keep the whole text there)."""
    check_truncation(limit, side)
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


def _response_text(tool: BaseTool, response: Any) -> str:
    """The text of what `tool.execute` returned; media or another type is a ToolError naming the tool."""
    if isinstance(response, str):
        return response
    if not isinstance(response, ToolResponse) and not hasattr(response, "text"):
        raise ToolError(f"tool {tool.name!r} ({type(tool).__name__}).execute returned {type(response).__name__} as "
                        "its response; return a ToolResponse or a str")
    for media in ("image", "video"):
        if getattr(response, media, None) is not None:
            raise ToolError(f"tool {tool.name!r} ({type(tool).__name__}) returned {media} data; meshppo's tools "
                            "answer with text only")
    text = response.text
    if text is not None and not isinstance(text, str):
        raise ToolError(f"tool {tool.name!r} ({type(tool).__name__}) returned a response whose text is "
                        f"{type(text).__name__}, not a str")
    return text or ""


def _reward(tool: BaseTool, reward: Any) -> float | None:
    """The step reward `tool.execute` returned, if a real number (not a bool; a 0-d tensor or array
    of one, as the reward functions may return) or None; anything else is a ToolError naming the tool
    (it would stop the rollout later, or a str be read as a number)."""
    boolean = isinstance(reward, bool) or str(getattr(reward, "dtype", "")) in ("bool", "torch.bool")
    value = None if reward is None or boolean else real_value(reward)
    if reward is not None and value is None:
        raise ToolError(f"tool {tool.name!r} ({type(tool).__name__}).execute returned {type(reward).__name__} "
                        f"{reward!r} as its reward; return a number or None")
    return value


# The answers a failed call gets, verl 0.9.1's `_call_tool` texts (its names quoted as written, not repr'd).
def unknown_tool_text(name: str, available: dict[str, BaseTool]) -> str:
    return f"Unknown function '{name}'. Available tools: {list(available)}"


def bad_arguments_text(name: str, err: Exception) -> str:
    return f"Invalid JSON in arguments for '{name}': {err}"


def tool_failed_text(name: str, err: Exception) -> str:
    return f"Error executing tool '{name}': {err}"


def _failed_call(text: str) -> tuple[str, float, dict]:
    logger.warning("%s", text)
    return text, 0.0, {}


async def call_tool(tools: dict[str, BaseTool], call: ToolCall, tools_kwargs: dict | None, limit: int,
                    side: str) -> tuple[str, float | None, dict]:
    """One call, verl's `_call_tool`: (the answer's text, cut by `truncate_tool_text`; the step
    reward or None; the tool's metrics).

    The tool is created with the row's `tools_kwargs[name]["create_kwargs"]` (keyword
    `create_kwargs`), executed on the decoded arguments, and released whenever it was created. As in
    verl, a name not in `tools` (the row's tools) answers `unknown_tool_text`, arguments that are not
    JSON `bad_arguments_text` and a tool that raises `tool_failed_text`, each with reward 0.0, uncut.
    """
    check_truncation(limit, side)
    if call.name not in tools:
        return _failed_call(unknown_tool_text(call.name, tools))
    try:
        arguments = json.loads(call.arguments)
    except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
        return _failed_call(bad_arguments_text(call.name, err))
    tool, instance_id = tools[call.name], None
    try:
        kwargs = (tools_kwargs or {}).get(call.name) or {}
        instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        response, reward, metrics = await tool.execute(instance_id, arguments)
    except (Exception, asyncio.CancelledError) as err:
        if isinstance(err, asyncio.CancelledError):  # a BaseException, which nothing above expects from a call
            if cancelled_from_outside():
                raise
            raise ToolError(f"tool {call.name!r} raised asyncio.CancelledError") from err
        return _failed_call(tool_failed_text(call.name, err))
    finally:
        if instance_id is not None:
            try:
                await tool.release(instance_id)
            except (Exception, asyncio.CancelledError) as err:  # noqa: BLE001 - a bug in the tool: stops the run
                if isinstance(err, asyncio.CancelledError) and cancelled_from_outside():
                    raise
                raise ToolError(f"tool {call.name!r} ({type(tool).__name__}).release failed: "
                                f"{type(err).__name__}: {err}") from err
    return truncate_tool_text(_response_text(tool, response), limit, side), _reward(tool, reward), metrics


def check_parallel_calls(max_parallel_calls: Any) -> None:
    if isinstance(max_parallel_calls, bool) or not isinstance(max_parallel_calls, int) or max_parallel_calls < 1:
        raise ValueError(f"{PARALLEL_KEY} must be a positive integer, got {max_parallel_calls!r}")


async def tool_turn(tools: dict[str, BaseTool], calls: list[ToolCall], tools_kwargs: dict | None, limit: int,
                    side: str, max_parallel_calls: int) -> list[tuple[str, float | None]]:
    """One sample's tool turn: its first `max_parallel_calls` calls at once (with the row's
    `tools_kwargs`); (text, reward) per call, in call order."""
    results = await asyncio.gather(*(call_tool(tools, call, tools_kwargs, limit, side)
                                     for call in calls[:max_parallel_calls]))
    return [(text, reward) for text, reward, _ in results]


def run_tool_calls(tools: dict[str, BaseTool], calls: list[list[ToolCall]], tools_kwargs: list[dict | None],
                   limit: int, side: str, max_parallel_calls: int) -> list[list[tuple[str, float | None]]]:
    """The tool turns of a batch of rows (`tool_turn` each), all at once in a fresh event loop; per
    row, (text, reward) in call order."""
    check_truncation(limit, side)
    check_parallel_calls(max_parallel_calls)
    if len(calls) != len(tools_kwargs):
        raise ValueError(f"{len(calls)} rows of tool calls but {len(tools_kwargs)} rows of tools_kwargs")

    async def turns():
        return await asyncio.gather(*(tool_turn(tools, row, kwargs, limit, side, max_parallel_calls)
                                      for row, kwargs in zip(calls, tools_kwargs)))

    return run(turns())


# ---- tool messages as tokens


def _template_name(tokenizer, chat_template_kwargs: dict) -> str:
    if chat_template_kwargs.get("chat_template") is not None:
        return "the custom chat template (chat_template)"
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def _chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict) -> str:
    """`messages` rendered by the chat template as text; a template that raises on them is a
    ValueError naming the template and the messages' roles."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **chat_template_kwargs)
    except Exception as err:
        roles = sorted({m["role"] for m in messages})
        raise ValueError(f"{_template_name(tokenizer, chat_template_kwargs)} cannot render {roles} messages: "
                         f"{type(err).__name__}: {err}") from err


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict) -> list[int]:
    """`messages` rendered by the chat template and tokenized as the rendering is (its special tokens
    are in the text: no more are added), which is what `apply_chat_template(tokenize=True)` gives."""
    text = _chat_text(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def system_prompt_ids(tokenizer, **chat_template_kwargs) -> list[int]:
    """The tokens the chat template puts before a chat's first message (a default system prompt, a
    BOS token; often none), verl's `initialize_system_prompt`: one empty user message rendered minus
    what a second one adds. Unlike verl, the template's keyword arguments apply here too."""
    empty = {"role": "user", "content": ""}
    one = _chat_ids(tokenizer, [empty], False, chat_template_kwargs)
    two = _chat_ids(tokenizer, [empty, empty], False, chat_template_kwargs)
    per_message = len(two) - len(one)
    if not 0 < per_message <= len(one):
        raise ValueError(f"{_template_name(tokenizer, chat_template_kwargs)} renders [user, user] with "
                         f"{len(two)} tokens and [user] with {len(one)}, so the tokens before a chat's first message "
                         "cannot be found")
    return one[:len(one) - per_message]


def message_ids(tokenizer, messages: list[dict], system_prompt: list[int], **chat_template_kwargs) -> list[int]:
    """The tokens that append `messages` (tool answers, an interaction's user reply) to a chat:
    rendered with the generation prompt (the model's next turn opens), without the `system_prompt`
    prefix the template puts before any first message (`system_prompt_ids`), as verl cuts them."""
    if not messages:
        raise ValueError("message_ids needs at least one message")
    ids = _chat_ids(tokenizer, messages, True, chat_template_kwargs)
    n = len(system_prompt)
    if ids[:n] != list(system_prompt):
        roles = sorted({m["role"] for m in messages})
        raise ValueError(f"{_template_name(tokenizer, chat_template_kwargs)} does not start a chat of {roles} "
                         f"messages with the tokens it puts before a first user message ({n} tokens), so the "
                         "turn's tokens cannot be cut from it")
    return ids[n:]


class ChatTemplateError(ValueError):
    """A chat template that cannot render the messages the turn loop inserts (`role`: "tool" for the
    tools' answers, "user" for an interaction's replies), or that renders them without their text,
    or the model's turn they follow (an `assistant` message: `turn_end_ids`)."""

    def __init__(self, message: str, role: str):
        super().__init__(message)
        self.role = role


TEMPLATE_SAMPLE = "meshppo sample message 42"


def turn_end_ids(tokenizer, **chat_template_kwargs) -> list[int]:
    """The tokens the chat template writes after an assistant message's text, which close the model's
    turn in the chat it renders: Qwen's `<|im_end|>\\n`, Gemma's `<end_of_turn>\\n`, Phi-3's
    `<|end|>\\n`, Llama 3's `<|eot_id|>` alone. The model generates the first of them (its end-of-turn
    token) and stops there; the turn loop inserts the rest before the messages it appends, so that what
    comes between two turns is what the template writes there, as the model reads it at inference
    (verl 0.9.1 inserts Qwen's `\\n` for its Qwen model types only; here it comes from the template,
    for any model).

    Found as verl finds the system prompt, by rendering: a user message and an assistant message
    whose text is `TEMPLATE_SAMPLE`, without the generation prompt, and the text after the sample,
    tokenized as the other renderings are. Only what follows the sample is read, so a template that
    renders the last assistant message with more before its text (Qwen3's empty `<think>` block) gives
    the same tail. A template that raises on the chat, or renders the sample other than exactly once
    (drops the assistant's text, or repeats it), is a ValueError naming the template."""
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": TEMPLATE_SAMPLE}]
    text = _chat_text(tokenizer, messages, False, chat_template_kwargs)
    found = text.count(TEMPLATE_SAMPLE)
    if found != 1:
        how = "without its text" if found == 0 else f"with its text {found} times"
        raise ValueError(f"{_template_name(tokenizer, chat_template_kwargs)} renders an 'assistant' message {how} "
                         f"(a user message and an 'assistant' message {TEMPLATE_SAMPLE!r} render as {text!r}), so "
                         "what it writes after the model's turn cannot be found")
    return list(tokenizer.encode(text[text.index(TEMPLATE_SAMPLE) + len(TEMPLATE_SAMPLE):], add_special_tokens=False))


def check_message_template(tokenizer, role: str, **chat_template_kwargs) -> None:
    """A ChatTemplateError unless the chat template renders a `role` message as the turn loop appends
    one (`system_prompt_ids`, `message_ids`) with the message's text in it, after a model's turn whose
    end it renders (`turn_end_ids`): a template that raises on the role, or drops a role it does not
    know (the model would never see the tools' answers), or cannot render an assistant message, is
    found before any model work, not at the model's first tool call."""
    try:
        system = system_prompt_ids(tokenizer, **chat_template_kwargs)
        ids = message_ids(tokenizer, [{"role": role, "content": TEMPLATE_SAMPLE}], system, **chat_template_kwargs)
    except ValueError as err:
        raise ChatTemplateError(str(err), role) from err
    text = tokenizer.decode(ids)
    if "".join(TEMPLATE_SAMPLE.split()) not in "".join(text.split()):
        raise ChatTemplateError(f"{_template_name(tokenizer, chat_template_kwargs)} renders a {role!r} message "
                                f"without its text (a {role!r} message {TEMPLATE_SAMPLE!r} renders as {text!r})", role)
    try:
        turn_end_ids(tokenizer, **chat_template_kwargs)
    except ValueError as err:
        raise ChatTemplateError(str(err), role) from err


def tool_message_ids(tokenizer, texts: list[str], system_prompt: list[int], **chat_template_kwargs) -> list[int]:
    """`message_ids` of the tool answers `texts`, as `tool` messages."""
    if not texts:
        raise ValueError("tool_message_ids needs at least one tool answer")
    return message_ids(tokenizer, [{"role": "tool", "content": t} for t in texts], system_prompt,
                       **chat_template_kwargs)
