"""Gemma 2's soft caps on a CUDA GPU: the capped packed attention on CUDA (the Triton kernels of
`models/attention_triton.py` by default, the explicit scores segment by segment under MESHPPO_CAPPED_ATTENTION=torch)
against the whole row's explicit capped scores (`models.attention.sdpa`) in float32 (values and gradients, tight)
and bf16 (within bf16 error), and against the CPU's; the Triton kernels in bf16 at Gemma-2-2b's attention shape
against float64 within the explicit bf16 path's own error, bitwise-equal reruns of their backward in deterministic
mode, a compiled tiny Gemma 2 against the eager one, and a capped layer's peak memory at 16k tokens far below the
explicit scores'; a tiny Gemma 2's logits and gradients against transformers' Gemma2ForCausalLM (its eager
attention, which caps) in float32 and bf16. Skipped without CUDA. (The engine's capped kernels with CUDA graphs:
test_engine_gpu.py's gemma2 cases; a Gemma 2 demo's GRPO run: test_trainer_gpu.py.)"""

import pytest
import torch

from models.attention import attention_packed, attention_padded, block_causal_mask, sdpa
from models.transformer import cu_seqlens_from_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
LENGTHS = [57, 1, 130, 64, 33, 200, 7]  # packed sequences of uneven lengths, one of a single token
CAP = 5.0  # scores of q, k ~ 3 N(0, 1) at head_dim 64 and scale 1/8 reach ~10: the cap acts


def _grads(fn, q, k, v, dout):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _explicit_packed(q, k, v, cu, window):
    """The reference semantics in float32: one masked, capped score matrix over the whole row."""
    mask = block_causal_mask(cu.long(), q.shape[0], window=window)
    qt, kt, vt = (t.float().transpose(0, 1)[None] for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    return sdpa(qt, kt, vt, attn_mask=mask[None, None], scale=0.125, softcap=CAP)[0].transpose(0, 1)


@pytest.mark.parametrize("path", ["auto", "torch"])
@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_capped_attention_packed_on_cuda_matches_the_whole_rows_scores(dtype, tol, window, path, monkeypatch):
    """attention_packed with a soft cap on CUDA (`auto`: the Triton kernels; `torch`: segment by segment) against the
    float32 whole-row scores: values and gradients (GQA 12 / 2, head_dim 64; with and without a window), relative to
    each tensor's largest value."""
    monkeypatch.setenv("MESHPPO_CAPPED_ATTENTION", path)
    g = torch.Generator(device=DEV).manual_seed(0)
    t = sum(LENGTHS)
    q = 3 * torch.randn(t, 12, 64, device=DEV, generator=g)
    k = 3 * torch.randn(t, 2, 64, device=DEV, generator=g)
    v = torch.randn(t, 2, 64, device=DEV, generator=g)
    dout = torch.randn(t, 12, 64, device=DEV, generator=g)
    cu = cu_seqlens_from_lengths(LENGTHS, device=DEV)
    got = _grads(lambda a, b, c: attention_packed(a, b, c, cu, max(LENGTHS), 0.125, window=window, softcap=CAP),
                 q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype))
    ref = _grads(lambda a, b, c: _explicit_packed(a, b, c, cu, window), q, k, v, dout)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
        err = ((x.float() - y).abs().max() / y.abs().max()).item()
        assert err <= tol, (name, err)
    uncapped = _grads(lambda a, b, c: attention_packed(a, b, c, cu, max(LENGTHS), 0.125, window=window), q, k, v,
                      dout)
    assert (uncapped[0] - ref[0]).abs().max() > 1e-2  # the cap acts


def test_capped_attention_padded_on_cuda_matches_the_cpus():
    """attention_padded with a soft cap on CUDA (the Triton kernels, the rows read as one packed row) against its
    explicit float32 scores computed on the CPU, at the real queries (left and right padding, a window of 9)."""
    g = torch.Generator().manual_seed(1)
    q = 3 * torch.randn(3, 70, 8, 64, generator=g)
    k = 3 * torch.randn(3, 70, 4, 64, generator=g)
    v = torch.randn(3, 70, 4, 64, generator=g)
    mask = torch.ones(3, 70, dtype=torch.long)
    mask[0, :20], mask[1, 50:] = 0, 0
    dout = torch.randn(3, 70, 8, 64, generator=g) * mask[..., None, None]
    got = _grads(lambda a, b, c: attention_padded(a, b, c, mask.to(DEV), 0.125, 9, CAP),
                 q.to(DEV), k.to(DEV), v.to(DEV), dout.to(DEV))
    ref = _grads(lambda a, b, c: attention_padded(a, b, c, mask, 0.125, 9, CAP), q, k, v, dout)
    real = mask.bool()
    assert ((got[0].cpu()[real] - ref[0][real]).abs().max() / ref[0][real].abs().max()).item() <= 1e-4
    for name, x, y in zip(("dq", "dk", "dv"), got[1:], ref[1:]):
        assert ((x.cpu() - y).abs().max() / y.abs().max()).item() <= 1e-4, name


def _gemma2(dtype):
    transformers = pytest.importorskip("transformers")
    from tests.unit.hf_family import randomized

    cfg = transformers.Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                    query_pre_attn_scalar=256, sliding_window=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0, pad_token_id=0)
    cfg._attn_implementation = "eager"  # transformers' attention that caps (its sdpa drops the cap)
    return randomized(transformers.Gemma2ForCausalLM(cfg), dtype).to(DEV)


def test_gemma2_logits_and_gradients_match_transformers_on_gpu(tmp_path):
    """A tiny Gemma 2 (head_dim 256, a window of 24, caps 2 and 3) in float32 on the GPU, packed (explicit scores):
    transformers' float32 logits and parameter gradients within float32 error; in bf16 (a bf16 model's packed
    forward), logits as close to the float32 ones as transformers' bf16 logits are (within 1.2 times their mean
    error: the packed segments' products may round otherwise than transformers' per-sequence ones)."""
    from models import Transformer

    hf = _gemma2(torch.float32)
    hf.save_pretrained(tmp_path / "g2")
    ours = Transformer.from_pretrained(tmp_path / "g2", dtype=torch.float32, device=DEV)
    lengths = [40, 75, 9]
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 512, (n,), generator=g).to(DEV) for n in lengths]
    weights = [torch.randn(n, 512, generator=g).to(DEV) for n in lengths]
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    ref_logits = [hf(input_ids=s[None]).logits[0] for s in seqs]
    sum((r * w).sum() for r, w in zip(ref_logits, weights)).backward()
    got = ours(torch.cat(seqs)[None], cu_seqlens=cu)[0]
    (got * torch.cat(weights)).sum().backward()
    ref = torch.cat(ref_logits).detach()
    assert ((got.detach() - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    theirs = {k.removeprefix("model."): p.grad for k, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        assert ((p.grad - theirs[name]).abs().max() / theirs[name].abs().max()).item() <= 1e-3, name

    hf16 = _gemma2(torch.bfloat16)  # the same weights (`randomized`'s seed), rounded to bf16
    ours16 = Transformer.from_pretrained(tmp_path / "g2", dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        theirs16 = torch.cat([hf16(input_ids=s[None]).logits[0] for s in seqs]).float()
        got16 = ours16(torch.cat(seqs)[None], cu_seqlens=cu)[0].float()
    bf16_error = (theirs16 - ref).abs().mean().item()
    assert bf16_error > 1e-3
    assert (got16 - ref).abs().mean().item() <= 1.2 * bf16_error


# Gemma-2-2b's attention: 8 query heads, 4 K/V heads of 256, scale 256^-0.5, cap 50; its sliding layers' window 4096
G2_HEADS, G2_KV_HEADS, G2_DIM, G2_CAP = 8, 4, 256, 50.0
G2_LENGTHS = [1500, 1, 977, 1200, 418]  # 4096 tokens; none a multiple of the kernels' blocks
# (query heads, K/V heads, head dim, scale) of Gemma-2-2b and of Gemma-2-27b (query_pre_attn_scalar 144), whose head
# dim of 128 takes other blocks (`attention_triton.blocks`)
G2_SHAPES = {"2b": (G2_HEADS, G2_KV_HEADS, G2_DIM, G2_DIM ** -0.5), "27b": (32, 16, 128, 144 ** -0.5)}


def _gemma2_inputs(lengths, dtype=torch.bfloat16, seed=3, shape="2b"):
    """q, k ~ 4 N(0, 1) (scores of std 16 at scale 1/16: the cap of 50 bends their tails; 15 at 27b's), v, dout ~
    N(0, 1), of `G2_SHAPES[shape]`."""
    heads, kv_heads, dim, _ = G2_SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lengths)
    q = 4 * torch.randn(t, heads, dim, device=DEV, generator=g)
    k = 4 * torch.randn(t, kv_heads, dim, device=DEV, generator=g)
    v = torch.randn(t, kv_heads, dim, device=DEV, generator=g)
    dout = torch.randn(t, heads, dim, device=DEV, generator=g)
    return [x.to(dtype) for x in (q, k, v, dout)]


@pytest.mark.parametrize("shape", ["2b", "27b"])
@pytest.mark.parametrize("window", [4096, 64])
def test_triton_capped_attention_in_bf16_at_gemma2_size(window, shape, monkeypatch):
    """The Triton kernels in bf16 at Gemma-2-2b's and Gemma-2-27b's attention shapes (4096 packed tokens in segments
    of 1 to 1500, windows of 4096 and 64) against float64 (the explicit path): output and gradients within twice the
    explicit bf16 path's own error against float64, relative to each tensor's largest value (plus 1e-3 where that
    error is tiny); the cap acts (the uncapped float64 output is far off)."""
    cu = cu_seqlens_from_lengths(G2_LENGTHS, device=DEV)
    q, k, v, dout = _gemma2_inputs(G2_LENGTHS, shape=shape)
    scale = G2_SHAPES[shape][3]

    def run(path, dtype, cap=G2_CAP):
        monkeypatch.setenv("MESHPPO_CAPPED_ATTENTION", path)
        return _grads(lambda a, b, c: attention_packed(a, b, c, cu, max(G2_LENGTHS), scale, window=window,
                                                       softcap=cap), *(x.to(dtype) for x in (q, k, v, dout)))

    exact = run("torch", torch.float64)
    explicit, triton = run("torch", torch.bfloat16), run("triton", torch.bfloat16)
    for name, x, y, e in zip(("out", "dq", "dk", "dv"), triton, explicit, exact):
        err, yard = (((t.double() - e).abs().max() / e.abs().max()).item() for t in (x, y))
        assert err <= max(2 * yard, 1e-3), (name, err, yard)
    uncapped = run("torch", torch.float64, cap=None)[0]
    assert ((uncapped - exact[0]).abs().max() / exact[0].abs().max()).item() > 1e-2


def test_triton_capped_attention_backward_is_deterministic():
    """Under torch's deterministic mode (fsdp_config.full_determinism) two backward passes of the Triton kernels give
    bitwise-equal dq, dk and dv (no atomics: each element is summed by one program in a fixed order)."""
    from models.attention_triton import capped_attention

    cu = cu_seqlens_from_lengths(G2_LENGTHS, device=DEV)
    q, k, v, dout = _gemma2_inputs(G2_LENGTHS)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_grads(lambda a, b, c: capped_attention(a, b, c, cu, cu, max(G2_LENGTHS), max(G2_LENGTHS),
                                                        G2_DIM ** -0.5, 4096, G2_CAP), q, k, v, dout)
                for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(before)
    for name, x, y in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(x, y), name


def test_compiled_gemma2_matches_eager_with_the_triton_kernels():
    """A tiny Gemma 2 (head_dim 256, a window of 24, caps 2 and 3) in bf16 with its blocks compiled
    (`sharding.compile.apply_compile`, Inductor; the kernels' custom ops trace without a graph break):
    logits and parameter gradients, packed, equal the eager model's within bf16 margins (both take the kernels)."""
    from models import ModelArgs, Transformer
    from sharding.compile import apply_compile

    args = ModelArgs.from_hf_config(dict(
        model_type="gemma2", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256, sliding_window=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rms_norm_eps=1e-6, max_position_embeddings=512))
    eager = Transformer.build(args, device=DEV, dtype=torch.bfloat16, seed=0)
    compiled = Transformer.build(args, device=DEV, dtype=torch.bfloat16, seed=0)
    apply_compile(compiled)
    torch._dynamo.utils.counters.clear()
    lengths = [40, 75, 9, 130]
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 512, (1, sum(lengths)), generator=g).to(DEV)
    weights = torch.randn(sum(lengths), 512, generator=g).to(DEV)
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    outs = []
    for m in (eager, compiled):
        logits = m(ids, cu_seqlens=cu)[0]
        (logits.float() * weights).sum().backward()
        outs.append((logits.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()}))
    (ref, ref_grads), (got, grads) = outs
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "the blocks were not compiled"
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 3e-2
    for name in ref_grads:
        err = ((grads[name] - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item()
        assert err <= 1e-1, (name, err)


def test_triton_capped_attention_memory_is_linear_in_the_tokens():
    """A capped layer's attention, forward and backward, at 16384 packed tokens (two sequences of 8192) at Gemma-2-2b's
    shape in bf16: its peak memory above the inputs is below a quarter of the scores and probabilities the explicit
    path keeps ([2, 8, 8192, 8192] float32 each: 8.6 GB), an O(T) against an O(T^2) property."""
    from models.attention_triton import capped_attention

    lengths = [8192, 8192]
    cu = cu_seqlens_from_lengths(lengths, device=DEV)
    q, k, v, dout = _gemma2_inputs(lengths)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    capped_attention(q, k, v, cu, cu, 8192, 8192, G2_DIM ** -0.5, None, G2_CAP).backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    explicit = 2 * 4 * len(lengths) * G2_HEADS * 8192 * 8192
    assert peak < explicit / 4, (peak, explicit)
    assert peak < 16 * q.numel() * q.element_size()  # a few [T, Hq, D] tensors: out, dq, dk, dv, lse, delta
