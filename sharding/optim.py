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

One flat step. Where the parameters, and their gradients, lie back to back in one buffer each
(the replicated runtime's masters and gradient buffer: `sharding.replicate`), the fused step
after the first runs on three flat buffers instead of a list per parameter: the Adam moments
are moved into flat buffers of the same layout (each state stays a DTensor, now a view), and
one `_fused_adamw_` call updates everything. Still `AdamW` bit for bit (the kernel is
elementwise); what goes is the per-parameter Python of `AdamW.step` (2.2–3.6 ms of host per
step of a 0.5b model in a profiled update, with the GPU idle between mini-batches). Each
parameter keeps its own `step` counter, copied from the first one's after each flat step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (no autograd view: `to_local()` builds one per call, which
    costs the host more than the kernels it feeds here); a plain tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over `tensors` when they lie back to back, in this order, in one storage
    (contiguous, one dtype); else None. Stops at the first tensor that does not follow."""
    first = tensors[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    start = offset
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        offset += t.numel()
    return first.new_empty(0).set_(storage, start, (offset - start,))


def _moment(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """An Adam moment of `p` over `view` (`p`'s local shape): a DTensor laid out as `p` where
    `p` is one, as `torch.zeros_like(p)` would make it."""
    if isinstance(p, DTensor):
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return view


class _FlatStep:
    """One parameter group's parameters, gradients and Adam moments as flat buffers, and its one
    `step` counter (see the module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor):
        ps = opt.param_groups[0]["params"]
        states = [opt.state[p] for p in ps]
        self.params, self.grads, self.exp_avg, self.exp_avg_sq = params, grads, exp_avg, exp_avg_sq
        # the first parameter's counter is the flat call's; the others are copied from it after each step
        self.steps = [st["step"] for st in states]
        # what `applies` compares: the gradient and moment tensors are kept, never replaced, while the layout holds
        self.ends = (ps[0], ps[-1], len(ps))
        self.marks = (ps[0].grad, ps[-1].grad, states[0]["exp_avg"], states[-1]["exp_avg_sq"])

    @classmethod
    @torch.no_grad()
    def build(cls, opt: torch.optim.Optimizer) -> "_FlatStep | None":
        """The flat layout of `opt`'s one group, or None where it does not apply: several groups,
        an option the flat call does not cover, parameters or gradients not back to back, a
        parameter without a gradient, states only some parameters have, step counters that
        differ, or too little free device memory to move existing moments into flat buffers.
        Fresh states are created flat (zeros, step 0: what `AdamW` creates)."""
        if len(opt.param_groups) != 1:
            return None
        group = opt.param_groups[0]
        if not group["fused"] or group["amsgrad"] or group["maximize"] or group["differentiable"] or group["capturable"]:
            return None
        ps = group["params"]
        if not ps or (len(ps) > 1 and _span([local_tensor(ps[0]), local_tensor(ps[1])]) is None):
            return None  # the common case where it does not apply (FSDP2's shards), found in O(1)
        if any(p.grad is None for p in ps):
            return None
        locals_ = [local_tensor(p) for p in ps]
        params = _span(locals_)
        grads = None if params is None else _span([local_tensor(p.grad) for p in ps])
        if grads is None or grads.dtype != params.dtype:
            return None
        sizes = [t.numel() for t in locals_]
        fresh = [len(opt.state[p]) == 0 for p in ps]
        if all(fresh):  # what AdamW's fused path creates, laid out flat: a float32 zero step, zero moments
            moments = [torch.zeros_like(params), torch.zeros_like(params)]
            views = [m.split(sizes) for m in moments]
            for p, t, m, v in zip(ps, locals_, *views):
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=params.device),
                                "exp_avg": _moment(p, m.view(t.shape)), "exp_avg_sq": _moment(p, v.view(t.shape))}
        elif any(fresh):
            return None
        else:
            moments = cls._adopt(opt, ps, locals_, sizes, params)
            if moments is None:
                return None
        return cls(opt, params, grads, *moments)

    @staticmethod
    def _adopt(opt, ps, locals_, sizes, params) -> list[torch.Tensor] | None:
        """Move existing moments (a loaded checkpoint's) into flat buffers, one moment at a time;
        the two buffers, or None (step counters that differ, too little free device memory)."""
        states = [opt.state[p] for p in ps]
        steps = torch.stack([s["step"].to(params.device) for s in states])
        if not bool((steps == steps[0]).all()):  # once per adoption: a host sync
            return None
        if params.is_cuda and torch.cuda.mem_get_info(params.device)[0] < 2 * params.nbytes:
            return None
        moments = []
        for key in ("exp_avg", "exp_avg_sq"):
            flat = torch.empty_like(params)
            for s, p, t, view in zip(states, ps, locals_, flat.split(sizes)):
                view.copy_(local_tensor(s[key]).reshape(-1))
                s[key] = _moment(p, view.view(t.shape))
            moments.append(flat)
        return moments

    def applies(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the layout still holds, checked in O(1): the same parameter list, the same
        gradient tensors on its first and last parameter (the replicated runtime keeps its
        gradient DTensors), the same moment tensors."""
        ps = opt.param_groups[0]["params"]
        first, last, count = self.ends
        if len(opt.param_groups) != 1 or len(ps) != count or ps[0] is not first or ps[-1] is not last:
            return False
        now = (ps[0].grad, ps[-1].grad, opt.state[ps[0]].get("exp_avg"), opt.state[ps[-1]].get("exp_avg_sq"))
        return all(a is b for a, b in zip(now, self.marks))

    @torch.no_grad()
    def run(self, opt: torch.optim.Optimizer) -> None:
        """`AdamW.step`'s fused path (step count, kernel, skip) with one tensor per list."""
        group = opt.param_groups[0]
        beta1, beta2 = group["betas"]
        device = self.params.device
        found_inf, grad_scale = getattr(opt, "found_inf", None), getattr(opt, "grad_scale", None)
        found_inf = None if found_inf is None else found_inf.to(device, non_blocking=True)
        step = self.steps[0]
        step.add_(1)
        torch._fused_adamw_([self.params], [self.grads], [self.exp_avg], [self.exp_avg_sq], [], [step],
                            amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                            grad_scale=None if grad_scale is None else grad_scale.to(device, non_blocking=True),
                            found_inf=found_inf)
        if found_inf is not None:
            step.sub_(found_inf)
        if len(self.steps) > 1:
            torch._foreach_copy_(self.steps[1:], [step] * (len(self.steps) - 1))


class ShardAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW`, bit for bit, with the update applied to local shards, and as one flat
    call where the layout allows (see the module docstring)."""

    _flat: _FlatStep | None = None
    last_step_flat = False  #: whether the last step ran as one flat call

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            if self._flat is None:
                self._flat = _FlatStep.build(self)
            self.last_step_flat = self._flat is not None and self._flat.applies(self)
            if self.last_step_flat:
                self._flat.run(self)
                return None
        self._flat = None
        return super().step(closure)

    def load_state_dict(self, state_dict):
        self._flat = None  # the loaded states replace the flat ones; moved into flat buffers at the next step
        super().load_state_dict(state_dict)

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
