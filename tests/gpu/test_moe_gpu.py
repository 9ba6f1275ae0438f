"""The mixture-of-experts MLP (models/moe.py) on a CUDA GPU, bf16, at a Qwen3-30B-A3B-like width (hidden 1024, 32
experts of 256, top 4): the grouped-GEMM path against the loop path and float64 (forward and backward), no host sync
on the grouped path, and its capture in a CUDA graph replayed on new inputs (as the engine captures its decode).
Skipped without CUDA."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models.moe import experts_forward, route, use_grouped_mm  # noqa: E402

DEV = torch.device("cuda", 0)
H, E, I, K = 1024, 32, 256, 4


def _weights(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    router = torch.randn(E, H, generator=g, device=DEV) * H ** -0.5
    gate_up = torch.randn(E, 2 * I, H, generator=g, device=DEV) * H ** -0.5
    down = torch.randn(E, H, I, generator=g, device=DEV) * I ** -0.5
    return router, gate_up, down


def _inputs(tokens, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(tokens, H, generator=g, device=DEV), torch.randn(tokens, H, generator=g, device=DEV)


def _run(x, dy, router, gate_up, down, dtype, grouped):
    """Output and the gradients of x, gate_up, down (routing taken from the float64 router, the same for all)."""
    weights, experts = route(x.double(), router.double(), K, True)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gate_up, down)]
    out = experts_forward(leaves[0], weights.to(dtype), experts, leaves[1], leaves[2], grouped=grouped)
    out.backward(dy.to(dtype))
    return [out.double()] + [t.grad.double() for t in leaves]


def test_grouped_path_is_as_close_to_float64_as_the_loop_path():
    """bf16, 4096 tokens: the grouped path's output and gradients are within the loop path's error of float64 (twice
    it, plus a bf16 ulp of the values), and the auto choice takes the grouped path."""
    router, gate_up, down = _weights()
    x, dy = _inputs(4096)
    assert use_grouped_mm(x.bfloat16(), gate_up.bfloat16())
    ref = _run(x, dy, router, gate_up, down, torch.float64, grouped=False)
    loop = _run(x, dy, router, gate_up, down, torch.bfloat16, grouped=False)
    grouped = _run(x, dy, router, gate_up, down, torch.bfloat16, grouped=True)
    for r, a, b in zip(ref, loop, grouped):
        scale = r.abs().max().item()
        err_loop, err_grouped = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err_grouped <= 2 * err_loop + scale / 128, (err_loop, err_grouped, scale)


def test_the_grouped_path_syncs_no_host_and_replays_in_a_cuda_graph():
    """The grouped forward (routing included) runs under torch.cuda's sync debug mode "error" (no host sync), is
    captured in a CUDA graph over static buffers, and replayed on new tokens it gives the eager outputs bit for
    bit."""
    router, gate_up, down = (t.bfloat16() for t in _weights())
    static = torch.zeros(512, H, device=DEV, dtype=torch.bfloat16)

    def step():
        weights, experts = route(static, router, K, True)
        return experts_forward(static, weights, experts, gate_up, down)

    static.copy_(_inputs(512, seed=2)[0])
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step()
    for seed in (3, 4):
        static.copy_(_inputs(512, seed=seed)[0])
        graph.replay()
        with torch.no_grad():
            eager = step()
        assert eager.abs().max() > 0.1
        assert torch.equal(out, eager)


@pytest.mark.parametrize("family", ["Mixtral", "Olmoe"])
def test_the_sparse_block_is_transformers_in_bf16(family):
    """meshppo's sparse block (`models.transformer.MoE`, the grouped path) of a Mixtral and of an OLMoE against
    transformers' MixtralSparseMoeBlock / OlmoeSparseMoeBlock with their default grouped_mm experts, bf16 on the GPU,
    2048 tokens: the same products in the same order, so the mean difference is far below what rounding the top-k
    weights the other family's way makes (Mixtral's stay float32, OLMoE's are cast to bf16: `ModelArgs.
    router_weights_float32`); a tolerance on the mean, not bit equality, as the kernels may order a group's rows
    differently (transformers' sort is not stable)."""
    transformers = pytest.importorskip("transformers")
    from models import ModelArgs
    from models.transformer import MoE

    model_type = family.lower()
    experts = {"num_local_experts": E} if family == "Mixtral" else {"num_experts": E}
    cfg = getattr(transformers, f"{family}Config")(hidden_size=H, intermediate_size=I, num_experts_per_tok=K,
                                                    num_attention_heads=8, **experts)
    cfg._experts_implementation = "grouped_mm"
    module = getattr(transformers.models, model_type)
    block = getattr(getattr(module, f"modeling_{model_type}"), f"{family}SparseMoeBlock")(cfg)
    router, gate_up, down = _weights()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    block = block.to(DEV, torch.bfloat16).eval()
    args = ModelArgs(model_type=model_type, hidden_size=H, intermediate_size=I, num_attention_heads=8, num_experts=E,
                     num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=family == "Mixtral")
    ours = MoE(args).to(DEV, torch.bfloat16)
    ours.load_state_dict(block.state_dict())
    x = _inputs(2048)[0].bfloat16()[None]
    with torch.no_grad():
        ref = block(x).double()
        got = ours(x).double()
        weights, chosen = route(x[0], ours.gate.weight, K, args.norm_topk_prob, not args.router_weights_float32)
        other = experts_forward(x[0], weights, chosen, ours.experts.gate_up_proj, ours.experts.down_proj).double()
    assert use_grouped_mm(x[0], ours.experts.gate_up_proj)
    err, err_other = (got - ref).abs().mean().item(), (other - ref[0]).abs().mean().item()
    assert err_other > 0 and err <= err_other / 10, (err, err_other)


def test_the_r2_record_comes_back_from_the_gpu_without_a_sync_and_replays_as_routing():
    """Routing replay R2 on the GPU in bf16 (a tiny Qwen3-MoE on the grouped path, 9 rows sharing 3 prompts, packed,
    one micro-batch): the old-log-prob pass's record (Actor.log_probs) is, token by token, what the routers choose in
    that micro-batch (the same forward with hooks); taking a forward's record to the host (trainer.forward.
    RoutingRecord: a copy into pinned memory and an event) syncs nothing (torch.cuda's sync debug mode "error"); and
    the micro-batch replaying the record computes the routing forward's log-probs bit for bit (the same kernels on
    the same inputs and experts)."""
    from models import Transformer
    from tests.unit.test_router_replay import moe_args, own_routing, r2_actor, r2_rollouts
    from trainer.forward import RoutingRecord, build_micro_batch, response_logprobs

    model = Transformer.build(moe_args(), device=DEV, dtype=torch.bfloat16, seed=0)
    assert use_grouped_mm(torch.zeros(1, 32, device=DEV, dtype=torch.bfloat16), model.layers[0].mlp.experts.gate_up_proj)
    ro = r2_rollouts(device=DEV)
    with torch.no_grad():
        r2_actor(model, "shared_prefix", micro=9, device=DEV).log_probs(ro)
        mb = build_micro_batch(ro.prompts, ro.responses, DEV, True, 0, None, True)
        laid = own_routing(model, mb.input_ids, **mb.model_kwargs()).reshape(-1, 2, 2).cpu()
    record = ro.routed_experts
    assert record.flat.dtype == np.uint8
    assert torch.equal(torch.from_numpy(record.flat).long(), laid[torch.from_numpy(mb.token_places.flat)])
    mb = build_micro_batch(ro.prompts, ro.responses, DEV, True, 0, None, True, record_routing=True)
    with torch.no_grad():
        _, on_device = model(mb.input_ids, **mb.model_kwargs())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = RoutingRecord(mb, on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.host.is_pinned()
    assert torch.equal(torch.from_numpy(pending.rows().flat), torch.from_numpy(record.flat))
    replayed = build_micro_batch(ro.prompts, ro.responses, DEV, True, 0, None, True, record)
    plain = build_micro_batch(ro.prompts, ro.responses, DEV, True, 0, None, True)
    with torch.no_grad():
        want, _ = response_logprobs(model, plain, ro.width, 1.0, False)
        got, _ = response_logprobs(model, replayed, ro.width, 1.0, False)
    assert torch.equal(got, want) and want.abs().max() > 0.1


def test_a_qwen2_moe_sparse_block_with_its_shared_expert_is_transformers_in_bf16():
    """meshppo's sparse block of a Qwen2-MoE (the grouped path, plus the shared expert of 4 I, Qwen1.5-MoE-A2.7B's
    ratio, times the sigmoid of its gate) against transformers' Qwen2MoeSparseMoeBlock with its default grouped_mm
    experts, bf16 on the GPU, 2048 tokens, top-k weights not renormalised (the family's default): the mean difference is
    far below what leaving out the shared expert's gate makes (the shared expert added ungated), and the engine's sparse
    branch (`EngineModel._feed_forward`, TP 1, the PyTorch ops) computes the same block. A tolerance on the mean, as the
    kernels may order a group's rows differently and the training MLP may take fused SwiGLU kernels."""
    import types

    transformers = pytest.importorskip("transformers")
    from models import ModelArgs
    from models.transformer import MoE
    from rollout.model import EngineModel
    from rollout.ops import TorchOps

    shared = 4 * I
    cfg = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=shared,
                                      num_experts=E, num_experts_per_tok=K, num_attention_heads=8, norm_topk_prob=False)
    cfg._experts_implementation = "grouped_mm"
    block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(cfg)
    router, gate_up, down = _weights()
    g = torch.Generator(device=DEV).manual_seed(2)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        for p in (*block.shared_expert.parameters(), block.shared_expert_gate.weight):
            p.copy_(torch.randn(p.shape, generator=g, device=DEV) * p.shape[1] ** -0.5)
    block = block.to(DEV, torch.bfloat16).eval()
    args = ModelArgs(model_type="qwen2_moe", hidden_size=H, intermediate_size=shared, num_attention_heads=8,
                     num_hidden_layers=1, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                     shared_expert_intermediate_size=shared, attention_bias=True)
    ours = MoE(args).to(DEV, torch.bfloat16)
    ours.load_state_dict(block.state_dict())
    tp = types.SimpleNamespace(rank=0, size=1, all_reduce=lambda t: t)  # TP 1: the all-reduce is the identity
    engine = EngineModel(args, tp, torch.bfloat16, DEV, 64)
    state = {f"layers.0.mlp.{k}": v for k, v in ours.state_dict().items()}
    x = _inputs(2048)[0].bfloat16()[None]
    with torch.no_grad():
        for name, slot in engine.param_slots().items():
            if name in state:
                slot.view.copy_(slot.shard_of(state[name]))
        ref = block(x).double()
        got = ours(x).double()
        served = engine._feed_forward(x[0], engine.layers[0], TorchOps, 1).double()
        weights, chosen = route(x[0], ours.gate.weight, K, False)
        routed = experts_forward(x[0], weights, chosen, ours.experts.gate_up_proj, ours.experts.down_proj)
        ungated = (routed + ours.shared_expert(x[0])).double()
    assert use_grouped_mm(x[0], ours.experts.gate_up_proj)
    err, err_served = (got - ref).abs().mean().item(), (served - ref[0]).abs().mean().item()
    err_other = (ungated - ref[0]).abs().mean().item()
    assert err_other > 0 and err <= err_other / 10 and err_served <= err_other / 10, (err, err_served, err_other)


def test_a_granite_moe_shared_block_is_transformers_in_bf16():
    """meshppo's sparse block of a Granite-MoE-Shared (its router's softmax over the top-k float32 logits, the grouped
    path, plus its ungated shared expert of 2 I) against transformers' GraniteMoeSharedMoE with its default grouped_mm
    experts plus its layer's GraniteMoeSharedMLP (`shared_mlp`, its fused input_linear split into meshppo's gate and up
    rows), bf16 on the GPU, 2048 tokens: the mean difference is a tenth or less of transformers' own bf16 error against
    the block in float64 (meshppo's, on the CPU: equal to transformers' to 1e-9 in tests/unit/test_moe_families.py);
    the engine's sparse branch (`EngineModel._feed_forward`, TP 1, the PyTorch ops) computes the same block. A
    tolerance on the mean, as the kernels may order a group's rows differently. (A yardstick of routing by the full
    softmax's top-k, renormalised, came out bit-equal on an H100: not a yardstick.)"""
    import types

    transformers = pytest.importorskip("transformers")
    from transformers.models.granitemoeshared import modeling_granitemoeshared as granite

    from models import ModelArgs
    from models.transformer import MoE
    from rollout.model import EngineModel
    from rollout.ops import TorchOps

    shared = 2 * I
    cfg = transformers.GraniteMoeSharedConfig(hidden_size=H, intermediate_size=I, shared_intermediate_size=shared,
                                              num_local_experts=E, num_experts_per_tok=K, num_attention_heads=8)
    cfg._experts_implementation = "grouped_mm"
    block, mlp = granite.GraniteMoeSharedMoE(cfg), granite.GraniteMoeSharedMLP(cfg)
    router, gate_up, down = _weights()
    g = torch.Generator(device=DEV).manual_seed(2)
    with torch.no_grad():
        block.router.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=DEV) * p.shape[1] ** -0.5)
    block, mlp = block.to(DEV, torch.bfloat16).eval(), mlp.to(DEV, torch.bfloat16).eval()
    args = ModelArgs(model_type="granitemoeshared", hidden_size=H, intermediate_size=I, num_attention_heads=8,
                     num_hidden_layers=1, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                     norm_topk_prob=True, shared_expert_intermediate_size=shared)
    ours = MoE(args).to(DEV, torch.bfloat16)
    gate, up = mlp.input_linear.weight.chunk(2)
    ours.load_state_dict({"gate.weight": block.router.weight, "experts.gate_up_proj": block.experts.gate_up_proj,
                          "experts.down_proj": block.experts.down_proj, "shared_expert.gate_proj.weight": gate,
                          "shared_expert.up_proj.weight": up,
                          "shared_expert.down_proj.weight": mlp.output_linear.weight})
    tp = types.SimpleNamespace(rank=0, size=1, all_reduce=lambda t: t)  # TP 1: the all-reduce is the identity
    engine = EngineModel(args, tp, torch.bfloat16, DEV, 64)
    state = {f"layers.0.mlp.{k}": v for k, v in ours.state_dict().items()}
    x = _inputs(2048)[0].bfloat16()[None]
    with torch.no_grad():
        for name, slot in engine.param_slots().items():
            if name in state:
                slot.view.copy_(slot.shard_of(state[name]))
        ref = (block(x) + mlp(x)).double()
        got = ours(x).double()
        served = engine._feed_forward(x[0], engine.layers[0], TorchOps, 1).double()
        exact = copy.deepcopy(ours).cpu().double()(x.cpu().double())
    assert use_grouped_mm(x[0], ours.experts.gate_up_proj)
    err, err_served = (got - ref).abs().mean().item(), (served - ref[0]).abs().mean().item()
    bf16_err = (ref.cpu() - exact).abs().mean().item()
    assert bf16_err > 0 and err <= bf16_err / 10 and err_served <= bf16_err / 10, (err, err_served, bf16_err)


@pytest.mark.parametrize("pairs,experts", [(2048, 128), (32768, 128), (131072, 128), (3000, 8), (1, 4)])
def test_the_sort_kernel_is_torchs_stable_sort_on_the_gpu(pairs, experts):
    """`models/moe_triton.py`'s counting sort gives torch's stable argsort, its inverse and the cumulative counts
    exactly, at a decode step's 2,048 pairs, the kernel's size limit (32,768), a training micro-batch's 131,072
    (beyond the limit, forced) and edge sizes; skewed ids leave experts empty."""
    from models.moe_triton import sort_by_expert as kernel

    g = torch.Generator(device=DEV).manual_seed(pairs)
    ids = (torch.rand(pairs, generator=g, device=DEV) ** 3 * experts).long()  # skewed: the top experts rare
    order, inverse, ends = kernel(ids, experts)
    ref = torch.argsort(ids, stable=True)
    assert torch.equal(order, ref)
    assert torch.equal(inverse[ref], torch.arange(pairs, device=DEV))
    assert torch.equal(ends, torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32))


def test_the_layer_is_bitwise_the_same_with_either_sort(monkeypatch):
    """The grouped bf16 layer, forward and backward, with the Triton sort (the default on CUDA at 2,048 pairs) and
    with torch's: bit for bit, as the permutation is the same."""
    from models import moe_triton

    kernel, calls = moe_triton.sort_by_expert, []
    monkeypatch.setattr(moe_triton, "sort_by_expert", lambda *args: calls.append(args[0].numel()) or kernel(*args))
    router, gate_up, down = (t.bfloat16() for t in _weights())
    x, dy = (t.bfloat16() for t in _inputs(512, seed=5))
    results = []
    for choice in ("auto", "torch"):
        monkeypatch.setenv("MESHPPO_MOE_SORT", choice)
        leaves = [t.clone().requires_grad_() for t in (x, router, gate_up, down)]
        weights, experts = route(leaves[0], leaves[1], K, True)
        out = experts_forward(leaves[0], weights, experts, leaves[2], leaves[3])
        out.backward(dy)
        results.append([out.detach()] + [t.grad for t in leaves])
    assert calls == [512 * K]  # the default took the kernel, the forced torch path did not
    for a, b in zip(*results):
        assert torch.equal(a, b)
