"""What the tests of a model family's checkpoints (test_mistral.py, test_phi3.py, test_attention_window.py) hold
against transformers' implementation, in float64 on CPU: a transformers model with decisive random weights, its
logits over padded and packed batches, the engine's greedy tokens, the trainer's loading path and the export."""

import json
import types
from unittest import mock

import pytest
import torch

from models import Transformer, cu_seqlens_from_lengths

# float64: rounding is ~1e-15 of the logits (~1); a wrong architecture (a window, a head size, a bias, a row order)
# is off by > 1e-3
TOL = 1e-9
# the experts implementation of transformers' mixture-of-experts references: its default (grouped_mm) takes no float64
# on CPU; its eager loop is the reference
EAGER = {"experts_implementation": "eager"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: intra-op threads only add synchronisation (a test module takes it as `_one_thread = one_thread`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def randomized(model, dtype=torch.float64):
    """`model` (transformers') in eval mode and `dtype`, with random weights large enough that its logits are
    decisive (norm weights near 1)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval().to(dtype)


# transformers' attention that soft-caps its scores (Gemma 2's; its sdpa ignores attn_logit_softcapping) with its
# softmax in the scores' dtype (`eager_float64`): the `attn_implementation` of a capped reference.
EAGER_FLOAT64 = "eager_float64"


def _eager_float64(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager attention (Gemma2's `eager_attention_forward`: scores scaled, soft-capped, masked,
    softmax, times v; Gemma3's is the same) with its softmax taken in the scores' dtype, where transformers' takes it
    in float32: 1e-7 off a float64 model, far above TOL."""
    from transformers.models.gemma2 import modeling_gemma2

    softmax = torch.nn.functional.softmax
    with mock.patch.object(torch.nn.functional, "softmax", lambda x, dim, dtype=None: softmax(x, dim)):
        return modeling_gemma2.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_eager_float64():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(EAGER_FLOAT64, _eager_float64)
    AttentionMaskInterface.register(EAGER_FLOAT64, eager_mask)


def hf_causal_lm(config_cls, model_cls, dtype=torch.float64, attn_implementation: str = "sdpa", **config):
    """transformers' `model_cls` of `config_cls(**config)`, randomized, with sdpa attention (its eager attention takes
    the softmax in float32), or `EAGER_FLOAT64` (a soft-capped model's)."""
    if attn_implementation == EAGER_FLOAT64:
        _register_eager_float64()
    cfg = config_cls(**config)
    cfg._attn_implementation = attn_implementation
    return randomized(model_cls(cfg), dtype)


def check_padded_and_packed_logits(hf, ours, vocab: int) -> None:
    """meshppo's logits are `hf`'s on a left-padded batch (positions from the mask) and on packed sequences."""
    ids = torch.randint(0, vocab, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :15] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, position_ids=pos, attention_mask=mask)
        real = mask.bool()
        assert ref[real].abs().max() > 1  # decisive logits: the tolerance is far below their differences
        assert (got[real] - ref[real]).abs().max().item() <= TOL
        lengths = [5, 17, 1, 30]
        seqs = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
        cu = cu_seqlens_from_lengths(lengths)
        packed = ours(torch.cat(seqs)[None], cu_seqlens=cu)[0]
        for i, s in enumerate(seqs):
            assert (packed[cu[i]:cu[i + 1]] - hf(input_ids=s[None]).logits[0]).abs().max().item() <= TOL


def check_engine_greedy(hf, path, vocab: int):
    """The engine on the checkpoint at `path` (chunked prefill and preemption forced): greedy tokens are those of a
    no-cache loop over the training model, its log-probs the training forward's (to float32, which the engine
    returns them in), and `hf`'s logits pick the same tokens, each token's log-prob log_softmax of them (float64,
    returned in float32: within 1e-6, a greedy token's log-prob lying in [-log(vocab), 0]). Returns (engine,
    prompts, params, outputs)."""
    from rollout import SamplingParams
    from tests.unit.test_engine import check_against_training_forward, greedy_reference, make_engine

    model = Transformer.from_pretrained(path, dtype=torch.float64).eval()
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 7, 13, 29, 4)]
    engine = make_engine(model, dtype=torch.float64, num_kv_blocks=16, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert engine.last_stats["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(model, prompt, 10)
        check_against_training_forward(model, out, params, atol=1e-5)  # the engine returns float32 log-probs
        with torch.no_grad():
            hf_logits = hf(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        assert hf_logits.argmax(-1).tolist() == out.token_ids
        ref = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        worst = (torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs().max().item()
        assert worst <= 1e-6, worst
    return engine, prompts, params, outs


def check_flops_match_the_flop_counter(args, lora=None) -> None:
    """`args.flops` (3 rows of 40 tokens, the head on each row's last 24) is what PyTorch's FLOP counter counts in
    meshppo's model of `args` (relative 1e-9), on a forward and on a forward and backward; with `lora` (injected) on
    the forward and backward only (a LoRA forward is the base's formula). Accounted by hand beside the matmuls: the
    head's backward recomputes its logits (recomputation, not counted) and the norm weights are in N but run no
    matmul."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.lora import inject_lora

    batch, seq, response = 3, 40, 24
    ids = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    index = torch.cat([torch.arange(r * seq + seq - response, (r + 1) * seq) for r in range(batch)])
    for backward in (False, True) if lora is None else (True,):
        model = Transformer.build(args, seed=0)
        if lora is not None:
            inject_lora(model, lora, generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(backward):
            logp, _ = model(ids, labels=ids.reshape(-1)[index], label_index=index)
            if backward:
                logp.sum().backward()
        counts = counter.get_flop_counts()["Global"]
        counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0)
        if backward:
            counted -= 2 * args.hidden_size * args.vocab_size * batch * response
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        counted += (2 if not backward else 6 if lora is None else 4) * norms * batch * seq
        predicted = args.flops(batch * seq, batch * response, 0, backward=backward, lora=lora)
        assert abs(predicted - counted) / counted < 1e-9, (lora, backward, predicted, counted)


def trainer_loads_bit_for_bit(rank, world, path, model_type, head_dim, by_meshppo_names):
    """(a `run_distributed` body) The trainer's actor builder (FSDP over `world` gloo ranks) reads the checkpoint at
    `path` as transformers' AutoModelForCausalLM does: each tensor bit for bit, `by_meshppo_names(state_dict,
    config)` of transformers' state dict giving the tensors meshppo's names should hold."""
    import transformers

    from sharding import ParallelDims
    from tests.unit.test_bad_model_files import _cfg
    from trainer.setup import build_trained_model

    cfg = _cfg(f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
               "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32")
    mesh = ParallelDims(world).build_meshes("cpu").train
    model = build_trained_model(cfg, "actor", mesh, torch.device("cpu"))
    assert model.args.model_type == model_type and model.args.head_dim == head_dim
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = by_meshppo_names(hf.state_dict(), hf.config)
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert got.keys() == expected.keys()
    for k in got:  # every tensor as saved, bit for bit
        assert torch.equal(got[k], expected[k]), k


def unprefixed(state_dict, config):
    """transformers' state dict of a family whose modules meshppo names alike, by meshppo's names."""
    return {k.removeprefix("model."): v for k, v in state_dict.items()}


def check_in_memory_names_load(tmp_path, hf, path, ours) -> None:
    """A safetensors file of `hf`'s state dict (transformers 5's in-memory names: a mixture of experts' stacked
    `mlp.experts.gate_up_proj` / `down_proj`) beside the config.json at `path` loads as the checkpoint at `path` did
    into `ours`: each tensor bit for bit."""
    from safetensors.torch import save_file

    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    again = Transformer.from_pretrained(stacked, dtype=torch.float64)
    for name, p in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], p), name


def check_export_round_trip(tmp_path, base, family: str, vocab: int, token_classifier: bool = True,
                            hf_kwargs: dict | None = None) -> dict:
    """The trained-policy export (`trainer.checkpointing.export_hf`, which `tools.export_hf` runs) of the checkpoint
    at `base` writes a directory transformers loads as `<family>ForCausalLM` with meshppo's logits, and a value
    model of it exports as `<family>ForTokenClassification` with its scores (without `token_classifier`: a family
    transformers has none of, whose value model's export is refused, writing nothing). `hf_kwargs`: what
    transformers' from_pretrained takes beside the path (Qwen3-MoE's eager experts, which run in float64). Returns
    the written config.json and the reloaded causal LM."""
    import transformers

    from models.checkpoint import load_model_args
    from trainer.checkpointing import export_hf

    ours = Transformer.from_pretrained(base)
    saved = []  # where the export had the tokenizer write itself (its files are the tokenizer's business)
    out = tmp_path / "hf_actor"
    export_hf(ours, load_model_args(base), types.SimpleNamespace(save_pretrained=saved.append), str(out), True,
              base_model=str(base))
    assert len(saved) == 1 and saved[0] != str(base)  # into the export (its staging directory), not the base
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [f"{family}ForCausalLM"]
    hf_kwargs = hf_kwargs or {}
    again = transformers.AutoModelForCausalLM.from_pretrained(out, **hf_kwargs).eval()
    assert type(again).__name__ == f"{family}ForCausalLM"
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (again.double()(input_ids=ids).logits - ours.double()(ids)).abs().max().item() <= TOL

    critic = Transformer.from_pretrained(base, head="value")
    with torch.no_grad():
        critic.score.weight.normal_(0, 0.5)
    if not token_classifier:
        with pytest.raises(ValueError, match=f"transformers has no {family}ForTokenClassification"):
            critic.save_pretrained(tmp_path / "v")
        assert not (tmp_path / "v").exists()
        return written, again
    critic.save_pretrained(tmp_path / "v")
    scorer = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "v", **hf_kwargs).eval()
    assert type(scorer).__name__ == f"{family}ForTokenClassification"
    with torch.no_grad():
        assert (scorer.double()(input_ids=ids).logits[..., 0] - critic.double()(ids)).abs().max().item() <= TOL
    return written, again


def check_peft_adapter_round_trip(tmp_path, hf, path, model_type: str, vocab: int, target_modules: list[str],
                                  adapted: tuple[str, ...] | None = None, selected: str | list[str] = "all-linear"):
    """LoRA of `selected` (target_modules; rank 4, alpha 8, each B drawn from N(0, 0.3)) on the checkpoint at `path`:
    save_peft_adapter
    writes peft's adapter naming `target_modules`, which PeftModel.from_pretrained on `hf` (transformers' model of
    that checkpoint) reads with meshppo's logits (within TOL, the adapters moving them by > 1e-2), and which reads back
    (lora_adapter_path) into the same adapters. `adapted`: the modules of a layer (self_attn.q_proj, ...) whose
    lora_A / lora_B are the trainable parameters. Returns the model the adapter was read back into."""
    from models.lora import LoRAConfig, adapter_state_dict, inject_lora, load_peft_adapter, save_peft_adapter

    cfg = LoRAConfig(4, 8.0, target_modules=selected)
    ours = inject_lora(Transformer.from_pretrained(path, dtype=torch.float64), cfg, torch.Generator().manual_seed(0))
    if adapted is not None:
        assert {n.split(".", 2)[2] for n, p in ours.named_parameters() if p.requires_grad} == {
            f"{m}.{ab}" for m in adapted for ab in ("lora_A", "lora_B")}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
    save_peft_adapter(tmp_path / "adapter", adapter_state_dict(ours), cfg, model_type=model_type)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(written) == sorted(target_modules)
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, vocab, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        ref = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(input_ids=ids).logits
        assert (ref - base).abs().max() > 1e-2  # the adapters act
        assert (ours(ids) - ref).abs().max().item() <= TOL
    again = inject_lora(Transformer.from_pretrained(path, dtype=torch.float64), cfg)
    load_peft_adapter(again, tmp_path / "adapter")
    for name, p in adapter_state_dict(ours).items():
        assert torch.equal(adapter_state_dict(again)[name], p), name
    return again


def check_reward_model_score(tmp_path, hf, vocab: int) -> None:
    """`hf` (transformers' <Family>ForSequenceClassification with num_labels 1, a reward model's form), saved, loads
    as meshppo's value model: its score at a sequence's last token is `hf`'s logit (float64, within TOL; the logits
    beyond 1e-1)."""
    hf.save_pretrained(tmp_path / "rm")
    ours = Transformer.from_pretrained(tmp_path / "rm", dtype=torch.float64, head="value")
    ids = torch.randint(2, vocab, (3, 25), generator=torch.Generator().manual_seed(6))  # no pad id: the last token
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[:, 0]
        assert ref.abs().max() > 1e-1
        assert (ours(ids)[:, -1] - ref).abs().max().item() <= TOL


def check_hf_critic_refused_at_preflight(path, refusal: str):
    """A critic of the checkpoint at `path` (GAE) passes the pre-flight; with critic.checkpoint.save_contents naming
    hf_model it is refused, naming the key, with a message that `refusal` (a regular expression) matches after
    "has hf_model: "."""
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    critic = ("algorithm.adv_estimator=gae", f"critic.model.path={path}")
    preflight(_cfg(path, 16, 32, *critic), devices=False)
    with pytest.raises(ConfigError, match=r"^critic\.checkpoint\.save_contents=\[model, optimizer, extra, hf_model\] "
                                          r"has hf_model: " + refusal):
        preflight(_cfg(path, 16, 32, *critic, "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]"),
                  devices=False)
