"""Multi-turn rollouts with tool calls and interactions: verl's tool agent loop (`rollout.multi_turn`),
in lockstep.

verl runs one asynchronous state machine per sample against a rollout server. Here every
sample of a rollout-DP replica advances together, one turn at a time, so that each turn is a
single call of the engine over all samples still running (continuous batching inside it):

    generate a turn for every running sample (each up to what is left of its response budget)
    -> per sample: stop when the engine cut the turn (its budget, or the engine's max_model_len),
       or at max_assistant_turns / max_user_turns; a turn with hermes `<tool_call>` JSON goes to
       its tools, one without to its interaction if there are interactions, else it ends;
       single-turn samples stop after their first turn
    -> run every sample's tool calls (the first max_parallel_calls of each) and every asking
       sample's interaction (`generate_response` on the chat so far), all concurrently
    -> append the tool responses (tool messages) and the interactions' replies (user messages),
       rendered by the chat template, to the samples; one whose messages do not fit in its budget
       stops without them (verl's rule), as does one whose interaction ends the rollout (verl
       appends that last reply, masked out; here the response ends on the model's turn)

A sample's response is every token after its prompt: the model's turns (mask 1) and the tokens
inserted between them (mask 0, log-prob 0), never longer than the response length. The engine
continues each sample under its own noise key (`LLMEngine.generate(sample_keys=...)`), so a
sample that calls no tool is token for token the single-turn rollout. `num_turns` is verl's count
(assistant turns + tool responses + interaction replies + 1); `tool_rewards` the rewards the
tools returned and `turn_scores` the interactions' reach the reward function in `extra_info`, as
verl passes them. Each tool-agent sample starts its interaction instance (`interaction_kwargs`'
`name`) before its first turn; the loop finalizes them at the end (verl's leaves them).

With engine tensor parallelism the replica's TP ranks must feed the engine identical turns: the
tools and interactions run on the replica's first TP rank only and their results are broadcast
(`share`), so a tool that is not deterministic (a search, a clock) still keeps the ranks in step;
an error there is raised on every rank of the replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable
from uuid import uuid4

from agent.interactions import BaseInteraction, finalize_interactions, interaction_turns, start_interactions
from agent.tool_parser import parse_tool_calls
from agent.tools import BaseTool, message_ids, run_tool_calls, system_prompt_ids
from data.dataset import TOOL_AGENT
from models.tokenizer import decode_batch


@dataclass
class TurnOutput:
    """One sample's multi-turn rollout, in the fields of the engine's `RequestOutput` that the
    trainer reads, plus the turns' mask and counts."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finish_reason: str
    num_turns: int
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)


@dataclass(eq=False)
class _Sample:
    key: tuple[int, int]
    context: list[int]
    agent: str
    tools_kwargs: dict
    messages: list[dict] | None = None  # the chat so far (with interactions: what they read)
    interaction_kwargs: dict | None = None
    instance: str | None = None  # its interaction's instance id
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    calls: list = field(default_factory=list)

    def output(self) -> TurnOutput:
        return TurnOutput(self.key[0], self.key[1], self.tokens, self.logprobs, self.mask, self.finish_reason,
                          self.user_turns + self.assistant_turns + 1, self.tool_rewards, self.turn_scores)


class ToolAgent:
    """The loop above for one replica's prompts. `tools`: by name (`agent.tools.load_tools`);
    `interactions`: by name (`agent.interactions.load_interactions`; none: a turn without tool
    calls ends the rollout); `chat_template_kwargs`: verl's `data.apply_chat_template_kwargs`, also
    used to render the inserted messages; the limits are `rollout.multi_turn`'s (None: no limit on
    that count)."""

    def __init__(self, tokenizer, tools: list[BaseTool], *, response_length: int, max_assistant_turns: int | None,
                 max_user_turns: int | None, max_parallel_calls: int, max_tool_response_length: int,
                 tool_response_truncate_side: str, format: str, chat_template_kwargs: dict[str, Any] | None = None,
                 interactions: dict[str, BaseInteraction] | None = None):
        self.tokenizer = tokenizer
        self.tools = {t.name: t for t in tools}
        self.interactions = dict(interactions or {})
        self.response_length = response_length
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.limit, self.side, self.format = max_tool_response_length, tool_response_truncate_side, format
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._system_prompt: list[int] | None = None

    def run(self, prompts: list[list[int]], keys: list[tuple[int, int]], agents: list[str], tools_kwargs: list[dict],
            generate: Callable, runs_tools: bool = True, share: Callable = lambda x: x,
            messages: list[list[dict]] | None = None, interaction_kwargs: list[dict | None] | None = None,
            ) -> list[TurnOutput]:
        """Roll out every sample: `prompts[i]` continued under noise key `keys[i]` (prompt index,
        sample index) by `agents[i]` with the row's `tools_kwargs[i]` (verl's `extra_info.tools_kwargs`).
        `generate(contexts, keys, max_tokens)` runs one turn of the given samples (the engine's
        outputs, in order). `runs_tools`: whether this rank executes the tools and interactions;
        `share(results)` returns the executing rank's results on every rank that generates with it.
        With interactions: `messages[i]`, the prompt as chat messages, and `interaction_kwargs[i]`
        (verl's `extra_info.interaction_kwargs`, whose `name` picks the interaction)."""
        samples = [_Sample(k, list(p), a, kw) for p, k, a, kw in zip(prompts, keys, agents, tools_kwargs)]
        if self.interactions:
            for s, m, kw in zip(samples, messages, interaction_kwargs):
                if s.agent == TOOL_AGENT:
                    s.messages, s.interaction_kwargs = list(m), kw
        talkers = [s for s in samples if s.messages is not None]
        if talkers:
            ids = _first_rank(lambda: start_interactions(self.interactions, [(uuid4().hex, s.interaction_kwargs)
                                                                             for s in talkers]), runs_tools, share)
            for s, instance in zip(talkers, ids):
                s.instance = instance
        running = samples
        while running:
            outs = generate([s.context for s in running], [s.key for s in running],
                            [self.response_length - len(s.tokens) for s in running])
            # the turns as text, in one batched decode each: with special tokens for the tool calls
            # (verl's parser reads them so), without for the chat an interaction reads
            tokens = [o.token_ids for o in outs]
            texts = decode_batch(self.tokenizer, tokens, skip_special_tokens=False)
            chats = decode_batch(self.tokenizer, tokens) if talkers else texts
            nexts = [self._take_turn(s, o, text, chat) for s, o, text, chat in zip(running, outs, texts, chats)]
            calling = [s for s, n in zip(running, nexts) if n == "tools"]
            asking = [s for s, n in zip(running, nexts) if n == "interaction"]
            tool_results, replies = _first_rank(lambda: (self._run_tools(calling), self._ask(asking)), runs_tools,
                                                share)
            running = [s for s, r in zip(calling, tool_results) if self._append_tool_responses(s, r)]
            running += [s for s, r in zip(asking, replies) if self._append_reply(s, r)]
        if talkers:
            _first_rank(lambda: finalize_interactions(self.interactions, [(s.interaction_kwargs["name"], s.instance)
                                                                          for s in talkers]), runs_tools, share)
        return [s.output() for s in samples]

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
        return "interaction" if s.instance is not None else None

    def _run_tools(self, calling: list[_Sample]) -> list[tuple[list[str], list[float | None]]]:
        """Every calling sample's tool responses (texts, rewards), all calls at once."""
        if not calling:
            return []
        results = run_tool_calls(self.tools, [s.calls for s in calling], [s.tools_kwargs for s in calling],
                                 self.limit, self.side, self.max_parallel_calls)
        return [([text for text, _ in r], [reward for _, reward in r]) for r in results]

    def _ask(self, asking: list[_Sample]) -> list[tuple[bool, str, float | None, dict]]:
        """Every asking sample's interaction reply, all at once."""
        if not asking:
            return []
        return interaction_turns(self.interactions, [(s.interaction_kwargs["name"], s.instance, s.messages,
                                                      s.interaction_kwargs) for s in asking])

    def _append(self, s: _Sample, messages: list[dict]) -> bool:
        """Append inserted messages (tool answers, a user reply) to the sample, masked out; False (the
        sample ends without them) when they do not fit in its response budget."""
        if self._system_prompt is None:
            self._system_prompt = system_prompt_ids(self.tokenizer, **self.chat_template_kwargs)
        ids = message_ids(self.tokenizer, messages, self._system_prompt, **self.chat_template_kwargs)
        if len(s.tokens) + len(ids) >= self.response_length:
            s.finish_reason = "length"
            return False
        if s.messages is not None:
            s.messages += messages
        s.context += ids
        s.tokens += ids
        s.logprobs += [0.0] * len(ids)
        s.mask += [0] * len(ids)
        s.user_turns += 1
        return True

    def _append_tool_responses(self, s: _Sample, result: tuple[list[str], list[float | None]]) -> bool:
        texts, rewards = result
        s.tool_rewards += [float(r) for r in rewards if r is not None]
        return self._append(s, [{"role": "tool", "content": t} for t in texts])

    def _append_reply(self, s: _Sample, reply: tuple[bool, str, float | None, dict]) -> bool:
        """An interaction's reply: its score counts; a reply that ends the rollout is not appended
        (the response ends on the model's turn, where the score goes)."""
        stop, text, score, _ = reply
        if score is not None:
            s.turn_scores.append(score)
        if stop:
            s.finish_reason = "stop"
            return False
        return self._append(s, [{"role": "user", "content": text}])


def _first_rank(work: Callable, runs: bool, share: Callable):
    """`work()` where `runs` (the replica's first TP rank), its result on every rank through `share`;
    an exception there is raised on every rank (the others with its message), not left to hang
    them in the next collective."""
    out = None
    if runs:
        try:
            out = ("ok", work())
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others hear of it
            share(("error", f"{type(err).__name__}: {err}"))
            raise
    kind, value = share(out)
    if kind == "error":
        raise RuntimeError(f"on the engine's first TP rank, which runs the tools and interactions: {value}")
    return value


__all__ = ["ToolAgent", "TurnOutput"]
