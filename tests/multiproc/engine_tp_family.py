"""A model family's engine at TP 2 over the two gloo ranks of the default group equals TP 1 (float32, CPU): the
check that test_granite_engine_tp.py, test_olmo2_engine_tp.py, test_gemma2_engine_tp.py, test_gemma3_engine_tp.py,
test_qwen3_moe_engine_tp.py and test_moe_families_engine_tp.py run with their families' model arguments (`run_family_tp2_equals_tp1`)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def run_family_tp2_equals_tp1(variants: list[dict], norm_std: float, triton: bool = False):
    """`check_family_tp2_equals_tp1(variants, norm_std, triton)` on two gloo processes; with `triton`, skipped
    where triton is not installed, the ranks running its kernels under the interpreter (TRITON_INTERPRET=1)."""
    if triton:
        pytest.importorskip("triton")
    run_distributed(_tp2_body, 2, variants, norm_std, triton, triton_interpret=triton)


def _tp2_body(rank, world_size, variants, norm_std, triton):
    check_family_tp2_equals_tp1(variants, norm_std, triton)


def check_family_tp2_equals_tp1(variants: list[dict], norm_std: float, triton: bool = False):
    """For each of `variants` (ModelArgs keywords over a 2-layer, 4-head, vocab-96 model; each names its
    num_key_value_heads), a model with random weights (norm weights 1 + `norm_std` · N(0, 1), the others
    0.15 · N(0, 1)) in a TP 2 engine and a TP 1 one: the same tokens (greedy, top-p with n = 2, one row's decode
    steps) and log-probs within 1e-5 (float32: the all-reduces add in another order, ~1e-7). `triton`: the TP 2
    engine runs the Triton kernels (under the interpreter, about a second a step) over 3 new tokens in place of
    10 and three of the five prompts, in the greedy and the one-row cases, within 1e-4; its one row is the prompt of
    3 tokens (one prefill step, then the one-row decode steps: the GEMVs at one row), not the chunked one (the
    greedy case's), whose 1-token second chunk was a third one-row step through the GEMVs, the slowest kernel
    under the interpreter. Both ranks return the same tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    from models import ModelArgs, Transformer
    from rollout import EngineConfig, LLMEngine, SamplingParams

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    outputs = []
    for variant in variants:
        args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128, **variant)
        kv = args.num_key_value_heads
        model = Transformer.build(args, seed=0)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                p.copy_(1 + norm_std * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.15 * torch.randn(p.shape, generator=g))
        config = EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
        tp2 = LLMEngine(args, config, tp_mesh=mesh["tp"], device="cpu")
        tp2.load_weights(model.named_parameters())
        tp1 = LLMEngine(args, config, device="cpu")
        tp1.load_weights(model.named_parameters())
        if triton:
            tp2.runner.use_triton = True
        g = torch.Generator().manual_seed(2)
        # the Triton run over three of the prompts (a chunked one, 17 tokens over two steps, and two short ones):
        # the same kinds of step as the five's, in half of them
        lengths = (3, 17, 1) if triton else (3, 17, 9, 30, 1)
        prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
        new = 3 if triton else 10
        one_row = prompts[:1] if triton else prompts[1:2]
        cases = [(SamplingParams(temperature=0, max_tokens=new), prompts),
                 (SamplingParams(n=2, temperature=0.9, top_p=0.9, max_tokens=new, seed=5), prompts),
                 (SamplingParams(temperature=0.9, max_tokens=new, seed=8), one_row)]  # decode steps of one row
        for sp, batch in cases[::2] if triton else cases:  # (the interpreter: about a second a step)
            a, b = tp1.generate(batch, sp), tp2.generate(batch, sp)
            assert [o.token_ids for o in a] == [o.token_ids for o in b], (kv, sp)
            diff = max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))
            assert diff < (1e-4 if triton else 1e-5), (kv, sp, diff)
            outputs.append([o.token_ids for o in b])
    gathered = [None, None]
    dist.all_gather_object(gathered, outputs)
    assert gathered[0] == gathered[1]
