"""Data parallelism without sharding: the training layout when every shard group is one rank.

With one GPU, or HYBRID_SHARD with `fsdp_size=1`, every rank holds every parameter whole.
FSDP2 still works there, but its runtime pays per parameter on the host at every pass: at one
rank its unshard casts and copies each parameter in a Python loop, its post-backward builds
each gradient as a DTensor, and a 0.5b update of one H200 was bound by that host work, not by
the GPU (BENCHMARKS.md, "Eleventh pass"). `ReplicatedParams` keeps FSDP2's parameters — the
same DTensors, placements and dtypes, so the optimizer, the gradient clipping, the resharder
and the checkpoints see exactly what FSDP2 gives them — and replaces only the runtime:

* the master parameters of each dtype live in one flat buffer, and so do their compute-dtype
  copies: the cast before a forward is one kernel;
* before a forward the compute copies are registered on the modules (after it, or after the
  backward when there is one, the masters are registered again and the copies' memory freed;
  inside `kept()` only at the end of the scope: the micro-batches of one mini-batch share one
  cast);
* during each backward, the gradients (compute dtype) are handed over in buckets of at least
  `bucket_numel` elements, as soon as every gradient of a bucket has been accumulated (in the
  order the backward produces them: from the last layers to the first), into the masters'
  gradients: DTensors over one flat buffer that stay the same objects. A gradient's
  compute-dtype memory is freed as soon as its bucket is handed over. With replicas, each
  bucket's slice of that buffer is then all-reduced in place, asynchronously, so the
  communication runs behind the rest of the backward (as PyTorch's DDP does), and divided by
  the number of replicas at the end of the backward. Whatever the buffer held before (a mean
  reduced earlier, the same on every replica, or sums of backward passes run without the
  reduction: `sync_gradients = False`, DDP's `no_sync`) comes out as the replica mean too. A
  reduce dtype other than the gradients' goes through a staging buffer of that dtype.

Buckets are always handed over in the same order on every rank: a bucket waits for the one
before it, so a parameter that one rank's loss does not reach (its bucket, and those after it,
go at the end of that rank's backward, with zeros for it) cannot put the ranks' all-reduces out
of step.

A frozen model whose masters already have the compute dtype (a bf16 reference, a LoRA base)
is computed from its masters directly: no copy at all.

Not covered: `offload_policy` (parameters living on the CPU); `apply_fsdp` keeps FSDP2's
`CPUOffloadPolicy` for it.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from sharding import comm

_ATTR = "_meshppo_replicated"

#: Gradient elements per bucket (128 MB of fp32): on NVLink an all-reduce of that size runs near
#: the link's bandwidth, and a 0.5b model has 11 buckets to overlap with its backward (the last,
#: with the tied embedding, ready only at the backward's end).
BUCKET_NUMEL = 1 << 25


def replicated_params(model: nn.Module) -> "ReplicatedParams | None":
    """The runtime `apply_fsdp` attached to `model` when its shard groups are one rank."""
    return model.__dict__.get(_ATTR)


class _Flat:
    """Tensors of one dtype laid out in one flat buffer (views), whose memory can be freed
    (`free`) and re-allocated (`alloc`) without the views changing identity."""

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device):
        self.numels = [s.numel() for s in shapes]
        self.buf = torch.empty(sum(self.numels), dtype=dtype, device=device)
        self.views = [v.view(s) for v, s in zip(self.buf.split(self.numels), shapes)]
        self.nbytes = self.buf.untyped_storage().nbytes()

    @property
    def allocated(self) -> bool:
        return self.buf.untyped_storage().nbytes() > 0

    def alloc(self) -> None:
        if not self.allocated:
            self.buf.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        if self.allocated:
            self.buf.untyped_storage().resize_(0)


class ReplicatedParams:
    """The unsharded training runtime of one model (see the module docstring).

    `mesh`: the training mesh, `("dp_shard",)` of size 1 or `("dp_replicate", "dp_shard")`
    with a shard dimension of size 1. `param_dtype`: the compute dtype; `reduce_dtype`: the
    dtype gradients are averaged over the replicas in. `keep_after_forward`: a frozen model
    keeps its compute copies registered between forwards (FSDP's `reshard_after_forward=False`).
    `bucket_numel`: gradient elements handed over together (a bucket closes with the parameter
    that takes it to that size). `sync_gradients`: whether a backward all-reduces over the
    replicas (`sharding.fsdp.no_gradient_sync` turns it off for the micro-batches before a
    mini-batch's last).
    """

    def __init__(self, model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 keep_after_forward: bool, shard_dim, bucket_numel: int = BUCKET_NUMEL):
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be at least 1, got {bucket_numel}")
        self.bucket_numel = bucket_numel
        self.sync_gradients = True
        if mesh.size(mesh.ndim - 1) != 1:
            raise ValueError(f"ReplicatedParams needs shard groups of one rank, the mesh shards over "
                             f"{mesh.size(mesh.ndim - 1)}")
        self.mesh = mesh
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.keep_after_forward = keep_after_forward
        self.replicas = mesh.size(0) if mesh.ndim == 2 else 1
        self._group = mesh.get_group(0) if self.replicas > 1 else None
        # Every registration (module, name) of a parameter, and the parameters once each.
        names = {id(p): n for n, p in model.named_parameters()}
        self.slots: list[tuple[nn.Module, str, int]] = []
        self.masters: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in index:
                    index[id(p)] = len(self.masters)
                    placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(shard_dim(names[id(p)], p.shape)),)
                    self.masters.append(nn.Parameter(DTensor.from_local(p.detach(), mesh, placements, run_check=False),
                                                     requires_grad=p.requires_grad))
                self.slots.append((module, name, index[id(p)]))
        for module, name, i in self.slots:
            module._parameters[name] = self.masters[i]
        self._built = False
        self._installed = False
        self._pending = False  # a forward with grad whose backward has not run yet
        self._kept = 0  # open `keep_compute_copies` scopes: the compute copies stay registered
        self._backward_queued = False

    # ------------------------------------------------------------------ layout (first use)
    def _build(self) -> None:
        """Move the (materialised) masters of each dtype into one flat buffer and set up the
        compute copies and the gradient buffer. Runs at the first forward: `apply_fsdp` sees a
        meta model, and the weights are loaded after it."""
        masters = self.masters
        device = masters[0].to_local().device
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[int]] = {}  # the masters to cast, by their dtype
            for i, m in enumerate(masters):
                if m.dtype != self.param_dtype:
                    by_dtype.setdefault(m.dtype, []).append(i)
            self._master_flats, self._compute_flats = [], []
            for dtype, idx in by_dtype.items():
                locals_ = [masters[i]._local_tensor for i in idx]
                flat = _Flat([t.shape for t in locals_], dtype, device)
                for t, v in zip(locals_, flat.views):
                    v.copy_(t)
                    t.set_(v)  # the DTensor's own local tensor now lives in the flat buffer
                compute = _Flat([t.shape for t in locals_], self.param_dtype, device)
                compute.free()
                self._master_flats.append(flat)
                self._compute_flats.append((compute, idx))
        self.compute: list[nn.Parameter] = [None] * len(masters)  # type: ignore[list-item]
        for compute, idx in self._compute_flats:
            for i, v in zip(idx, compute.views):
                self.compute[i] = nn.Parameter(v, requires_grad=masters[i].requires_grad)
        for i, m in enumerate(masters):
            if self.compute[i] is None:  # already in the compute dtype: computed from the master itself
                self.compute[i] = nn.Parameter(m.to_local(), requires_grad=m.requires_grad)
        self._trainable = [i for i, m in enumerate(masters) if m.requires_grad]
        self._grads = self._stage = None
        self._buckets: list[tuple[int, int]] = []
        if self._trainable:
            dtypes = {masters[i].dtype for i in self._trainable}
            if len(dtypes) != 1:
                raise ValueError(f"the trainable parameters of one model must share one dtype, got {sorted(map(str, dtypes))}")
            self._grads = _Flat([masters[i].shape for i in self._trainable], dtypes.pop(), device)
            self._grads.free()
            self._grad_dtensors = [DTensor.from_local(v, self.mesh, masters[i].placements, run_check=False)
                                   for i, v in zip(self._trainable, self._grads.views)]
            if self.replicas > 1 and self.reduce_dtype != self._grads.buf.dtype:
                self._stage = _Flat([masters[i].shape for i in self._trainable], self.reduce_dtype, device)
                self._stage.free()
            self._make_buckets()
        self._reset_buckets()
        self._built = True

    def _make_buckets(self) -> None:
        """Contiguous ranges of the trainable parameters (`self._trainable` positions, which are
        also the gradient buffer's layout), from the last parameter backwards: bucket 0 holds the
        parameters a backward reaches first. Each compute parameter gets a hook that counts its
        bucket down once its gradient is accumulated."""
        numels = self._grads.numels
        self._offsets = [0, *itertools.accumulate(numels)]  # each parameter's start in the buffer
        hi = len(numels)
        while hi > 0:  # a bucket closes once it holds bucket_numel elements (DDP's rule)
            lo, size = hi, 0
            while lo > 0 and size < self.bucket_numel:
                lo -= 1
                size += numels[lo]
            self._buckets.append((lo, hi))
            hi = lo
        # The hooks hold this runtime weakly: a tensor's hooks are not visible to Python's cycle
        # collector, so a strong reference would keep the runtime, and with it the fp32 masters,
        # alive after the model is dropped (5.8 GiB at 1.5b for every model a process builds).
        this = weakref.ref(self)
        for b, (lo, hi) in enumerate(self._buckets):
            for k in range(lo, hi):
                self.compute[self._trainable[k]].register_post_accumulate_grad_hook(
                    lambda _p, b=b: this()._on_gradient(b))

    def _reset_buckets(self) -> None:
        self._remaining = [hi - lo for lo, hi in self._buckets]  # gradients each bucket still waits for
        self._next = 0  # the next bucket to hand over
        self._works: list = []  # this backward's pending all-reduces
        self._fresh = False  # whether this backward's gradients start the masters' (else: add to them)
        self._reducing = False  # whether this backward all-reduces over the replicas

    # ------------------------------------------------------------------ runtime
    def install(self) -> None:
        """Cast the masters into the compute copies and register those on the modules."""
        if not self._built:
            self._build()
        if self._installed:
            return
        self.release_gradients()  # the optimizer dropped the gradients (zero_grad): so do we
        with torch.no_grad():
            for (compute, _), master in zip(self._compute_flats, self._master_flats):
                compute.alloc()
                compute.buf.copy_(master.buf)
        for module, name, i in self.slots:
            module._parameters[name] = self.compute[i]
        self._installed = True

    def uninstall(self) -> None:
        """Register the masters again and free the compute copies."""
        if not self._installed:
            return
        for module, name, i in self.slots:
            module._parameters[name] = self.masters[i]
        for compute, _ in self._compute_flats:
            compute.free()
        self._installed = False

    def release(self) -> None:
        """Masters registered, compute copies freed, and the gradient buffer freed when the
        optimizer holds no gradients (`reshard_all`: before an offload, when a resharder is built)."""
        self.uninstall()
        self.release_gradients()

    def release_gradients(self) -> None:
        """Free the gradient buffer if no master holds its gradient any more: FSDP2's gradients
        go with `zero_grad(set_to_none=True)`, this buffer (which the gradients of the next
        backward reuse) stays until told, as here, or until the next forward."""
        if self._built and self._trainable and not any(self.masters[i].grad is not None for i in self._trainable):
            self._grads.free()

    @contextmanager
    def kept(self):
        """The compute copies stay registered from the first forward inside to the end of the
        scope (see `sharding.fsdp.keep_compute_copies`)."""
        self._kept += 1
        try:
            yield
        finally:
            self._kept -= 1
            if not self._kept and not self._pending and not self.keep_after_forward:
                self.uninstall()

    def flat_gradients(self) -> torch.Tensor | None:
        """The trainable masters' gradients as one flat buffer (each gradient's local tensor is a
        view of it), when they hold them, as after a backward; else None. Checked in O(1) on the
        first and last gradient: the runtime sets all of them or none, and the optimizer drops
        all of them (`zero_grad`)."""
        if not self._built or not self._trainable:
            return None
        ends = (self.masters[self._trainable[0]].grad, self.masters[self._trainable[-1]].grad)
        if ends[0] is not self._grad_dtensors[0] or ends[1] is not self._grad_dtensors[-1]:
            return None
        return self._grads.buf

    def pre_forward(self, module, args, kwargs):
        self.install()
        return None

    def post_forward(self, module, args, output):
        outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            if not self.keep_after_forward and not self._pending and not self._kept:
                self.uninstall()
            return output
        self._pending = True
        self._backward_queued = False
        for t in outs:
            t.register_hook(self._queue_post_backward)
        return output

    def _queue_post_backward(self, grad):
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.post_backward)
        return grad

    def _on_gradient(self, b: int) -> None:
        """A gradient of bucket `b` has been accumulated: hand over every bucket that is complete
        and has all the buckets before it handed over."""
        if b < self._next:
            raise RuntimeError("a parameter received a second gradient in one backward after its bucket was "
                               "handed over; the replicated runtime supports one accumulation per backward")
        self._remaining[b] -= 1
        while self._next < len(self._buckets) and self._remaining[self._next] == 0:
            self._hand_over(self._next)

    @torch.no_grad()
    def _hand_over(self, b: int) -> None:
        """Bucket `b`'s gradients, as one concatenation (handing them over one by one with a dtype
        change runs a kernel per parameter), into the masters' gradient buffer; then, when this
        backward reduces, that slice's all-reduce started. A parameter this backward did not
        reach contributes zeros. Buckets are handed over in order, 0 first."""
        masters, compute = self.masters, self.compute
        if b == 0:  # the first bucket of a backward: where its gradients go
            have = [masters[i].grad is not None for i in self._trainable]
            self._fresh = not any(have)
            if self._fresh:  # the first backward since the optimizer dropped the gradients
                self._grads.alloc()
            else:
                for k, i in enumerate(self._trainable):
                    if not have[k]:
                        self._grads.views[k].zero_()
                        masters[i].grad = self._grad_dtensors[k]
            self._reducing = self.replicas > 1 and self.sync_gradients
            if self._reducing and self._stage is not None:
                self._stage.alloc()
        lo, hi = self._buckets[b]
        idx = self._trainable[lo:hi]
        flat = torch.cat([(compute[i].grad if compute[i].grad is not None else torch.zeros_like(compute[i])).reshape(-1)
                          for i in idx])
        for i in idx:
            compute[i].grad = None
        start, stop = self._offsets[lo], self._offsets[hi]
        dst = self._grads.buf[start:stop]
        if self._fresh:
            dst.copy_(flat)
        else:
            dst.add_(flat)
        del flat
        if self._reducing:
            if self._stage is not None:
                dst = self._stage.buf[start:stop].copy_(dst)
            self._works.append(comm.all_reduce_async(dst, group=self._group))
        self._next = b + 1

    @torch.no_grad()
    def post_backward(self) -> None:
        """The end of a backward: the buckets not handed over yet (a parameter this backward did
        not reach holds them back), then, when it reduces, the replica sums divided into means."""
        while self._next < len(self._buckets):
            self._hand_over(self._next)
        if self._reducing:
            for work in self._works:
                work.wait()
            if self._stage is not None:
                self._grads.buf.copy_(self._stage.buf)
                self._stage.free()
            self._grads.buf.mul_(1.0 / self.replicas)
        if self._fresh:
            for i, g in zip(self._trainable, self._grad_dtensors):
                self.masters[i].grad = g
        self._reset_buckets()
        self._pending = False
        self._backward_queued = False  # per backward, like the bucket counts
        if not self._kept:
            self.uninstall()


def apply_replicated(model: nn.Module, mesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                     keep_after_forward: bool, shard_dim, bucket_numel: int = BUCKET_NUMEL) -> ReplicatedParams:
    """Give `model` (on meta or materialised) the replicated runtime; returns it. `shard_dim(name,
    shape)`: the dimension each parameter's placement names (FSDP2's choice, for the resharder)."""
    if replicated_params(model) is not None:
        raise RuntimeError("this model already has a replicated runtime")
    rp = ReplicatedParams(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                          keep_after_forward=keep_after_forward, shard_dim=shard_dim, bucket_numel=bucket_numel)
    model.register_forward_pre_hook(rp.pre_forward, with_kwargs=True)
    model.register_forward_hook(rp.post_forward)
    model.__dict__[_ATTR] = rp
    return rp
