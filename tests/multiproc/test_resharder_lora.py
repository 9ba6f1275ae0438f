"""The resharder gives the engine the adapted policy of a LoRA actor (gloo, CPU, 2 and 4 ranks, TP 1 and 2).

For each configuration: engine slots of adapted weights equal `base + scaling·B@A` of the full
tensors cast once to bf16, bitwise, on the zero-redundancy and the naive path, for a bf16 base
(merged in the slot) and an fp32 base (wider than the engine: merged from the base itself);
the base bytes still meet the zero-redundancy bound, the adapters are counted apart; greedy
tokens of an fp32 engine equal those of the unmerged, unsharded adapted model; the FSDP shards
(the reference's weights) are untouched.

Adapters with small dyadic entries make `B@A` exact in float32 whatever the order of the sums,
so the bitwise comparison does not depend on how a CPU's GEMM blocks a slice against the whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import Transformer
from models.lora import LoRAConfig, inject_lora, merge_weight, trainable_parameters
from rollout import SamplingParams
from sharding import FSDPConfig, ParallelDims, Resharder, build_fsdp_model, load_full_tensors, reshard_all
from tests.dist_utils import run_distributed
from tests.multiproc.test_resharder import MODELS, NEW_TOKENS, PROMPTS, _engine, _expected_slice, _greedy, _peaky_weights

LORA = {"even": LoRAConfig(rank=4, alpha=8),  # scaling 2: exact
        "uneven": LoRAConfig(rank=4, alpha=4, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])}


def _dyadic_adapters(model, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randint(-4, 5, p.shape, generator=g).float() / 16) for n, p in model.named_parameters()
            if n.endswith((".lora_A", ".lora_B"))]


def _base_weights(model, seed):
    return [(n, t) for n, t in _peaky_weights(model, seed) if not n.endswith((".lora_A", ".lora_B"))]


def _check(rank, world, fsdp_size, tp, kind, device="cpu"):
    """One configuration on `device` (the GPU check, tests/gpu/multi_gpu_checks.py, runs it over NCCL)."""
    device = torch.device(device)
    args, lora = MODELS[kind], LORA[kind]
    dims = ParallelDims(world, fsdp_size=fsdp_size, tp=tp)
    meshes = dims.build_meshes(device.type)
    tp_rank, S, t = dims.tp_rank(rank), dims.dp_shard, dims.tp
    n_adapted = args.num_hidden_layers * len(lora.targets)
    for base_dtype in ("bf16", "fp32"):
        cfg = FSDPConfig(fsdp_size=fsdp_size, mixed_precision={"param_dtype": base_dtype})
        model = build_fsdp_model(args, meshes.train, cfg, lora=lora, device=device)
        load_full_tensors(model, _base_weights(model, seed=3) + _dyadic_adapters(model, seed=4))
        assert {p.dtype for n, p in model.named_parameters() if not p.requires_grad} == \
            {torch.bfloat16 if base_dtype == "bf16" else torch.float32}
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        want = {n: v for n, v in full.items() if not n.endswith((".lora_A", ".lora_B"))}
        for n in list(want):
            mod = n[:-len(".weight")]
            if mod + ".lora_A" in full:
                want[n] = merge_weight(full[n], full[mod + ".lora_A"], full[mod + ".lora_B"], lora.scaling,
                                       torch.bfloat16)
        reshard_all(model)
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}

        engine = _engine(args, torch.bfloat16, meshes, device)
        resharder = Resharder(model, meshes, engine)
        for path in ("zero_redundancy", "naive"):
            for slot in engine.param_slots().values():
                slot.view.fill_(float("nan"))
            stats = resharder.reshard() if path == "zero_redundancy" else resharder.reshard_naive()
            for name, slot in engine.param_slots().items():
                expect = _expected_slice(want[name].to(torch.bfloat16), slot.shard_dim, tp_rank, t)
                assert torch.equal(slot.view, expect), (path, base_dtype, name, fsdp_size, tp)
            assert stats.num_merged == n_adapted
            if path == "zero_redundancy":
                fast = stats
        for n, p in model.named_parameters():
            assert torch.equal(p.to_local(), before[n]), n  # the reference's weights: never written

        # Adapters travel whole, once per layer, in fp32, counted apart from the base bytes.
        per_layer = sum(-(-p.shape[0] // S) * p.shape[1] for n, p in model.named_parameters()
                        if n.startswith("layers.0.") and n.endswith((".lora_A", ".lora_B")))
        assert fast.adapter_bytes_received == (S - 1) * per_layer * 4 * args.num_hidden_layers
        even = args.vocab_size % S == 0 and args.intermediate_size % S == 0
        if base_dtype == "bf16":
            assert fast.num_wide == 0
            if even:
                assert fast.bytes_received == fast.bytes_bound  # LoRA costs the base no redundancy
        else:  # an fp32 base cannot be merged from its bf16 cast: gathered whole in fp32, and counted
            assert fast.num_wide == (0 if dims.micro_dp == 1 else n_adapted)
            if dims.micro_dp > 1:
                assert fast.bytes_received > fast.bytes_bound

    # A training step moves only the adapters; the fp32 engine's greedy tokens then equal the
    # unmerged adapted model's (the fp32 `model` above: same base, same adapters).
    opt = torch.optim.SGD(trainable_parameters(model), lr=0.05)
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank)).to(device)
    F.cross_entropy(model(ids[:, :-1]).reshape(-1, args.vocab_size), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    reshard_all(model)
    for n, p in model.named_parameters():
        assert torch.equal(p.to_local(), before[n]) != p.requires_grad, n
    full = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    engine32 = _engine(args, torch.float32, meshes, device)
    Resharder(model, meshes, engine32).reshard()
    ref = inject_lora(Transformer(args), lora)
    ref.load_state_dict(full)
    outs = engine32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    want_tokens = [_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert [o.token_ids for o in outs] == want_tokens, (kind, fsdp_size, tp)
    base = Transformer(args)
    base.load_state_dict({n: v for n, v in full.items() if not n.endswith((".lora_A", ".lora_B"))})
    assert want_tokens != [_greedy(base, p, NEW_TOKENS) for p in PROMPTS]  # the adapters change the policy


def _body(rank, world, configs):
    for fsdp_size, tp, kind in configs:
        _check(rank, world, fsdp_size, tp, kind)
    dist.barrier()


def test_lora_reshard_2_ranks_tp1_tp2():
    run_distributed(_body, 2, [(-1, 1, "even"), (-1, 2, "even"), (-1, 1, "uneven")])


def test_lora_reshard_4_ranks_fsdp_and_hsdp_tp2():
    run_distributed(_body, 4, [(-1, 2, "even"), (2, 2, "even"), (-1, 1, "uneven")])

