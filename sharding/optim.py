"""AdamW whose step runs on the local shards of DTensor parameters.

`torch.optim.AdamW` over DTensors (FSDP2's parameters, and those of the replicated runtime)
computes the right update, but every foreach or fused call goes through DTensor's Python
dispatch, which unwraps the four tensor lists element by element: on an H200 that was ~8 ms of
host time per optimizer step of a 0.5b model (33 of 49 profiled ms in four steps of one rank's
GRPO update, BENCHMARKS.md "Eleventh pass"), while the step's kernels take well under 1 ms.
The update is elementwise, so it is the same on the local shards: `ShardAdamW` hands the
kernels the DTensors' local tensors and keeps everything else — the DTensor states (so
`state_dict` and the distributed checkpoints are those of `AdamW`), the parameter groups, the
learning-rate schedulers, the `found_inf` skip of the fused kernel.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (no autograd view: `to_local()` builds one per call, which
    costs the host more than the kernels it feeds here); a plain tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW`, bit for bit, with the update applied to local shards (see the module docstring)."""

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = super()._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                          state_steps)
        for p, g in zip(params_with_grad, grads):
            if isinstance(p, DTensor) and (not isinstance(g, DTensor) or g.placements != p.placements):
                raise ValueError(f"a gradient laid out as {getattr(g, 'placements', 'a plain tensor')} for a parameter "
                                 f"sharded as {p.placements}: the update on local shards would be wrong")
        for tensors in (params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            tensors[:] = [local_tensor(t) for t in tensors]
        return has_complex
