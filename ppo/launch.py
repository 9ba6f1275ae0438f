"""Process-group and device set-up for the SPMD trainer (torchrun or a plain single process)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistContext:
    """Initialise the default process group (nccl on CUDA, gloo on CPU) from torchrun's env.

    A single process without torchrun's variables still gets a (world size 1) group, so the
    rest of the code has one path: FSDP2 and DTensor need a process group. `timeout_s`
    (`trainer.nccl_timeout`) bounds how long a collective waits for the other ranks.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available on this machine")
    rank, world = int(os.environ.get("RANK", "0")), world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        backend = "nccl" if device == "cuda" else "gloo"
        kwargs = {"device_id": dev} if device == "cuda" else {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        # torchrun keeps one store across restarts (--max-restarts): keys written by the killed
        # attempt (a dead rank's gloo address) would be read by the new one and its connect
        # fails. Each attempt therefore gets its own key prefix.
        store, _, _ = next(dist.rendezvous("env://", rank, world))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"meshppo/attempt_{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
        owns = True
    return DistContext(rank, world, local_rank, local_world, dev, owns)
