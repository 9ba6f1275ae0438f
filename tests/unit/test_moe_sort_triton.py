"""The mixture-of-experts sort by expert (`models/moe_triton.py`, a counting sort) against torch's stable argsort,
on CPU under Triton's interpreter (as in tests/unit/test_triton_kernels.py, the checks run in a child process: this
file run as a script), and `experts_forward` through it against the torch path.

Integer outputs: the permutation, its inverse and the groups' ends must be equal, not close; the layer's outputs and
gradients bitwise equal, since the kernel gives the same permutation.
"""

from __future__ import annotations

import os

import pytest
import torch

from models.moe import sort_by_expert
from tests import interpreter

CHECKS = ["sort_matches_argsort", "experts_forward_same", "compiled"]


def _reference(ids: torch.Tensor, num_experts: int):
    order = torch.argsort(ids, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(ids.numel())
    ends = torch.bincount(ids, minlength=num_experts).cumsum(0).to(torch.int32)
    return order, inverse, ends


def _cases():
    """(ids, experts): a decode step's 256 tokens x 8 of 128 experts; ids over several of the kernel's blocks
    (5,000 > 2,048) and a partial last block; one pair; every pair on one expert (the last: the others' groups
    empty); ids at both ends with empty experts between; few pairs for many experts."""
    g = torch.Generator().manual_seed(0)
    decode = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(256)]).reshape(-1)
    few = torch.tensor([0, 9, 9, 0, 5, 9, 0])
    return [(decode, 128), (torch.randint(0, 8, (5000,), generator=g), 8), (torch.tensor([3]), 4),
            (torch.full((33,), 5), 6), (few, 10), (torch.randint(0, 60, (40,), generator=g), 60)]


def _checks() -> dict:
    from models import moe_triton
    from models.moe import experts_forward

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def sort_matches_argsort():
        for ids, num_experts in _cases():
            got = moe_triton.sort_by_expert(ids, num_experts)
            for name, a, b in zip(("order", "inverse", "ends"), got, _reference(ids, num_experts)):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs at {len(ids)} pairs, {num_experts} experts"
        return 0.0

    def experts_forward_same():
        tokens, hidden, inter, num_experts, top_k = 37, 16, 8, 6, 2
        x = torch.randn(tokens, hidden, dtype=torch.float64)
        gate_up, down = torch.randn(num_experts, 2 * inter, hidden, dtype=torch.float64), torch.randn(
            num_experts, hidden, inter, dtype=torch.float64)
        experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
        experts[:5] = torch.tensor([0, num_experts - 1])  # both ends; expert 3 may be empty
        weights = torch.rand(tokens, top_k, dtype=torch.float64)
        results, kernel, calls = [], moe_triton.sort_by_expert, []

        def counted(*args):
            calls.append(args[0].numel())
            return kernel(*args)

        moe_triton.sort_by_expert = counted  # (`models.moe.sort_by_expert` looks it up at each call)
        try:
            for path in ("torch", "triton"):
                os.environ["MESHPPO_MOE_SORT"] = path
                leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
                out = experts_forward(leaves[0], leaves[1], experts, leaves[2], leaves[3])
                out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
                results.append([out.detach()] + [t.grad for t in leaves])
        finally:
            moe_triton.sort_by_expert = kernel
        assert calls == [tokens * top_k], f"the kernel ran for {calls} pairs: once, on the Triton path, expected"
        for name, a, b in zip(("out", "dx", "dweights", "dgate_up", "ddown"), *results):
            assert torch.equal(a, b), f"{name} differs between the torch and the Triton sort"
        return 0.0

    def compiled():
        """The custom op under torch.compile (its fake implementation traces; aot_eager runs the kernel)."""
        ids, num_experts = _cases()[1]
        got = torch.compile(moe_triton.sort_by_expert, backend="aot_eager", fullgraph=True)(ids, num_experts)
        for a, b in zip(got, _reference(ids, num_experts)):
            assert torch.equal(a, b)
        return 0.0

    return locals()


interpreter_report, test_moe_sort_matches_torch_under_interpreter, test_moe_sort_kernel_compiles_for_hopper = \
    interpreter.tests(__file__, CHECKS)


def test_path_choice_and_torch_path(monkeypatch):
    """On CPU `auto` and `torch` take torch's sort (the reference above, independently written); a misspelt choice
    is an error naming the variable."""
    ids, num_experts = _cases()[4]
    for choice in ("auto", "torch"):
        monkeypatch.setenv("MESHPPO_MOE_SORT", choice)
        for a, b in zip(sort_by_expert(ids, num_experts), _reference(ids, num_experts)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    monkeypatch.setenv("MESHPPO_MOE_SORT", "trition")
    with pytest.raises(ValueError, match="MESHPPO_MOE_SORT"):
        sort_by_expert(ids, num_experts)


if __name__ == "__main__":
    interpreter.main(_checks(), CHECKS)
