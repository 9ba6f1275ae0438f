"""verl's `model.override_config` reaches every model the trainer builds (`trainer.setup.build_models`,
`build_engine`; one gloo rank): the actor, the reference and the engine with the actor's overrides, the
critic and the reward model with their own. Each model equals, in its arguments and its outputs, the
model built without overrides from a checkpoint whose config.json was written with the overridden
values; the actor's Hugging Face export carries them."""

from __future__ import annotations

import json
import os
import shutil

import torch

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# rope_theta of the checkpoints; the overrides of the actor, the critic and the reward model
THETA, ACTOR_THETA, CRITIC_THETA, RM_THETA = 10000.0, 500.0, 2000.0, 50.0
ACTOR_CONTEXT = 4096


def _write_checkpoints(root: str) -> None:
    """A causal LM (the actor's) and a value model (the critic's and the reward model's), each also
    as a copy of its weights under a config.json written with the rope_theta (and, for the actor,
    max_position_embeddings) that the overrides set. Weights of std 0.5 make attention sharp, so
    that the positions' rotation moves the outputs well above rounding."""
    from models import ModelArgs, Transformer

    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, rope_theta=THETA, initializer_range=0.5, eos_token_id=2)
    for name, head, seed in (("lm", "lm", 0), ("value", "value", 1)):
        Transformer.build(args, head=head, seed=seed).save_pretrained(os.path.join(root, name))
    for name, copy, changes in (("lm", "lm_actor", {"rope_theta": ACTOR_THETA,
                                                    "max_position_embeddings": ACTOR_CONTEXT}),
                                ("value", "value_critic", {"rope_theta": CRITIC_THETA}),
                                ("value", "value_rm", {"rope_theta": RM_THETA})):
        shutil.copytree(os.path.join(root, name), os.path.join(root, copy))
        path = os.path.join(root, copy, "config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(changes)
        if "rope_parameters" in config:  # transformers v5 writes rope_theta in both places
            config["rope_parameters"]["rope_theta"] = config["rope_theta"]
        with open(path, "w") as f:
            json.dump(config, f)


def _body(rank, world_size, root):
    from data.demo import build_demo_tokenizer
    from models import Transformer, load_model_args
    from models.transformer import rope_cos_sin, rope_inv_freq
    from trainer.checkpointing import export_hf
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.launch import init_distributed
    from trainer.setup import build_engine, build_models

    ctx = init_distributed("cpu")
    lm, value = os.path.join(root, "lm"), os.path.join(root, "value")
    cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), [
        "trainer.n_gpus_per_node=1", f"actor_rollout_ref.model.path={lm}", "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=true", f"critic.model.path={value}", "reward_model.enable=true",
        f"reward_model.model.path={value}", "reward_model.model.input_tokenizer=null",
        "critic.model.fsdp_config.mixed_precision.param_dtype=fp32",
        "reward_model.model.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.model.override_config={rope_theta: %g, max_position_embeddings: %d, "
        "attn_implementation: eager}" % (ACTOR_THETA, ACTOR_CONTEXT),
        f"critic.model.override_config.rope_theta={CRITIC_THETA}",
        f"+reward_model.model.override_config.rope_theta={RM_THETA}"])
    models = build_models(cfg, ctx, total_steps=1, tokenizer=None)
    engine = build_engine(cfg, ctx, models)

    ids = torch.tensor([[5, 9, 3, 17, 11, 4, 8, 30, 21, 6, 12, 40, 7, 13, 2, 19]])
    labels = torch.roll(ids, -1, dims=1)

    def outputs(model):
        with torch.no_grad():
            if model.head == "value":
                return model(ids).float()
            return model(ids, labels=labels)[0].float()

    checks = [("actor", models.actor, "lm", "lm_actor"), ("ref", models.ref, "lm", "lm_actor"),
              ("critic", models.critic, "value", "value_critic"), ("reward model", models.reward_model, "value",
                                                                     "value_rm")]
    for role, model, plain_dir, written_dir in checks:
        written = load_model_args(os.path.join(root, written_dir))
        assert model.args == written, (role, model.args, written)
        head = "value" if plain_dir == "value" else "lm"
        expected = outputs(Transformer.from_pretrained(os.path.join(root, written_dir), head=head))
        plain = outputs(Transformer.from_pretrained(os.path.join(root, plain_dir), head=head))
        got = outputs(model)
        # the override changes the outputs far above rounding; the written config gives the same ones
        assert (plain - expected).abs().max() > 0.05, (role, (plain - expected).abs().max())
        assert torch.allclose(got, expected, rtol=0, atol=1e-5), (role, (got - expected).abs().max())

    actor_written = load_model_args(os.path.join(root, "lm_actor"))
    assert models.actor_args == actor_written and engine.args == actor_written
    cos, _ = rope_cos_sin(rope_inv_freq(actor_written), torch.arange(engine.max_model_len), torch.float32)
    assert torch.equal(engine.model.cos, cos[:, :actor_written.head_dim // 2].contiguous())

    out = os.path.join(root, "export")
    export_hf(models.actor, models.actor_args, build_demo_tokenizer(), out, ctx.is_main)
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    assert (exported["rope_theta"], exported["max_position_embeddings"]) == (ACTOR_THETA, ACTOR_CONTEXT)
    assert "attn_implementation" not in exported
    assert load_model_args(out) == actor_written


def test_override_config_reaches_every_model(tmp_path):
    _write_checkpoints(str(tmp_path))
    run_distributed(_body, 1, str(tmp_path))
