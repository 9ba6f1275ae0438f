"""The tensor-parallel process group of the engine, taken from a DeviceMesh.

TP=1 (no mesh, or a mesh of size 1) needs no process group at all: every collective is
then a no-op. Collectives always run on the mesh's group, never the world group.

The engine's all-reduces (two per layer per decode step, of `[batch, hidden]`) are small and
latency-bound: NCCL's ring costs ~15-20 us each whatever the size. On CUDA with peer access
(NVLink) they can instead go through a symmetric-memory buffer that every rank of the group
maps (`torch.distributed._symmetric_memory`): the in-place two-shot all-reduce reads and
writes the peers' halves directly, with no NCCL launch. `all_reduce="auto"` uses it where
it can be set up and NCCL otherwise (and for messages larger than the buffer).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALL_REDUCE_IMPLS = ("auto", "nccl", "symm_mem")
_ALIGN = 8  # elements: 16 bytes of bf16

# `all_gather_into_tensor` was renamed `all_gather_single` (torch 2.13); both take a flat output.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def vocab_shard(vocab_size: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(first id, width, real ids) of TP rank `rank`'s shard of a vocabulary of `vocab_size` ids: `ceil(V / t)`
    ids a rank, so that where `t` does not divide `V` (a Llama with an added pad token: 32001) the last shard
    ends past the vocabulary, padded as vLLM pads it to a multiple of its TP size; `real` counts the ids below
    `V`, the only ones a rank embeds, samples or counts in a log-probability."""
    width = -(-vocab_size // tp)
    start = rank * width
    return start, width, max(0, min(width, vocab_size - start))


class TPGroup:
    """Rank, size and collectives of one TP group."""

    def __init__(self, group=None):
        self.group = group
        self._symm: torch.Tensor | None = None  # symmetric-memory buffer of the fast all-reduce
        if group is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def setup_all_reduce(self, impl: str, device: torch.device, dtype: torch.dtype, max_numel: int) -> str:
        """Choose the all-reduce of `dtype` messages up to `max_numel` elements (see the module
        docstring); returns the implementation in use, the same on every rank of the group.
        `symm_mem` fails loudly where it cannot be set up; `auto` falls back to NCCL, saying why
        in the log.

        Each stage's outcome is agreed before the next collective one (allocate the buffer, map
        the peers' buffers, a probe all-reduce): a rank that failed alone and fell back would
        leave its peers in the rendezvous or the probe, or decode with another all-reduce."""
        if impl not in ALL_REDUCE_IMPLS:
            raise ValueError(f"tp all_reduce must be one of {ALL_REDUCE_IMPLS}, got {impl!r}")
        self._symm = None
        if self.size == 1:
            return "none"
        if impl == "nccl" or (impl == "auto" and device.type != "cuda"):
            return dist.get_backend(self.group)
        buf = None

        def allocate():
            nonlocal buf
            if device.type != "cuda":
                raise RuntimeError(f"symmetric memory needs CUDA devices, the engine runs on {device}")
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(max_numel, dtype=dtype, device=device)

        def rendezvous():
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.rendezvous(buf, self.group)

        def probe():  # one round trip now: a broken setup fails here, not mid-decode
            ones = buf[:min(max_numel, 1024)].fill_(1)
            torch.ops.symm_mem.two_shot_all_reduce_(ones, "sum", self.group.group_name)
            if not bool((ones == self.size).all()):
                raise RuntimeError(f"the probe all-reduce gave {ones.tolist()}, expected {self.size} everywhere")

        failure = self.agreed_stages((allocate, rendezvous, probe), device)
        if failure is not None:
            stage, cause = failure
            if impl == "symm_mem":
                raise RuntimeError(f"rank {dist.get_rank()}: the symmetric-memory all-reduce could not be set up "
                                   f"({stage}): {cause}")
            log.warning("engine TP all-reduce: NCCL (symmetric memory unavailable at %s: %s)", stage, cause)
            return "nccl"
        self._symm = buf
        return "symm_mem"

    def agreed_stages(self, stages, device) -> tuple[str, str] | None:
        """Run `stages` (callables) in turn on every rank of the group, each one's outcome agreed
        (one all-reduce on `device`) before the next starts: None when every stage passed on every
        rank; else, on every rank, the failed stage's name and its cause as this rank says it
        (its own exception, or the lowest group rank that failed), the later stages not run."""
        for stage in stages:
            try:
                stage()
                mine = None
            except Exception as e:  # noqa: BLE001 - said on every rank, by the caller
                mine = f"{type(e).__name__}: {e}"
            failed = self.all_reduce_min(self.size if mine is None else self.rank, device)
            if failed != self.size:
                return stage.__name__, mine or f"on the TP group's rank {failed}"
        return None

    @classmethod
    def from_mesh(cls, tp_mesh) -> "TPGroup":
        """`tp_mesh`: None, a 1-D DeviceMesh, or one named dimension of a larger mesh (`mesh["tp"]`)."""
        if tp_mesh is None or tp_mesh.size() == 1:
            return cls(None)
        if tp_mesh.ndim != 1:
            raise ValueError(f"tp_mesh must be 1-D (a mesh dimension such as mesh['tp']), got {tp_mesh.ndim} dims")
        return cls(tp_mesh.get_group())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (returns `t`)."""
        if self.size == 1:
            return t
        buf = self._symm
        # (the two-shot kernel splits the message over the ranks in 16-byte vectors)
        if (buf is not None and t.dtype == buf.dtype and t.numel() <= buf.numel() and t.is_contiguous()
                and t.numel() % (_ALIGN * self.size) == 0):
            # The sum must happen in the symmetric buffer: copy in, reduce in place, copy out.
            chunk = buf[:t.numel()]
            chunk.copy_(t.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(chunk, "sum", self.group.group_name)
            t.view(-1).copy_(chunk)
            return t
        dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_min(self, value: int, device) -> int:
        """The smallest `value` over the group (host integer; for sizing decisions, not hot paths)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise largest `t` over the group, in place (quantization scales; not a hot path)."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """`[size, *t.shape]`: every rank's `t`, in rank order."""
        if self.size == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
        _all_gather_flat(out, t.reshape(-1), group=self.group)
        return out.view(self.size, *t.shape)
