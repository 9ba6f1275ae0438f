"""OLMo-2 in the engine at TP 2 over two gloo processes equals TP 1 (float32, CPU): its q / k norms span the
whole q and k projections, whose columns TP splits over the ranks, so each rank norms its heads by the sums of
squares of every rank's (an all-reduce), its KV heads' copy too where the ranks replicate one KV head."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def check_olmo2_tp2_equals_tp1(rank: int, triton: bool = False, model_type: str = "olmo2", extra_hf=None):
    """(also another type's: `model_type`, with config.json's keys `extra_hf`: tests/multiproc/
    test_gemma3_engine_tp.py)"""
    from torch.distributed.device_mesh import init_device_mesh

    from models import ModelArgs, Transformer
    from rollout import EngineConfig, LLMEngine, SamplingParams

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    outputs = []
    # 2 KV heads (one a rank) with tied embeddings and attention_bias (o_proj's bias added once, after the
    # all-reduce); 1 KV head (each rank a copy) with an explicit head_dim, untied
    for kv, head_dim, tied in ((2, None, True), (1, 24, False)):
        args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=128,
                         model_type=model_type, tie_word_embeddings=tied, attention_bias=tied,
                         extra_hf=extra_hf or {})
        model = Transformer.build(args, seed=0)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():  # norms far from 1 and apart per column: a wrong slice shows
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.15 * torch.randn(p.shape, generator=g))
        config = EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
        tp2 = LLMEngine(args, config, tp_mesh=mesh["tp"], device="cpu")
        tp2.load_weights(model.named_parameters())
        tp1 = LLMEngine(args, config, device="cpu")
        tp1.load_weights(model.named_parameters())
        if triton:
            tp2.runner.use_triton = True
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]
        new = 3 if triton else 10
        cases = [(SamplingParams(temperature=0, max_tokens=new), prompts),
                 (SamplingParams(n=2, temperature=0.9, top_p=0.9, max_tokens=new, seed=5), prompts),
                 (SamplingParams(temperature=0.9, max_tokens=new, seed=8), prompts[1:2])]  # decode steps of one row
        for sp, batch in cases[::2] if triton else cases:  # (the interpreter: about a second a step)
            a, b = tp1.generate(batch, sp), tp2.generate(batch, sp)
            assert [o.token_ids for o in a] == [o.token_ids for o in b], (kv, sp)
            # float32: the sums of squares add in another order (~1e-7); a norm by this rank's columns alone, or
            # by the wrong part of its weight, moves the log-probs by > 1e-2
            diff = max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))
            assert diff < (1e-4 if triton else 1e-5), (kv, sp, diff)
            outputs.append([o.token_ids for o in b])
    gathered = [None, None]
    dist.all_gather_object(gathered, outputs)
    assert gathered[0] == gathered[1]


def _body(rank, world_size):
    check_olmo2_tp2_equals_tp1(rank)


def test_olmo2_tp2_equals_tp1():
    run_distributed(_body, 2)


def _triton_body(rank, world_size):
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before this process imports triton
    check_olmo2_tp2_equals_tp1(rank, triton=True)


def test_olmo2_tp2_triton_kernels_equal_tp1_torch_ops():
    """The Triton kernels at TP 2 (the sums of squares, the norm by them, the post-norm residual add) against the
    PyTorch ops at TP 1."""
    pytest.importorskip("triton")
    run_distributed(_triton_body, 2)
