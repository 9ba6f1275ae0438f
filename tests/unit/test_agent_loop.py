"""`agent.loop.ToolAgent`, verl's tool agent loop in lockstep, against scripted model turns: the
response is the turns and the tool messages, masked by who wrote them, every count and cut by
verl's rules, and the engine asked for each sample's continuation under its own key and budget."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from agent.loop import ToolAgent
from agent.interactions import BaseInteraction
from agent.tools import BaseTool, ToolResponse, message_ids, system_prompt_ids, tool_message_ids
from tests.byte_chat import IM_END, build_byte_tokenizer

SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}


class Lookup(BaseTool):
    """Answers `value of <key>` with reward len(key) / 10, counting its executions."""

    def __init__(self):
        super().__init__({}, SCHEMA)
        self.calls = 0

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls += 1
        return ToolResponse(text=f"value of {parameters['key']}"), len(parameters["key"]) / 10, {}


@dataclass
class Out:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def call(key: str) -> str:
    return "<tool_call>" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "</tool_call>"


class Script:
    """The model: per sample key, its turns as texts, each ended by <|im_end|> and cut at the
    turn's budget as the engine cuts it (finish reason `length`). Records every call."""

    def __init__(self, tok, turns: dict[tuple[int, int], list[str]]):
        self.tok, self.turns, self.calls = tok, {k: list(v) for k, v in turns.items()}, []
        self.eos = tok.convert_tokens_to_ids(IM_END)

    def __call__(self, contexts, keys, limits):
        self.calls.append((list(map(list, contexts)), list(keys), list(limits)))
        outs = []
        for key, limit in zip(keys, limits):
            ids = self.tok(self.turns[key].pop(0), add_special_tokens=False)["input_ids"] + [self.eos]
            cut = ids[:limit]
            outs.append(Out(cut, [-0.5] * len(cut), "stop" if len(cut) == len(ids) else "length"))
        return outs


def agent(tok, tool, **kw):
    args = dict(response_length=400, max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                max_tool_response_length=256, tool_response_truncate_side="middle", format="hermes")
    return ToolAgent(tok, [tool], **{**args, **kw})


def ids(tok, text, end=True):
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.convert_tokens_to_ids(IM_END)] if end else [])


def test_turns_masks_counts_and_the_engine_calls(tok):
    tool = Lookup()
    a = agent(tok, tool)
    prompts = [[1, 2, 3], [4, 5], [6]]
    keys = [(7, 0), (7, 1), (8, 0)]
    script = Script(tok, {(7, 0): [call("ab"), "#### 5"], (7, 1): [call("xyz")], (8, 0): ["plain"]})
    outs = a.run(prompts, keys, ["tool_agent", "single_turn_agent", "tool_agent"], [{}, {}, {}], script)
    system = system_prompt_ids(tok)
    t1, answer, t2 = ids(tok, call("ab")), tool_message_ids(tok, ["value of ab"], system), ids(tok, "#### 5")
    assert tok.decode(answer) == "<|im_start|>user\n<tool_response>\nvalue of ab\n</tool_response><|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    first = outs[0]
    assert first.token_ids == t1 + answer + t2
    assert first.mask == [1] * len(t1) + [0] * len(answer) + [1] * len(t2)
    assert first.logprobs == [-0.5] * len(t1) + [0.0] * len(answer) + [-0.5] * len(t2)
    assert (first.num_turns, first.tool_rewards, first.finish_reason) == (4, [0.2], "stop")
    # a single-turn row keeps its tool call as text: one turn, nothing run
    second = outs[1]
    assert second.token_ids == ids(tok, call("xyz")) and set(second.mask) == {1} and second.num_turns == 2
    assert (outs[2].num_turns, outs[2].tool_rewards) == (2, [])
    assert tool.calls == 1
    assert [(o.prompt_index, o.sample_index) for o in outs] == keys
    # turn 1: every sample from its prompt with the whole budget; turn 2: the caller alone, its
    # context the prompt and what came so far, its budget what is left
    (c1, k1, l1), (c2, k2, l2) = script.calls
    assert (c1, k1, l1) == (prompts, keys, [400] * 3)
    assert (c2, k2, l2) == ([prompts[0] + t1 + answer], [(7, 0)], [400 - len(t1 + answer)])


def test_budget_and_turn_limits(tok):
    t1 = ids(tok, call("ab"))
    answer = tool_message_ids(tok, ["value of ab"], system_prompt_ids(tok))
    # the answer does not fit: the sample ends before it ("length"), the tool's reward still counts
    tool = Lookup()
    outs = agent(tok, tool, response_length=len(t1) + len(answer)).run(
        [[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, {(0, 0): [call("ab")]}))
    assert outs[0].token_ids == t1 and outs[0].finish_reason == "length"
    assert (outs[0].num_turns, outs[0].tool_rewards, tool.calls) == (2, [0.2], 1)
    # one token more and it fits; the next turn gets the single token left and is cut by the engine
    outs = agent(tok, Lookup(), response_length=len(t1) + len(answer) + 1).run(
        [[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, {(0, 0): [call("ab"), "#### 5"]}))
    assert outs[0].token_ids == t1 + answer + ids(tok, "#")[:1] and outs[0].finish_reason == "length"
    assert outs[0].num_turns == 4
    # max_assistant_turns=1: the first turn's call is not run
    tool = Lookup()
    outs = agent(tok, tool, max_assistant_turns=1).run([[1]], [(0, 0)], ["tool_agent"], [{}],
                                                      Script(tok, {(0, 0): [call("ab")]}))
    assert (outs[0].token_ids, outs[0].num_turns, tool.calls) == (t1, 2, 0)
    # max_user_turns=1: one tool answer, then the next turn's call is not run
    tool = Lookup()
    outs = agent(tok, tool, max_user_turns=1).run([[1]], [(0, 0)], ["tool_agent"], [{}],
                                                 Script(tok, {(0, 0): [call("ab"), call("cd")]}))
    assert (outs[0].num_turns, tool.calls) == (4, 1) and outs[0].token_ids == t1 + answer + ids(tok, call("cd"))


def test_parallel_calls_and_truncated_answers(tok):
    tool = Lookup()
    two = call("a") + call("bcdefghij")
    # limit 10: the first answer fits exactly, the second keeps its first 10 characters ("left")
    outs = agent(tok, tool, max_parallel_calls=2, max_tool_response_length=10, tool_response_truncate_side="left").run(
        [[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, {(0, 0): [two + call("k"), "done"]}))
    answer = tool_message_ids(tok, ["value of a", "value of b...(truncated)"], system_prompt_ids(tok))
    assert tool.calls == 2 and outs[0].tool_rewards == [0.1, 0.9]
    assert outs[0].token_ids == ids(tok, two + call("k")) + answer + ids(tok, "done")  # the third call not run


def test_only_the_first_tp_rank_runs_the_tools(tok):
    """A rank that does not run the tools takes the shared answers: the same rollout, no execution."""
    turns = {(0, 0): [call("ab"), "ok"]}
    leader_tool, follower_tool = Lookup(), Lookup()
    shared = []
    lead = agent(tok, leader_tool).run([[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, turns),
                                       share=lambda r: shared.append(r) or r)
    replay = iter(shared)  # the leader's turns' results, in order (the last turn's is empty)
    follow = agent(tok, follower_tool).run([[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, turns), runs_tools=False,
                                           share=lambda r: next(replay) if r is None else pytest.fail())
    assert (leader_tool.calls, follower_tool.calls) == (1, 0)
    assert follow[0].token_ids == lead[0].token_ids and follow[0].tool_rewards == lead[0].tool_rewards == [0.2]


def test_a_turn_the_engine_cut_ends_the_rollout(tok):
    """A turn cut short of its budget by the engine (its max_model_len) ends the rollout, even when
    the cut text holds a whole tool call: the context has no room left for the answer."""
    tool = Lookup()
    t1 = ids(tok, call("ab"), end=False)
    outs = agent(tok, tool).run([[1]], [(0, 0)], ["tool_agent"], [{}],
                                lambda contexts, keys, limits: [Out(t1, [-0.5] * len(t1), "length")])
    assert (outs[0].token_ids, outs[0].finish_reason, outs[0].num_turns, tool.calls) == (t1, "length", 2, 0)


class Teacher(BaseInteraction):
    """Says "try again" (score 0) until the last assistant message holds "4", then stops (score 1);
    records the chats it read, and its starts and ends."""

    def __init__(self):
        super().__init__({"name": "teacher"})
        self.read, self.started, self.ended = [], [], []

    async def start_interaction(self, instance_id=None, **kwargs):
        self.started.append(kwargs)
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.read.append([dict(m) for m in messages])
        done = "4" in messages[-1]["content"]
        return done, "try again", 1.0 if done else 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.ended.append(instance_id)


def test_interactions_reply_between_turns(tok):
    """A turn without tool calls goes to the row's interaction, whose reply is appended as a user
    message (masked out) until it ends the rollout; its scores are the turn scores; the chat it
    reads holds the prompt, the model's turns as text and the tool and user messages."""
    teacher, tool = Teacher(), Lookup()
    a = agent(tok, tool, interactions={"teacher": teacher})
    prompt = [{"role": "user", "content": "2+2?"}]
    kwargs = {"name": "teacher", "level": 1}
    script = Script(tok, {(0, 0): ["3", call("ab"), "#### 4"], (1, 0): ["plain"]})
    outs = a.run([[1], [2]], [(0, 0), (1, 0)], ["tool_agent", "single_turn_agent"], [{}, {}], script,
                 messages=[prompt, prompt], interaction_kwargs=[kwargs, None])
    system = system_prompt_ids(tok)
    reply = message_ids(tok, [{"role": "user", "content": "try again"}], system)
    answer = tool_message_ids(tok, ["value of ab"], system)
    t1, t2, t3 = ids(tok, "3"), ids(tok, call("ab")), ids(tok, "#### 4")
    o = outs[0]
    assert o.token_ids == t1 + reply + t2 + answer + t3
    assert o.mask == [1] * len(t1) + [0] * len(reply) + [1] * len(t2) + [0] * len(answer) + [1] * len(t3)
    assert (o.num_turns, o.turn_scores, o.tool_rewards, o.finish_reason) == (6, [0.0, 1.0], [0.2], "stop")
    assert outs[1].num_turns == 2 and outs[1].turn_scores == []  # single-turn: no interaction
    assert teacher.started == [kwargs] and len(teacher.ended) == 1
    assert teacher.read[1] == prompt + [{"role": "assistant", "content": "3"}, {"role": "user", "content": "try again"},
                                        {"role": "assistant", "content": call("ab")},
                                        {"role": "tool", "content": "value of ab"},
                                        {"role": "assistant", "content": "#### 4"}]


def test_an_error_on_the_first_tp_rank_reaches_every_rank(tok):
    """A tool layer error where the tools run is raised on the ranks that only wait for its results."""
    class Broken(Teacher):
        async def generate_response(self, instance_id, messages, **kwargs):
            raise KeyError("gone")

    shared = []
    kw = dict(messages=[[{"role": "user", "content": "x"}]], interaction_kwargs=[{"name": "teacher"}])
    with pytest.raises(Exception, match="gone"):
        agent(tok, Lookup(), interactions={"teacher": Broken()}).run(
            [[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, {(0, 0): ["3"]}),
            share=lambda r: shared.append(r) or r, **kw)
    replay = iter(shared)
    with pytest.raises(RuntimeError, match="first TP rank.*InteractionError.*gone"):
        agent(tok, Lookup(), interactions={"teacher": Broken()}).run(
            [[1]], [(0, 0)], ["tool_agent"], [{}], Script(tok, {(0, 0): ["3"]}), runs_tools=False,
            share=lambda r: next(replay), **kw)
