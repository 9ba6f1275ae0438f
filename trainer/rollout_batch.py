"""The rollouts of one PPO step as they travel between its phases.

After generation every rank knows every sequence's tokens (they are small); each rank then
keeps its own rows (`take`) for the forward/backward work, and per-token tensors `[N_local, R]`
are padded to the global response width `R` so they can be all-gathered for batch-wide maths
(advantage whitening, group baselines). The phases fill the optional tensors in the order of
`PPOTrainer.step` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.transfer import host_to_device
from trainer.batching import PrefixGroups, Ragged, prompt_groups
from trainer.forward import index_on


# The per-sequence lists, and the per-row tensors (per token `[N, R]`; gdpo's reward components `[N, K]`) in
# the order the step fills them.
SEQUENCE_FIELDS = ("prompts", "responses", "uids", "data_sources", "ground_truths", "extra_infos", "finish_reasons",
                   "engine_log_probs")
# Per-sequence lists that only some batches have (None otherwise): kept by `take`, `concat` and pooling.
OPTIONAL_SEQUENCE_FIELDS = ("raw_prompts", "turn_masks", "num_turns", "row_names", "routed_experts")
TOKEN_FIELDS = ("token_level_scores", "reward_components", "rollout_log_probs", "old_log_probs", "sum_pi_squared",
                "rollout_is_weights", "rollout_rs_mask", "ref_log_probs", "values", "token_level_rewards", "advantages",
                "returns")


# The token-level sequences a batch keeps as `Ragged` (a list of rows given is converted), and their dtypes.
RAGGED_FIELDS = {"prompts": np.int32, "responses": np.int32, "engine_log_probs": np.float32, "turn_masks": np.int8}


@dataclass
class RolloutBatch:
    prompts: Ragged                   # each row's prompt ids (given as a list of rows: converted)
    responses: Ragged
    uids: list[int]                   # index of the prompt in the step's batch (group id)
    data_sources: list[str | None]
    ground_truths: list[Any]          # as stored in the data (any JSON / Arrow value)
    extra_infos: list[dict]
    finish_reasons: list[str]
    engine_log_probs: Ragged          # the engine's log-prob of each sampled token (float32, as sampled)
    width: int                        # global response width R
    device: torch.device
    # [N, R] per-token tensors (and gdpo's [N, K] components); None until the phase that computes them has run
    token_level_scores: torch.Tensor | None = None  # the score on each response's last token
    reward_components: torch.Tensor | None = None   # gdpo: each row's values of algorithm.gdpo_reward_keys
    rollout_log_probs: torch.Tensor | None = None   # `engine_log_probs` padded (rollout correction)
    old_log_probs: torch.Tensor | None = None       # the actor before the update (or the engine's, bypass mode;
                                                    # None: an on-policy update takes its own forward's)
    sum_pi_squared: torch.Tensor | None = None      # sum of squared probabilities of each token's distribution
                                                    # (the old-log-prob pass, actor.calculate_sum_pi_squared)
    rollout_is_weights: torch.Tensor | None = None  # importance weights pi_old / pi_rollout (decoupled mode)
    rollout_rs_mask: torch.Tensor | None = None     # 1 on the tokens rollout rejection kept (decoupled mode)
    ref_log_probs: torch.Tensor | None = None       # the reference policy
    values: torch.Tensor | None = None              # the critic before the update
    token_level_rewards: torch.Tensor | None = None  # scores minus any KL-in-reward penalty
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # the reward function's extras that are not (all) numbers, as returned, per key a list over
    # the rows (`score_responses`' other_extras): for the dumps, not the metrics
    other_extras: dict[str, list[Any]] | None = None
    # each row's prompt as the data gave it (a string or chat messages): the reward model's own
    # rendering of the chat reads it (rewards.model_inputs); None where nothing reads it
    raw_prompts: list[Any] | None = None
    # multi-turn rollouts (`agent.loop`): per row, 1 on each response token the model generated and
    # 0 on those inserted between its turns (tool responses, the chat template's turn markers), and
    # the row's number of turns (verl's count); None in a single-turn batch
    turn_masks: Ragged | None = None
    num_turns: list[int] | None = None
    # how a reward function's error names each row (`ppo_trainer.reward_row_names`: its place in the
    # batch it was generated in, its prompt's response and data row), the same whichever rank's share
    # holds it; None: by its place in the rows scored
    row_names: list[str] | None = None
    # routing replay (`actor.router_replay.mode`): per row, the experts each token of prompt + response ran through in
    # each sparse layer, a `Ragged` of `[tokens, sparse layers, k]` rows (uint8 or int16): R3 the engine's (the last
    # token's, never run, 0), which the actor's forwards replay; R2 the old-log-prob pass's, which the update replays;
    # None without one
    routed_experts: Ragged | None = None
    _response_mask: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        for name, dtype in RAGGED_FIELDS.items():
            if (rows := getattr(self, name)) is not None:
                setattr(self, name, Ragged.of(rows, dtype))

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def response_mask(self) -> torch.Tensor:
        """`[N, R]`, 1.0 on each response's tokens; in a multi-turn batch only on the tokens the model
        generated (verl's `response_mask`: the losses, advantages, KL and entropy skip the tokens
        inserted between turns, which still sit in the sequences as context)."""
        if self._response_mask is None:
            # built on the host, moved in one non-blocking copy: no per-row kernel, no wait for the device
            self._response_mask = host_to_device([self.host_response_mask()], self.device)[0]
        return self._response_mask

    def host_response_mask(self) -> np.ndarray:
        """`response_mask` as a NumPy float32 array, from the responses' lengths (and the turn masks):
        for host-side counting without reading the device back."""
        if self.turn_masks is not None:
            return self.turn_masks.padded(self.width)
        return (np.arange(self.width) < self.responses.lengths()[:, None]).astype(np.float32)

    @property
    def loss_mask(self) -> torch.Tensor:
        """`[N, R]`: `response_mask` without the tokens rollout rejection removed (decoupled mode;
        `response_mask` itself otherwise). verl overwrites its batch's `response_mask` with it:
        the advantages, the actor's and critic's losses and their normalisers, and the per-token
        data metrics use it; the sequences themselves (lengths, packing, attention), KL in reward,
        `actor/entropy` and `response_length` keep `response_mask`."""
        return self.response_mask if self.rollout_rs_mask is None else self.rollout_rs_mask

    def host_loss_mask(self) -> np.ndarray:
        """`loss_mask` as a NumPy float32 array, for host-side counting: without rejection from
        the lengths, with it one read-back of the device mask (once per update's planning)."""
        if self.rollout_rs_mask is None:
            return self.host_response_mask()
        return self.rollout_rs_mask.detach().float().cpu().numpy()

    def padded(self, rows) -> torch.Tensor:
        """Per-token host values, one row per sequence as long as its response (the engine's
        log-probs: a `Ragged` or lists), as `[N, R]` float32 on the device, zero after each response: one copy."""
        return host_to_device([Ragged.of(rows, np.float32).padded(self.width)], self.device)[0]

    def drop_tensors(self) -> None:
        """Free every per-row tensor and the cached response mask, keeping the per-sequence lists: the
        whole batch that every rank holds (the step's `full`) needs its `[N_total, R]` tensors only until
        each rank has taken its rows; kept, they would sit on every device through the updates."""
        for name in TOKEN_FIELDS + ("_response_mask",):
            setattr(self, name, None)

    def lengths(self) -> list[int]:
        return (self.prompts.lengths() + self.responses.lengths()).tolist()

    def prefix_groups(self) -> PrefixGroups:
        """The rows' prompt groups and lengths, for planning micro-batches under prefix sharing."""
        return PrefixGroups(prompt_groups(self.prompts), self.prompts.lengths().tolist(),
                            self.responses.lengths().tolist())

    def index(self, idx: list[int]) -> torch.Tensor:
        """`idx` as a device tensor; the copy does not wait for the device (an update loop that
        synchronised here would let the GPU drain before every micro-batch)."""
        return index_on(idx, self.device)

    def take(self, idx: list[int]) -> RolloutBatch:
        """The rows `idx`, in that order: of every per-sequence list, every tensor set and the
        reward's other extras."""
        rows = self.index(idx)
        lists = {name: _take(getattr(self, name), idx) for name in SEQUENCE_FIELDS}
        tensors = {name: t[rows] for name in TOKEN_FIELDS + ("_response_mask",)
                   if (t := getattr(self, name)) is not None}
        others = (None if self.other_extras is None
                  else {k: [v[i] for i in idx] for k, v in self.other_extras.items()})
        optional = {name: None if (xs := getattr(self, name)) is None else _take(xs, idx)
                    for name in OPTIONAL_SEQUENCE_FIELDS}
        return RolloutBatch(**lists, width=self.width, device=self.device, other_extras=others, **optional, **tensors)

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """The rows of `batches` one after the other, as fresh rollouts (per-sequence lists only: no
        tensor is set yet), the group ids renumbered so that each batch's groups stay apart (a
        group is the rows of one prompt of one batch), and the response width the widest row's."""
        lists = {name: join_rows([getattr(b, name) for b in batches]) for name in SEQUENCE_FIELDS}
        uids, offset = [], 0
        for b in batches:
            ids = {u: offset + k for k, u in enumerate(dict.fromkeys(b.uids))}
            uids += [ids[u] for u in b.uids]
            offset += len(ids)
        lists["uids"] = uids
        width = int(lists["responses"].lengths().max(initial=1)) or 1
        def joined(name):  # an optional per-row list: kept when every batch has it
            parts = [getattr(b, name) for b in batches]
            return None if any(p is None for p in parts) else join_rows(parts)

        return RolloutBatch(**lists, width=width, device=batches[0].device,
                            **{name: joined(name) for name in OPTIONAL_SEQUENCE_FIELDS})

    @staticmethod
    def sequences(token_ids: list[list[int]], device) -> RolloutBatch:
        """Whole sequences without a response (a reward model's own inputs), for a forward that
        reads each sequence's last position (`forward.last_token_scores`)."""
        n = len(token_ids)
        return RolloutBatch([list(t) for t in token_ids], [[] for _ in range(n)], list(range(n)), [None] * n,
                            [None] * n, [{} for _ in range(n)], [""] * n, [[] for _ in range(n)], width=1,
                            device=device)


def _take(rows, idx: list[int]):
    """The rows `idx` of a per-sequence field (a `Ragged` or a list)."""
    return rows.take(idx) if isinstance(rows, Ragged) else [rows[i] for i in idx]


def join_rows(parts: list):
    """Per-sequence fields' rows one batch after the other (`Ragged`s or lists)."""
    return Ragged.concat(parts) if isinstance(parts[0], Ragged) else [x for p in parts for x in p]
