"""Multi-turn rollouts with tool calls: verl's tool agent loop (`rollout.multi_turn`), in lockstep.

verl runs one asynchronous state machine per sample against a rollout server. Here every
sample of a rollout-DP replica advances together, one turn at a time, so that each turn is a
single call of the engine over all samples still running (continuous batching inside it):

    generate a turn for every running sample (each up to what is left of its response budget)
    -> per sample: stop when the engine cut the turn (its budget, or the engine's max_model_len),
       at max_assistant_turns / max_user_turns, or when the turn calls no tool (hermes `<tool_call>`
       JSON); single-turn samples stop after their first turn
    -> run every sample's tool calls (the first max_parallel_calls of each), all concurrently
    -> append the tool responses, rendered by the chat template as tool messages, to the sample;
       a sample whose responses do not fit in its budget stops without them (verl's rule)

A sample's response is every token after its prompt: the model's turns (mask 1) and the tokens
inserted between them (mask 0, log-prob 0), never longer than the response length. The engine
continues each sample under its own noise key (`LLMEngine.generate(sample_keys=...)`), so a
sample that calls no tool is token for token the single-turn rollout. `num_turns` is verl's count
(assistant turns + tool responses + 1); `tool_rewards` the rewards the tools returned, and
`turn_scores` (an interaction's scores: always empty, interactions are not supported) reach the
reward function in `extra_info`, as verl passes them.

With engine tensor parallelism the replica's TP ranks must feed the engine identical turns: the
tools run on the replica's first TP rank only and their responses are broadcast (`share`), so a
tool that is not deterministic (a search, a clock) still keeps the ranks in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from agent.tool_parser import parse_tool_calls
from agent.tools import BaseTool, run_tool_calls, system_prompt_ids, tool_message_ids
from data.dataset import TOOL_AGENT


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


@dataclass
class _Sample:
    key: tuple[int, int]
    context: list[int]
    agent: str
    tools_kwargs: dict
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    calls: list = field(default_factory=list)

    def output(self) -> TurnOutput:
        return TurnOutput(self.key[0], self.key[1], self.tokens, self.logprobs, self.mask, self.finish_reason,
                          self.user_turns + self.assistant_turns + 1, self.tool_rewards)


class ToolAgent:
    """The loop above for one replica's prompts. `tools`: by name (`agent.tools.load_tools`);
    `chat_template_kwargs`: verl's `data.apply_chat_template_kwargs`, also used to render the tool
    messages; the limits are `rollout.multi_turn`'s (None: no limit on that count)."""

    def __init__(self, tokenizer, tools: list[BaseTool], *, response_length: int, max_assistant_turns: int | None,
                 max_user_turns: int | None, max_parallel_calls: int, max_tool_response_length: int,
                 tool_response_truncate_side: str, format: str, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.tools = {t.name: t for t in tools}
        self.response_length = response_length
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.limit, self.side, self.format = max_tool_response_length, tool_response_truncate_side, format
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._system_prompt: list[int] | None = None

    def run(self, prompts: list[list[int]], keys: list[tuple[int, int]], agents: list[str], tools_kwargs: list[dict],
            generate: Callable, runs_tools: bool = True, share: Callable = lambda x: x) -> list[TurnOutput]:
        """Roll out every sample: `prompts[i]` continued under noise key `keys[i]` (prompt index,
        sample index) by `agents[i]` with the row's `tools_kwargs[i]` (verl's `extra_info.tools_kwargs`).
        `generate(contexts, keys, max_tokens)` runs one turn of the given samples (the engine's
        outputs, in order). `runs_tools`: whether this rank executes the tools; `share(results)`
        returns the executing rank's results on every rank that generates with it."""
        samples = [_Sample(k, list(p), a, kw) for p, k, a, kw in zip(prompts, keys, agents, tools_kwargs)]
        running = samples
        while running:
            outs = generate([s.context for s in running], [s.key for s in running],
                            [self.response_length - len(s.tokens) for s in running])
            calling = [s for s, o in zip(running, outs) if self._take_turn(s, o)]
            results = share(self._run_tools(calling) if runs_tools else None)
            running = [s for s, texts in zip(calling, results) if self._append_responses(s, texts)]
        return [s.output() for s in samples]

    def _take_turn(self, s: _Sample, out) -> bool:
        """Append one generated turn; True when the sample goes on to tool calls."""
        s.context += out.token_ids
        s.tokens += out.token_ids
        s.logprobs += list(out.logprobs)
        s.mask += [1] * len(out.token_ids)
        s.assistant_turns += 1
        s.finish_reason = out.finish_reason
        # a turn the engine cut ("length": the budget, or the engine's max_model_len) ends the rollout
        if s.agent != TOOL_AGENT or out.finish_reason == "length" or len(s.tokens) >= self.response_length:
            return False
        if self.max_assistant_turns and s.assistant_turns >= self.max_assistant_turns:
            return False
        if self.max_user_turns and s.user_turns >= self.max_user_turns:
            return False
        _, s.calls = parse_tool_calls(self.tokenizer.decode(out.token_ids), self.format)
        return bool(s.calls)

    def _run_tools(self, calling: list[_Sample]) -> list[tuple[list[str], list[float | None]]]:
        """Every calling sample's tool responses (texts, rewards), all calls at once."""
        if not calling:
            return []
        results = run_tool_calls(self.tools, [s.calls for s in calling], [s.tools_kwargs for s in calling],
                                 self.limit, self.side, self.max_parallel_calls)
        return [([text for text, _ in r], [reward for _, reward in r]) for r in results]

    def _append_responses(self, s: _Sample, result: tuple[list[str], list[float | None]]) -> bool:
        """Append a sample's tool responses as tool messages; False (the sample ends) when they do
        not fit in its response budget."""
        texts, rewards = result
        s.tool_rewards += [float(r) for r in rewards if r is not None]
        if self._system_prompt is None:
            self._system_prompt = system_prompt_ids(self.tokenizer, **self.chat_template_kwargs)
        ids = tool_message_ids(self.tokenizer, texts, self._system_prompt, **self.chat_template_kwargs)
        if len(s.tokens) + len(ids) >= self.response_length:
            s.finish_reason = "length"
            return False
        s.context += ids
        s.tokens += ids
        s.logprobs += [0.0] * len(ids)
        s.mask += [0] * len(ids)
        s.user_turns += 1
        return True


__all__ = ["ToolAgent", "TurnOutput"]
