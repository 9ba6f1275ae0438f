"""The rollout phase: generation for ALL prompts of a step, shared with every rank.

Each engine replica (rollout-DP group) generates its slice of the prompts; then every rank
gets every sample (`Samples`: prompt-major, `n` samples per prompt, the responses' ids and log-probs
as flat int32 / float32 arrays, without the prompts every rank has). With meshppo's engine the phase's
steps, and with them every memory move between training and generation, are in
`EngineRollout.generate`:

    reshard (FSDP actor -> engine weights) -> offload the actor's training states
    -> generate -> free the KV cache and the engine's weights (free_cache_engine, free_engine_weights;
    its CUDA graphs stay) -> split the peak-memory counters -> reload the actor's states -> share outputs

Seeding: a call's `seed` is the step's (or the validation chunk's). The engine keys each sample's
noise by (seed, GLOBAL prompt index, sample index): every replica passes the step's seed and its
first prompt's index in the whole batch, so no two samples of a step share a stream and a sample
does not depend on how the prompts are split over replicas. (Adding the replica to the seed made
replica r at step t replay replica 0's noise at step t + r.) The HF loop draws from one generator
per replica, seeded with `rollout.sequence.derive_seed(seed, replica)`.

Multi-turn rollouts (`rollout.multi_turn.enable`, `AgentRows`): the same phase and the same one
engine call, driven by `agent.loop.ToolAgent`: each sample's later turns join the call as its
tools answer, and keep the sample's key (prompt index, sample index).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from agent import InteractionError, ToolError
from agent.loop import ToolAgent, error_heard, shareable_error
from rollout.engine import CacheTooSmallError
from rollout.sequence import derive_seed
from trainer.errors import UserError
from trainer.roles import Actor
from trainer.batching import Ragged
from trainer.tracking import PeakMemory, Timer


@dataclass
class AgentRows:
    """A multi-turn generation (`rollout.multi_turn.enable`): the loop, and per prompt of the whole
    batch its agent (`agent_name`), its tools' arguments (`extra_info.tools_kwargs`), its chat
    messages, its interaction's arguments (`extra_info.interaction_kwargs`) and the tools it may call
    (`extra_info.tool_selection`; None for all, as for every prompt when not given)."""

    loop: ToolAgent
    agents: list[str]
    tools_kwargs: list[dict]
    messages: list
    interaction_kwargs: list[dict | None]
    tool_selections: list[list[str] | None] | None = None


# A multi-turn sample's figures besides its tokens (`agent.loop.TurnOutput`), one value (or list) a sample.
TURN_FIELDS = ("num_turns", "tool_rewards", "turn_scores", "generate_s", "tool_s")


@dataclass
class Samples:
    """Generated samples, prompt-major (sample k of prompt i at `i * n + k`), as the rollout phase shares
    them between ranks and hands them to the trainer: each response's ids and the engine's log-probs of
    them (`Ragged`, int32 and float32: no per-token Python object is pickled, and no prompt, which every
    rank has already), why each ended and, for a multi-turn rollout, each sample's turn mask and
    `TURN_FIELDS` (None otherwise). `routed_experts` (the engine's `return_routed_experts`, for routing replay):
    per sample, the experts of each token of prompt + response in each sparse layer (`[tokens, sparse layers, k]`
    rows; the last token's, which the engine never ran, 0); None otherwise."""

    token_ids: Ragged
    logprobs: Ragged
    finish_reasons: list[str]
    masks: Ragged | None = None
    turns: dict[str, list] | None = None
    routed_experts: Ragged | None = None

    def __len__(self) -> int:
        return len(self.finish_reasons)

    @classmethod
    def of(cls, outs: list, multi_turn: bool) -> Samples:
        """`outs`, the engine's `RequestOutput`s or the tool agent's `TurnOutput`s (`multi_turn`)."""
        masks = Ragged.of([o.mask for o in outs], np.int8) if multi_turn else None
        turns = {name: [getattr(o, name) for o in outs] for name in TURN_FIELDS} if multi_turn else None
        routed = [getattr(o, "routed_experts", None) for o in outs]
        routed = (Ragged.of_arrays([np.concatenate([r.numpy(), np.zeros_like(r[:1].numpy())]) for r in routed])
                  if routed and routed[0] is not None else None)
        return cls(Ragged.of([o.token_ids for o in outs], np.int32), Ragged.of([o.logprobs for o in outs], np.float32),
                   [o.finish_reason for o in outs], masks, turns, routed)

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        multi_turn = parts[0].masks is not None
        return Samples(Ragged.concat([p.token_ids for p in parts]), Ragged.concat([p.logprobs for p in parts]),
                       [r for p in parts for r in p.finish_reasons],
                       Ragged.concat([p.masks for p in parts]) if multi_turn else None,
                       {name: [v for p in parts for v in p.turns[name]] for name in TURN_FIELDS} if multi_turn else None,
                       None if any(p.routed_experts is None for p in parts)
                       else Ragged.concat([p.routed_experts for p in parts]))


def _all_gather_outputs(local: Samples | None, index: int, count: int, error: Exception | None = None) -> Samples:
    """Every engine replica's samples, in replica order (each replica's TP ranks agree). `error`: this replica's
    rollout failed (a tool's or an interaction's error, or its KV pool too small: on every rank of its TP group):
    every rank raises, the other replicas' ranks the same error, where they would have waited in their next
    collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return local
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (index, local, None if error is None else shareable_error(error)))
    if error is not None:
        raise error
    failed = next(((idx, shared) for idx, _, shared in gathered if shared is not None), None)
    if failed is not None:
        raise error_heard(failed[1], f"(on engine replica {failed[0]})")
    by_replica = {}
    for idx, outs, _ in gathered:
        by_replica.setdefault(idx, outs)
    return Samples.concat([by_replica[i] for i in range(count)])


class _Rollout:
    def __init__(self, actor: Actor, replica: int, replicas: int, peaks: PeakMemory):
        self.actor, self.replica, self.replicas, self.peaks = actor, replica, replicas, peaks

    def _slice(self, prompts: list) -> tuple[int, list]:
        """This replica's prompts and the index of the first."""
        n = len(prompts)
        lo, hi = self.replica * n // self.replicas, (self.replica + 1) * n // self.replicas
        return lo, prompts[lo:hi]

    def _share(self, outs: list | None, error: Exception | None = None, multi_turn: bool = False) -> Samples:
        """Every replica's samples (`outs`: this replica's outputs, None after an `error`), compact (`Samples`)."""
        local = None if outs is None else Samples.of(outs, multi_turn)
        return _all_gather_outputs(local, self.replica, self.replicas, error)


class EngineRollout(_Rollout):
    """`rollout.name=native`: meshppo's paged-KV engine, colocated with the FSDP actor."""

    def __init__(self, actor: Actor, engine, resharder, replica: int, replicas: int, peaks: PeakMemory, timer: Timer,
                 free_cache: bool, free_weights: bool):
        super().__init__(actor, replica, replicas, peaks)
        self.engine, self.resharder, self.timer = engine, resharder, timer
        self.free_cache, self.free_weights = free_cache, free_weights

    def generate(self, prompts: list[list[int]], *, max_tokens, eos_ids, ignore_eos, seed, n, temperature, top_p,
                 top_k, agent: AgentRows | None = None) -> Samples:
        from rollout import SamplingParams

        with self.timer("reshard"):
            self.resharder.reshard()  # re-allocates engine weights that free_weights() released
        self.actor.offload()
        lo, mine = self._slice(prompts)
        try:  # the pool is sized from this GPU's free memory on the first call: each replica its own
            if mine:
                self.engine.init_cache()
        except CacheTooSmallError as e:  # agreed within the replica's TP group; the other replicas hear of it
            return self._share(None, UserError(e.worded("actor_rollout_ref.rollout.gpu_memory_utilization",
                                                         "actor_rollout_ref.rollout.max_model_len")))
        sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                            eos_token_id=list(eos_ids) or None, ignore_eos=ignore_eos, seed=seed)
        capture_s = 0.0
        if agent is None:
            # Noise keyed by the global prompt index lo + i (module docstring); no eos ids: the model's.
            outs = self.engine.generate(mine, sp, prompt_index_offset=lo) if mine else []
            capture_s = self.engine.last_stats["graph_capture_s"] if mine else 0.0
        else:
            def serve(on_finish):
                nonlocal capture_s
                # One call: every sample's first turn from its prompt (one prefill per prompt, its n
                # samples forked from it, as the single-turn call runs: the same keys, in the same
                # order), each later turn joining it from the sample's kept K/V (`agent.loop`).
                self.engine.generate(mine, sp, prompt_index_offset=lo, keep_kv=True, on_finish=on_finish)
                capture_s = self.engine.last_stats["graph_capture_s"] if mine else 0.0

            # Each sample of prompt lo + i is its own row, keyed (lo + i, k) as the single-turn call keys it.
            rows = [(i, k) for i in range(len(mine)) for k in range(n)]
            per_row = lambda xs: [xs[lo + i] for i, _ in rows]  # noqa: E731
            try:
                outs = agent.loop.run([mine[i] for i, _ in rows], [(lo + i, k) for i, k in rows],
                                      per_row(agent.agents), per_row(agent.tools_kwargs), serve,
                                      runs_tools=self.engine.tp.rank == 0, share=self._tp_broadcast,
                                      messages=per_row(agent.messages),
                                      interaction_kwargs=per_row(agent.interaction_kwargs),
                                      tool_selections=per_row(agent.tool_selections or [None] * len(prompts)))
            except (ToolError, InteractionError) as err:  # on every rank of this replica's TP group (its first
                return self._share(None, err)                # rank's tools); the other replicas hear of it here
            self.engine.drop_kept()
        # Decode graphs are captured in the first generation, and again only when the weights or
        # the KV pool came back at other addresses (free_weights() keeps the graphs): each step shows it.
        self.timer.add("graph_capture", capture_s)
        if self.free_cache:
            self.engine.free_cache()
        if self.free_weights:
            self.engine.free_weights()
        self.peaks.split()
        self.actor.load()
        return self._share(outs, multi_turn=agent is not None)

    def _tp_broadcast(self, obj):
        """`obj` of the engine's first TP rank, on every rank of its TP group (the tools' responses)."""
        group = self.engine.tp.group
        if group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]


class NoCacheRollout(_Rollout):
    """`rollout.name=hf`: the plain sampling loop on the FSDP actor itself (`trainer.hf_rollout`)."""

    def generate(self, prompts: list[list[int]], *, max_tokens, eos_ids, ignore_eos, seed, n, temperature, top_p,
                 top_k, agent: AgentRows | None = None) -> Samples:
        from trainer.hf_rollout import generate_no_cache

        if agent is not None:  # refused by the config's checks (`multi_turn.enable` needs the engine)
            raise ValueError("multi-turn rollouts need actor_rollout_ref.rollout.name=native")

        lo, mine = self._slice(prompts)
        # The actor generates, so only its optimizer states can wait in host memory meanwhile
        # (`optimizer_offload`; `param_offload` has nothing to free here: a start-up note says so).
        self.actor.offload(params=False)
        outs = generate_no_cache(self.actor.model, mine, n=n, max_tokens=max_tokens, eos_ids=eos_ids,
                                 ignore_eos=ignore_eos, seed=derive_seed(seed, self.replica), temperature=temperature,
                                 top_p=top_p, top_k=top_k, device=self.actor.device, pad_token_id=0)
        self.peaks.split()
        self.actor.load(params=False)
        return self._share(outs)


def build_rollout(cfg, models, actor: Actor, engine, rank: int, peaks: PeakMemory, timer: Timer):
    """The rollout phase for `cfg.actor_rollout_ref.rollout.name`."""
    dims = models.dims
    replica = dims.rollout_dp_rank(rank)
    if engine is None:
        return NoCacheRollout(actor, replica, dims.rollout_dp, peaks)
    from sharding.resharder import Resharder

    r = cfg.actor_rollout_ref.rollout
    return EngineRollout(actor, engine, Resharder(models.actor, models.meshes, engine), replica, dims.rollout_dp,
                         peaks, timer, free_cache=r.free_cache_engine, free_weights=r.free_engine_weights)


__all__ = ["AgentRows", "EngineRollout", "NoCacheRollout", "Samples", "build_rollout"]
