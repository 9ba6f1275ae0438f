"""The LM head's Triton kernels against the PyTorch path and float64, on CPU under Triton's interpreter.

As in tests/unit/test_triton_kernels.py: `TRITON_INTERPRET=1` must be set before triton is
imported, so the checks run in one child process (this file run as a script) and the tests
read its report. The interpreter mishandles bf16 (triton 3.9), so the checks use float32 and
float16; bf16 at full size is checked on the GPU (tests/gpu/test_lm_head_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from models.lm_head import _use_triton
from tests import interpreter

CHECKS = ["logit_stats", "logit_grad", "end_to_end", "sum_pi_squared"]
# (rows, vocabulary, tile, temperature, with entropy, soft cap): tiles smaller than the vocabulary, which
# is never a multiple of them; caps (Gemma 2's final_logit_softcapping) well inside the logits' range (3 N(0, 1)).
# One program a row (and tile): a few rows show what many would (labels at both ends of the vocabulary and in
# between), the interpreter running each row's program anew
CASES = [(1, 50, 16, 1.0, True, None), (1, 50, 16, 0.7, False, None), (7, 1000, 128, 0.7, False, None),
         (7, 1000, 128, 1.0, True, None), (3, 4099, 512, 1.3, True, None), (3, 4099, 512, 1.0, False, None),
         (7, 1000, 128, 0.7, True, 2.0), (3, 4099, 512, 1.0, False, 1.5)]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # max error, relative to max(1, max |reference|)
PAD = 3  # columns past V in each logits row, NaN: a kernel that reads or writes them fails


def _checks() -> dict:
    from models import lm_head_triton
    from models.lm_head import chunked_token_logprobs, torch_logit_grad, torch_logit_stats
    from tests.unit.test_lm_head import _reference

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def close(a, b, tol):
        a, b = a.double(), b.double()
        assert torch.isfinite(a).all(), "non-finite values (an unwritten or corrupted element)"
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1)).item()
        assert err <= tol, f"max error {err} > {tol}"
        return err

    def padded_logits(c, v, dtype):
        """Logits `[c, v]`, a view with NaN columns after each row, and labels hitting both ends."""
        buf = torch.full((c, v + PAD), float("nan"), dtype=dtype)
        buf[:, :v] = (3 * torch.randn(c, v)).to(dtype)
        labels = torch.randint(0, v, (c,))
        labels[0], labels[-1] = v - 1, 0
        return buf, buf[:, :v], labels

    def capped64(logits, cap):
        """The logits in float64, soft-capped (cap·tanh(logits / cap)) where `cap` is set."""
        x = logits.double()
        return x if cap is None else torch.tanh(x / cap) * cap

    def float64_stats(logits, labels, inv_temp, cap=None):
        x = capped64(logits, cap) * inv_temp
        log_p = torch.log_softmax(x, -1)
        return torch.logsumexp(x, -1), log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    def cases():
        for dtype in TOL:
            for case in CASES:
                yield dtype, *case

    def logit_stats():
        errs = []
        for dtype, c, v, block, temperature, with_entropy, cap in cases():
            _, z, labels = padded_logits(c, v, dtype)
            got = [torch.full((c,), float("nan")) for _ in range(3 if with_entropy else 2)]
            lm_head_triton.logit_stats(z, labels, 1 / temperature, *got, *[None] * (3 - len(got)), softcap=cap,
                                       block_v=block)
            ref = [torch.empty(c) for _ in got]
            torch_logit_stats(z, labels, 1 / temperature, *ref, softcap=cap)
            exact = float64_stats(z, labels, 1 / temperature, cap)
            for g, r, e in zip(got, ref, exact):
                errs += [close(g, r, 1e-5), close(g, e, 1e-5)]  # fp32 arithmetic on exact inputs either way
            if cap is not None:  # the cap acts: the uncapped statistics are far from these
                assert (float64_stats(z, labels, 1 / temperature)[1] - exact[1]).abs().max() > 0.1
        return max(errs)

    def logit_grad():
        errs = []
        for dtype, c, v, block, temperature, with_entropy, cap in cases():
            buf, z, labels = padded_logits(c, v, dtype)
            lse, logp, ent = torch.empty(c), torch.empty(c), torch.empty(c)
            torch_logit_stats(z, labels, 1 / temperature, lse, logp, ent, softcap=cap)
            g_logp, g_ent = torch.randn(c), (torch.randn(c) if with_entropy else None)
            ent_args = (ent, g_ent) if with_entropy else (None, None)
            ref = torch_logit_grad(z.clone(), labels, 1 / temperature, lse, g_logp, *ent_args, softcap=cap)

            z64 = z.double().requires_grad_()  # d/dz through the cap and the temperature, by autograd
            log_p = torch.log_softmax(capped64(z64, cap) / temperature, -1)
            loss = (log_p.gather(-1, labels[:, None]).squeeze(-1) * g_logp).sum()
            if with_entropy:
                loss = loss - ((log_p.exp() * log_p).sum(-1) * g_ent).sum()
            exact, = torch.autograd.grad(loss, z64)

            got = lm_head_triton.logit_grad_(z, labels, 1 / temperature, lse, g_logp, *ent_args, softcap=cap,
                                             block_v=block)
            assert got.data_ptr() == buf.data_ptr(), "the gradient is written over the logits"
            assert torch.isnan(buf[:, v:]).all(), "wrote past the vocabulary"
            errs += [close(got, ref, TOL[dtype]), close(got, exact, TOL[dtype])]
        return max(errs)

    def sum_pi_squared():
        """sum p^2 next to the other statistics (with and without entropy), and alone through
        `chunked_token_logprobs`, against float64; the other outputs as without it."""
        errs = []
        for dtype, c, v, block, temperature, with_entropy, _ in cases():
            _, z, labels = padded_logits(c, v, dtype)
            got = [torch.full((c,), float("nan")) for _ in range(4)]
            lm_head_triton.logit_stats(z, labels, 1 / temperature, *got[:2], got[2] if with_entropy else None, got[3],
                                       block_v=block)
            ref = [torch.empty(c) for _ in range(4)]
            torch_logit_stats(z, labels, 1 / temperature, *ref)
            exact = torch.softmax(z.double() / temperature, -1).pow(2).sum(-1)
            errs += [close(got[3], ref[3], 1e-5), close(got[3] / exact, torch.ones_like(exact), 1e-5)]
            without = [torch.empty(c) for _ in range(3)]
            lm_head_triton.logit_stats(z, labels, 1 / temperature, *without[:2],
                                       without[2] if with_entropy else None, block_v=block)
            assert torch.equal(got[0], without[0]) and torch.equal(got[1], without[1])
            if with_entropy:
                assert torch.equal(got[2], without[2])
        os.environ["MESHPPO_LM_HEAD"] = "triton"
        n, hdim, vocab = 9, 16, 4099
        h, w = 2 * torch.randn(n, hdim), torch.randn(vocab, hdim)
        labels = torch.randint(0, vocab, (n,))
        _, _, sps = chunked_token_logprobs(h, w, labels, 0.7, 4, with_sum_pi_squared=True)
        exact = torch.softmax((h.double() @ w.double().t()) / 0.7, -1).pow(2).sum(-1)
        errs.append(close(sps / exact, torch.ones_like(exact), 1e-4))
        return max(errs)

    def end_to_end():
        calls = {"stats": 0, "grad": 0}
        stats, grad = lm_head_triton.logit_stats, lm_head_triton.logit_grad_

        def counted(name, fn):
            def run(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return run

        lm_head_triton.logit_stats, lm_head_triton.logit_grad_ = counted("stats", stats), counted("grad", grad)
        os.environ["MESHPPO_LM_HEAD"] = "triton"
        errs = []
        # vocabulary 4099: one full default tile (4096) and a 3-column tail
        # (the last with a soft cap of 1.5, well inside the logits' range)
        for temperature, chunk, n, with_entropy, cap in ((1.0, 5, 13, True, None), (0.7, 64, 9, True, None),
                                                         (1.3, 4, 6, False, None), (0.7, 5, 11, True, 1.5)):
            hdim, vocab = 16, 4099
            h = (0.5 * torch.randn(n, hdim)).requires_grad_()
            w = (0.5 * torch.randn(vocab, hdim)).requires_grad_()
            labels = torch.randint(0, vocab, (n,))
            g1, g2 = torch.randn(n), torch.randn(n)
            rh, rw = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
            logp, ent = chunked_token_logprobs(h, w, labels, temperature, chunk, with_entropy=with_entropy,
                                               softcap=cap)
            ref_logp, ref_ent = _reference(rh, rw, labels, temperature, cap)
            for lp, en in ((logp, ent), (ref_logp, ref_ent)):
                ((lp * g1).sum() + ((en * g2).sum() if with_entropy else 0)).backward()
            errs += [close(logp, ref_logp, 1e-4), close(h.grad, rh.grad, 1e-4), close(w.grad, rw.grad, 1e-4)]
            if with_entropy:
                errs.append(close(ent, ref_ent, 1e-4))
            # only log p in the loss: its grad arrives expanded (stride 0), the entropy's as zeros
            h.grad = w.grad = None
            logp, _ = chunked_token_logprobs(h, w, labels, temperature, chunk, with_entropy=with_entropy,
                                             softcap=cap)
            logp.sum().backward()
            rh.grad = rw.grad = None
            _reference(rh, rw, labels, temperature, cap)[0].sum().backward()
            errs += [close(h.grad, rh.grad, 1e-4), close(w.grad, rw.grad, 1e-4)]
        assert calls["stats"] and calls["grad"], f"the Triton path did not run: {calls}"
        return max(errs)

    return locals()


interpreter_report, test_lm_head_kernel_matches_torch_under_interpreter, test_lm_head_kernels_compile_for_hopper = \
    interpreter.tests(__file__, CHECKS)


def test_path_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("MESHPPO_LM_HEAD", raising=False)
    assert not _use_triton(cpu)
    monkeypatch.setenv("MESHPPO_LM_HEAD", "triton")
    assert _use_triton(cpu)
    monkeypatch.setenv("MESHPPO_LM_HEAD", "torch")
    assert not _use_triton(cpu)
    monkeypatch.setenv("MESHPPO_LM_HEAD", "trition")
    with pytest.raises(ValueError, match="MESHPPO_LM_HEAD"):
        _use_triton(cpu)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
