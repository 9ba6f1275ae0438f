"""`agent.loop.ToolAgent`, verl's tool agent loop, against scripted model turns in a simulated
engine call: the response is the turns and the tool messages, masked by who wrote them, every
count and cut by verl's rules, and each sample's next turn joins the call, under its own key and
budget, at the step its tools answered while other samples still generate."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import pytest

from agent.loop import ToolAgent, _first_rank
from agent.interactions import BaseInteraction, InteractionError
from agent.tools import (BaseTool, ChatTemplateError, ToolError, ToolResponse, message_ids, system_prompt_ids,
                         tool_message_ids, turn_end_ids)
from tests.byte_chat import CHAT_TEMPLATE, ENDOFTEXT, IM_END, build_byte_tokenizer

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
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def call(key: str, name: str = "lookup") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"key": key}}) + "</tool_call>"


class Script:
    """The model behind one engine call (`LLMEngine.generate(on_finish=...)`, simulated): per sample
    key, its turns as texts, each ended by <|im_end|> (or the stop token `eos` gives the key) and cut
    at the turn's budget as the engine cuts it (finish reason `length`). A turn takes one step per
    token; the turns that end at a step reach `on_finish` together, and the continuations it returns
    start at the next step; with nothing running, `on_finish` is called idle until it returns none.
    `requests` records every request as (context, key, budget, the step it started)."""

    def __init__(self, tok, turns: dict[tuple[int, int], list[str]], eos: dict[tuple[int, int], int] | None = None):
        self.tok, self.turns, self.requests = tok, {k: list(v) for k, v in turns.items()}, []
        self.eos = tok.convert_tokens_to_ids(IM_END)
        self.eos_of = dict(eos or {})
        self.on_idle = lambda: None  # called each time the call has nothing left to run

    def reply(self, key, context, limit) -> Out:
        ids = self.tok(self.turns[key].pop(0), add_special_tokens=False)["input_ids"] + [self.eos_of.get(key, self.eos)]
        cut = ids[:limit]
        return Out(key[0], key[1], list(context), cut, [-0.5] * len(cut), "stop" if len(cut) == len(ids) else "length")

    def serve(self, prompts, keys, limit):
        """The `generate` callable of `ToolAgent.run`: the call whose requests are the first turns."""
        def generate(on_finish):
            running, step = [], 0

            def start(context, key, budget):
                # the loop never continues a sample with no budget left (its turn would end at no step)
                assert budget >= 1, (key, budget)
                self.requests.append((list(context), key, budget, step))
                out = self.reply(key, context, budget)
                running.append((step + len(out.token_ids), out))

            for p, k in zip(prompts, keys):
                start(p, k, limit)
            while True:
                step += 1
                ended = [out for end, out in running if end == step]
                running[:] = [(end, out) for end, out in running if end != step]
                for c in on_finish(ended, False):
                    start(c.token_ids, c.key, c.max_tokens)
                while not running:
                    self.on_idle()
                    more = on_finish([], True)
                    if not more:
                        return
                    for c in more:
                        start(c.token_ids, c.key, c.max_tokens)

        return generate


def run(a, script, prompts, keys, agents, **kw):
    return a.run(prompts, keys, agents, [{}] * len(prompts), script.serve(prompts, keys, a.response_length), **kw)


AGENT_ARGS = dict(response_length=400, max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                  max_tool_response_length=256, tool_response_truncate_side="middle", format="hermes")


def agent(tok, tool, **kw):
    return ToolAgent(tok, [tool], **{**AGENT_ARGS, **kw})


def ids(tok, text, end=True):
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.convert_tokens_to_ids(IM_END)] if end else [])


def nl(tok):
    """The `\\n` the byte template writes after `<|im_end|>`, which the loop inserts (masked out) after a
    turn that ended on it, before the messages it appends."""
    return ids(tok, "\n", end=False)


def test_turns_masks_counts_and_the_engine_calls(tok):
    tool = Lookup()
    a = agent(tok, tool)
    prompts = [[1, 2, 3], [4, 5], [6]]
    keys = [(7, 0), (7, 1), (8, 0)]
    script = Script(tok, {(7, 0): [call("ab"), "#### 5"], (7, 1): [call("xyz")], (8, 0): ["plain"]})
    outs = run(a, script, prompts, keys, ["tool_agent", "single_turn_agent", "tool_agent"])
    system = system_prompt_ids(tok)
    t1, message, t2 = ids(tok, call("ab")), tool_message_ids(tok, ["value of ab"], system), ids(tok, "#### 5")
    assert tok.decode(message) == "<|im_start|>user\n<tool_response>\nvalue of ab\n</tool_response><|im_end|>\n" \
                                  "<|im_start|>assistant\n"
    answer = nl(tok) + message  # the first turn ended on <|im_end|>: the template's \n after it comes first
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
    # the call's requests: every sample's first turn from its prompt with the whole budget, then
    # the caller's second turn, its context the prompt and what came so far, its budget what is
    # left, joining at the step its first turn ended
    assert script.requests == [(p, k, 400, 0) for p, k in zip(prompts, keys)] + [
        (prompts[0] + t1 + answer, (7, 0), 400 - len(t1 + answer), len(t1))]


class Clock(Lookup):
    """A second tool, `clock`: answers `tick <key>`, reward 1.0."""

    def __init__(self):
        BaseTool.__init__(self, {}, {**SCHEMA, "function": {**SCHEMA["function"], "name": "clock"}})
        self.calls = 0

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls += 1
        return ToolResponse(text=f"tick {parameters['key']}"), 1.0, {}


def test_a_row_s_tool_selection_narrows_the_tools_it_may_call(tok):
    """verl 0.9.1's `extra_info.tool_selection`: a sample whose row selects `clock` gets verl's
    unknown-tool answer, naming only its row's tools, for a call to `lookup` (reward 0.0, run by
    nobody), while its row's other sample calls `clock`; a row without a selection calls either."""
    lookup, clock = Lookup(), Clock()
    a = ToolAgent(tok, [lookup, clock], **AGENT_ARGS)
    prompts, keys = [[1], [1], [2]], [(0, 0), (0, 1), (1, 0)]
    calls = {(0, 0): call("ab"), (0, 1): call("ab", "clock"), (1, 0): call("ab")}
    script = Script(tok, {k: [c, "done"] for k, c in calls.items()})
    outs = a.run(prompts, keys, ["tool_agent"] * 3, [{}] * 3, script.serve(prompts, keys, a.response_length),
                 tool_selections=[["clock"], ["clock"], None])
    system = system_prompt_ids(tok)
    answers = ["Unknown function 'lookup'. Available tools: ['clock']", "tick ab", "value of ab"]
    for out, key, answer in zip(outs, keys, answers):
        assert out.token_ids == ids(tok, calls[key]) + nl(tok) + tool_message_ids(tok, [answer], system) + \
            ids(tok, "done"), key
    assert [o.tool_rewards for o in outs] == [[0.0], [1.0], [0.2]]
    assert (lookup.calls, clock.calls) == (1, 1)
    # a selection naming a tool the loop does not have is refused before anything runs
    with pytest.raises(ValueError, match=r"the tool selection of sample \(0, 0\) names 'search', which is not a "
                                         r"tool of .*\(its tools: \['lookup', 'clock'\]\)"):
        a.run([[1]], [(0, 0)], ["tool_agent"], [{}], pytest.fail, tool_selections=[["search"]])


class Gated(Lookup):
    """Lookup that answers only once `open` is set, polling for it as a tool waiting on I/O would."""

    def __init__(self):
        super().__init__()
        self.open = False

    async def execute(self, instance_id, parameters, **kwargs):
        while not self.open:
            await asyncio.sleep(0.001)
        return await super().execute(instance_id, parameters, **kwargs)


@pytest.mark.parametrize("poll_every", [1, 5])
def test_a_sample_s_next_turn_joins_the_running_call(tok, poll_every):
    """Sample A's tool answers at once: its second turn joins at the step its first turn ended,
    while B's long turn still runs. With a tool that waits on I/O (answering only once the call is
    idle), A joins when it answered, with the same rollout; the loop looks at it at the step its
    turn ended, every `poll_every` steps while it waits, and once idle (each look one `share`)."""
    turns = {(0, 0): [call("ab"), "ok"], (1, 0): ["x" * 120]}
    prompts, keys = [[1], [2]], [(0, 0), (1, 0)]
    script = Script(tok, turns)
    instant = run(agent(tok, Lookup(), poll_every=poll_every), script, prompts, keys, ["tool_agent"] * 2)
    a_end, b_end = len(ids(tok, call("ab"))), len(ids(tok, "x" * 120))
    assert a_end < b_end
    assert [(r[1], r[3]) for r in script.requests] == [((0, 0), 0), ((1, 0), 0), ((0, 0), a_end)]

    gated, looks = Gated(), []
    script = Script(tok, turns)
    script.on_idle = lambda: setattr(gated, "open", True)
    waited = run(agent(tok, gated, poll_every=poll_every), script, prompts, keys, ["tool_agent"] * 2,
                 share=lambda r: looks.append(r) or r)
    assert [(r[1], r[3]) for r in script.requests] == [((0, 0), 0), ((1, 0), 0), ((0, 0), b_end)]
    assert [(o.token_ids, o.mask, o.tool_rewards) for o in waited] == [(o.token_ids, o.mask, o.tool_rewards)
                                                                       for o in instant]
    polls = sum(1 for step in range(a_end + 1, b_end + 1) if step % poll_every == 0)
    assert len(looks) == 1 + polls + 1
    assert [len(r[1]) for r in looks] == [0] * (1 + polls) + [1]  # ("ok", answered samples)


def test_the_loop_runs_inside_a_running_event_loop(tok):
    """Called from a coroutine (a notebook, an async caller), the rollout's event loop runs in a
    worker thread: the same rollout, with a tool that waits on I/O as well."""
    turns = {(0, 0): [call("ab"), "ok"], (1, 0): ["x" * 120]}
    plain = run(agent(tok, Lookup()), Script(tok, turns), [[1], [2]], [(0, 0), (1, 0)], ["tool_agent"] * 2)

    async def caller():
        gated, script = Gated(), Script(tok, turns)
        script.on_idle = lambda: setattr(gated, "open", True)
        return run(agent(tok, gated), script, [[1], [2]], [(0, 0), (1, 0)], ["tool_agent"] * 2)

    inside = asyncio.run(caller())
    assert [(o.token_ids, o.tool_rewards) for o in inside] == [(o.token_ids, o.tool_rewards) for o in plain]
    assert plain[0].tool_rewards == [0.2]


class Slow(Lookup):
    """Lookup that takes 50 ms of I/O."""

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0.05)
        return await super().execute(instance_id, parameters, **kwargs)


def test_each_sample_times_its_turns_and_its_tools(tok):
    """verl's agent-loop times per sample: `tool_s`, the seconds it waited for its tools (at least
    the tool's 50 ms of I/O; none for a sample that called none), and `generate_s`, its turns'
    seconds in the engine; each no more than the rollout's wall time."""
    t0 = time.perf_counter()
    outs = run(agent(tok, Slow()), Script(tok, {(0, 0): [call("ab"), "ok"], (1, 0): ["plain"]}), [[1], [2]],
               [(0, 0), (1, 0)], ["tool_agent", "tool_agent"])
    wall = time.perf_counter() - t0
    assert 0.05 <= outs[0].tool_s <= wall and outs[1].tool_s == 0.0
    assert all(0 < o.generate_s <= wall for o in outs)
    assert outs[0].generate_s + outs[0].tool_s <= wall


def test_budget_and_turn_limits(tok):
    t1 = ids(tok, call("ab"))
    answer = nl(tok) + tool_message_ids(tok, ["value of ab"], system_prompt_ids(tok))
    # the answer (after the template's \n, which counts as the answer does) does not fit: the sample ends
    # before it ("length"), the tool's reward still counts
    tool = Lookup()
    outs = run(agent(tok, tool, response_length=len(t1) + len(answer)), Script(tok, {(0, 0): [call("ab")]}),
               [[1]], [(0, 0)], ["tool_agent"])
    assert outs[0].token_ids == t1 and outs[0].finish_reason == "length"
    assert (outs[0].num_turns, outs[0].tool_rewards, tool.calls) == (2, [0.2], 1)
    # one token more and it fits; the next turn gets the single token left and is cut by the engine
    outs = run(agent(tok, Lookup(), response_length=len(t1) + len(answer) + 1),
               Script(tok, {(0, 0): [call("ab"), "#### 5"]}), [[1]], [(0, 0)], ["tool_agent"])
    assert outs[0].token_ids == t1 + answer + ids(tok, "#")[:1] and outs[0].finish_reason == "length"
    assert outs[0].num_turns == 4
    # max_assistant_turns=1: the first turn's call is not run
    tool = Lookup()
    outs = run(agent(tok, tool, max_assistant_turns=1), Script(tok, {(0, 0): [call("ab")]}), [[1]], [(0, 0)],
               ["tool_agent"])
    assert (outs[0].token_ids, outs[0].num_turns, tool.calls) == (t1, 2, 0)
    # max_user_turns=1: one tool answer, then the next turn's call is not run
    tool = Lookup()
    outs = run(agent(tok, tool, max_user_turns=1), Script(tok, {(0, 0): [call("ab"), call("cd")]}), [[1]],
               [(0, 0)], ["tool_agent"])
    assert (outs[0].num_turns, tool.calls) == (4, 1) and outs[0].token_ids == t1 + answer + ids(tok, call("cd"))
    # 0 is no limit, as in verl (its loop tests the limit for truth): both calls run, as with null
    for limits in (dict(max_assistant_turns=0), dict(max_user_turns=0)):
        tool = Lookup()
        outs = run(agent(tok, tool, **limits), Script(tok, {(0, 0): [call("ab"), call("cd"), "done"]}), [[1]],
                   [(0, 0)], ["tool_agent"])
        assert (outs[0].num_turns, tool.calls) == (6, 2), limits


def test_zero_turn_limits_are_verls_no_limit():
    """verl's `multi_turn.max_assistant_turns` / `max_user_turns` of 0 mean no limit (its loop tests them for
    truth); the config takes 0 and the trainer passes it on, where a negative count is refused."""
    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, load_config

    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(PPOConfig, None, [f"{mt}.max_assistant_turns=0", f"{mt}.max_user_turns=0"])
    assert (cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns,
            cfg.actor_rollout_ref.rollout.multi_turn.max_user_turns) == (0, 0)
    with pytest.raises(ConfigError, match="max_user_turns"):
        load_config(PPOConfig, None, [f"{mt}.max_user_turns=-1"])


def test_parallel_calls_and_truncated_answers(tok):
    tool = Lookup()
    two = call("a") + call("bcdefghij")
    # limit 10: the first answer fits exactly, the second keeps its first 10 characters ("right" cuts the end)
    outs = run(agent(tok, tool, max_parallel_calls=2, max_tool_response_length=10, tool_response_truncate_side="right"),
               Script(tok, {(0, 0): [two + call("k"), "done"]}), [[1]], [(0, 0)], ["tool_agent"])
    answer = nl(tok) + tool_message_ids(tok, ["value of a", "value of b...(truncated)"], system_prompt_ids(tok))
    assert tool.calls == 2 and outs[0].tool_rewards == [0.1, 0.9]
    assert outs[0].token_ids == ids(tok, two + call("k")) + answer + ids(tok, "done")  # the third call not run


def test_only_the_first_tp_rank_runs_the_tools(tok):
    """A rank that does not run the tools takes the shared answers: the same rollout, no execution."""
    turns = {(0, 0): [call("ab"), "ok"]}
    leader_tool, follower_tool = Lookup(), Lookup()
    shared = []
    lead = run(agent(tok, leader_tool), Script(tok, turns), [[1]], [(0, 0)], ["tool_agent"],
               share=lambda r: shared.append(r) or r)
    replay = iter(shared)  # the leader's looks at its waiting samples, in order
    follow = run(agent(tok, follower_tool), Script(tok, turns), [[1]], [(0, 0)], ["tool_agent"], runs_tools=False,
                 share=lambda r: next(replay) if r is None else pytest.fail())
    assert len(shared) == 1 and next(replay, None) is None
    assert (leader_tool.calls, follower_tool.calls) == (1, 0)
    assert follow[0].token_ids == lead[0].token_ids and follow[0].tool_rewards == lead[0].tool_rewards == [0.2]


def test_a_turn_the_engine_cut_ends_the_rollout(tok):
    """A turn cut short of its budget by the engine (its max_model_len) ends the rollout, even when
    the cut text holds a whole tool call: the context has no room left for the answer."""
    tool = Lookup()
    t1 = ids(tok, call("ab"), end=False)
    cut = Script(tok, {})
    cut.reply = lambda key, context, limit: Out(key[0], key[1], context, t1, [-0.5] * len(t1), "length")
    outs = run(agent(tok, tool), cut, [[1]], [(0, 0)], ["tool_agent"])
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
    outs = run(a, script, [[1], [2]], [(0, 0), (1, 0)], ["tool_agent", "single_turn_agent"],
               messages=[prompt, prompt], interaction_kwargs=[kwargs, None])
    system = system_prompt_ids(tok)
    reply = nl(tok) + message_ids(tok, [{"role": "user", "content": "try again"}], system)
    answer = nl(tok) + tool_message_ids(tok, ["value of ab"], system)
    t1, t2, t3 = ids(tok, "3"), ids(tok, call("ab")), ids(tok, "#### 4")
    o = outs[0]
    assert o.token_ids == t1 + reply + t2 + answer + t3
    assert o.mask == [1] * len(t1) + [0] * len(reply) + [1] * len(t2) + [0] * len(answer) + [1] * len(t3)
    # verl's count: 3 assistant turns + the tool answer + 2 user replies (the last, which ends the rollout, is
    # counted though not appended) + 1
    assert (o.num_turns, o.turn_scores, o.tool_rewards, o.finish_reason) == (7, [0.0, 1.0], [0.2], "stop")
    assert outs[1].num_turns == 2 and outs[1].turn_scores == []  # single-turn: no interaction
    assert teacher.started == [kwargs] and len(teacher.ended) == 1
    assert teacher.read[1] == prompt + [{"role": "assistant", "content": "3"}, {"role": "user", "content": "try again"},
                                        {"role": "assistant", "content": call("ab")},
                                        {"role": "tool", "content": "value of ab"},
                                        {"role": "assistant", "content": "#### 4"}]


def test_an_interaction_reply_that_does_not_fit_still_counts_as_a_user_turn(tok):
    """verl counts an interaction's reply before it appends it (and cuts the response later); a tool
    answer that does not fit it does not count. Here the reply ends the rollout without being
    appended, and num_turns counts it (it was one lower than verl's)."""
    prompt = [{"role": "user", "content": "2+2?"}]
    t1 = ids(tok, "3")
    reply = nl(tok) + message_ids(tok, [{"role": "user", "content": "try again"}], system_prompt_ids(tok))
    teacher = Teacher()
    a = agent(tok, Lookup(), interactions={"teacher": teacher}, response_length=len(t1) + len(reply))
    (o,) = run(a, Script(tok, {(0, 0): ["3", "4"]}), [[1]], [(0, 0)], ["tool_agent"], messages=[prompt],
               interaction_kwargs=[{"name": "teacher"}])
    assert (o.token_ids, o.finish_reason, o.turn_scores) == (t1, "length", [0.0])
    assert o.num_turns == 3  # 1 assistant turn + the reply + 1


def test_an_interactions_metrics_are_not_shared_over_the_tp_group(tok):
    """The turn results are broadcast over the engine's TP group (pickled): an interaction's metrics
    dict, which the loop does not read, may hold objects that do not pickle; it failed the first rank
    alone, leaving the others in the broadcast."""
    import pickle

    class Unpicklable(Teacher):
        async def generate_response(self, instance_id, messages, **kwargs):
            stop, text, score, _ = await super().generate_response(instance_id, messages, **kwargs)
            return stop, text, score, {"callback": lambda: None}

    a = agent(tok, Lookup(), interactions={"teacher": Unpicklable()})
    (o,) = run(a, Script(tok, {(0, 0): ["3", "4"]}), [[1]], [(0, 0)], ["tool_agent"],
               messages=[[{"role": "user", "content": "2+2?"}]], interaction_kwargs=[{"name": "teacher"}],
               share=lambda r: pickle.loads(pickle.dumps(r)))
    assert (o.num_turns, o.turn_scores, o.finish_reason) == (5, [0.0, 1.0], "stop")


def test_an_interaction_written_for_verl_is_called_under_the_request_id(tok):
    """verl calls `start_interaction(request_id, **kwargs)`, ignores what it returns and uses the request
    id from then on: an interaction whose start returns nothing (or another id) still answers the turns,
    under the id it was started with, and is finalized under it."""
    class VerlStyle(Teacher):
        def __init__(self, returns):
            super().__init__()
            self.returns, self.ids = returns, []

        async def start_interaction(self, instance_id=None, **kwargs):
            self.ids.append(("start", instance_id))
            return self.returns

        async def generate_response(self, instance_id, messages, **kwargs):
            self.ids.append(("turn", instance_id))
            return await super().generate_response(instance_id, messages, **kwargs)

        async def finalize_interaction(self, instance_id=None, **kwargs):
            self.ids.append(("end", instance_id))

    for returns in (None, "other"):
        teacher = VerlStyle(returns)
        a = agent(tok, Lookup(), interactions={"teacher": teacher})
        script = Script(tok, {(0, 0): ["3", "4"]})
        (o,) = run(a, script, [[1]], [(0, 0)], ["tool_agent"], messages=[[{"role": "user", "content": "2+2?"}]],
                   interaction_kwargs=[{"name": "teacher"}])
        (request_id,) = {i for _, i in teacher.ids}
        assert isinstance(request_id, str) and request_id != returns
        assert [k for k, _ in teacher.ids] == ["start", "turn", "turn", "end"]
        assert (o.num_turns, o.turn_scores, o.finish_reason) == (5, [0.0, 1.0], "stop")


# the byte template, which raises on a tool message, or drops tool (or user) messages
RAISES_ON_TOOL = CHAT_TEMPLATE.replace("{% if m['role'] == 'tool' %}",
                                       "{% if m['role'] == 'tool' %}{{ raise_exception('no tool role here') }}")
DROPS_TOOL = CHAT_TEMPLATE.replace("{% if m['role'] == 'tool' %}", "{% if m['role'] == 'tool' %}{% if false %}")\
    .replace("</tool_response><|im_end|>\n", "</tool_response><|im_end|>\n{% endif %}")
DROPS_USER = CHAT_TEMPLATE.replace("{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}",
                                   "{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
                                   "{{ '' if m['role'] == 'user' and m['content'].startswith('meshppo') "
                                   "else m['content'] }}")


def test_a_template_that_cannot_render_the_inserted_messages_is_refused_when_built(tok):
    """The tools' answers are `tool` messages and the interactions' replies `user` ones: a template
    that raises on the role, or drops the message, is a ChatTemplateError when the loop is built
    (it was found at the model's first tool call, or never), naming the role; the usual one passes."""
    teacher = {"teacher": Teacher()}
    for template in (CHAT_TEMPLATE, DROPS_USER):
        agent(tok, Lookup(), chat_template_kwargs={"chat_template": template})  # tools only: tool messages
    agent(tok, Lookup(), chat_template_kwargs={"chat_template": CHAT_TEMPLATE}, interactions=teacher)  # and user
    with pytest.raises(ChatTemplateError, match=r"^the custom chat template \(chat_template\) cannot render \['tool'\] "
                                                r"messages: TemplateError: no tool role here$") as err:
        agent(tok, Lookup(), chat_template_kwargs={"chat_template": RAISES_ON_TOOL})
    assert err.value.role == "tool"
    with pytest.raises(ChatTemplateError, match=r"^the custom chat template \(chat_template\) renders a 'tool' message "
                                                r"without its text") as err:
        agent(tok, Lookup(), chat_template_kwargs={"chat_template": DROPS_TOOL})
    with pytest.raises(ChatTemplateError, match=r"renders a 'user' message without its text") as err:
        ToolAgent(tok, [], **{**AGENT_ARGS, "chat_template_kwargs": {"chat_template": DROPS_USER},
                              "interactions": teacher})
    assert err.value.role == "user"
    # the tokenizer's own template, named so
    bad = build_byte_tokenizer()
    bad.chat_template, bad.name_or_path = DROPS_TOOL, "/models/drops-tool"
    with pytest.raises(ChatTemplateError, match=r"^the chat template of '/models/drops-tool' renders a 'tool' message"):
        agent(bad, Lookup())


# Llama 3's shape in the byte tokenizer's tokens: a BOS before the chat (<|endoftext|>), each message
# `<|im_start|>role\n\n` + its trimmed text + `<|im_end|>`, and nothing after the end token
LLAMA_STYLE = ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|im_end|>"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}")
# Qwen3's shape of the last assistant message: an empty think block before its text
THINKS = CHAT_TEMPLATE.replace("{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}",
                               "{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
                               "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
                               "{{ m['content'] }}")
ASSISTANT_TEXT = "\n{{ m['content'] }}<|im_end|>"
DROPS_ASSISTANT = CHAT_TEMPLATE.replace(ASSISTANT_TEXT, "\n{{ '' if m['role'] == 'assistant' else m['content'] }}"
                                                        "<|im_end|>")
REPEATS_ASSISTANT = CHAT_TEMPLATE.replace(ASSISTANT_TEXT, "\n{{ m['content'] }}{{ m['content'] if m['role'] == "
                                                          "'assistant' else '' }}<|im_end|>")


def test_the_turn_end_is_what_the_template_writes_after_an_assistant_message(tok):
    """`turn_end_ids`: the byte template (Qwen's) closes an assistant message with `<|im_end|>\\n`, so
    after the model's `<|im_end|>` the loop inserts the `\\n`; with a think block before the last
    message's text (Qwen3) the same; Llama 3's writes nothing after its end token, so nothing is
    inserted. A template that drops or repeats the assistant's text is refused when the loop is
    built, naming the template and the role of the messages it would insert."""
    im_end = tok.convert_tokens_to_ids(IM_END)
    # (the templates below edit the byte template's user/assistant branch, each once)
    assert CHAT_TEMPLATE.count(ASSISTANT_TEXT) == 1 and "<think>" in THINKS and "<think>" not in CHAT_TEMPLATE
    assert turn_end_ids(tok) == [im_end, ord("\n")]  # the byte tokenizer's ids are the bytes
    assert turn_end_ids(tok, chat_template=THINKS) == [im_end, ord("\n")]
    assert turn_end_ids(tok, chat_template=LLAMA_STYLE) == [im_end]
    qwen, llama = (agent(tok, Lookup(), chat_template_kwargs=kw) for kw in ({}, {"chat_template": LLAMA_STYLE}))
    assert [qwen._turn_end_rest(ids(tok, t)) for t in ("4", "")] == [[ord("\n")]] * 2
    assert qwen._turn_end_rest(ids(tok, "4", end=False)) == []
    assert qwen._turn_end_rest(ids(tok, "4", end=False) + [tok.convert_tokens_to_ids(ENDOFTEXT)]) == []
    assert qwen._turn_end_rest(ids(tok, "4") + [ord("\n")]) == []  # the whole turn end is there already
    assert llama._turn_end_rest(ids(tok, "4")) == []
    for template, how in ((DROPS_ASSISTANT, "without its text"), (REPEATS_ASSISTANT, "with its text 2 times")):
        refused = (r"^the custom chat template \(chat_template\) renders an 'assistant' message " + how +
                   r" \(a user message and an 'assistant' message 'meshppo sample message 42' render as .*\), so what "
                   r"it writes after the model's turn cannot be found$")
        with pytest.raises(ChatTemplateError, match=refused) as err:
            agent(tok, Lookup(), chat_template_kwargs={"chat_template": template})
        assert err.value.role == "tool"
    with pytest.raises(ChatTemplateError, match=r"renders an 'assistant' message without its text") as err:
        ToolAgent(tok, [], **{**AGENT_ARGS, "chat_template_kwargs": {"chat_template": DROPS_ASSISTANT},
                              "interactions": {"teacher": Teacher()}})
    assert err.value.role == "user"


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA_STYLE], ids=["qwen_style", "llama_style"])
def test_a_multi_turn_context_is_the_templates_rendering_of_the_conversation(tok, template):
    """The prompt and the response before the last turn are, token for token, the chat template's own
    rendering of the conversation (with the tools' schemas and the generation prompt), what the model
    reads at inference: with the byte template (Qwen's) the `\\n` after each `<|im_end|>` that ended
    a turn is in the response, masked out with the messages after it; with a Llama-3-style template
    nothing is added after the end token. A tool call, the interaction's reply, a second call."""
    kw = {"chat_template": template}
    teacher = Teacher()
    a = agent(tok, Lookup(), interactions={"teacher": teacher}, chat_template_kwargs=kw)
    question = [{"role": "user", "content": "2+2?"}]

    def render(messages):
        return tok(tok.apply_chat_template(messages, tools=[SCHEMA], add_generation_prompt=True, tokenize=False, **kw),
                   add_special_tokens=False)["input_ids"]

    prompt = render(question)
    turns = [call("ab"), "3", call("cd"), "#### 4"]
    (o,) = run(a, Script(tok, {(0, 0): list(turns)}), [prompt], [(0, 0)], ["tool_agent"], messages=[question],
               interaction_kwargs=[{"name": "teacher"}])
    assert (o.finish_reason, o.turn_scores, o.tool_rewards) == ("stop", [0.0, 1.0], [0.2, 0.2])
    conversation = question + [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "value of ab"},
                               {"role": "assistant", "content": turns[1]}, {"role": "user", "content": "try again"},
                               {"role": "assistant", "content": turns[2]}, {"role": "tool", "content": "value of cd"}]
    assert prompt + o.token_ids == render(conversation) + ids(tok, turns[3])
    # the mask: 1 on the model's turns (each ended by its <|im_end|>), 0 (log-prob 0) on what is between them
    runs = []  # (mask, tokens) of each run of one mask value
    for t, m, lp in zip(o.token_ids, o.mask, o.logprobs, strict=True):
        assert lp == (-0.5 if m else 0.0)
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    assert [r for m, r in runs if m] == [ids(tok, t) for t in turns] and [m for m, _ in runs] == [1, 0] * 3 + [1]
    if template == CHAT_TEMPLATE:
        tool, user = ("\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                      "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
    else:
        tool, user = ("<|im_start|>tool\n\n{}<|im_end|><|im_start|>assistant\n\n",
                      "<|im_start|>user\n\n{}<|im_end|><|im_start|>assistant\n\n")
    assert [tok.decode(r, skip_special_tokens=False) for m, r in runs if not m] == [
        tool.format("value of ab"), user.format("try again"), tool.format("value of cd")]


def test_a_turn_that_ended_on_another_stop_token_gets_no_newline(tok):
    """verl's rule: the template's `\\n` is inserted only when the model's turn ended on the template's
    end-of-turn token (`<|im_end|>`); a turn that stopped on `<|endoftext|>` (also a stop token of
    Qwen's) is followed by the tool's answer directly. The other sample, same calls, gets the `\\n`."""
    endoftext = tok.convert_tokens_to_ids(ENDOFTEXT)
    script = Script(tok, {(0, 0): [call("ab"), "done"], (1, 0): [call("ab"), "done"]}, eos={(1, 0): endoftext})
    outs = run(agent(tok, Lookup()), script, [[1], [2]], [(0, 0), (1, 0)], ["tool_agent"] * 2)
    message = tool_message_ids(tok, ["value of ab"], system_prompt_ids(tok))
    t1 = ids(tok, call("ab"), end=False)
    assert outs[0].token_ids == t1 + [tok.convert_tokens_to_ids(IM_END)] + nl(tok) + message + ids(tok, "done")
    assert outs[1].token_ids == t1 + [endoftext] + message + ids(tok, "done", end=False) + [endoftext]
    assert outs[1].mask == [1] * (len(t1) + 1) + [0] * len(message) + [1] * (len("done") + 1)


def test_an_error_on_the_first_tp_rank_reaches_every_rank(tok):
    """A tool layer error where the tools run is raised on the ranks that only wait for its results."""
    class Broken(Teacher):
        async def generate_response(self, instance_id, messages, **kwargs):
            raise KeyError("gone")

    shared = []
    kw = dict(messages=[[{"role": "user", "content": "x"}]], interaction_kwargs=[{"name": "teacher"}])
    with pytest.raises(Exception, match="gone"):
        run(agent(tok, Lookup(), interactions={"teacher": Broken()}), Script(tok, {(0, 0): ["3"]}), [[1]], [(0, 0)],
            ["tool_agent"], share=lambda r: shared.append(r) or r, **kw)
    replay = iter(shared)
    # an interaction's (or a tool's) error is the same input error there; anything else a RuntimeError naming it
    with pytest.raises(InteractionError, match=r"^\(on the engine's first TP rank, which runs the tools and "
                                               r"interactions\) interaction 'teacher' \(Broken\)\.generate_response "
                                               r"failed: KeyError: 'gone'$"):
        run(agent(tok, Lookup(), interactions={"teacher": Broken()}), Script(tok, {(0, 0): ["3"]}), [[1]], [(0, 0)],
            ["tool_agent"], runs_tools=False, share=lambda r: next(replay), **kw)
    # where the tools run, the error's kind goes with it: a subclass of the tool error is one too
    class PainterError(ToolError):
        """A tool's own kind of contract error (a subclass: the relay must go by isinstance, not by name)."""

    def fail(error):
        def work():
            raise error
        return work

    for error, kind, text in ((PainterError("tool 't' broke"), ToolError, "tool 't' broke"),
                              (KeyError("k"), RuntimeError, "KeyError: 'k'")):
        heard = []
        with pytest.raises(type(error)):
            _first_rank(fail(error), True, lambda r: heard.append(r) or r)
        with pytest.raises(kind, match=r"^\(on the engine's first TP rank, which runs the tools and interactions\) "
                                       f"{text}$") as err:
            _first_rank(lambda: None, False, lambda _: heard[0])
        assert type(err.value) is kind


class Painter(Lookup):
    """Breaks the tool contract: answers with an image."""

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(image=[parameters["key"]]), 0.0, {}


def test_a_tool_error_is_raised_and_every_ended_tasks_error_retrieved(tok, caplog):
    """Two samples' tools break the contract in the same engine step: the first error stops the run,
    and the other task's is retrieved too (asyncio logs an unretrieved one when the task is freed,
    a traceback after the run's one-line error)."""
    import gc

    script = Script(tok, {(0, 0): [call("a")], (1, 0): [call("b")]})
    with pytest.raises(ToolError, match=r"tool 'lookup' \(Painter\) returned image data"):
        run(agent(tok, Painter()), script, [[1], [2]], [(0, 0), (1, 0)], ["tool_agent", "tool_agent"])
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage() and "Painter" in r.getMessage()]
