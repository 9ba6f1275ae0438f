"""A LoRA actor on a CUDA GPU: the bf16 engine with merged adapters tracks the training forward
with adapters on, and the resharder leaves the base (the reference) untouched. Skipped without CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models import Transformer  # noqa: E402
from models.lora import LoRAConfig, adapters_disabled, inject_lora  # noqa: E402
from rollout import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from sharding import FSDPConfig, Resharder, build_fsdp_model, load_full_tensors, reshard_all  # noqa: E402
from tests.gpu.test_engine_gpu import _logprob_errors  # noqa: E402
from tests.gpu.test_sharding_gpu import SMALL, _peaky_weights  # noqa: E402
from tests.unit.test_engine import prompts_of  # noqa: E402

DEV = torch.device("cuda", 0)
LORA = LoRAConfig(rank=16, alpha=32)


@pytest.mark.parametrize("args", [SMALL, dataclasses.replace(SMALL, model_type="phi3", attention_bias=False)],
                         ids=["qwen2", "phi3"])
def test_bf16_engine_with_merged_adapters_tracks_the_adapted_training_forward(meshes, args):
    """(phi3: q / k / v and gate / up share one A each, peft's adapter of the fused projection; the resharder
    merges B_part @ A into each part)"""
    actor = build_fsdp_model(args, meshes.train, FSDPConfig(), lora=LORA, device=DEV)  # bf16 compute and base
    g = torch.Generator().manual_seed(4)
    tensors = [(n, 0.05 * torch.randn(t.shape, generator=g) if n.endswith((".lora_A", ".lora_B")) else t)
               for n, t in _peaky_weights(actor, seed=3)]
    load_full_tensors(actor, tensors)
    reshard_all(actor)
    before = {n: p.to_local().clone() for n, p in actor.named_parameters()}

    # The float32 truth: the same (bf16-stored) base and fp32 adapters, unmerged, in float32.
    ref32 = inject_lora(Transformer(args), LORA).to(DEV)
    missing, unexpected = ref32.load_state_dict({n: p.full_tensor().float() for n, p in actor.named_parameters()},
                                                strict=False)
    assert not unexpected and all(n.endswith(("k_proj.lora_A", "v_proj.lora_A", "up_proj.lora_A")) for n in missing)
    assert bool(missing) == (args.model_type == "phi3")  # (a shared A is listed once, under q's / gate's name)

    engine = LLMEngine(args, EngineConfig(dtype=torch.bfloat16, block_size=16, num_kv_blocks=64, max_num_seqs=16,
                                           max_model_len=256), tp_mesh=meshes.tp, device=DEV)
    stats = Resharder(actor, meshes, engine).reshard()
    assert stats.num_merged == args.num_hidden_layers * 7 and stats.num_wide == 0
    for n, p in actor.named_parameters():
        assert torch.equal(p.to_local(), before[n]), n  # the reference's weights are not written

    prompts = prompts_of([12, 30, 64, 7], seed=5)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=32, seed=1))

    def off(seq):
        with adapters_disabled(actor):
            return actor(seq)

    engine_err, train_err, base_err = _logprob_errors(outs, [ref32, actor, off])
    # As close to the truth as the bf16 training forward with adapters on (the bound of
    # tests/gpu/test_engine_gpu.py), and far closer than the base policy: the adapters are in.
    assert engine_err <= 1.5 * train_err + 1e-3, (engine_err, train_err)
    assert base_err > 10 * engine_err, (base_err, engine_err)
