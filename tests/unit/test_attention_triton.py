"""The capped packed attention's Triton kernels (`models/attention_triton.py`) against the explicit path in float64, on
CPU under Triton's interpreter (`tests/interpreter.py`: the checks run in a child process, and every launch they made
is compiled for sm_90).

Float32 inputs (the interpreter mishandles bf16; bf16 at Gemma 2's size: tests/gpu/test_gemma2_gpu.py), errors
relative to each reference tensor's largest value, within 1e-4 (float32 rounding gives ~1e-6). The reference is
`attention_packed` on float64 with `MESHPPO_CAPPED_ATTENTION=torch` (explicit scores; SDPA when uncapped). The cap is
small (2) against scores of several units, so that it acts: each capped case also holds the uncapped reference far
from the capped one. Segments of 1 token and of lengths that are not multiples of the blocks (32 at head dims 24 and
64 in float32: `attention_triton.blocks`), trailing padding past `cu_seqlens[-1]` (Ulysses pads the row so), GQA
4:2 and 4:1, windows of 2, 5 and 7 tokens and none, keys longer than their queries (a shared prefix), a head dim
that is no power of two (24: the kernels mask the padded lanes)."""

from __future__ import annotations

import os

import pytest
import torch

from tests import interpreter

CHECKS = ["kernels_match_float64", "shared_prefix", "padded_rows", "model_takes_the_kernels",
          "compiled_block_traces_the_ops"]
CAP = 2.0
TOL = 1e-4
ENV = "MESHPPO_CAPPED_ATTENTION"


def _gemma2_args():
    """A tiny Gemma 2 (head_dim 24, GQA 4:2, a window of 5 on layer 0, attention cap 2)."""
    from models import ModelArgs

    return ModelArgs.from_hf_config(dict(
        model_type="gemma2", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=24, sliding_window=5,
        attn_logit_softcapping=CAP, final_logit_softcapping=None, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=128))


def _checks() -> dict:
    from models import Transformer, attention_triton, cu_seqlens_from_lengths
    from models.attention import PrefixSharing, attention_packed, attention_padded

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def rel_err(a, b):
        assert torch.isfinite(a).all(), "non-finite values (an unwritten or corrupted element)"
        return ((a.double() - b.double()).abs().max() / b.abs().max()).item()

    def values_and_grads(fn, q, k, v, dout):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def compare(q, k, v, dout, cu, max_len, shared, window, cap):
        """The kernels' values and gradients (float32) against the explicit path's in float64: through
        `attention_packed` under `MESHPPO_CAPPED_ATTENTION=triton` with a cap, called directly without (the
        uncapped kernel, which `attention_packed` leaves to FlashAttention or SDPA)."""
        os.environ[ENV] = "triton"
        if cap:
            got = values_and_grads(lambda a, b, c: attention_packed(a, b, c, cu, max_len, 0.3, shared, window, cap),
                                   q, k, v, dout)
        else:
            assert shared is None
            got = values_and_grads(lambda a, b, c: attention_triton.capped_attention(a, b, c, cu, cu, max_len,
                                                                                     max_len, 0.3, window), q, k, v,
                                   dout)
        os.environ[ENV] = "torch"
        ref = values_and_grads(lambda a, b, c: attention_packed(a, b, c, cu, max_len, 0.3, shared, window, cap),
                               *(t.double() for t in (q, k, v, dout)))
        errs = []
        for name, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
            errs.append(rel_err(x, y))
            assert errs[-1] <= TOL, f"{name}: error {errs[-1]} > {TOL} (window {window}, cap {cap})"
        if cap:  # the cap acts
            uncapped = attention_packed(*(t.double() for t in (q, k, v)), cu, max_len, 0.3, shared, window)
            assert rel_err(uncapped, ref[0]) > 1e-2
        return max(errs)

    def inputs(t, tk, heads, kv_heads, d):
        q = 3 * torch.randn(t, heads, d)  # scores of several units: a cap of 2 acts
        k, v = 3 * torch.randn(tk, kv_heads, d), torch.randn(tk, kv_heads, d)
        return q, k, v, torch.randn(t, heads, d)

    calls = []
    kernel = attention_triton.capped_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    attention_triton.capped_attention = counted

    def kernels_match_float64():
        """Capped: segments of 33, 1, 45 and 5 tokens and 3 of trailing padding at head dim 24 (GQA 4:2) with
        windows none, 2 and 5. Uncapped (the SOFTCAP = 0 kernels): 40 and 1 tokens at head dim 64 (GQA 4:1) with
        windows none and 7. (Few distinct kernels: each is compiled for sm_90 too.)"""
        errs = []
        lengths = [33, 1, 45, 5]
        cu = cu_seqlens_from_lengths(lengths)
        q, k, v, dout = inputs(sum(lengths) + 3, sum(lengths) + 3, 4, 2, 24)
        for window in (None, 5, 2):
            errs.append(compare(q, k, v, dout, cu, max(lengths), None, window, CAP))
        cu = cu_seqlens_from_lengths([40, 1])
        q, k, v, dout = inputs(41, 41, 4, 1, 64)
        for window in (None, 7):
            errs.append(compare(q, k, v, dout, cu, 40, None, window, None))
        assert len(calls) == 5, f"the kernels ran {len(calls)} times, not 5"
        return max(errs)

    def shared_prefix():
        """Keys longer than their queries (`PrefixSharing`, the queries the last of their segment's keys): query
        segments of 2, 3, 1 and 35 tokens over keys of 2, 9, 40 and 35 (a prompt of 6 and of 39 before responses),
        head dim 24, GQA 4:2, windows none and 5 (reaching back into the prompt), gathered from a row of 50 keys."""
        calls.clear()
        lengths, key_lengths = [2, 3, 1, 35], [2, 9, 40, 35]
        cu = cu_seqlens_from_lengths(lengths)
        g = torch.Generator().manual_seed(1)
        kv_index = torch.randint(0, 50, (sum(key_lengths),), generator=g)
        shared = PrefixSharing(kv_index, cu_seqlens_from_lengths(key_lengths), max(key_lengths))
        q, k, v, dout = inputs(sum(lengths), 50, 4, 2, 24)
        errs = [compare(q, k, v, dout, cu, max(lengths), shared, window, CAP) for window in (None, 5)]
        assert len(calls) == 2
        return max(errs)

    def padded_rows():
        """The padded layout (`attention_padded`, use_remove_padding false) through the kernels: rows of 12 columns
        with padding on the left (3), on the right (4), none, and a row of padding only; windows none and 3. Each
        row's tokens' outputs and every gradient (the loss reading the tokens' outputs only, as the losses mask
        padding) are the explicit path's in float64; without a mask (one whole row a sequence), the outputs too."""
        calls.clear()
        mask = torch.ones(4, 12, dtype=torch.long)
        mask[0, :3] = 0
        mask[1, 8:] = 0
        mask[3] = 0
        real = mask.bool()[:, :, None, None]
        errs = []
        for attention_mask in (mask, None):
            q, k, v, dout = (t.view(4, 12, *t.shape[1:]) for t in inputs(48, 48, 4, 2, 24))
            if attention_mask is not None:
                dout = dout * real

            def take(out):
                return out * real if attention_mask is not None else out

            for window in (None, 3):
                os.environ[ENV] = "triton"
                got = values_and_grads(lambda a, b, c: attention_padded(a, b, c, attention_mask, 0.3, window, CAP),
                                       q, k, v, dout)
                os.environ[ENV] = "torch"
                ref = values_and_grads(lambda a, b, c: attention_padded(a, b, c, attention_mask, 0.3, window, CAP),
                                       *(t.double() for t in (q, k, v, dout)))
                for name, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
                    x, y = (take(x), take(y)) if name == "out" else (x, y)
                    errs.append(rel_err(x, y))
                    assert errs[-1] <= TOL, f"{name}: error {errs[-1]} > {TOL} (window {window}, mask {mask})"
        assert len(calls) == 4, f"the kernels ran {len(calls)} times, not 4"
        return max(errs)

    def model_outputs(model, ids, cu, weights):
        model.zero_grad(set_to_none=True)
        logits = model(ids, cu_seqlens=cu)[0]
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    def gemma2_batch():
        """The tiny Gemma 2, a packed row of sequences of 9, 1 and 23 tokens, and random weights of its logits."""
        lengths = [9, 1, 23]
        weights = torch.randn(sum(lengths), 61)
        return (Transformer.build(_gemma2_args(), seed=0), torch.randint(0, 61, (1, sum(lengths))),
                cu_seqlens_from_lengths(lengths), weights)

    def model_takes_the_kernels():
        """A tiny Gemma 2's float32 logits and parameter gradients, packed, under `MESHPPO_CAPPED_ATTENTION=triton`
        equal the explicit path's (`torch`), and the kernels ran once a layer."""
        calls.clear()
        model, ids, cu, weights = gemma2_batch()
        os.environ[ENV] = "torch"
        ref, ref_grads = model_outputs(model, ids, cu, weights)
        os.environ[ENV] = "triton"
        got, grads = model_outputs(model, ids, cu, weights)
        assert len(calls) == 2, f"the kernels ran {len(calls)} times for 2 layers"
        errs = [rel_err(got, ref)] + [rel_err(grads[n], ref_grads[n]) for n in ref_grads]
        assert max(errs) <= TOL, errs
        return max(errs)

    def compiled_block_traces_the_ops():
        """Each block compiled (`torch.compile`, dynamic shapes, as `sharding.compile.apply_compile`; fullgraph: no
        graph break) with the kernels' custom ops in its graph, forward and backward; its logits and gradients are
        the eager kernels'."""
        model, ids, cu, weights = gemma2_batch()
        os.environ[ENV] = "triton"
        ref, ref_grads = model_outputs(model, ids, cu, weights)
        graphs = []

        def backend(gm, example_inputs):
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def record(g, _):
                graphs.append({str(n.target) for n in g.graph.nodes})
                return make_boxed_func(g.forward)

            return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

        for block in model.layers:
            block.forward = torch.compile(block.forward, backend=backend, dynamic=True, fullgraph=True)
        got, grads = model_outputs(model, ids, cu, weights)
        assert len(graphs) >= 2, f"{len(graphs)} graphs: the blocks were not compiled forward and backward"
        assert any("meshppo.capped_attention.default" in g for g in graphs), "no forward op in the graphs"
        assert any("meshppo.capped_attention_backward.default" in g for g in graphs), "no backward op in the graphs"
        errs = [rel_err(got, ref)] + [rel_err(grads[n], ref_grads[n]) for n in ref_grads]
        assert max(errs) <= 1e-5, errs
        return max(errs)

    return locals()


interpreter_report, test_capped_attention_under_interpreter, test_capped_attention_compiles_for_hopper = \
    interpreter.tests(__file__, CHECKS)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_blocks_compile_for_hopper(head_dim):
    """The kernels at Gemma 2's head dims (256 for 2b and 9b, 128 for 27b) in bf16 with the GPU's blocks
    (`attention_triton.blocks`, which the interpreter checks do not launch) compile for sm_90 and fit a Hopper
    block's shared memory."""
    pytest.importorskip("triton")
    from models import attention_triton as at

    x, f, i = torch.empty(1, dtype=torch.bfloat16), torch.empty(1), torch.empty(1, dtype=torch.int32)
    launches = []
    for kernel, tensors, backward in ((at._fwd_kernel, [x, x, x, x, f, i, i], False),
                                      (at._dkdv_kernel, [x, x, x, x, f, f, x, x, i, i], True),
                                      (at._dq_kernel, [x, x, x, x, f, f, x, i, i], True)):
        bm, bn, warps, stages = at.blocks(head_dim, torch.bfloat16, backward)
        constants = dict(D=head_dim, BLOCK_D=head_dim, BLOCK_M=bm, BLOCK_N=bn, SOFTCAP=50.0, PRECISION="tf32")
        runtime = [n for n in kernel.arg_names if n not in constants]
        args = tensors + [0.5 if n == "scale" else 1 for n in runtime[len(tensors):]]
        names = runtime + list(constants)
        launches.append(interpreter._launch_entry(kernel.fn, names, args + list(constants.values()),
                                                  {**constants, "num_warps": warps, "num_stages": stages}))
    assert not interpreter.compile_report(launches)


def test_path_choice(monkeypatch):
    """`MESHPPO_CAPPED_ATTENTION`: auto takes the kernels only where Triton runs on the device (never on CPU),
    triton always, torch never; another value is an error naming the variable."""
    from models.attention import capped_triton

    cpu = torch.zeros(1, 2, 16)
    monkeypatch.delenv(ENV, raising=False)
    assert not capped_triton(cpu)
    monkeypatch.setenv(ENV, "triton")
    assert capped_triton(cpu)
    monkeypatch.setenv(ENV, "torch")
    assert not capped_triton(cpu)
    monkeypatch.setenv(ENV, "flash")
    with pytest.raises(ValueError, match=ENV):
        capped_triton(cpu)


def test_the_auto_choice_traces_without_a_graph_break(monkeypatch):
    """`capped_triton` under `torch.compile` with `auto` (the default) and a CUDA tensor's device, as the compiled
    blocks of a capped model trace it on the GPU: it looks nothing up (torch 2.11's dynamo refuses to trace
    `importlib.util.find_spec`: a graph break in every block, seen on an H100), and `fullgraph` traces it. The device
    is only named: nothing runs on it."""
    from types import SimpleNamespace

    from models import triton_support
    from models.attention import capped_triton
    from models.triton_support import TRITON_IMPORTABLE

    def no_lookup(*args, **kwargs):
        raise AssertionError("a module lookup in traced code")

    monkeypatch.delenv(ENV, raising=False)
    # meshppo's lookups only (torch's own tracing machinery may look modules up, depending on what is imported)
    monkeypatch.setattr(triton_support, "importlib", SimpleNamespace(util=SimpleNamespace(find_spec=no_lookup)))

    class OnCuda:  # what capped_triton reads of a tensor: its device and head dim
        device = torch.device("cuda")
        shape = (1, 2, 16)

    @torch.compile(backend="eager", fullgraph=True)
    def takes(x):
        return x + 1 if capped_triton(OnCuda) else x - 1

    torch._dynamo.reset()
    assert takes(torch.zeros(2)).tolist() == ([1.0, 1.0] if TRITON_IMPORTABLE else [-1.0, -1.0])


def test_forced_kernels_refuse_what_they_cannot_take(monkeypatch):
    """A head dim over 256 or float64 under the forced path: a ValueError naming what, before any kernel runs."""
    pytest.importorskip("triton")
    from models.attention import attention_packed
    from models.transformer import cu_seqlens_from_lengths

    monkeypatch.setenv(ENV, "triton")
    cu = cu_seqlens_from_lengths([4])
    with pytest.raises(ValueError, match="head dims up to 256"):
        attention_packed(*(torch.zeros(4, 2, 288) for _ in range(3)), cu, 4, 0.1, softcap=2.0)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        attention_packed(*(torch.zeros(4, 2, 16, dtype=torch.float64) for _ in range(3)), cu, 4, 0.1, softcap=2.0)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
