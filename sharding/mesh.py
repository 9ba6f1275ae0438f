"""Process-group layout: the training mesh, the generation mesh and the resharder's groups.

One validated dataclass, `ParallelDims`, turns the two user-facing sizes into every group the
program needs (docs/ARCHITECTURE.md):

* training: `fsdp_size` (verl's `actor_rollout_ref.actor.fsdp_config.fsdp_size`) — `-1` (or
  the world size or more, as verl's `create_device_mesh` reads it) shards over the whole world
  (FULL_SHARD, 1-D mesh `("dp_shard",)`); any other divisor `S` of the world gives HYBRID_SHARD
  on a 2-D mesh
  `("dp_replicate", "dp_shard") = (W/S, S)`: shard inside a group of `S` ranks, replicate
  across groups.
* generation: `tp` (`actor_rollout_ref.rollout.tensor_model_parallel_size`) gives the 2-D mesh
  `("rollout_dp", "tp") = (W/t, t)`.

FSDP2 puts chunk `k` of a sharded dimension on the `k`-th rank of the shard group. With
`m = S/t`, TP shard `j` of every parameter is then exactly FSDP chunks `[j·m, (j+1)·m)`, held by
the contiguous ranks of "micro-DP group" `j`. A TP group must therefore hold one rank of each
micro-DP group: for shard-local rank `l = i + j·m` it is `{i + j'·m : j' < t}` — strided — and
the resharder gathers only inside micro-DP groups. Everything below is laid out relative to
the shard group `g` (global ranks `[g·S, (g+1)·S)`), so HSDP replicas reshard independently.

The rank arithmetic is pure Python (`tp_group`, `micro_dp_group`, ...) so it is unit-tested
without processes; `build_meshes` turns it into `DeviceMesh`es.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

FSDP_SIZE_KEY = "actor_rollout_ref.actor.fsdp_config.fsdp_size"
TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


@dataclass
class ParallelDims:
    """Validated parallel sizes; derived sizes are filled in by `__post_init__`."""

    world_size: int = field(metadata={"help": "number of ranks (WORLD_SIZE)"})
    fsdp_size: int = field(default=-1, metadata={
        "help": f"{FSDP_SIZE_KEY}: -1 (or the world size) shards over the world, else HSDP shard-group size"})
    tp: int = field(default=1, metadata={"help": f"{TP_KEY}: tensor-parallel size of the generation engine"})
    local_world_size: int | None = field(
        default=None, metadata={"help": "ranks per node (LOCAL_WORLD_SIZE); TP groups must stay inside one node; None: one node"})

    dp_shard: int = field(init=False, metadata={"help": "ranks one parameter is sharded over (S)"})
    dp_replicate: int = field(init=False, metadata={"help": "number of HSDP replicas (W/S)"})
    rollout_dp: int = field(init=False, metadata={"help": "number of engine replicas (W/t)"})
    micro_dp: int = field(init=False, metadata={"help": "ranks holding one TP shard inside a shard group (S/t)"})

    def __post_init__(self):
        w, t = self.world_size, self.tp
        if not isinstance(w, int) or w < 1:
            raise ValueError(f"world_size must be a positive integer, got {w!r}")
        if not isinstance(t, int) or t < 1:
            raise ValueError(f"{TP_KEY} must be a positive integer, got {t!r}")
        fs = self.fsdp_size
        if not isinstance(fs, int) or fs == 0 or fs < -1:
            raise ValueError(f"{FSDP_SIZE_KEY} must be -1 (shard over all {w} ranks) or a positive divisor of the "
                             f"world size, got {fs!r}")
        if fs != -1 and (fs > w or w % fs):  # (the config reads a size above the world's as -1: full_shard_note)
            raise ValueError(
                f"{FSDP_SIZE_KEY}={fs} does not divide the world size {w}: HYBRID_SHARD needs world_size = "
                f"dp_replicate x fsdp_size; use -1 to shard over all ranks or one of {_divisors(w)}")
        self.dp_shard = w if fs == -1 else fs
        self.dp_replicate = w // self.dp_shard
        if self.dp_shard % t:
            hint = (f"with {FSDP_SIZE_KEY}={fs} each shard group has {self.dp_shard} ranks" if fs != -1
                    else f"the world has {w} ranks")
            raise ValueError(
                f"{TP_KEY}={t} must divide the FSDP shard-group size ({hint}): a TP group is built from "
                f"ranks of one shard group so that each rank's FSDP chunk lies inside its TP shard; "
                f"use one of {_divisors(self.dp_shard)}")
        self.rollout_dp = w // t
        self.micro_dp = self.dp_shard // t
        lws = self.local_world_size
        if lws is not None:
            if not isinstance(lws, int) or lws < 1 or w % lws:
                raise ValueError(f"local_world_size (LOCAL_WORLD_SIZE) {lws!r} must be a positive divisor of the "
                                 f"world size {w}")
            if t > lws:
                raise ValueError(f"{TP_KEY}={t} is larger than the {lws} ranks of one node: TP groups must stay "
                                 f"inside a node (NVLink)")
            for r in range(w):
                nodes = {q // lws for q in self.tp_group(r)}
                if len(nodes) > 1:
                    raise ValueError(
                        f"{TP_KEY}={t} with a shard group of {self.dp_shard} ranks puts the TP group "
                        f"{self.tp_group(r)} on nodes {sorted(nodes)} (a TP group is strided by "
                        f"{self.micro_dp} ranks, docs/ARCHITECTURE.md); set {FSDP_SIZE_KEY}={lws} (HYBRID_SHARD inside "
                        f"each node of {lws} ranks) so that TP groups stay inside a node")

    @classmethod
    def from_env(cls, fsdp_size: int = -1, tp: int = 1) -> "ParallelDims":
        """Sizes from the torchrun environment (or the initialised default group)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        return cls(world_size=world, fsdp_size=fsdp_size, tp=tp, local_world_size=int(lws) if lws else None)

    @property
    def hsdp(self) -> bool:
        """True for HYBRID_SHARD (a 2-D training mesh)."""
        return self.dp_replicate > 1

    # ------------------------------------------------------------- rank arithmetic
    def shard_group(self, rank: int) -> list[int]:
        """Global ranks of `rank`'s FSDP shard group, in shard-rank (= chunk) order."""
        base = rank - rank % self.dp_shard
        return list(range(base, base + self.dp_shard))

    def tp_rank(self, rank: int) -> int:
        """Which TP shard `rank` holds for generation (= its micro-DP group index)."""
        return (rank % self.dp_shard) // self.micro_dp

    def tp_group(self, rank: int) -> list[int]:
        """Global ranks of `rank`'s TP group, ordered by TP rank."""
        base, local = rank - rank % self.dp_shard, rank % self.dp_shard
        i = local % self.micro_dp
        return [base + i + j * self.micro_dp for j in range(self.tp)]

    def micro_dp_group(self, rank: int) -> list[int]:
        """Global ranks holding the same TP shard as `rank` inside its shard group (contiguous)."""
        base, local = rank - rank % self.dp_shard, rank % self.dp_shard
        start = base + (local // self.micro_dp) * self.micro_dp
        return list(range(start, start + self.micro_dp))

    def rollout_dp_rank(self, rank: int) -> int:
        """Index of `rank`'s engine replica (which slice of the prompts it generates for)."""
        g, local = divmod(rank, self.dp_shard)
        return g * self.micro_dp + local % self.micro_dp

    def gen_mesh_ranks(self) -> torch.Tensor:
        """`[rollout_dp, tp]` global ranks; row `d` is the TP group of engine replica `d`."""
        rows = [None] * self.rollout_dp
        for r in range(self.world_size):
            rows[self.rollout_dp_rank(r)] = self.tp_group(r)
        return torch.tensor(rows, dtype=torch.int)

    def micro_dp_mesh_ranks(self) -> torch.Tensor:
        """`[dp_replicate * tp, micro_dp]` global ranks; each row is one micro-DP group."""
        rows = sorted({tuple(self.micro_dp_group(r)) for r in range(self.world_size)})
        return torch.tensor(rows, dtype=torch.int)

    # ------------------------------------------------------------- meshes
    def build_meshes(self, device_type: str | None = None, timeout_s: float | None = None) -> "ParallelMeshes":
        """Create the DeviceMeshes (collective: every rank must call it, in the same order).

        `device_type` defaults to "cuda" when CUDA is available (NCCL), else "cpu" (gloo). On
        CUDA, call `torch.cuda.set_device(local_rank)` first. `timeout_s` bounds how long a
        collective of the meshes' groups waits for the other ranks (`trainer.nccl_timeout`; torch
        gives sub-groups its own default, not the default group's).
        """
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if not torch.distributed.is_initialized():
            raise RuntimeError("build_meshes needs an initialised default process group (torchrun + init_process_group)")
        if torch.distributed.get_world_size() != self.world_size:
            raise ValueError(f"ParallelDims.world_size={self.world_size} but the process group has "
                             f"{torch.distributed.get_world_size()} ranks")
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        def override(shape):
            return _timeout_override(device_type, timeout_s, shape, self.world_size)

        if self.hsdp:
            shape = (self.dp_replicate, self.dp_shard)
            train = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard"),
                                     backend_override={i: o for i, o in enumerate(override(shape) or ())
                                                       if o != (None, None)} or None)
        else:  # one dimension of every rank: the default group itself
            train = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp_shard",))
        ranks = self.gen_mesh_ranks()
        gen = DeviceMesh(device_type, ranks, mesh_dim_names=("rollout_dp", "tp"), backend_override=override(ranks.shape))
        if self.hsdp:
            # Under HSDP a rollout-DP column spans replicas, but the gather must stay inside one
            # shard group (only it holds this replica's chunks): a mesh of its own.
            ranks = self.micro_dp_mesh_ranks()
            micro = DeviceMesh(device_type, ranks, mesh_dim_names=("tp_shard", "micro_dp"),
                               backend_override=override(ranks.shape))["micro_dp"]
        else:
            # Without replicas a rollout-DP column of the generation mesh *is* a micro-DP group.
            micro = gen["rollout_dp"]
        return ParallelMeshes(dims=self, train=train, gen=gen, micro_dp=micro, timeout_s=timeout_s)

    def block_mesh_ranks(self, size: int) -> torch.Tensor:
        """`[world_size / size, size]` global ranks: each shard group cut into blocks of `size` consecutive ranks."""
        if self.dp_shard % size:
            raise ValueError(f"blocks of {size} ranks do not tile a shard group of {self.dp_shard}")
        return torch.arange(self.world_size, dtype=torch.int).view(-1, size)


def _timeout_override(device_type: str, timeout_s: float | None, shape, world_size: int):
    """Per-dimension `(backend, options)` of a mesh of `shape` whose groups wait `timeout_s`, or None
    (no timeout given). A dimension of every rank gets `(None, None)`: it is the default group
    itself, which has the timeout already (no second communicator). NCCL sub-groups are split from
    the default group with a copy of its options, as torch does without an override."""
    if timeout_s is None or world_size == 1:
        return None
    import copy
    import datetime

    import torch.distributed as dist

    if device_type == "cuda":
        backend = "nccl"
        options = copy.deepcopy(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).options)
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return tuple((None, None) if n == world_size else (backend, options) for n in shape)


@dataclass
class ParallelMeshes:
    """The DeviceMeshes of one run, named by role."""

    dims: ParallelDims
    train: object  # DeviceMesh: ("dp_shard",) or ("dp_replicate", "dp_shard") — pass to apply_fsdp
    gen: object  # DeviceMesh ("rollout_dp", "tp") — `gen["tp"]` goes to the engine
    micro_dp: object  # 1-D DeviceMesh: the ranks this rank gathers its TP shard from
    timeout_s: float | None = None  # how long the groups' collectives wait (`build_meshes`)
    _blocks: dict = field(default_factory=dict, repr=False)  # block size -> process group (`block_group`)

    @property
    def tp(self):
        """1-D TP mesh for `LLMEngine(..., tp_mesh=...)`."""
        return self.gen["tp"]

    @property
    def shard(self):
        """1-D mesh of this rank's FSDP shard group."""
        return self.train["dp_shard"]

    def block_group(self, size: int):
        """The process group of this rank's block of `size` consecutive ranks of its shard group: the ranks that
        hold the FSDP chunks of one K/V head the engine replicates over `size / micro_dp` TP ranks (the
        resharder's `kv` route). Collective the first time a size is asked for: every rank must ask for it."""
        if size not in self._blocks:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = self.dims.block_mesh_ranks(size)
            mesh = DeviceMesh(self.train.device_type, ranks, mesh_dim_names=("blocks", "block"),
                              backend_override=_timeout_override(self.train.device_type, self.timeout_s, ranks.shape,
                                                                 self.dims.world_size))
            self._blocks[size] = mesh["block"].get_group()
        return self._blocks[size]


def full_shard_note(key: str, fsdp_size: int, world_size: int) -> str | None:
    """The start-up line for an `fsdp_size` (option `key`) above the world size, which shards over
    every rank (FULL_SHARD), as verl's `create_device_mesh` reads any size of at least the world's
    (its 8-node scripts' 32 trains on 2 nodes); None for any other size."""
    if fsdp_size <= world_size:
        return None
    return (f"{key}={fsdp_size} is more than the {world_size} ranks of this launch: the models shard over all "
            f"{world_size} (FULL_SHARD), as verl does for an fsdp_size of at least the world size")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
