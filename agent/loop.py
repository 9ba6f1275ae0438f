"""Multi-turn rollouts with tool calls and interactions: verl's tool agent loop (`rollout.multi_turn`),
each sample's turns joining one running engine call.

verl runs one asynchronous state machine per sample against a rollout server. Here a rollout-DP
replica's samples share one call of the engine (`LLMEngine.generate(on_finish=...)`): every
sample's first turn is a request of the call, and each later turn joins the running call as
soon as the sample's tools or interaction have answered, so continuous batching keeps the batch
full while other samples still generate, wait for tools, or have ended:

    a turn ends (EOS, its budget, or the engine's max_model_len)
    -> stop when the engine cut the turn ("length"), or at max_assistant_turns / max_user_turns;
       a turn with hermes `<tool_call>` JSON goes to its tools (its first max_parallel_calls
       calls, at once; the tools its row's `extra_info.tool_selection` names, all without one),
       one without to its interaction if there are interactions, else it ends;
       single-turn samples stop after their first turn
    -> the tools or the interaction run as tasks of the rollout's event loop, while the engine
       goes on with the other samples
    -> their answers (tool messages, the interaction's user message), rendered by the chat
       template, are appended to the sample (after what the template writes after the model's
       end-of-turn token when the turn ended on it: Qwen's `\\n` after `<|im_end|>`), which
       continues from its kept K/V with what is left of its budget; one whose messages do not
       fit in its budget stops without them (verl's rule), as does one whose interaction ends
       the rollout (verl appends that last reply, masked out; here the response ends on the
       model's turn, but the reply counts as a user turn in `num_turns`, as in verl)

A sample's response is every token after its prompt: the model's turns (mask 1) and the tokens
inserted between them (mask 0, log-prob 0), never longer than the response length. The inserted
tokens are what the chat template writes between the turns, as the model reads them at
inference: the rest of the template's turn end after the model's end-of-turn token
(`agent.tools.turn_end_ids`), then the messages rendered alone minus the template's chat prefix
(`message_ids`). The engine continues each sample under its own noise key, at the token's
position in the sample, so a sample that calls no tool is token for token the single-turn
rollout, and when its next turn joins the call does not change what it samples (up to the
rounding of GEMMs of another batch size). `num_turns` is verl's count (assistant turns + tool responses + interaction replies + 1);
`tool_rewards` the rewards the tools returned and `turn_scores` the interactions' reach the reward
function in `extra_info`, as verl passes them. Each tool-agent sample starts its interaction
instance (`interaction_kwargs`' `name`) before its first turn, under the sample's own request id,
which its later calls use (as verl, whatever `start_interaction` returns); the loop finalizes them
at the end (verl's leaves them).

When answers join. The loop looks at its waiting samples after every engine step in which a
sample began to wait, every `poll_every` steps otherwise, and whenever the engine has nothing left
to run (then it waits for the first answer). A task that awaits no I/O (GSM8K's tool, a rule-based
interaction) has ended by then, so its sample joins at the step its turn ended, on every run; one
that waits on I/O (a sandbox, a search) joins at the first look after it answered.

With engine tensor parallelism the replica's TP ranks must feed the engine identical requests:
the tools and interactions run on the replica's first TP rank only and each look's answers are
broadcast (`share`), so a tool that is not deterministic (a search, a clock) still keeps the
ranks in step; an error there is raised on every rank of the replica. The looks happen at the
same steps on every rank (the steps' ended turns are the same), so each is one broadcast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable
from uuid import uuid4

from agent._load import EventLoop
from agent.interactions import (BaseInteraction, InteractionError, finalize_interactions, interaction_turn,
                                start_interactions)
from agent.tool_parser import parse_tool_calls
from agent.tools import (BaseTool, ToolError, check_message_template, check_parallel_calls, check_truncation,
                         message_ids, select_tools, system_prompt_ids, tool_turn, turn_end_ids)
from data.dataset import TOOL_AGENT
from models.tokenizer import decode_batch
from rollout.config import Continuation
from trainer.errors import UserError


@dataclass
class TurnOutput:
    """One sample's multi-turn rollout, in the fields of the engine's `RequestOutput` that the
    trainer reads, plus the turns' mask, counts and times (wall seconds, summed over its turns)."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finish_reason: str
    num_turns: int
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    generate_s: float = 0.0  # seconds its turns spent in the engine (queued or generating), verl's generate_sequences
    tool_s: float = 0.0  # seconds it waited for its tools and interaction, verl's tool_calls


@dataclass(eq=False)
class _Sample:
    key: tuple[int, int]
    context: list[int]
    agent: str
    tools_kwargs: dict
    tools: dict[str, BaseTool]  # the ones its row may call (verl's `_active_tools`)
    messages: list[dict] | None = None  # the chat so far (with interactions: what they read)
    interaction_kwargs: dict | None = None
    instance: str | None = None  # its interaction's instance id (its request id, as verl's)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    calls: list = field(default_factory=list)
    generate_s: float = 0.0
    tool_s: float = 0.0
    since: float = 0.0  # when its current turn was requested, or it began to wait

    def output(self) -> TurnOutput:
        return TurnOutput(self.key[0], self.key[1], self.tokens, self.logprobs, self.mask, self.finish_reason,
                          self.user_turns + self.assistant_turns + 1, self.tool_rewards, self.turn_scores,
                          self.generate_s, self.tool_s)


class ToolAgent:
    """The loop above for one replica's prompts. `tools`: by name (`agent.tools.load_tools`);
    `interactions`: by name (`agent.interactions.load_interactions`; none: a turn without tool
    calls ends the rollout); `chat_template_kwargs`: verl's `data.apply_chat_template_kwargs`, also
    used to render the inserted messages; the limits are `rollout.multi_turn`'s (None: no limit on
    that count); `poll_every`: the engine steps between looks at waiting samples when none began
    to wait (each look is a broadcast at TP > 1). A chat template that cannot render a `tool`
    message (with tools) or a `user` one (with interactions) with its text, or an assistant message
    (the model's turn they follow), is a ChatTemplateError."""

    def __init__(self, tokenizer, tools: list[BaseTool], *, response_length: int, max_assistant_turns: int | None,
                 max_user_turns: int | None, max_parallel_calls: int, max_tool_response_length: int,
                 tool_response_truncate_side: str, format: str, chat_template_kwargs: dict[str, Any] | None = None,
                 interactions: dict[str, BaseInteraction] | None = None, poll_every: int = 1):
        check_truncation(max_tool_response_length, tool_response_truncate_side)
        check_parallel_calls(max_parallel_calls)
        if isinstance(poll_every, bool) or not isinstance(poll_every, int) or poll_every < 1:
            raise ValueError(f"poll_every must be a positive integer, got {poll_every!r}")
        self.tokenizer = tokenizer
        self.tools = {t.name: t for t in tools}
        self.interactions = dict(interactions or {})
        self.response_length = response_length
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.limit, self.side, self.format = max_tool_response_length, tool_response_truncate_side, format
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.poll_every = poll_every
        self._system_prompt: list[int] | None = None
        self._turn_end: list[int] | None = None
        # the messages the loop will insert, and the model's turn they follow, rendered now: a
        # template that cannot render them (or drops them) is a ChatTemplateError here, not at the
        # model's first tool call mid-training
        for role, needed in (("tool", self.tools), ("user", self.interactions)):
            if needed:
                check_message_template(tokenizer, role, **self.chat_template_kwargs)

    def run(self, prompts: list[list[int]], keys: list[tuple[int, int]], agents: list[str], tools_kwargs: list[dict],
            generate: Callable, runs_tools: bool = True, share: Callable = lambda x: x,
            messages: list[list[dict]] | None = None, interaction_kwargs: list[dict | None] | None = None,
            tool_selections: list[list[str] | None] | None = None) -> list[TurnOutput]:
        """Roll out every sample: `prompts[i]`, the sample `keys[i]` (prompt index, sample index),
        by `agents[i]` with the row's `tools_kwargs[i]` (verl's `extra_info.tools_kwargs`) and, when
        given, its `tool_selections[i]` (verl's `extra_info.tool_selection`: the names of the only
        tools it may call; a call to another is answered as one to an unknown tool, naming these;
        None: all the tools, as for every sample without `tool_selections`).
        `generate(on_finish)` makes the engine call whose requests are every sample's first turn
        (each up to the response length), passing `on_finish` to `LLMEngine.generate`.
        `runs_tools`: whether this rank executes the tools and interactions; `share(results)`
        returns the executing rank's results on every rank that generates with it. With
        interactions: `messages[i]`, the prompt as chat messages, and `interaction_kwargs[i]`
        (verl's `extra_info.interaction_kwargs`, whose `name` picks the interaction)."""
        selections = tool_selections if tool_selections is not None else [None] * len(prompts)
        samples = {k: _Sample(k, list(p), a, kw, self._row_tools(k, selection))
                   for p, k, a, kw, selection in zip(prompts, keys, agents, tools_kwargs, selections)}
        if self.interactions:
            for s, m, kw in zip(samples.values(), messages, interaction_kwargs):
                if s.agent == TOOL_AGENT:
                    s.messages, s.interaction_kwargs = list(m), kw
        talkers = [s for s in samples.values() if s.messages is not None]
        loop = EventLoop() if runs_tools else None
        try:
            if talkers:
                # verl starts an instance under the sample's request id and uses that id from then on,
                # ignoring what start_interaction returns (an interaction written for verl may return None)
                for s in talkers:
                    s.instance = uuid4().hex
                requests = [(s.instance, s.interaction_kwargs) for s in talkers]

                def start() -> None:  # (the ids the interactions return are not used)
                    start_interactions(self.interactions, requests, loop)

                _first_rank(start, runs_tools, share)
            start = time.perf_counter()
            for s in samples.values():
                s.since = start
            generate(_Turns(self, samples, loop, runs_tools, share).on_finish)
            if talkers:
                _first_rank(lambda: finalize_interactions(self.interactions, [(s.interaction_kwargs["name"], s.instance)
                                                                              for s in talkers], loop), runs_tools,
                            share)
        finally:
            if loop is not None:
                loop.close()
        return [s.output() for s in samples.values()]

    def _row_tools(self, key: tuple[int, int], selection: list[str] | None) -> dict[str, BaseTool]:
        """The tools sample `key` may call: those its row selects (all for None)."""
        try:
            return select_tools(self.tools, selection)
        except ValueError as err:
            raise ValueError(f"the tool selection of sample {key} {err}") from None

    def _take_turn(self, s: _Sample, out, text: str, chat: str) -> str | None:
        """Append one generated turn (`text`: decoded with its special tokens, `chat`: without);
        what comes next: "tools", "interaction", or None (the end)."""
        s.context += out.token_ids
        s.tokens += out.token_ids
        s.logprobs += list(out.logprobs)
        s.mask += [1] * len(out.token_ids)
        s.assistant_turns += 1
        s.finish_reason = out.finish_reason
        # a turn the engine cut ("length": the budget, or the engine's max_model_len) ends the rollout
        if s.agent != TOOL_AGENT or out.finish_reason == "length" or len(s.tokens) >= self.response_length:
            return None
        if self.max_assistant_turns and s.assistant_turns >= self.max_assistant_turns:
            return None
        if self.max_user_turns and s.user_turns >= self.max_user_turns:
            return None
        _, s.calls = parse_tool_calls(text, self.format)
        if s.messages is not None:  # what the interaction reads: the turn as text, as verl decodes it
            s.messages.append({"role": "assistant", "content": chat})
        if s.calls:
            return "tools"
        return "interaction" if s.messages is not None else None

    def _work(self, s: _Sample, kind: str):
        """The coroutine of a waiting sample's tools or interaction turn."""
        if kind == "tools":
            return tool_turn(s.tools, s.calls, s.tools_kwargs, self.limit, self.side, self.max_parallel_calls)
        return _without_metrics(interaction_turn(self.interactions, s.interaction_kwargs["name"], s.instance,
                                                 list(s.messages), s.interaction_kwargs))

    def _answer(self, s: _Sample, kind: str, result) -> bool:
        """Append a sample's tool answers or interaction reply; whether it goes on."""
        if kind == "tools":
            s.tool_rewards += [float(r) for _, r in result if r is not None]
            appended = self._append(s, [{"role": "tool", "content": text} for text, _ in result])
            s.user_turns += appended  # (verl counts tool answers that fit)
            return appended
        stop, text, score, _ = result  # an interaction's reply: its score counts, and it counts as a user
        if score is not None:  # turn whether or not it is appended, as verl counts it (num_turns)
            s.turn_scores.append(score)
        s.user_turns += 1
        if stop:  # not appended: the response ends on the model's turn, where the score goes
            s.finish_reason = "stop"
            return False
        return self._append(s, [{"role": "user", "content": text}])

    def _append(self, s: _Sample, messages: list[dict]) -> bool:
        """Append inserted messages (tool answers, a user reply) to the sample, masked out, after the
        rest of the chat template's turn end (`_turn_end_rest`); False (the sample ends without them)
        when they do not fit in its response budget."""
        if self._system_prompt is None:
            self._system_prompt = system_prompt_ids(self.tokenizer, **self.chat_template_kwargs)
        ids = self._turn_end_rest(s.tokens) + message_ids(self.tokenizer, messages, self._system_prompt,
                                                           **self.chat_template_kwargs)
        if len(s.tokens) + len(ids) >= self.response_length:
            s.finish_reason = "length"
            return False
        if s.messages is not None:
            s.messages += messages
        s.context += ids
        s.tokens += ids
        s.logprobs += [0.0] * len(ids)
        s.mask += [0] * len(ids)
        return True

    def _turn_end_rest(self, response: list[int]) -> list[int]:
        """What the chat template writes after the model's end-of-turn token and the model does not
        generate (Qwen: the `\\n` after `<|im_end|>`; Llama 3: nothing): when `response` (whose last
        tokens are the model's turn) ends with the first k >= 1 tokens of the template's turn end
        (`turn_end_ids`), the rest of it, for the longest such k. A turn that ended otherwise (on
        another stop token such as Qwen's `<|endoftext|>`) gets nothing, as in verl, which inserts
        its `\\n` only after `<|im_end|>`."""
        if self._turn_end is None:
            self._turn_end = turn_end_ids(self.tokenizer, **self.chat_template_kwargs)
        end = self._turn_end
        for k in range(min(len(end), len(response)), 0, -1):
            if response[-k:] == end[:k]:
                return end[k:]
        return []


class _Turns:
    """One rollout's `on_finish`: takes the turns that ended, starts their samples' tools and
    interactions, and returns the continuations of the samples they answered."""

    def __init__(self, agent: ToolAgent, samples: dict, loop: EventLoop | None, runs_tools: bool, share: Callable):
        self.agent, self.samples, self.loop, self.runs_tools, self.share = agent, samples, loop, runs_tools, share
        self.waiting: dict[tuple[int, int], str] = {}  # sample key -> "tools" | "interaction", in arrival order
        self.tasks: dict = {}  # on the rank that runs them: sample key -> its task
        self.steps = 0

    def on_finish(self, outs, idle: bool) -> list[Continuation]:
        self.steps += 1
        fresh = []
        now = time.perf_counter()
        if outs:
            agent = self.agent
            # the turns as text, in one batched decode each: with special tokens for the tool calls
            # (verl's parser reads them so), without for the chat an interaction reads
            tokens = [o.token_ids for o in outs]
            texts = decode_batch(agent.tokenizer, tokens, skip_special_tokens=False)
            talking = any(self.samples[o.prompt_index, o.sample_index].messages is not None for o in outs)
            chats = decode_batch(agent.tokenizer, tokens) if talking else texts
            for o, text, chat in zip(outs, texts, chats):
                s = self.samples[o.prompt_index, o.sample_index]
                s.generate_s += now - s.since
                s.since = now
                kind = agent._take_turn(s, o, text, chat)
                if kind is not None:
                    self.waiting[s.key] = kind
                    fresh.append(s)
        if not self.waiting or not (fresh or idle or self.steps % self.agent.poll_every == 0):
            return []
        while True:
            answered = _first_rank(lambda: self._answered(fresh, block=idle), self.runs_tools, self.share)
            fresh = []
            continuing = []
            now = time.perf_counter()
            for key, result in answered:
                s = self.samples[key]
                s.tool_s += now - s.since
                s.since = now
                if self.agent._answer(s, self.waiting.pop(key), result):
                    continuing.append(Continuation(list(s.context), key, self.agent.response_length - len(s.tokens)))
            # idle: the engine ends the call unless something continues, so wait for the next answer
            if continuing or not idle or not self.waiting:
                return continuing

    def _answered(self, fresh: list, block: bool) -> list[tuple[tuple[int, int], Any]]:
        """On the rank that runs them: start the fresh samples' tasks, let every task run as far as
        it can, (with `block`, until one has ended), and take the ended ones' results, in the
        order the samples began to wait; a task's error is raised here."""
        for s in fresh:
            self.tasks[s.key] = self.loop.spawn(self.agent._work(s, self.waiting[s.key]))
        self.loop.settle()
        if block and not any(t.done() for t in self.tasks.values()):
            self.loop.wait_first(list(self.tasks.values()))
        ended = [(key, self.tasks.pop(key)) for key, t in list(self.tasks.items()) if t.done()]
        # Every ended task's error is retrieved here (asyncio reports an unretrieved one at exit);
        # the first is raised.
        errors = [err for _, t in ended if not t.cancelled() and (err := t.exception()) is not None]
        if errors:
            raise errors[0]
        return [(key, t.result()) for key, t in ended]


async def _without_metrics(turn):
    """An interaction turn's result without its metrics dict (as `tool_turn` drops the tools'): the
    loop does not read it, and the results are broadcast over the engine's TP group, where an object
    of the user's that does not pickle would fail the first rank alone and leave the others waiting."""
    stop, text, score, _ = await turn
    return stop, text, score, {}


def _first_rank(work: Callable, runs: bool, share: Callable):
    """`work()` where `runs` (the replica's first TP rank), its result on every rank through `share`;
    an exception there is raised on every rank (the others with its message, as the same error
    when it is a tool's or an interaction's), not left to hang them in the next collective."""
    out = None
    if runs:
        try:
            out = ("ok", work())
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others hear of it
            share(("error", shareable_error(err)))
            raise
    kind, value = share(out)
    if kind == "error":
        raise error_heard(value, FIRST_TP_RANK)
    return value


# The input errors (said in one line) that a user's tool or interaction causes, or the trainer's
# rollout meets on one engine replica (its KV pool too small): raised as themselves on the ranks
# that hear of them, after where they happened (which the launcher reads as another rank's copy
# of the same error).
_SHARED_ERRORS = (ToolError, InteractionError, UserError)
FIRST_TP_RANK = "(on the engine's first TP rank, which runs the tools and interactions)"


def shareable_error(err: Exception) -> tuple[int | None, str]:
    """`err` as other ranks can hear of it (it pickles): the index of its kind in `_SHARED_ERRORS` (None for
    another error) and its text."""
    kind = next((i for i, error in enumerate(_SHARED_ERRORS) if isinstance(err, error)), None)
    return kind, str(err) if kind is not None else f"{type(err).__name__}: {err}"


def error_heard(shared: tuple[int | None, str], where: str) -> Exception:
    """The error another rank hit (`shareable_error`), to raise here: a tool's or an interaction's as itself."""
    kind, text = shared
    return (RuntimeError if kind is None else _SHARED_ERRORS[kind])(f"{where} {text}")


__all__ = ["ToolAgent", "TurnOutput"]
