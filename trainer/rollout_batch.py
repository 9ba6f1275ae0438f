"""The rollouts of one PPO step as this rank holds them.

After generation every rank knows every sequence's tokens (they are small); each rank then
keeps its own part for the forward/backward work, and per-token tensors `[N_local, R]` are
padded to the global response width `R` so they can be all-gathered for batch-wide maths
(advantage whitening, group baselines).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollouts:
    prompts: list[list[int]]
    responses: list[list[int]]
    uids: list[int]                   # index of the prompt in the step's batch (group id)
    data_sources: list[str | None]
    ground_truths: list[str | None]
    extra_infos: list[dict]
    finish_reasons: list[str]
    rollout_log_probs: list[list[float]]
    width: int                        # global response width R
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # [N_local, R] per-token tensors

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def response_mask(self) -> torch.Tensor:
        if "response_mask" not in self.tensors:
            mask = torch.zeros(len(self), self.width, device=self.device)
            for i, r in enumerate(self.responses):
                mask[i, :len(r)] = 1.0
            self.tensors["response_mask"] = mask
        return self.tensors["response_mask"]

    def lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def select(self, idx: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        return [self.prompts[i] for i in idx], [self.responses[i] for i in idx]

    def rows(self, name: str, idx: list[int]) -> torch.Tensor:
        return self.tensors[name][torch.as_tensor(idx, dtype=torch.long, device=self.device)]
