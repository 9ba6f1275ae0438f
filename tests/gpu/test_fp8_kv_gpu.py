"""The e4m3 KV cache on a CUDA GPU (compute capability 8.9+): the cache-write and attention kernels on hardware
against the PyTorch reference at qwen2.5-1.5b's head shape, the graphed engine against eager and against a
training forward over rounded K/V, and the qwen2.5-0.5b shape's accuracy."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with e4m3 conversions")

from rollout import SamplingParams  # noqa: E402
from rollout.attention import PREFILL_TILE, AttentionMetadata, decode_attention_ref  # noqa: E402
from rollout.ops import FP8, TorchOps, quantize_rows  # noqa: E402
from tests.gpu.test_engine_gpu import _gpu_model, _logprob_errors, _rel  # noqa: E402
from tests.gpu.test_fp8_gpu import _e4m3_steps, qwen_shape_model  # noqa: E402
from tests.unit.test_engine import make_engine, prompts_of  # noqa: E402
from tests.unit.test_fp8_rollout import _logprob_errors as _errors_against  # noqa: E402

DEV = "cuda"


def _pool(hkv, d, lengths, page=16, spare=4):
    """An e4m3 pool (values from random bf16 rows) holding `lengths` tokens a sequence in scattered pages."""
    nblocks = sum(-(-n // page) for n in lengths) + spare
    g = torch.Generator(device=DEV).manual_seed(5)
    (k, ks), (v, vs) = (quantize_rows(torch.randn(nblocks, page, hkv, d, device=DEV, generator=g).bfloat16() * 4)
                        for _ in range(2))
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(6)).tolist()
    width = max(-(-n // page) for n in lengths)
    bt = torch.zeros(len(lengths), width, dtype=torch.int32)
    for i, n in enumerate(lengths):
        for c in range(-(-n // page)):
            bt[i, c] = perm.pop()
    return [k, v, ks, vs], bt.to(DEV), torch.arange(len(lengths), dtype=torch.int32, device=DEV)


def _same_cache(tri, ref):
    """The kernel's e4m3 values and scales against `quantize_rows`'s: the rotated bf16 K rows are the same, so at most
    a rare value one e4m3 step away (a float32 product on either side of a rounding boundary)."""
    for a, b in zip(tri[:2], ref[:2]):
        steps = _e4m3_steps(a, b)
        assert steps.max() <= 1 and (steps > 0).double().mean() < 1e-3
    for a, b in zip(tri[2:], ref[2:]):
        assert _rel(a, b) < 1e-6


def test_kv_fp8_kernels_on_hardware():
    from models.transformer import rope_cos_sin, rope_inv_freq
    from rollout.triton_kernels import TritonOps
    from bench.common import model_args

    args = model_args("qwen2.5-1.5b", max_position_embeddings=1024)
    hq, hkv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    cos, sin = rope_cos_sin(rope_inv_freq(args, device=DEV), torch.arange(1024, device=DEV), torch.bfloat16)
    cos, sin = cos[:, :d // 2].contiguous(), sin[:, :d // 2].contiguous()
    torch.manual_seed(0)
    lengths = [1, 17, 300, 64, 129, 700]
    pool, bt, slots = _pool(hkv, d, lengths)
    qkv = (torch.randn(len(lengths), (hq + 2 * hkv) * d, device=DEV) * 3).bfloat16()
    for splits in (1, 4):  # RoPE and the write fused into the attention, and after rope_and_cache
        meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=torch.tensor(lengths, dtype=torch.int32,
                                 device=DEV), max_context_len=max(lengths), num_splits=splits)
        pos = meta.context_lens - 1
        ref, tri = [t.clone() for t in pool], [t.clone() for t in pool]
        q = TorchOps.rope_and_cache(qkv.clone(), pos, slots, cos, sin, ref[0], ref[1], bt, hq, hkv, d, ref[2], ref[3])
        out = TritonOps.decode_attention(qkv.clone(), pos, cos, sin, tri[0], tri[1], bt, meta, d ** -0.5, hq, hkv, d,
                                         None, tri[2], tri[3])
        _same_cache(tri, ref)
        expect = decode_attention_ref(q.float(), tri[0], tri[1], bt, meta, d ** -0.5, tri[2], tri[3])
        assert out.dtype == torch.bfloat16 and _rel(out, expect) < 2 ** -8, (splits, _rel(out, expect))

    # prefill: a fresh prompt over several tiles, a chunk after a cached prefix, a one-query row
    q_lens, starts = [PREFILL_TILE * 3 + 7, 40, 1], [0, 200, 650]
    ctx = [s + n for s, n in zip(starts, q_lens)]
    pool, bt, slots = _pool(hkv, d, ctx)
    positions = torch.tensor([p for s, n in zip(starts, q_lens) for p in range(s, s + n)], dtype=torch.int32,
                             device=DEV)
    token_slots = torch.tensor([i for i, n in enumerate(q_lens) for _ in range(n)], dtype=torch.int32, device=DEV)
    qkv = (torch.randn(sum(q_lens), (hq + 2 * hkv) * d, device=DEV) * 3).bfloat16()
    ref, tri = [t.clone() for t in pool], [t.clone() for t in pool]
    TorchOps.rope_and_cache(qkv.clone(), positions, token_slots, cos, sin, ref[0], ref[1], bt, hq, hkv, d, ref[2],
                            ref[3])
    q = TritonOps.rope_and_cache(qkv.clone(), positions, token_slots, cos, sin, tri[0], tri[1], bt, hq, hkv, d,
                                 tri[2], tri[3])
    _same_cache(tri, ref)
    meta = AttentionMetadata.prefill(slots, q_lens, ctx)
    out = TritonOps.prefill_attention(q, *tri[:2], bt, meta, d ** -0.5, *tri[2:])
    expect = TorchOps.prefill_attention(q.float(), *tri[:2], bt, meta, d ** -0.5, *tri[2:])
    assert _rel(out, expect) < 2 ** -8


def test_kv_fp8_engine_graphs_equal_eager_and_match_rounded_kv(monkeypatch):
    """The float32 engine with an e4m3 cache, graphed and eager, on the GPU: the same tokens, and log-probs at a
    training forward whose attention sees K/V rounded as the cache holds them (`tests/unit/test_fp8_kv_cache.py`'s
    reference, in float64 on the CPU); the float32 model is far from both (the rounding is real)."""
    from tests.unit.test_fp8_kv_cache import _kv_rounded_reference

    model = _gpu_model("qwen2")
    prompts = prompts_of([5, 40, 3, 17, 90, 12, 8, 33] * 2, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=2, ignore_eos=True)
    cfg = dict(device=DEV, block_size=16, num_kv_blocks=128, kv_cache_dtype="fp8", free_cache_engine=False)
    graph, eager = make_engine(model, **cfg), make_engine(model, enforce_eager=True, **cfg)
    a, b = graph.generate(prompts, params), eager.generate(prompts, params)
    assert graph.runner.use_triton and graph.runner.graphs and not eager.runner.graphs
    assert graph.runner.kv_cache.dtype == FP8
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    cpu = model.cpu()
    with torch.no_grad():
        ref = _kv_rounded_reference(cpu, monkeypatch)
    assert _errors_against(ref, a).median().item() < 1e-4
    monkeypatch.undo()
    assert _errors_against(cpu, a).mean().item() > 1e-3


def test_kv_fp8_qwen_shape_accuracy():
    """qwen2.5-0.5b's shape in bf16 with an e4m3 KV cache (and with e4m3 projections too): how far its log-probs are
    from the float32 model's, next to the bf16 engine's."""
    from rollout import EngineConfig, LLMEngine

    args, ref32 = qwen_shape_model()
    prompts = prompts_of([16] * 8, seed=7)
    errs = {}
    for quant, kv in ((None, "auto"), (None, "fp8"), ("fp8", "fp8")):
        engine = LLMEngine(args, EngineConfig(max_num_seqs=16, gpu_memory_utilization=0.3, quantization=quant,
                                              kv_cache_dtype=kv), device=DEV)
        engine.load_weights(ref32.named_parameters())
        outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True))
        errs[(quant, kv)] = _logprob_errors(outs, [ref32])[0]
        del engine
    print("qwen2.5-0.5b shape, mean |log-prob - float32|:", errs)
    # the e4m3 cache rounds K and V to 3 mantissa bits: more than the bf16 engine, finite and below 3 nats
    # (a scale misapplied gives tens)
    assert errs[(None, "auto")] < errs[(None, "fp8")] < 3.0 and errs[("fp8", "fp8")] < 3.0, errs
