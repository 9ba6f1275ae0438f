"""The engine on a CUDA GPU: Triton kernels against the PyTorch reference ops, CUDA graphs
against eager execution, and the engine against the training model. Skipped without CUDA."""

import gc
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models import Transformer  # noqa: E402
from rollout import Continuation, SamplingParams  # noqa: E402
from rollout.attention import PREFILL_TILE, AttentionMetadata, decode_attention_ref  # noqa: E402
from rollout.ops import TorchOps  # noqa: E402
from rollout.sampler import combine_partials  # noqa: E402
from tests.unit.test_engine import (check_against_training_forward, greedy_reference, make_engine,  # noqa: E402
                                    prompts_of, tiny_args, tiny_model)
from tests.unit.test_sampler import (CASES, DRAW_KEY, FIT_IDS, FITS, LOGITS, P_REJECT, check_extremes,  # noqa: E402
                                     check_group_extremes, chi_square_pvalue, constant_logit_engine, draw_tokens, expected_probs,
                                     key_rows, load_decode_inputs)

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative L2 error


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _triton():
    from rollout.triton_kernels import TritonOps

    return TritonOps


def _paged(dtype, hkv, d, lengths, page=16, spare=8):
    nblocks = sum(-(-n // page) for n in lengths) + spare
    k = torch.randn(nblocks, page, hkv, d, device=DEV).to(dtype)
    v = torch.randn(nblocks, page, hkv, d, device=DEV).to(dtype)
    perm = torch.randperm(nblocks).tolist()
    width = max(-(-n // page) for n in lengths) + 2
    bt = torch.zeros(len(lengths) + 3, width, dtype=torch.int32)
    slots = torch.randperm(len(lengths) + 3)[:len(lengths)].to(torch.int32)
    for i, n in enumerate(lengths):
        for c in range(-(-n // page)):
            bt[slots[i], c] = perm.pop()
    return k, v, bt.to(DEV), slots.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_kernels(dtype):
    from models import ModelArgs
    from models.transformer import rope_cos_sin, rope_inv_freq

    T = _triton()
    torch.manual_seed(0)
    x, res = torch.randn(37, 896, device=DEV).to(dtype), torch.randn(37, 896, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(896, device=DEV)).to(dtype)
    ref_out, ref_res = TorchOps.rms_norm(x, w, 1e-6, res.clone())
    out, new_res = T.rms_norm(x, w, 1e-6, res)
    assert torch.equal(new_res, ref_res)
    assert _rel(out, ref_out) < TOL[dtype] / 10
    gu = torch.randn(37, 2 * 4864, device=DEV).to(dtype)
    assert _rel(T.silu_and_mul(gu), TorchOps.silu_and_mul(gu)) < TOL[dtype] / 10

    hq, hkv, d = 14, 2, 64
    args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, rope_theta=1e6)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device=DEV), torch.arange(512, device=DEV), dtype)
    cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
    lengths = [300, 40, 129]
    k_ref, v_ref, bt, slots = _paged(dtype, hkv, d, lengths)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    pos = torch.cat([torch.randperm(n, device=DEV)[:20] for n in lengths]).int()
    tslots = slots.repeat_interleave(20)
    qkv = torch.randn(60, (hq + 2 * hkv) * d, device=DEV).to(dtype)
    q_ref = TorchOps.rope_and_cache(qkv.clone(), pos, tslots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
    q_tri = T.rope_and_cache(qkv.clone(), pos, tslots, cos, sin, k_tri, v_tri, bt, hq, hkv, d)
    # Same roundings as torch (no FMA contraction): at most a rare double-rounding difference.
    assert _rel(q_tri, q_ref) < 1e-5 and _rel(k_tri, k_ref) < 1e-5
    assert torch.equal(v_tri, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_pointwise_kernels(dtype):
    """Gemma 3's variants at gemma-3-1b's sizes (hidden 1152, 4 query heads and 1 KV head of 256, intermediate 6912):
    the norms by 1 + weight (with and without the residual, the post-norm add, the per-head q / k norm) and GeGLU
    (the activation kernel and the one-row gated GEMV)."""
    T = _triton()
    torch.manual_seed(3)
    x, res = torch.randn(37, 1152, device=DEV).to(dtype), torch.randn(37, 1152, device=DEV).to(dtype)
    w = (0.3 * torch.randn(1152, device=DEV)).to(dtype)
    for residual in (None, res):
        ref_out, ref_res = TorchOps.rms_norm(x, w, 1e-6, None if residual is None else residual.clone(),
                                             unit_offset=True)
        out, new_res = T.rms_norm(x, w, 1e-6, None if residual is None else residual.clone(), unit_offset=True)
        assert torch.equal(new_res, ref_res) and _rel(out, ref_out) < TOL[dtype] / 10
    ref = TorchOps.post_norm_add(x, w, 1e-6, res.clone(), unit_offset=True)
    assert _rel(T.post_norm_add(x, w, 1e-6, res.clone(), unit_offset=True), ref) < TOL[dtype] / 10
    qkv = torch.randn(37, 6 * 256, device=DEV).to(dtype)
    qn, kn = (0.3 * torch.randn(256, device=DEV)).to(dtype), (0.3 * torch.randn(256, device=DEV)).to(dtype)
    ref = TorchOps.qk_norm(qkv.clone(), qn, kn, 4, 1, 256, 1e-6, unit_offset=True)
    assert _rel(T.qk_norm(qkv.clone(), qn, kn, 4, 1, 256, 1e-6, unit_offset=True), ref) < TOL[dtype] / 10
    gu = torch.randn(37, 2 * 6912, device=DEV).to(dtype)
    assert _rel(T.silu_and_mul(gu, "gelu_tanh"), TorchOps.silu_and_mul(gu, "gelu_tanh")) < TOL[dtype] / 10
    x1, wg = torch.randn(1, 1152, device=DEV).to(dtype), (torch.randn(2 * 6912, 1152, device=DEV) / 34).to(dtype)
    ref = TorchOps.gated_linear(x1.float(), wg.float(), act="gelu_tanh")
    assert _rel(T.gated_linear(x1, wg, act="gelu_tanh"), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (12, 2, 128), (28, 4, 128), (12, 4, 80), (8, 2, 96), (4, 2, 8),
                                     (4, 1, 256)])
def test_decode_attention_kernel(dtype, hq, hkv, d):
    """RoPE and the K/V write of each sequence's new token, then attention, in one kernel: against
    `rope_and_cache` in the same dtype and the reference attention in float32. Head dims 80, 96 and 8
    run padded (`head_lanes`); 256 is Gemma 3's (gemma-3-1b: 4 query heads, 1 KV head)."""
    from models import ModelArgs
    from models.transformer import rope_cos_sin, rope_inv_freq

    T = _triton()
    torch.manual_seed(1)
    lengths = [1, 15, 16, 17, 129, 384, 2000, 57]
    k, v, bt, slots = _paged(dtype, hkv, d, lengths)
    args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, rope_theta=1e6)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device=DEV), torch.arange(2048, device=DEV), dtype)
    cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
    qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d, device=DEV).to(dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    for splits in (1, 4, 16):  # fused (one split a sequence) and after `rope_and_cache`
        meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=ctx, max_context_len=max(lengths),
                                 num_splits=splits)
        k_ref, v_ref, k_tri, v_tri = k.clone(), v.clone(), k.clone(), v.clone()
        q = TorchOps.rope_and_cache(qkv, ctx - 1, slots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
        ref = decode_attention_ref(q.float(), k_ref.float(), v_ref.float(), bt, meta, d ** -0.5)
        out = T.decode_attention(qkv.clone(), ctx - 1, cos, sin, k_tri, v_tri, bt, meta, d ** -0.5, hq, hkv, d)
        assert out.dtype == dtype and _rel(out, ref) < TOL[dtype], splits
        # Same roundings as torch (no FMA contraction): at most a rare double-rounding difference.
        assert _rel(k_tri, k_ref) < 1e-5 and torch.equal(v_tri, v_ref), splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (12, 2, 128), (12, 4, 80), (8, 2, 96), (4, 2, 8), (4, 1, 256)])
def test_prefill_attention_kernel(dtype, hq, hkv, d):
    T = _triton()
    torch.manual_seed(2)
    starts, q_lens = [0, 0, 100, 31, 500], [128, 1, 37, 2 * PREFILL_TILE + 3, 1]  # fresh, tiny, chunk, long, decode
    ctx = [s + n for s, n in zip(starts, q_lens)]
    k, v, bt, slots = _paged(dtype, hkv, d, ctx)
    meta = AttentionMetadata.prefill(slots, q_lens, ctx)
    q = torch.randn(sum(q_lens), hq, d, device=DEV).to(dtype)
    ref = TorchOps.prefill_attention(q.float(), k.float(), v.float(), bt, meta, d ** -0.5)
    assert _rel(T.prefill_attention(q, k, v, bt, meta, d ** -0.5), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(4608, 3584, True), (3584, 18944, False), (9728, 896, True), (37, 1000, False)])
def test_gemv_kernel(dtype, n, k, bias):
    """One row through the GEMV (qwen2.5-7b's qkv and down, 0.5b's gate_up, a ragged shape):
    within the error cuBLAS itself makes against float64 (bf16: one rounding of the output;
    float32: IEEE products, no TF32), and more rows go to cuBLAS unchanged."""
    T = _triton()
    torch.manual_seed(5)
    x = torch.randn(1, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    ours = (T.linear(x, w, b).double() - ref).abs().max().item()
    cublas = (torch.nn.functional.linear(x, w, b).double() - ref).abs().max().item()
    assert ours <= 1.5 * cublas + (1e-5 if dtype == torch.float32 else 1e-3), (ours, cublas)
    x4 = torch.randn(4, k, device=DEV).to(dtype)
    assert torch.equal(T.linear(x4, w, b), torch.nn.functional.linear(x4, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(18944, 3584, False), (4864, 896, True), (21, 1000, False)])
def test_gated_gemv_kernel(dtype, n, k, bias):
    """One row through the fused gate/up GEMV + SiLU (qwen2.5-7b's and 0.5b's MLP, a ragged shape):
    within the error of cuBLAS + the SiLU kernel against float64; more rows take that path."""
    T = _triton()
    torch.manual_seed(6)
    x = torch.randn(1, k, device=DEV).to(dtype)
    w = (torch.randn(2 * n, k, device=DEV) / k ** 0.5).to(dtype)
    b = torch.randn(2 * n, device=DEV).to(dtype) if bias else None
    gu = x.double() @ w.double().t() + (b.double() if bias else 0)
    ref = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    ours = (T.gated_linear(x, w, b).double() - ref).abs().max().item()
    unfused = (T.silu_and_mul(torch.nn.functional.linear(x, w, b)).double() - ref).abs().max().item()
    assert ours <= 1.5 * unfused + (1e-5 if dtype == torch.float32 else 1e-3), (ours, unfused)
    x4 = torch.randn(4, k, device=DEV).to(dtype)
    assert torch.equal(T.gated_linear(x4, w, b), T.silu_and_mul(torch.nn.functional.linear(x4, w, b)))


def test_combine_kernel_and_programmatic_launch():
    """The partials' merge in one kernel equals `combine_partials` (ties to the first chunk, empty
    chunks); on Hopper and later the engine's kernels are launched with PDL."""
    from rollout import triton_kernels as tk

    torch.manual_seed(7)
    r, p = 300, 37
    parts = torch.randn(r, p, 5, device=DEV) * 4
    parts[..., 4] = torch.rand(r, p, device=DEV) * 1000 + 1
    parts.view(torch.int32)[..., 1] = torch.randint(0, 151936, (r, p), dtype=torch.int32, device=DEV)
    parts[0, 3, 0] = parts[0, 30, 0] = 99.0
    parts[1, 5:, 0] = parts[1, 5:, 3] = float("-inf")
    parts[1, 5:, 4] = 0.0
    ref_t, ref_lp = combine_partials(parts)
    t, lp = _triton().combine_partials(parts)
    assert torch.equal(t, ref_t) and t[0] == parts.view(torch.int32)[0, 3, 1]
    assert (lp - ref_lp).abs().max() < 1e-4
    launch = tk._launch(parts)
    wanted = os.environ.get(tk.PDL_ENV, "auto") == "auto"
    assert launch["launch_pdl"] == (wanted and torch.cuda.get_device_capability()[0] >= 9)
    if launch["launch_pdl"]:  # the compiled kernel carries the launch attribute and waits for its predecessor
        compiled = tk._combine_kernel[(r,)](parts, p, t, lp, P_P=64, num_warps=1, **launch)
        assert compiled.metadata.launch_pdl and "griddepcontrol.wait" in compiled.asm["ptx"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_kernel(dtype):
    T = _triton()
    torch.manual_seed(3)
    r, v = 33, 151936 // 2
    logits = (torch.randn(r, v, device=DEV) * 3).to(dtype)
    keys = torch.randint(-2**31, 2**31 - 1, (r,), dtype=torch.int32, device=DEV)
    pos = torch.randint(0, 4000, (r,), dtype=torch.int32, device=DEV)
    for temperature, thresh in ((0.0, None), (1.0, None), (0.7, "top")):
        inv_t = torch.tensor(1.0 if temperature == 0 else 1 / temperature, device=DEV)
        noise = torch.tensor(0.0 if temperature == 0 else 1.0, device=DEV)
        th = None if thresh is None else torch.topk(logits.float() * inv_t, 50, dim=-1).values[:, -1]
        for group in (1, 16):
            ref_t, ref_lp = combine_partials(TorchOps.sample_partials(logits, keys, pos, inv_t, noise, th, v, 1, group))
            for splits in (1, 7, 37):
                t, lp = combine_partials(T.sample_partials(logits, keys, pos, inv_t, noise, th, v, splits, group))
                # Same noise integers; log/exp may differ in the last bit, so a near-tie could flip.
                assert (t == ref_t).float().mean() >= 0.96, (temperature, group, splits)
                same = t == ref_t
                assert (lp[same] - ref_lp[same]).abs().max() < 1e-4
                if temperature == 0:
                    assert torch.equal(t, ref_t) and torch.equal(t - v, logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_kernel_with_a_soft_cap(dtype):
    """Gemma 2's final cap inside the race (SOFTCAP) on the GPU, where the kernel's quotient and tanh (from an
    approximate exp) may each round to the other side of a bf16 boundary from CUDA PyTorch's `soft_cap` (the
    interpreter's numpy cannot show that: tests/unit/test_gemma2_triton.py), so a capped value may be two ulps of the
    dtype off (bf16: 0.125 below 32; float32: the tanh's few ulps): at Gemma 2's cap of 30 over half of its
    vocabulary, the winner's s is PyTorch's capped value within that, the tokens are those of `soft_cap` then the
    uncapped race but at near-ties, the log-probs within twice that (the token's and the normaliser's), and greedy is
    the argmax of the capped logits wherever its margin exceeds twice that."""
    from models.attention import soft_cap

    T = _triton()
    torch.manual_seed(4)
    r, v, cap = 33, 256000 // 2, 30.0
    logits = (torch.randn(r, v, device=DEV) * 10).to(dtype)
    capped = soft_cap(logits, cap)
    keys = torch.randint(-2**31, 2**31 - 1, (r,), dtype=torch.int32, device=DEV)
    pos = torch.randint(0, 4000, (r,), dtype=torch.int32, device=DEV)
    err = 2 * 0.125 if dtype == torch.bfloat16 else 1e-5  # the most a capped value may be off
    for temperature in (0.0, 1.0):
        inv_t = torch.tensor(1.0 if temperature == 0 else 1 / temperature, device=DEV)
        noise = torch.tensor(0.0 if temperature == 0 else 1.0, device=DEV)
        ref_t, ref_lp = combine_partials(TorchOps.sample_partials(capped, keys, pos, inv_t, noise, None, 0, 1, 16))
        for splits in (1, 37):
            parts = T.sample_partials(logits, keys, pos, inv_t, noise, None, 0, splits, 16, cap)
            t, lp = combine_partials(parts)
            same = t == ref_t
            assert same.float().mean() >= 0.9, (temperature, splits)
            assert (lp[same] - ref_lp[same]).abs().max() <= 2 * err + 1e-4
            s_win = parts[..., 2].gather(1, parts[..., 0].argmax(1, keepdim=True))[:, 0]
            assert (s_win - capped.float().gather(1, t[:, None])[:, 0]).abs().max() <= err
            if temperature == 0:
                top2 = capped.float().topk(2, dim=-1).values
                clear = top2[:, 0] - top2[:, 1] > 2 * err
                assert clear.any() and torch.equal(t[clear], ref_t[clear])


@pytest.mark.parametrize("logits,case", FITS, ids=FIT_IDS)
def test_sampler_kernel_fits_softmax(logits, case):
    """The kernel's draws fit softmax(logits / T) (truncated): 16x the CPU test's draws
    (tests/unit/test_sampler.py explains the bound), with and without vocabulary splits, raced
    in groups of 1 (12 tokens) and of 16 (32 tokens)."""
    T = _triton()
    probs = expected_probs(*case, logits=logits)
    for splits in (1, 3):
        tokens, logprobs = draw_tokens(*case, n=1 << 22, ops=T, device=DEV, num_splits=splits, logits=logits)
        assert chi_square_pvalue(tokens, probs) > P_REJECT, splits
        ref = torch.log_softmax(logits.to(DEV) / case[0], -1)[tokens]
        assert (logprobs - ref).abs().max() < 1e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_sampler_kernel_at_the_hash_extremes(splits):
    """Finite noise at u = 1 - 2**-24 needs an accurate log near 1 (an approximate one may return 0)."""
    check_extremes(_triton(), device=DEV, num_splits=splits)
    check_group_extremes(_triton(), device=DEV, num_splits=splits)


def test_sampler_kernel_large_vocab_draws_no_uniform_tokens():
    """Issue 14 at its scale: over a 152k vocabulary the old uniform was exactly 1 for some token
    about once per 110 rows, and that token (uniformly random) won: about 2400 of these rows. Here
    the other tokens sit 30 below the largest of LOGITS, beyond the 19.45 that finite noise (within
    [-2.81, 16.64]) can bridge, so they are never drawn."""
    from rollout.parallel import TPGroup
    from rollout.sampler import Sampler

    v, n = 151936, 1 << 18
    logits = torch.full((v,), -30.0, device=DEV)
    logits[:len(LOGITS)] = LOGITS.to(DEV)
    sampler = Sampler(TPGroup(None), v, DEV)
    sampler.set_params(1.0, -1, 1.0)
    positions = torch.arange(n, dtype=torch.int32, device=DEV)
    tokens, _ = sampler(logits.expand(n, -1), key_rows(DRAW_KEY, n, DEV), positions, _triton(), None, 8)
    assert int((tokens >= len(LOGITS)).sum()) == 0
    assert chi_square_pvalue(tokens, expected_probs(1.0, -1, 1.0)) > P_REJECT


def _gpu_model(kind="qwen2", dtype=torch.float32, **kw):
    args = tiny_args(kind, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                     max_position_embeddings=512, **kw)
    return tiny_model(args).to(DEV, dtype)


def _check_graphed_greedy_against_loop(model):
    """The engine (Triton kernels, CUDA graphs, chunked prefill, preemption in a pool of 14 blocks of 16) generates
    40 greedy tokens after 8 prompts of 1 to 70 tokens: the tokens of a no-cache loop over `model`, the log-probs its
    forward's (within 1e-4)."""
    prompts = prompts_of([1, 7, 33, 70, 4, 22, 16, 50], seed=3)
    engine = make_engine(model, device=DEV, block_size=16, num_kv_blocks=14, max_num_batched_tokens=48)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    assert engine.runner.use_triton and engine.runner.graphs, "expected the Triton + CUDA-graph decode path"
    assert engine.last_stats["preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_reference(model, p, 40)
        check_against_training_forward(model, o, SamplingParams(temperature=0), atol=1e-4)


@pytest.mark.parametrize("kind,kw", [("qwen2", {}), ("qwen3", {"head_dim": 128}), ("llama", {"head_dim": 80}),
                                     ("qwen3", {"head_dim": 24}), ("gemma3_text", {"head_dim": 256}),
                                     ("gemma2", {"head_dim": 256})])
def test_engine_greedy_with_graphs_matches_no_cache_loop(kind, kw):
    model = _gpu_model(kind, eos_token_id=None, **kw)
    _check_graphed_greedy_against_loop(model)


@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.9, max_tokens=24, seed=2),
                                    SamplingParams(n=2, temperature=1.2, top_k=9, top_p=0.9, max_tokens=16, seed=4)])
def test_engine_graphs_equal_eager_equal_torch_backend(params):
    model = _gpu_model("llama")
    prompts = prompts_of([5, 40, 3, 17, 90], seed=4)
    cfg = dict(device=DEV, block_size=16, num_kv_blocks=64)
    graph = make_engine(model, **cfg)
    eager = make_engine(model, enforce_eager=True, **cfg)
    torch_path = make_engine(model, enforce_eager=True, **cfg)
    torch_path.runner.use_triton = False
    a, b, c = graph.generate(prompts, params), eager.generate(prompts, params), torch_path.generate(prompts, params)
    assert graph.runner.graphs and not eager.runner.graphs  # top-k / top-p run inside the graph too
    assert all(key[1] == graph.runner.sampler.truncation for key in graph.runner.graphs)
    for x, y, z in zip(a, b, c):
        assert x.token_ids == y.token_ids == z.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, z.logprobs)) < 1e-4
        check_against_training_forward(model, x, params, atol=1e-4)


def test_engine_one_sequence_graphs_equal_torch_backend():
    """One sequence: every projection of a layer is a GEMV (the MLP's input half fused with SiLU)
    and the step runs as a CUDA graph of PDL launches; same tokens as the PyTorch path."""
    model = _gpu_model("qwen2")
    prompt = prompts_of([23], seed=5)
    params = SamplingParams(temperature=0.8, max_tokens=48, seed=3)
    graph = make_engine(model, device=DEV, block_size=16, num_kv_blocks=16)
    torch_path = make_engine(model, enforce_eager=True, device=DEV, block_size=16, num_kv_blocks=16)
    torch_path.runner.use_triton = False
    a, c = graph.generate(prompt, params)[0], torch_path.generate(prompt, params)[0]
    assert [key[0] for key in graph.runner.graphs] == [1]
    assert a.token_ids == c.token_ids
    assert max(abs(p - q) for p, q in zip(a.logprobs, c.logprobs)) < 1e-4
    check_against_training_forward(model, a, params, atol=1e-4)


def test_prefill_graphs_equal_eager():
    """Prefill steps replayed from CUDA graphs, padded to their token and row buckets (prompts that
    refill freed slots, chunked, forked): the eager engine's tokens, log-probs within 1e-4 (float32),
    and the same again in a second call."""
    model = _gpu_model("qwen2")
    prompts = prompts_of([5, 40, 3, 17, 90, 12, 8, 33, 61, 2, 25, 14, 7, 70], seed=7)
    params = SamplingParams(n=2, temperature=1.0, top_k=30, max_tokens=12, seed=5)
    cfg = dict(device=DEV, block_size=16, num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=64)
    graph, eager = make_engine(model, **cfg), make_engine(model, enforce_eager=True, **cfg)
    a, b = graph.generate(prompts, params), eager.generate(prompts, params)
    assert graph.runner.prefill_graph_tokens == 64 and eager.runner.prefill_graph_tokens == 0
    kinds = {key[0] for key in graph.runner.prefill_graphs}
    assert kinds == {"prefill", "sample"}, graph.runner.prefill_graphs.keys()
    assert graph.last_stats["prefill_steps"] >= 6 and graph.last_stats["prefill_steps_decoding"] > 0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    again = graph.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in a] and graph.runner.prefill_graphs


def test_kept_kv_continuations_equal_recomputed_ones_with_graphs():
    """generate(keep_kv=True) on the GPU (Triton kernels, decode and prefill CUDA graphs, block size
    16): turn 2 prefills only the appended tokens, from positions inside a kept block, and samples
    what a recompute of the whole context samples (float32: same tokens, log-probs within 1e-4),
    the race over the training forward's logits."""
    model = _gpu_model("qwen2")
    prompts = prompts_of([5, 40, 17, 33], seed=9)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=6)
    engine = make_engine(model, device=DEV, block_size=16, num_kv_blocks=64, max_num_batched_tokens=64)
    keys = [(i, k) for i in range(4) for k in range(2)]
    turn = SamplingParams(temperature=1.0, max_tokens=11, seed=6)
    runs = {}
    for keep in (True, False):
        first = engine.generate(prompts, params, keep_kv=keep)
        contexts = [prompts[i] + o.token_ids + [3, 1, 4, 1, 5][:1 + i] for (i, _), o in zip(keys, first)]
        second = engine.generate(contexts, turn, sample_keys=keys)
        runs[keep] = (first, second, engine.last_stats["reused_kv_tokens"])
    assert engine.runner.graphs and engine.runner.prefill_graphs
    (kept_first, kept, reused), (plain_first, plain, none) = runs[True], runs[False]
    assert none == 0 and reused == sum(len(prompts[i]) + 9 - 1 for i, _ in keys)
    for x, y in zip(kept_first + kept, plain_first + plain):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    for o in kept:
        check_against_training_forward(model, o, turn, atol=1e-4)


def test_turns_joining_a_running_call_equal_separate_calls_with_graphs():
    """generate(on_finish=...) on the GPU (Triton kernels, decode and prefill CUDA graphs): each
    sample's next turn joins the running call as soon as its turn ended, from its kept K/V, with
    turns of different lengths, and samples what one call per turn samples (float32: same tokens,
    log-probs within 1e-4)."""
    model = _gpu_model("qwen2")
    prompts = prompts_of([5, 40, 17, 33], seed=9)
    engine = make_engine(model, device=DEV, block_size=16, num_kv_blocks=64, max_num_batched_tokens=64)
    turn = SamplingParams(temperature=1.0, max_tokens=99, seed=6, ignore_eos=True)
    limit = lambda key, t: 2 + (5 * key[0] + 3 * key[1] + 2 * t) % 9  # noqa: E731
    answer = lambda key, t: [3, 1, 4, 1, 5][:1 + (key[0] + t) % 5]  # noqa: E731
    first = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=99, seed=6, ignore_eos=True),
                            max_tokens=[limit((i, 0), 0) for i in range(4)])
    separate = {(o.prompt_index, o.sample_index): [o] for o in first}
    for t in (1, 2):
        keys = list(separate)
        outs = engine.generate([separate[k][-1].prompt_token_ids + separate[k][-1].token_ids + answer(k, t)
                                for k in keys], turn, sample_keys=keys, max_tokens=[limit(k, t) for k in keys])
        for k, o in zip(keys, outs):
            separate[k].append(o)
    joined = {}

    def on_finish(outs, idle):
        more = []
        for o in outs:
            k = (o.prompt_index, o.sample_index)
            joined.setdefault(k, []).append(o)
            t = len(joined[k])
            if t < 3:
                more.append(Continuation(o.prompt_token_ids + o.token_ids + answer(k, t), k, limit(k, t)))
        return more

    engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=99, seed=6, ignore_eos=True),
                    max_tokens=[limit((i, 0), 0) for i in range(4)], keep_kv=True, on_finish=on_finish)
    assert engine.runner.graphs and engine.runner.prefill_graphs
    assert engine.last_stats["reused_kv_tokens"] > 0
    assert joined.keys() == separate.keys()
    for k in separate:
        for x, y in zip(joined[k], separate[k], strict=True):
            assert x.token_ids == y.token_ids and x.prompt_token_ids == y.prompt_token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def _logprob_errors(outs, models):
    """Mean |log-prob - float32 reference| over the generated tokens: of the engine, then of each other model.

    `models[0]` is the float32 reference.
    """
    ref32, others = models[0], models[1:]
    errs = [[] for _ in range(1 + len(others))]
    for o in outs:
        seq = torch.tensor([o.prompt_token_ids + o.token_ids], device=DEV)
        p = len(o.prompt_token_ids)
        tok = torch.tensor(o.token_ids, device=DEV)[:, None]
        with torch.no_grad():
            lps = [torch.log_softmax(m(seq)[0, p - 1:-1].float(), -1).gather(1, tok).squeeze(1).cpu()
                   for m in (ref32, *others)]
        errs[0].append((torch.tensor(o.logprobs) - lps[0]).abs())
        for i in range(len(others)):
            errs[i + 1].append((lps[i + 1] - lps[0]).abs())
    return [torch.cat(e).mean().item() for e in errs]


@pytest.mark.parametrize("kind,kw", [("qwen2", {}), ("qwen3", {"head_dim": 128}), ("llama", {"head_dim": 80}),
                                     ("gemma3_text", {"head_dim": 256}), ("gemma2", {"head_dim": 256}),
                                     ("qwen3_moe", {"head_dim": 128, "num_experts": 8, "moe_intermediate_size": 128})])
def test_engine_bf16_tracks_training_forward(kind, kw):
    """bf16 engine log-probs (Triton kernels, CUDA graphs; a padded head_dim of 80 too; a Qwen3-MoE's experts through
    models.moe's grouped GEMM, as the trainer runs them) are as close to the float32 truth as the bf16 training
    forward's."""
    model32 = _gpu_model(kind, **kw)
    model16 = _gpu_model(kind, dtype=torch.bfloat16, **kw)
    prompts = prompts_of([12, 30, 64, 7], seed=5)
    engine = make_engine(model32, device=DEV, dtype=torch.bfloat16, block_size=16, num_kv_blocks=64)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=32, seed=1))
    assert engine.runner.use_triton and engine.runner.graphs and engine.runner.prefill_graph_tokens
    engine_err, train_err = _logprob_errors(outs, [model32, model16])
    assert engine_err <= 1.5 * train_err + 1e-3, (engine_err, train_err)


def test_cache_and_weights_cycle_keeps_outputs():
    model = _gpu_model("llama")
    prompts = prompts_of([9, 31], seed=6)
    sp = SamplingParams(temperature=0.8, max_tokens=12, seed=9)
    engine = make_engine(model, device=DEV, block_size=16, num_kv_blocks=32)
    ref = [o.token_ids for o in engine.generate(prompts, sp)]
    assert engine.runner.kv_cache is None  # free_cache_engine
    assert [o.token_ids for o in engine.generate(prompts, sp)] == ref
    engine.free_weights()
    engine.init_weights_storage()
    engine.load_weights(model.named_parameters())
    assert [o.token_ids for o in engine.generate(prompts, sp)] == ref


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 0 or c[2] < 1])
def test_truncated_sampling_inside_a_cuda_graph_fits_softmax(case):
    """A captured decode step with top-k / top-p (threshold, Triton race, combine, write-back):
    replays equal the eager step token for token, and 2**22 draws (4 replays over fresh keys) fit
    the truncated softmax (tests/unit/test_sampler.py explains the bound)."""
    rows = 1 << 20
    engine = constant_logit_engine(rows, device=DEV)
    runner = engine.runner
    assert runner.use_triton
    runner.begin_generate(*case)
    key = (rows, runner.sampler.truncation)
    runner._capture(key)
    tokens, logprobs = [], []
    for rep in range(4):
        load_decode_inputs(runner, rows, offset=rep * rows)
        runner.graphs[key].replay()
        tokens.append(runner.dec_tokens[:rows].clone())
        logprobs.append(runner.dec_logprobs[:rows].clone())
    runner._decode_body(rows, 1)  # eager, on the last inputs
    assert torch.equal(runner.dec_tokens[:rows], tokens[-1])
    tokens, logprobs = torch.cat(tokens), torch.cat(logprobs)
    assert chi_square_pvalue(tokens, expected_probs(*case)) > P_REJECT
    assert (logprobs - torch.log_softmax(LOGITS.to(DEV) / case[0], -1)[tokens]).abs().max() < 1e-5


def _memory():
    gc.collect()  # an earlier test's cyclic garbage, freed here rather than between two readings
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_free_weights_keeps_the_graphs_and_replays_them_while_the_address_holds():
    """Issue 14 part 3: `free_weights()` gives the weights' bytes back to the allocator and keeps the
    captured graphs; `free_graphs()` returns the graphs' pool. Refilled through `param_slots()` (as
    the resharder does), the next generation replays the kept graphs when the weights are back at
    their address and recaptures them when they are not. The tokens stay the same throughout,
    greedy and sampled with top-k / top-p."""
    args = tiny_args("llama", hidden_size=512, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                     num_hidden_layers=4, max_position_embeddings=512)
    model = tiny_model(args).to(DEV)
    prompts = prompts_of([9, 31, 5, 17, 40, 3], seed=6)
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.9, max_tokens=16, seed=3)]
    # The KV pool stays (free_cache_engine=False): only the weights can move under the graphs.
    engine = make_engine(model, device=DEV, block_size=16, num_kv_blocks=64, free_cache_engine=False)
    refs = []
    for sp in params:
        refs.append([o.token_ids for o in engine.generate(prompts, sp)])
        assert engine.last_stats["graphs_captured"] > 0 and engine.last_stats["graph_capture_s"] > 0
    storage = engine.model.storage
    wbytes = storage.numel() * storage.element_size()
    assert wbytes > 10 << 20

    def refill():  # as the resharder does: the slots (re-allocating the weights), then the writes
        slots = engine.param_slots()
        with torch.no_grad():
            for name, p in model.named_parameters():
                slots[name].view.copy_(p)

    def same_tokens():
        for sp, ref in zip(params, refs):
            assert [o.token_ids for o in engine.generate(prompts, sp)] == ref

    # (decode graphs by identity: padded-prefill graphs are captured once a bucket has been used
    # often enough, whatever happened to the weights)
    graphs = dict(engine.runner.graphs)
    assert graphs
    alloc0, res0 = _memory()
    engine.free_weights()
    alloc1, res1 = _memory()
    # (block rounding: 512 B.) Whether the segment also goes back to the device depends on what else
    # the allocator placed in it (on the H200 it held other tensors: reserved did not move); the
    # actor's update allocates through the same allocator, so the freed block is what it gains.
    assert 0 <= alloc0 - alloc1 - wbytes < 512, (alloc0, alloc1, wbytes)
    assert engine.runner.graphs == graphs  # kept, pool and all
    engine.free_graphs()
    alloc2, res2 = _memory()
    assert not engine.runner.graphs and res2 < res1, (res1, res2)  # the pool is gone too
    refill()
    assert torch.cuda.memory_allocated() >= alloc2 + wbytes
    same_tokens()
    assert set(engine.runner.graphs) == set(graphs)  # captured again

    # Freed and refilled from the allocator's cache: the same block, so the same graphs replay.
    graphs, ptr = dict(engine.runner.graphs), storage.data_ptr()
    engine.free_weights()
    refill()
    assert storage.data_ptr() == ptr
    same_tokens()
    assert all(engine.runner.graphs[k] is g for k, g in graphs.items())

    # Something else takes the block meanwhile: the weights come back elsewhere and the graphs,
    # captured over the old address, are replaced.
    engine.free_weights()
    blocker = torch.empty(wbytes, dtype=torch.uint8, device=DEV)
    refill()
    assert storage.data_ptr() != ptr and blocker.data_ptr() == ptr
    same_tokens()
    assert set(engine.runner.graphs) == set(graphs)
    assert not any(engine.runner.graphs[k] is g for k, g in graphs.items())


def test_warm_ups_share_one_stream_so_captures_do_not_pile_up_cublas_workspaces():
    """cuBLAS keeps a workspace (32 MiB on an H200) per stream it ran on until the workspaces are
    cleared; a fresh stream per warm-up left one per captured batch size (1.13 GB over the 35-size
    ladder of 256 slots, BENCHMARKS.md "Twenty-third pass"). After the first capture, capturing
    more sizes must not keep memory: the warm-ups' and captures' temporaries all come back."""
    engine = constant_logit_engine(8, device=DEV)
    runner = engine.runner
    runner.begin_generate(1.0, 0, 1.0)
    sizes = runner.capture_sizes
    assert len(sizes) >= 3, sizes
    runner._capture((sizes[0], runner.sampler.truncation))
    torch.cuda.synchronize()
    first = torch.cuda.memory_allocated()
    for rows in sizes[1:]:
        runner._capture((rows, runner.sampler.truncation))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - first < 1 << 20, (first, torch.cuda.memory_allocated(), sizes)


@pytest.mark.parametrize("shape", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_qwen_shape_smoke(shape):
    """The real qwen2.5-0.5b shape (GQA 7, vocab 151936) and qwen3-0.6b's (per-head q/k norms, head_dim 128
    against hidden / heads 64) in bf16: as accurate as the bf16 training forward."""
    from bench.common import model_args
    from rollout import EngineConfig, LLMEngine

    args = model_args(shape, max_position_embeddings=256)
    engine = LLMEngine(args, EngineConfig(max_num_seqs=16, gpu_memory_utilization=0.3), device=DEV)
    ref32 = Transformer.build(args, device=DEV, dtype=torch.float32, seed=0)
    with torch.no_grad():
        for n, p in ref32.named_parameters():
            if "norm" not in n:
                p.mul_(3)  # std 0.06: logits far from uniform
    engine.load_weights(ref32.named_parameters())
    ref16 = Transformer.build(args, device=DEV, dtype=torch.bfloat16)
    ref16.load_state_dict(ref32.state_dict())
    prompts = prompts_of([16] * 8, seed=7)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True))
    assert len(outs) == 16 and all(len(o.token_ids) == 8 for o in outs)
    engine_err, train_err = _logprob_errors(outs, [ref32, ref16])
    assert engine_err <= 1.5 * train_err + 1e-3, (engine_err, train_err)


def test_steps_are_queued_without_waiting_for_the_gpu():
    """A step's host inputs (new KV blocks, copy-on-write copies, an eager prefill's arrays) go
    over behind the work already queued: with the GPU busy, `execute` returns before it is done."""
    model = _gpu_model("qwen2", eos_token_id=None)
    # blocks of 4 tokens: decode steps start blocks; n=2 forks share a partial last block (copies);
    # prefill_graph_max_tokens=0: every prefill step is eager
    engine = make_engine(model, device=DEV, dtype=torch.bfloat16, block_size=4, num_kv_blocks=256,
                         prefill_graph_max_tokens=0)
    prompts = prompts_of([6, 13, 9, 21], seed=2)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    first = engine.generate(prompts, params)  # captures the decode graphs (a capture synchronises)
    runner, execute, seen = engine.runner, engine.runner.execute, []

    def busy_execute(batch):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU work queued ahead of the step
        queued = torch.cuda.Event()
        queued.record()
        out = execute(batch)
        seen.append((batch.is_prefill, bool(batch.block_table_updates), bool(batch.copies), queued.query()))
        return out

    runner.execute = busy_execute
    try:
        again = engine.generate(prompts, params)
    finally:
        del runner.execute
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert any(p for p, *_ in seen) and any(u for _, u, _, _ in seen) and any(c for *_, c, _ in seen), seen
    assert not any(done for *_, done in seen), seen


def test_captured_decode_steps_copy_nothing_between_them():
    """A captured decode step reads its inputs from and writes its results to pinned memory itself:
    decode steps that start no KV block queue no copy at all (the step before this design queued
    three: inputs up, tokens and log-probs down). Same tokens as the eager engine."""
    from torch.profiler import ProfilerActivity, profile

    model = _gpu_model("qwen2", eos_token_id=None)
    # 17-23 tokens: no new block of 16 before token 32; one sample a prompt: no copy-on-write
    prompts = prompts_of([17, 20, 18, 23, 19, 21, 17, 22], seed=5)
    cfg = dict(device=DEV, block_size=16, num_kv_blocks=64)
    graph, eager = make_engine(model, **cfg), make_engine(model, enforce_eager=True, **cfg)

    def copies(max_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=6)
        graph.generate(prompts, params)  # captures
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = graph.generate(prompts, params)
            torch.cuda.synchronize()
        n = sum(e.count for e in prof.key_averages() if e.key.startswith("Memcpy"))
        return n, outs, params

    before, _, _ = copies(1)  # the prefill step alone
    after, outs, params = copies(9)  # and 8 decode steps, all before token 32
    assert graph.runner.graphs and graph.last_stats["decode_steps"] == 8
    assert after == before, (before, after)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 16, 100, 4096])
def test_decode_attention_kernel_with_a_window(dtype, window):
    """The decode kernel with a sliding window (keys ctx - window .. ctx - 1; one split a sequence with RoPE fused,
    and 4 or 16 splits over the window's keys) against the reference path's window in float32; 4096 reaches past
    every context (the full attention)."""
    from models import ModelArgs
    from models.transformer import rope_cos_sin, rope_inv_freq

    T = _triton()
    torch.manual_seed(3)
    hq, hkv, d = 12, 2, 128
    lengths = [1, 15, 16, 17, 129, 384, 2000, 57]
    k, v, bt, slots = _paged(dtype, hkv, d, lengths)
    args = ModelArgs(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, rope_theta=1e6)
    cos, sin = rope_cos_sin(rope_inv_freq(args, device=DEV), torch.arange(2048, device=DEV), dtype)
    cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
    qkv = torch.randn(len(lengths), (hq + 2 * hkv) * d, device=DEV).to(dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    for splits in (1, 4, 16):
        meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=ctx, max_context_len=max(lengths),
                                 num_splits=splits)
        k_ref, v_ref, k_tri, v_tri = k.clone(), v.clone(), k.clone(), v.clone()
        q = TorchOps.rope_and_cache(qkv, ctx - 1, slots, cos, sin, k_ref, v_ref, bt, hq, hkv, d)
        ref = decode_attention_ref(q.float(), k_ref.float(), v_ref.float(), bt, meta, d ** -0.5, window=window)
        out = T.decode_attention(qkv.clone(), ctx - 1, cos, sin, k_tri, v_tri, bt, meta, d ** -0.5, hq, hkv, d,
                                 window=window)
        assert out.dtype == dtype and _rel(out, ref) < TOL[dtype], splits
        assert _rel(k_tri, k_ref) < 1e-5 and torch.equal(v_tri, v_ref), splits
        if window < 2000:
            full = decode_attention_ref(q.float(), k_ref.float(), v_ref.float(), bt, meta, d ** -0.5)
            assert _rel(full, ref) > 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 40, 300])
def test_prefill_attention_kernel_with_a_window(dtype, window):
    """The prefill kernel with a sliding window (tiles whose later rows see none of the first key blocks; a chunk
    after a cached prefix; one-query rows) against the reference path's window in float32."""
    T = _triton()
    torch.manual_seed(4)
    hq, hkv, d = 12, 2, 128
    starts, q_lens = [0, 0, 100, 31, 500], [128, 1, 37, 2 * PREFILL_TILE + 3, 1]
    ctx = [s + n for s, n in zip(starts, q_lens)]
    k, v, bt, slots = _paged(dtype, hkv, d, ctx)
    meta = AttentionMetadata.prefill(slots, q_lens, ctx)
    q = torch.randn(sum(q_lens), hq, d, device=DEV).to(dtype)
    ref = TorchOps.prefill_attention(q.float(), k.float(), v.float(), bt, meta, d ** -0.5, window=window)
    got = T.prefill_attention(q, k, v, bt, meta, d ** -0.5, window=window)
    assert not got.isnan().any() and _rel(got, ref) < TOL[dtype]
    full = TorchOps.prefill_attention(q.float(), k.float(), v.float(), bt, meta, d ** -0.5)
    # the window matters on the rows it cuts (a query at position `window` or later): compared over the whole
    # output, one such row of 295 moves the norm by less than bf16's tolerance (window 300)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)]).to(DEV)
    cut = positions >= window
    assert cut.any() and _rel(full[cut], ref[cut]) > 10 * TOL[dtype]


def test_engine_greedy_with_graphs_past_the_window():
    """A Qwen2 whose layer 0 attends through a window of 24 (layer 1 full), generating 40 tokens after prompts of
    up to 70 (Triton kernels, CUDA graphs, chunked prefill, preemption): greedy tokens are a no-cache loop's over the
    windowed training model, log-probs its forward's."""
    model = _gpu_model("qwen2", eos_token_id=None, extra_hf={"use_sliding_window": True, "sliding_window": 24,
                                                             "layer_types": ["sliding_attention", "full_attention"]})
    assert model.args.layer_windows == [24, None]
    _check_graphed_greedy_against_loop(model)
