"""Rank layout of ParallelDims (pure arithmetic, no processes) and config validation errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from models.args import HF_FAMILY
from sharding import FSDPConfig, ParallelDims, fsdp_shard_dim
from sharding.mesh import FSDP_SIZE_KEY, TP_KEY, full_shard_note


def test_full_shard_layout_w8_tp2():
    d = ParallelDims(8, tp=2)
    assert (d.dp_shard, d.dp_replicate, d.rollout_dp, d.micro_dp, d.hsdp) == (8, 1, 4, 4, False)
    assert d.tp_group(0) == [0, 4] and d.tp_group(5) == [1, 5] and d.tp_group(7) == [3, 7]
    assert d.micro_dp_group(5) == [4, 5, 6, 7] and d.micro_dp_group(2) == [0, 1, 2, 3]
    assert [d.tp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert d.gen_mesh_ranks().tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.micro_dp_mesh_ranks().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_note_of_an_fsdp_size_above_the_world():
    """verl's create_device_mesh builds its 1-D FULL_SHARD mesh for any fsdp_size of at least the
    world size (its 8-node scripts' fsdp_size=32 trains on 2 nodes); the config reads such a size as
    -1 with this start-up line (tests/unit/test_config.py), so the layout never sees it. A size below
    the world that does not divide it is refused."""
    assert full_shard_note(FSDP_SIZE_KEY, 8, 4) == (
        f"{FSDP_SIZE_KEY}=8 is more than the 4 ranks of this launch: the models shard over all 4 "
        "(FULL_SHARD), as verl does for an fsdp_size of at least the world size")
    assert full_shard_note(FSDP_SIZE_KEY, 4, 4) is full_shard_note(FSDP_SIZE_KEY, -1, 4) is None
    with pytest.raises(ValueError, match=f"{FSDP_SIZE_KEY}=3 does not divide the world size 4"):
        ParallelDims(4, fsdp_size=3)


def test_hsdp_layout_w8_shard4_tp2():
    d = ParallelDims(8, fsdp_size=4, tp=2)
    assert (d.dp_shard, d.dp_replicate, d.rollout_dp, d.micro_dp, d.hsdp) == (4, 2, 4, 2, True)
    assert d.shard_group(6) == [4, 5, 6, 7]
    assert d.tp_group(5) == [5, 7] and d.tp_group(0) == [0, 2]
    assert d.micro_dp_group(7) == [6, 7]
    assert d.gen_mesh_ranks().tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.micro_dp_mesh_ranks().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("world,fsdp,tp", [(w, f, t) for w in (1, 2, 4, 8, 16) for f in (-1, 1, 2, 4, 8)
                                           for t in (1, 2, 4, 8) if (f == -1 or w % f == 0 and f <= w)
                                           and (w if f == -1 else f) % t == 0])
def test_every_rank_fsdp_chunk_lies_in_its_tp_shard(world, fsdp, tp):
    d = ParallelDims(world, fsdp_size=fsdp, tp=tp)
    gen = d.gen_mesh_ranks()
    assert gen.shape == (world // tp, tp) and sorted(gen.flatten().tolist()) == list(range(world))
    for r in range(world):
        k = r % d.dp_shard  # FSDP chunk index = rank inside the shard group
        j = d.tp_rank(r)
        # TP shard j of a dimension n is FSDP chunks [j m, (j+1) m): chunk k must be among them
        assert j * d.micro_dp <= k < (j + 1) * d.micro_dp
        group = d.tp_group(r)
        assert group.index(r) == j and set(group) <= set(d.shard_group(r))
        assert gen[d.rollout_dp_rank(r)].tolist() == group
        assert r in d.micro_dp_group(r) and all(d.tp_rank(q) == j for q in d.micro_dp_group(r))
    # TP groups partition the world; so do micro-DP groups.
    tps = {tuple(d.tp_group(r)) for r in range(world)}
    assert sorted(itertools.chain(*tps)) == list(range(world))


def test_tp_groups_inside_a_node():
    d = ParallelDims(16, fsdp_size=8, tp=4, local_world_size=8)
    assert all(len({q // 8 for q in d.tp_group(r)}) == 1 for r in range(16))
    with pytest.raises(ValueError, match=f"{FSDP_SIZE_KEY}=8"):  # the fix it suggests
        ParallelDims(16, tp=2, local_world_size=8)
    with pytest.raises(ValueError, match="inside a node"):
        ParallelDims(16, fsdp_size=16, tp=16, local_world_size=8)


@pytest.mark.parametrize("kwargs,key", [
    (dict(world_size=8, fsdp_size=3), FSDP_SIZE_KEY),
    (dict(world_size=8, fsdp_size=0), FSDP_SIZE_KEY),
    (dict(world_size=8, fsdp_size=-2), FSDP_SIZE_KEY),
    (dict(world_size=8, tp=3), TP_KEY),
    (dict(world_size=8, tp=0), TP_KEY),
    (dict(world_size=8, fsdp_size=2, tp=4), TP_KEY),
    (dict(world_size=0), "world_size"),
    (dict(world_size=8, local_world_size=3), "LOCAL_WORLD_SIZE"),
])
def test_sizes_that_do_not_fit_name_the_config_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ParallelDims(**kwargs)


def test_fsdp_config_validation():
    cfg = FSDPConfig(mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    assert cfg.param_torch_dtype == torch.bfloat16 and cfg.reduce_torch_dtype == torch.float32
    assert FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]})
    for kwargs, match in [
        (dict(mixed_precision={"param_dtype": "fp16"}), "not supported"),
        (dict(mixed_precision={"buffer_dtype": "bf16"}), "buffer_dtype.*not supported"),
        (dict(mixed_precision={"cast_forward_inputs": True}), "unknown keys"),
        (dict(model_dtype="int8"), "model_dtype"),
        (dict(wrap_policy={"size_based": 1}), "not supported"),
        (dict(wrap_policy={"transformer_layer_cls_to_wrap": ["GPT2Block"]}), "not supported"),
        (dict(wrap_policy={"min_num_params": -1}), "min_num_params"),
        (dict(fsdp_size=0), "fsdp_size"),
        (dict(param_offload="yes"), "param_offload"),
        (dict(offload_policy=True, optimizer_offload=True), "offload_policy"),
    ]:
        with pytest.raises(ValueError, match=match):
            FSDPConfig(**kwargs)


@pytest.mark.parametrize("model_type", sorted(HF_FAMILY))
def test_wrap_policy_takes_the_decoder_layer_class_transformers_gives_each_family(model_type):
    """A verl config names the Hugging Face model's decoder-layer class in transformer_layer_cls_to_wrap (its
    `_no_split_modules`): for every family meshppo builds, the class transformers' causal-LM model of that type
    declares is accepted (the mixture-of-experts families' included)."""
    import transformers

    model_class = getattr(transformers, f"{HF_FAMILY[model_type]}ForCausalLM")
    layer_classes = model_class._no_split_modules
    assert layer_classes and FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": list(layer_classes)})


def test_fsdp_shard_dim_follows_tp_plan():
    assert fsdp_shard_dim("layers.0.self_attn.q_proj.weight", (64, 64), 4) == 0
    assert fsdp_shard_dim("layers.0.self_attn.o_proj.weight", (64, 64), 4) == 1
    assert fsdp_shard_dim("layers.3.mlp.down_proj.weight", (64, 128), 8) == 1
    # FSDP2 cannot shard dim 1 unevenly: fall back to dim 0 (the resharder then gathers it whole)
    assert fsdp_shard_dim("layers.3.mlp.down_proj.weight", (64, 102), 4) == 0
    assert fsdp_shard_dim("layers.0.input_layernorm.weight", (64,), 4) == 0
    assert fsdp_shard_dim("score.weight", (1, 64), 4) == 0
