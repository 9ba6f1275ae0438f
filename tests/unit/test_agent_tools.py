"""The tool layer of multi-turn rollouts: truncation, the Hermes parser, tool config files, the GSM8K
tool, one call and one turn of calls, and the tokens of tool messages."""

import asyncio
import json
import re
import threading

import pytest
import yaml

from agent import (
    BaseTool,
    Gsm8kTool,
    ToolCall,
    ToolConfigError,
    ToolError,
    ToolResponse,
    call_tool,
    load_tools,
    parse_tool_calls,
    run_tool_calls,
    select_tools,
    system_prompt_ids,
    tool_message_ids,
    truncate_tool_text,
)
from agent.tools import GSM8K_TOOL_SCHEMA
from rewards.gsm8k import compute_score
from tests.agent_files import user_module, write_yaml

SHIPPED = "configs/tools/gsm8k_tool.yaml"


def _schema(name, **parameters):
    function = {"name": name, "description": f"the {name} tool"}
    if parameters:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


# ---- truncation


@pytest.mark.parametrize("side, limit, expected", [
    ("left", 4, "(truncated)...ghij"),    # verl 0.9.1: left cuts the start, keeping the tail
    ("right", 4, "abcd...(truncated)"),   # right cuts the end, keeping the head
    ("middle", 4, "ab...(truncated)...ij"),
    ("middle", 5, "ab...(truncated)...ij"),  # an odd limit keeps limit // 2 of each end
    ("middle", 1, "...(truncated)..."),       # nothing of either end (verl's text[-0:] would keep it all)
    ("left", 9, "(truncated)...bcdefghij"),
    ("right", 9, "abcdefghi...(truncated)"),
])
def test_truncation_strings(side, limit, expected):
    assert truncate_tool_text("abcdefghij", limit, side) == expected


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_text_at_or_under_the_limit_is_untouched(side):
    assert truncate_tool_text("abcdefghij", 10, side) == "abcdefghij"
    assert truncate_tool_text("abcdefghij", 11, side) == "abcdefghij"
    assert truncate_tool_text("", 1, side) == ""


def test_truncation_options_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=r"multi_turn\.max_tool_response_length must be a positive integer"):
        truncate_tool_text("abc", 0, "left")
    with pytest.raises(ValueError, match=r"multi_turn\.max_tool_response_length"):
        truncate_tool_text("abc", True, "left")
    with pytest.raises(ValueError, match=r"multi_turn\.tool_response_truncate_side must be one of "
                                         r"\['left', 'right', 'middle'\], got 'top'"):
        truncate_tool_text("abc", 2, "top")


# ---- the Hermes parser


def _call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_parser_without_calls_returns_the_text():
    assert parse_tool_calls("so the answer is 72") == ("so the answer is 72", [])
    # one tag alone is no call, and the text comes back whole
    text = 'check <tool_call>{"name": "f", "arguments": {}}'
    assert parse_tool_calls(text) == (text, [])
    text = '{"name": "f", "arguments": {}}</tool_call> done'
    assert parse_tool_calls(text) == (text, [])


def test_parser_one_call():
    content, calls = parse_tool_calls("Let me check.\n" + _call("calc_gsm8k_reward", {"answer": "72"}) + "\nok")
    assert content == "Let me check.\n\nok"
    assert calls == [ToolCall("calc_gsm8k_reward", '{"answer": "72"}')]


def test_parser_two_calls_in_order_each_its_own_span():
    # a greedy match would take both spans as one body, which is not JSON
    text = "a" + _call("f", {"x": 1}) + "b" + _call("g", {"y": [1, 2]}) + "c"
    content, calls = parse_tool_calls(text)
    assert content == "abc"
    assert calls == [ToolCall("f", '{"x": 1}'), ToolCall("g", '{"y": [1, 2]}')]


@pytest.mark.parametrize("bad", [
    '{"name": "f", "arguments": {"x": 1}',   # not JSON
    '{"arguments": {"x": 1}}',               # no name
    '{"name": "f"}',                         # no arguments
    '{"name": 3, "arguments": {}}',          # a name that is not a string
    '["f", {}]',                             # not an object
])
def test_parser_skips_malformed_calls_and_removes_their_spans(bad):
    text = "x<tool_call>" + bad + "</tool_call>y" + _call("g", {"a": "b"}) + "z"
    content, calls = parse_tool_calls(text)
    assert content == "xyz"
    assert calls == [ToolCall("g", '{"a": "b"}')]


def test_parser_keeps_non_ascii_arguments_as_text():
    # written with escapes by the model or not, the arguments come back as the characters themselves
    escaped = '<tool_call>{"name": "f", "arguments": {"answer": "\\u4e03\\u5341\\u4e8c"}}</tool_call>'
    raw = '<tool_call>{"name": "f", "arguments": {"answer": "七十二", "note": "café"}}</tool_call>'
    assert parse_tool_calls(escaped)[1] == [ToolCall("f", '{"answer": "七十二"}')]
    assert parse_tool_calls(raw)[1] == [ToolCall("f", '{"answer": "七十二", "note": "café"}')]
    # non-object arguments are passed on as JSON too
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "72"}</tool_call>')[1] == [ToolCall("f", '"72"')]


def test_parser_across_lines_and_surrounding_whitespace():
    text = '<tool_call>\n  {"name": "f",\n   "arguments": {"a": 1}}\n</tool_call>'
    assert parse_tool_calls(text) == ("", [ToolCall("f", '{"a": 1}')])


@pytest.mark.parametrize("fmt", ["gpt-oss", "kimi", "gemma4"])
def test_parser_refuses_formats_other_than_hermes(fmt):
    """The message lists verl 0.9.1's other registered parsers (its tool_parser.py), written out here."""
    others = "['gpt-oss', 'qwen3_coder', 'glm', 'seed', 'minimax', 'kimi', 'deepseek_v4', 'gemma4']"
    with pytest.raises(ValueError) as err:
        parse_tool_calls("x", fmt=fmt)
    assert str(err.value) == (f"actor_rollout_ref.rollout.multi_turn.format={fmt!r} is not supported; supported: "
                              f"['hermes'] (verl 0.9.1's other formats, not supported here: {others})")


# ---- tool config files


def test_shipped_gsm8k_config_loads_as_verls_tool():
    (tool,) = load_tools(SHIPPED)
    assert type(tool) is Gsm8kTool and tool.name == "calc_gsm8k_reward"
    assert tool.config == {"type": "native"}
    assert tool.tool_schema == GSM8K_TOOL_SCHEMA
    # the file names verl's class, which meshppo maps to its own
    with open(SHIPPED, encoding="utf-8") as f:
        assert yaml.safe_load(f)["tools"][0]["class_name"] == "verl.tools.gsm8k_tool.Gsm8kTool"


USER_TOOLS = '''
from agent.tools import BaseTool, ToolResponse


class EchoTool(BaseTool):
    """Written against verl's BaseTool shape: its own default schema, instances, a step reward."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.live = {}

    def get_openai_tool_schema(self):
        return {"type": "function", "function": {"name": "echo", "description": "echoes",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id, **kwargs)
        self.live[instance_id] = kwargs.get("create_kwargs", {}).get("prefix", "")
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=self.live[instance_id] + parameters["text"] * self.config["times"]), None, {"n": 1}

    async def release(self, instance_id, **kwargs):
        del self.live[instance_id]


class Broken(BaseTool):
    def __init__(self, config, tool_schema):
        raise RuntimeError("boom")


class NotATool:
    """A class that is not a BaseTool: load_tools refuses it."""
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    return user_module(tmp_path, monkeypatch, "meshppo_test_user_tools", USER_TOOLS)


def _write_config(tmp_path, doc, name="tools.yaml"):
    return write_yaml(tmp_path, doc, name)


def test_a_users_tool_by_dotted_path_with_its_own_schema(tmp_path, user_tools):
    path = _write_config(tmp_path, {"tools": [
        {"class_name": f"{user_tools}.EchoTool", "config": {"type": "native", "times": 2}},
        {"class_name": "agent.tools.Gsm8kTool", "config": {"type": "native"}},  # meshppo's own path, no schema
    ]})
    echo, gsm = load_tools(path)
    assert (echo.name, gsm.name) == ("echo", "calc_gsm8k_reward")
    assert echo.get_openai_tool_schema() == echo.tool_schema and gsm.tool_schema == GSM8K_TOOL_SCHEMA
    tools = {echo.name: echo, gsm.name: gsm}
    text, reward, metrics = asyncio.run(call_tool(
        tools, ToolCall("echo", '{"text": "ab"}'), {"echo": {"create_kwargs": {"prefix": "> "}}}, 100, "left"))
    assert (text, reward, metrics) == ("> abab", None, {"n": 1})
    assert echo.live == {}  # released


def _entry(**overrides):
    entry = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"},
             "tool_schema": _schema("calc_gsm8k_reward", type="object", properties={"answer": {"type": "string"}},
                                    required=["answer"])}
    entry.update(overrides)
    return {k: v for k, v in entry.items() if v is not None}


@pytest.mark.parametrize("doc, message", [
    ("tools: [", r"not valid YAML"),
    ("- a\n- b\n", r"must be a mapping with a 'tools' list, got list"),
    ({"tool": []}, r"must be a mapping with a 'tools' list, got dict with keys \['tool'\]"),
    ({"tools": [_entry()], "interactions": []}, r"unknown top-level keys \['interactions'\]"),
    ({"tools": []}, r"tools: must be a non-empty list"),
    ({"tools": ["x"]}, r"tools\[0\]: must be a mapping"),
    ({"tools": [_entry(extra=1)]}, r"tools\[0\]: unknown keys \['extra'\]"),
    # verl's own MCP entry (examples/sglang_multiturn/config/tool_config/mcp_tool_config.yaml): told it is MCP
    ({"tools": [_entry(class_name="verl.tools.mcp_search_tool.MCPSearchTool", config={"type": "mcp"},
                       mcp={"mcp_servers_config_path": "x"}, tool_schema=None)]},
     r"tools\[0\]\.config\.type: 'mcp' tools are not supported; meshppo runs native tools \(type: native\) only$"),
    ({"tools": [_entry(mcp={"mcp_servers_config_path": "x"})]}, r"tools\[0\]\.mcp: 'mcp' tools are not supported"),
    ({"tools": [_entry(class_name=None)]}, r"tools\[0\]\.class_name: missing"),
    ({"tools": [_entry(config=None)]}, r"tools\[0\]\.config: must be a mapping with at least 'type: native'"),
    ({"tools": [_entry(config={"rate_limit": 1})]}, r"tools\[0\]\.config\.type: must be 'native', got None"),
    ({"tools": [_entry(config={"type": "mcp"})]}, r"tools\[0\]\.config\.type: 'mcp' tools are not supported"),
    ({"tools": [_entry(class_name="Gsm8kTool")]}, r"tools\[0\]\.class_name: must be a dotted import path"),
    ({"tools": [_entry(), _entry(class_name="nosuch_pkg.tools.Tool")]},
     r"tools\[1\]\.class_name: cannot import module 'nosuch_pkg\.tools'"),
    ({"tools": [_entry(class_name="verl.tools.search_tool.SearchTool")]},
     r"tools\[0\]\.class_name: cannot import module 'verl\.tools\.search_tool'.*of verl's tools meshppo provides "
     r"\['verl\.tools\.base_tool\.BaseTool', 'verl\.tools\.gsm8k_tool\.Gsm8kTool'\]"),
    ({"tools": [_entry(class_name="agent.tools.NoSuchTool")]},
     r"tools\[0\]\.class_name: module 'agent\.tools' has no 'NoSuchTool'"),
    ({"tools": [_entry(class_name="agent.tools.ToolResponse")]},
     r"tools\[0\]\.class_name: agent\.tools\.ToolResponse is not a subclass of agent\.tools\.BaseTool"),
    ({"tools": [_entry(), _entry()]},
     r"tools\[1\]\.tool_schema\.function\.name: 'calc_gsm8k_reward' is also the name of tools\[0\]"),
    ({"tools": [_entry(tool_schema={"type": "retrieval", "function": {"name": "f"}})]},
     r"tools\[0\]\.tool_schema\.type: must be 'function', got 'retrieval'"),
    ({"tools": [_entry(tool_schema={"type": "function"})]}, r"tools\[0\]\.tool_schema\.function: must be a mapping"),
    ({"tools": [_entry(tool_schema=_schema(" "))]},
     r"tools\[0\]\.tool_schema\.function\.name: must be a non-empty string, got ' '"),
    ({"tools": [_entry(tool_schema=_schema("f", type="string"))]},
     r"tools\[0\]\.tool_schema\.function\.parameters: must be a JSON object schema"),
    ({"tools": [_entry(tool_schema=_schema("f", type="object", properties={"a": "string"}))]},
     r"tools\[0\]\.tool_schema\.function\.parameters\.properties: must map each parameter's name to its schema"),
    ({"tools": [_entry(tool_schema=_schema("f", type="object", properties={"a": {"type": "string"}},
                                           required=["b"]))]},
     r"tools\[0\]\.tool_schema\.function\.parameters\.required: \['b'\] are not among the properties \['a'\]"),
    ({"tools": [_entry(class_name="verl.tools.base_tool.BaseTool", tool_schema=None)]},
     r"tools\[0\]: BaseTool: no tool_schema given and get_openai_tool_schema\(\) gives none"),
])
def test_bad_tool_configs_name_the_file_entry_and_key(tmp_path, doc, message):
    path = _write_config(tmp_path, doc)
    with pytest.raises(ToolConfigError, match=re.escape(path) + ": " + message):
        load_tools(path)


@pytest.mark.parametrize("section,what,key", [("tools", "tool", "tool_config_path"),
                                              ("interaction", "interaction", "interaction_config_path")])
def test_a_tool_or_interaction_config_not_in_utf8_names_the_file(tmp_path, section, what, key):
    from agent.interactions import InteractionConfigError, load_interactions

    load, error = (load_tools, ToolConfigError) if section == "tools" else (load_interactions, InteractionConfigError)
    path = tmp_path / "latin1.yaml"
    data = f"{section}:\n  - class_name: x  # caf\u00e9\n".encode("latin-1")
    path.write_bytes(data)
    offset = data.index("\u00e9".encode("latin-1"))
    message = (rf": the {what} config \(actor_rollout_ref\.rollout\.multi_turn\.{key}\) is not valid UTF-8 "
               rf"\(invalid continuation byte at byte offset {offset}\)")
    with pytest.raises(error, match=re.escape(str(path)) + message) as info:
        load(str(path))
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


TOOL_CONFIG_WITH_INTERPOLATIONS = """tools:
  - class_name: verl.tools.gsm8k_tool.Gsm8kTool
    config:
      type: native
      url: ${oc.env:MESHPPO_TEST_TOOL_URL}
      retries: ${oc.env:MESHPPO_TEST_UNSET_VARIABLE,null}
      kind: ${.type}
      named: tool ${tools[0].tool_schema.function.name}
    tool_schema:
      type: function
      function:
        name: calc_gsm8k_reward
        description: scores at ${oc.env:MESHPPO_TEST_TOOL_URL}
"""


def test_tool_and_interaction_configs_resolve_their_interpolations_as_verl(tmp_path, monkeypatch):
    """verl reads both files with OmegaConf and resolves them (`to_container(resolve=True)`): a tool
    got the text `${oc.env:...}` itself. An interpolation that cannot be resolved names the file and
    the entry's key."""
    from agent.interactions import InteractionConfigError, load_interactions

    monkeypatch.setenv("MESHPPO_TEST_TOOL_URL", "http://sandbox:8080")
    monkeypatch.delenv("MESHPPO_TEST_UNSET_VARIABLE", raising=False)
    (tool,) = load_tools(_write_config(tmp_path, TOOL_CONFIG_WITH_INTERPOLATIONS))
    assert tool.config == {"type": "native", "url": "http://sandbox:8080", "retries": None, "kind": "native",
                           "named": "tool calc_gsm8k_reward"}
    assert tool.tool_schema["function"]["description"] == "scores at http://sandbox:8080"
    interactions = load_interactions(_write_config(tmp_path, "interaction:\n  - name: ${oc.env:MESHPPO_TEST_TOOL_URL}\n"
                                                             "    class_name: verl.interactions.base.BaseInteraction\n",
                                                   "interactions.yaml"))
    assert list(interactions) == ["http://sandbox:8080"]
    monkeypatch.delenv("MESHPPO_TEST_TOOL_URL")
    path = _write_config(tmp_path, TOOL_CONFIG_WITH_INTERPOLATIONS)
    with pytest.raises(ToolConfigError, match=re.escape(path) + r": tools\[0\]\.config\.url: "
                                              r"\$\{oc\.env:MESHPPO_TEST_TOOL_URL\} reads the environment variable "
                                              "MESHPPO_TEST_TOOL_URL, which is not set"):
        load_tools(path)
    path = _write_config(tmp_path, "interaction:\n  - class_name: ${oc.env:MESHPPO_TEST_TOOL_URL}\n", "i.yaml")
    with pytest.raises(InteractionConfigError, match=re.escape(path) + r": interaction\[0\]\.class_name: "):
        load_interactions(path)


def test_a_tool_schema_reaches_the_template_as_written(tmp_path):
    """docs/VERL.md: the schema is kept whole (verl 0.9.1's pydantic classes drop `items`, `default`,
    `additionalProperties`; they refuse a function without `description`, which loads here)."""
    schema = {"type": "function", "function": {"name": "calc_gsm8k_reward", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"answer": {"type": "array", "items": {"type": "string"}, "default": []}}}}}
    (tool,) = load_tools(_write_config(tmp_path, {"tools": [_entry(tool_schema=schema)]}))
    assert tool.tool_schema == schema


def test_bad_tool_classes_name_the_file_entry_and_key(tmp_path, user_tools):
    for cls, message in [("Broken", r"tools\[0\]: meshppo_test_user_tools\.Broken\(config, tool_schema\) failed: "
                                    r"RuntimeError: boom"),
                         ("NotATool", r"tools\[0\]\.class_name: .*NotATool is not a subclass of "
                                      r"agent\.tools\.BaseTool")]:
        path = _write_config(tmp_path, {"tools": [_entry(class_name=f"{user_tools}.{cls}")]})
        with pytest.raises(ToolConfigError, match=re.escape(path) + ": " + message):
            load_tools(path)


def test_missing_tool_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ToolConfigError, match=re.escape(path) + r": cannot read the tool config "
                                              r"\(actor_rollout_ref\.rollout\.multi_turn\.tool_config_path\)"):
        load_tools(path)
    assert issubclass(ToolConfigError, ValueError)


# ---- the GSM8K tool


def _gsm8k_session(answers, **create):
    """Submit `answers` in turn to one instance made with `create`; (text, step reward, score) per submission."""
    tool = load_tools(SHIPPED)[0]

    async def session():
        instance, greeting = await tool.create(**create)
        assert greeting == ToolResponse()
        out = []
        for answer in answers:
            response, reward, metrics = await tool.execute(instance, {"answer": answer})
            assert metrics == {}
            out.append((response.text, reward, await tool.calc_reward(instance)))
        await tool.release(instance)
        assert tool._instances == {}
        return out

    return asyncio.run(session())


def test_gsm8k_tool_scores_right_and_wrong_answers_as_rewards_gsm8k_does():
    out = _gsm8k_session(["71", "72", "#### 72", 72, "7 2"], create_kwargs={"ground_truth": "72"})
    # the stored response is the answer with '#### ' in front, scored flexibly
    stored = ["#### 71", "#### 72", "#### 72", "#### 72", "#### 7 2"]
    scores = [compute_score(r, "72", method="flexible") for r in stored]
    assert scores == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert [score for _, _, score in out] == scores
    assert [text for text, _, _ in out] == [
        "Current parsed answer='71' reward=0.0", "Current parsed answer='72' reward=1.0",
        "Current parsed answer='#### 72' reward=1.0", "Current parsed answer='72' reward=1.0",
        "Current parsed answer='7 2' reward=0.0",
    ]
    # 0.0 when the score beats the previous one, else verl's penalty of 0.05
    assert [reward for _, reward, _ in out] == [-0.05, 0.0, -0.05, -0.05, -0.05]


def test_gsm8k_tool_format_cases():
    # no number at all: no answer, score 0; a comma kept by the flexible match: not equal to "1500"
    out = _gsm8k_session(["fifteen hundred", "1,500", "1500"], create_kwargs={"ground_truth": "1500"})
    assert [score for _, _, score in out] == [0.0, 0.0, 1.0]
    assert compute_score("#### 1,500", "1500", method="flexible") == 0.0
    assert [reward for _, reward, _ in out] == [-0.05, -0.05, 0.0]


def test_gsm8k_tool_ground_truth_keyword_wins_over_create_kwargs():
    out = _gsm8k_session(["5"], ground_truth="5", create_kwargs={"ground_truth": "6"})
    assert out[0][2] == 1.0
    assert _gsm8k_session(["5"], ground_truth=None, create_kwargs={"ground_truth": "6"})[0][2] == 0.0


def test_gsm8k_tool_default_schema_is_verls():
    assert Gsm8kTool({"type": "native"}, None).tool_schema == GSM8K_TOOL_SCHEMA
    with open(SHIPPED, encoding="utf-8") as f:
        assert yaml.safe_load(f)["tools"][0]["tool_schema"] == GSM8K_TOOL_SCHEMA


# ---- one call


class CountingTool(BaseTool):
    """Counts instances; `execute` does what the arguments say (answer, raise, return media or a number)."""

    def __init__(self, name="count"):
        super().__init__({}, _schema(name))
        self.created, self.released, self.create_kwargs = 0, 0, []
        self.fail_release = False

    async def create(self, instance_id=None, **kwargs):
        if kwargs.get("create_kwargs", {}).get("fail"):
            raise RuntimeError("create failed")
        self.created += 1
        self.create_kwargs.append(kwargs)
        return await super().create(instance_id)

    async def execute(self, instance_id, parameters, **kwargs):
        if "raise" in parameters:
            raise ValueError(parameters["raise"])
        if "image" in parameters:
            return ToolResponse(text="x", image=["pixels"]), 0.0, {}
        if "number" in parameters:
            return 7, 0.0, {}
        if "str" in parameters:
            return parameters["str"], 0.5, {"m": 1}
        if "reward" in parameters:
            return ToolResponse(text="ok"), parameters["reward"], {}
        return ToolResponse(text=parameters.get("text")), None, {}

    async def release(self, instance_id, **kwargs):
        self.released += 1
        if self.fail_release:
            raise OSError("socket closed")


def _one(tools, name, arguments, kwargs=None, limit=100, side="left"):
    return asyncio.run(call_tool(tools, ToolCall(name, arguments), kwargs, limit, side))


def test_call_tool_passes_create_kwargs_and_releases_every_time():
    tool = CountingTool()
    tools = {"count": tool}
    kwargs = {"count": {"create_kwargs": {"ground_truth": "3"}, "execute_kwargs": {"unused": 1}}}
    assert _one(tools, "count", '{"text": "hi"}', kwargs) == ("hi", None, {})
    assert tool.create_kwargs == [{"create_kwargs": {"ground_truth": "3"}}]
    assert _one(tools, "count", '{"str": "plain"}') == ("plain", 0.5, {"m": 1})
    assert tool.create_kwargs[-1] == {"create_kwargs": {}}  # no kwargs for the row: an empty dict, as verl
    assert _one(tools, "count", '{}') == ("", None, {})     # text None: an empty answer
    assert _one(tools, "count", '{"raise": "boom"}') == ("Error executing tool 'count': boom", 0.0, {})
    assert (tool.created, tool.released) == (4, 4)


def test_call_tool_errors_become_verls_text():
    """verl 0.9.1's three answers to a failed call (tool_agent_loop.py `_call_tool`), written out by hand."""
    tool = CountingTool()
    tools = {"count": tool, "other": CountingTool()}
    assert _one(tools, "nope", '{}') == ("Unknown function 'nope'. Available tools: ['count', 'other']", 0.0, {})
    # json's own message for the cut-off object: "Expecting value: line 1 column 10 (char 9)"
    assert _one(tools, "count", '{"text": ') == (
        "Invalid JSON in arguments for 'count': Expecting value: line 1 column 10 (char 9)", 0.0, {})
    # a create that raises: an error answer and no instance to release
    assert _one(tools, "count", '{}', {"count": {"create_kwargs": {"fail": True}}}) == (
        "Error executing tool 'count': create failed", 0.0, {})
    assert (tool.created, tool.released) == (0, 0)
    # the error text is not cut (verl cuts only a tool's answer)
    assert _one(tools, "count", '{"raise": "' + "x" * 50 + '"}', limit=5)[0] == "Error executing tool 'count': " + "x" * 50
    assert (tool.created, tool.released) == (1, 1)


def test_select_tools_keeps_the_named_in_the_selection_s_order():
    """verl 0.9.1's per-row tools: `{name: tools[name] for name in tool_selection}` (the selection's
    order, each once); None or empty: all the tools. A name without a tool is refused, not dropped."""
    tools = {"count": 1, "other": 2, "third": 3}
    chosen = select_tools(tools, ["third", "count", "third"])
    assert list(chosen.items()) == [("third", 3), ("count", 1)]
    assert select_tools(tools, None) == select_tools(tools, []) == tools
    with pytest.raises(ValueError, match=r"names 'nope', which is not a tool of actor_rollout_ref\.rollout\."
                                         r"multi_turn\.tool_config_path \(its tools: \['count', 'other', 'third'\]\)"):
        select_tools(tools, ["count", "nope"])
    for bad in ("count", ("count",), ["count", None]):
        with pytest.raises(ValueError, match="must be a list of tool names"):
            select_tools(tools, bad)


def test_call_tool_cuts_long_answers():
    tools = {"count": CountingTool()}
    assert _one(tools, "count", '{"text": "abcdefghij"}', limit=4, side="middle")[0] == "ab...(truncated)...ij"
    assert _one(tools, "count", '{"str": "abcdefghij"}', limit=4, side="right")[0] == "abcd...(truncated)"


def test_a_tool_that_breaks_its_contract_stops_the_run_naming_it():
    tool = CountingTool("painter")
    with pytest.raises(ToolError, match=r"tool 'painter' \(CountingTool\) returned image data; meshppo's tools answer "
                                        r"with text only"):
        _one({"painter": tool}, "painter", '{"image": 1}')
    with pytest.raises(ToolError, match=r"tool 'painter' \(CountingTool\)\.execute returned int as its response"):
        _one({"painter": tool}, "painter", '{"number": 1}')
    assert (tool.created, tool.released) == (2, 2)
    # a reward that is not a real number (a dict, a str, a bool): stops the run naming the tool, not a bare
    # TypeError in the turn loop (a str is not read as a number)
    for reward, kind in (({"score": 1}, "dict"), ("0.5", "str"), (True, "bool")):
        with pytest.raises(ToolError, match=rf"^tool 'painter' \(CountingTool\)\.execute returned {kind} "
                                            rf"{re.escape(repr(reward))} as its reward; return a number or None$"):
            _one({"painter": tool}, "painter", json.dumps({"reward": reward}))
    assert _one({"painter": tool}, "painter", '{"reward": 2}') == ("ok", 2, {})
    assert (tool.created, tool.released) == (6, 6)
    # a 0-d tensor or array is a number, as a reward function's result may be one
    import numpy as np
    import torch

    from agent.tools import _reward
    assert _reward(tool, torch.tensor(0.5)) == 0.5 and _reward(tool, np.array(0.25)) == 0.25
    with pytest.raises(ToolError, match=r"returned Tensor tensor\(\[0\.5000\]\) as its reward"):
        _reward(tool, torch.tensor([0.5]))
    # a release that raises, after an answer or after an error answer: the tool's bug, not the model's
    tool.fail_release = True
    for arguments in ('{"text": "ok"}', '{"raise": "no"}'):
        with pytest.raises(ToolError, match=r"^tool 'painter' \(CountingTool\)\.release failed: OSError: socket closed$"):
            _one({"painter": tool}, "painter", arguments)
    assert (tool.created, tool.released) == (8, 8)


# ---- a turn of calls


class EventTool(BaseTool):
    """`wait` blocks until a `set` call runs (5 s at most, then an error answer), so calls run one after
    the other fail; `sleep` answers after the given seconds; every call is recorded."""

    def __init__(self):
        super().__init__({}, _schema("ev"))
        self.event = asyncio.Event()
        self.seen = []

    async def execute(self, instance_id, parameters, **kwargs):
        self.seen.append(parameters)
        if parameters.get("op") == "wait":
            await asyncio.wait_for(self.event.wait(), timeout=5)
        elif parameters.get("op") == "set":
            self.event.set()
        elif "sleep" in parameters:
            await asyncio.sleep(parameters["sleep"])
        return ToolResponse(text=str(parameters.get("op", parameters.get("sleep")))), float(len(self.seen)), {}


def _ev(**arguments):
    return ToolCall("ev", json.dumps(arguments))


def test_calls_of_all_rows_run_concurrently():
    tool = EventTool()
    # the waiting call comes first, within a row and across rows
    out = run_tool_calls({"ev": tool}, [[_ev(op="wait")], [_ev(op="set")]], [{}, {}], 100, "left", 1)
    assert [[text for text, _ in row] for row in out] == [["wait"], ["set"]]
    tool = EventTool()
    out = run_tool_calls({"ev": tool}, [[_ev(op="wait"), _ev(op="set")]], [None], 100, "left", 2)
    assert [text for text, _ in out[0]] == ["wait", "set"]


def test_turn_keeps_call_order_and_respects_max_parallel_calls():
    tool = EventTool()
    calls = [[_ev(sleep=0.3), _ev(sleep=0.0), _ev(sleep=0.1)], [], [_ev(sleep=0.2), _ev(sleep=0.4)],
             [ToolCall("x", "{}")]]
    out = run_tool_calls({"ev": tool}, calls, [{}] * 4, 100, "left", 2)
    assert [[text for text, _ in row] for row in out] == [["0.3", "0.0"], [], ["0.2", "0.4"],
                                                          ["Unknown function 'x'. Available tools: ['ev']"]]
    assert sorted(p["sleep"] for p in tool.seen) == [0.0, 0.2, 0.3, 0.4]  # the third call of row 0 never ran
    # the reward is the number of calls started when the call answered: all four, before any answered
    assert [reward for row in out[:3] for _, reward in row] == [4.0, 4.0, 4.0, 4.0]


def test_turn_from_a_thread_and_from_inside_a_running_loop():
    result = {}

    def worker():
        result["out"] = run_tool_calls({"ev": EventTool()}, [[_ev(op="wait"), _ev(op="set")]], [{}], 100, "left", 2)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert [text for text, _ in result["out"][0]] == ["wait", "set"]

    async def inside():
        return run_tool_calls({"ev": EventTool()}, [[_ev(op="set")]], [{}], 100, "left", 1)

    assert asyncio.run(inside()) == [[("set", 1.0)]]


def test_turn_checks_its_arguments():
    with pytest.raises(ValueError, match=r"multi_turn\.max_parallel_calls must be a positive integer, got 0"):
        run_tool_calls({}, [[]], [{}], 100, "left", 0)
    with pytest.raises(ValueError, match=r"2 rows of tool calls but 1 rows of tools_kwargs"):
        run_tool_calls({}, [[], []], [{}], 100, "left", 1)


# ---- tool messages as tokens

# Ids of the demo tokenizer (tests/unit/test_data.py): 6 special tokens, then "0".."9", "+", "-", "*", "=", " ".
BOS, USER, ASSISTANT = 1, 3, 4
DIGIT = {str(d): 6 + d for d in range(10)}
PLUS, EQ = 16, 19

# The demo template, with tool messages rendered as `<|user|>=text` and a BOS before the first message.
TOOL_TEMPLATE = (
    "{{ bos_token }}{{ prefix | default('') }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|user|>={{ m['content'] }}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from data.demo import build_demo_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_demo_tokenizer(out)
    return transformers.AutoTokenizer.from_pretrained(str(out))


@pytest.fixture
def tool_tokenizer(tokenizer):
    tok = tokenizer
    saved = tok.chat_template
    tok.chat_template = TOOL_TEMPLATE
    yield tok
    tok.chat_template = saved


def test_tool_message_ids(tool_tokenizer):
    tok = tool_tokenizer
    system = system_prompt_ids(tok)
    assert system == [BOS]
    ids = tool_message_ids(tok, ["12", "3+4"], system)
    assert ids == tok("<|user|>=12<|user|>=3+4<|assistant|>", add_special_tokens=False)["input_ids"]
    assert ids == [USER, EQ, DIGIT["1"], DIGIT["2"], USER, EQ, DIGIT["3"], PLUS, DIGIT["4"], ASSISTANT]
    # the prefix and the tool turn are the whole rendering
    rendered = tok.apply_chat_template([{"role": "tool", "content": "12"}, {"role": "tool", "content": "3+4"}],
                                       add_generation_prompt=True, tokenize=False)
    assert system + ids == tok(rendered, add_special_tokens=False)["input_ids"]


def test_tool_message_ids_with_template_kwargs(tool_tokenizer):
    tok = tool_tokenizer
    system = system_prompt_ids(tok, prefix="9")
    assert system == [BOS, DIGIT["9"]]
    assert tool_message_ids(tok, ["5"], system, prefix="9") == [USER, EQ, DIGIT["5"], ASSISTANT]


def test_tool_message_ids_without_a_system_prefix(tokenizer):
    tok = tokenizer
    template = TOOL_TEMPLATE.replace("{{ bos_token }}{{ prefix | default('') }}", "")
    assert system_prompt_ids(tok, chat_template=template) == []
    assert tool_message_ids(tok, ["7"], [], chat_template=template) == [USER, EQ, DIGIT["7"], ASSISTANT]


def test_tool_message_ids_errors_name_the_template(tokenizer):
    tok = tokenizer
    # the demo's own template refuses tool messages
    with pytest.raises(ValueError, match=r"the chat template of '.*' cannot render \['tool'\] messages: .*"
                                         r"only supports the user and assistant roles, got tool"):
        tool_message_ids(tok, ["1"], [])
    # a template that puts its prefix only before a user message: the tool turn cannot be cut from it
    template = TOOL_TEMPLATE.replace("{{ bos_token }}",
                                     "{% if messages[0]['role'] == 'user' %}{{ bos_token }}{% endif %}")
    system = system_prompt_ids(tok, chat_template=template)
    assert system == [BOS]
    with pytest.raises(ValueError, match=r"the custom chat template \(chat_template\) does not start a chat of \['tool'\] "
                                         r"messages with the tokens it puts before a first user message \(1 tokens\)"):
        tool_message_ids(tok, ["1"], system, chat_template=template)
