"""`model.load_format=dummy`: each rank draws its own shards (no checkpoint, no full tensor)."""

import torch
from torch.distributed.tensor import DTensor

from models import ModelArgs
from sharding import FSDPConfig, ParallelDims, build_fsdp_model
from tests.dist_utils import run_distributed

ARGS = ModelArgs(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, model_type="qwen2", attention_bias=True,
                 tie_word_embeddings=False, initializer_range=0.05)


def _full(model):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}


def _body(rank, world):
    meshes = ParallelDims(world).build_meshes("cpu")
    fp32 = {"param_dtype": "fp32"}
    actor = _full(build_fsdp_model(ARGS, meshes.train, FSDPConfig(mixed_precision=fp32), seed=3, dummy_weights=True))
    ref = _full(build_fsdp_model(ARGS, meshes.train, FSDPConfig(mixed_precision=fp32), trainable=False, seed=3,
                                 dummy_weights=True))
    other = _full(build_fsdp_model(ARGS, meshes.train, FSDPConfig(mixed_precision=fp32), seed=4, dummy_weights=True))
    assert actor.keys() == ref.keys()
    for name, w in actor.items():
        assert torch.equal(w, ref[name]), name  # the reference starts equal to the actor
        if name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
        elif name.endswith(".bias"):
            assert torch.equal(w, torch.zeros_like(w)), name
        else:
            # normal(0, 0.05): the sample std of >= 4096 draws is within 10 % (> 6 sigma)
            assert abs(w.std().item() / 0.05 - 1) < 0.1, (name, w.std())
            assert not torch.equal(w, other[name]), name  # the seed matters
            halves = w.flatten().chunk(2)
            assert not torch.equal(halves[0], halves[1])  # ranks draw different numbers


def test_dummy_weights_are_drawn_per_shard_and_seeded():
    run_distributed(_body, 2)


def _replicas_body(rank, world):
    """4 ranks as HYBRID_SHARD (2 replicas x 2 shards) and as data parallelism (4 replicas): every
    replica holds the same model (its shards drawn by shard, not by rank)."""
    import torch.distributed as dist

    fp32 = {"param_dtype": "fp32"}
    for fsdp_size in (2, 1):
        meshes = ParallelDims(world, fsdp_size=fsdp_size).build_meshes("cpu")
        full = _full(build_fsdp_model(ARGS, meshes.train, FSDPConfig(fsdp_size=fsdp_size, mixed_precision=fp32),
                                      seed=3, dummy_weights=True))
        for name, w in full.items():
            every = [torch.empty_like(w) for _ in range(world)]
            dist.all_gather(every, w.contiguous())
            for r in range(1, world):
                assert torch.equal(every[r], every[0]), (fsdp_size, name, r)
            if fsdp_size == 2 and not name.endswith(("norm.weight", ".bias")):
                halves = w.flatten().chunk(2)
                assert not torch.equal(halves[0], halves[1]), name  # the two shards draw different numbers


def test_dummy_weights_are_the_same_on_every_replica():
    run_distributed(_replicas_body, 4)
