"""A LoRA actor in the trainer (CPU, gloo, fp32, the tiny model): only the adapters train and
have optimizer state; the reference is the actor with its adapters off, no second model, and
its log-probs are bitwise those of a separately built frozen base model; a run resumed from a
checkpoint (adapters + optimizer + trainer state) reproduces the uninterrupted one; the end
of training writes the merged Hugging Face model and the peft adapter."""

import torch

from tests.dist_utils import run_distributed
from tests.e2e.conftest import assert_resumed_run_matches, assert_trains_only, checkpoint_keys, demo_args, demo_trainer
from tests.e2e.test_resume import LENGTH_REWARD
from trainer import cli

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=[q_proj, v_proj, down_proj]", "actor_rollout_ref.actor.optim.lr=1e-2"]
COMMON = ["trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.rollout.n=4", "trainer.logger=[jsonl]"]


def _reference_body(rank, world_size, assets, run_root):
    from models.lora import is_lora_name, lora_modules
    from sharding.fsdp import build_fsdp_model
    from trainer.roles import AdaptersOffReference, ReferencePolicy

    trainer = demo_trainer(assets, f"{run_root}/ref", f"{run_root}/reward.py", "trainer.total_training_steps=2",
                           "actor_rollout_ref.rollout.calculate_log_probs=true", *COMMON, *LORA)
    cfg, ctx, m = trainer.cfg, trainer.ctx, trainer.models
    assert m.ref is None and isinstance(trainer.ref, AdaptersOffReference)  # no second model
    trained = {n for n, _ in m.actor.named_parameters() if is_lora_name(n)}
    assert_trains_only(m.actor, m.actor_optim, trained)
    assert len(lora_modules(m.actor)) == 3 * m.actor_args.num_hidden_layers
    start = {n: p.to_local().detach().clone() for n, p in m.actor.named_parameters()}
    steps = [trainer.step() for _ in range(2)]
    now = {n: p.to_local().detach() for n, p in m.actor.named_parameters()}
    for n in start:  # the base is frozen bit for bit; the adapters moved
        assert torch.equal(start[n], now[n]) != (n in trained), n
    assert steps[1]["actor/ref_kl"] > 1e-6, steps[1]
    # the engine generates with the trained adapters merged: its log-probs are the actor's (fp32)
    assert steps[1]["rollout/logprob_diff"] < 1e-5, steps[1]["rollout/logprob_diff"]

    # a frozen base model built on its own, read through the same micro-batch loop
    arr = cfg.actor_rollout_ref
    base = build_fsdp_model(arr.model.path, m.meshes.train, arr.ref.fsdp_config, device=ctx.device, trainable=False,
                            seed=cfg.trainer.seed)
    separate = ReferencePolicy(base, device=ctx.device, packed=True, pad_token_id=trainer.pad_id,
                               temperature=arr.rollout.temperature, batching=trainer.ref.batching)
    ro, _ = trainer._partition(trainer._generate_all(trainer.loader.next_batch(), validate=False, seed=5))
    mask = ro.response_mask.bool()
    ref_lp, base_lp = trainer.ref.log_probs(ro), separate.log_probs(ro)
    actor_lp, _ = trainer.actor.log_probs(ro)
    assert torch.equal(ref_lp, base_lp), (ref_lp - base_lp).abs().max()
    # the adapters change the policy (and are back on): mean |gap| 0.016-0.018 measured, so an engine
    # generating without them would have shown a rollout/logprob_diff 1000x the bound above
    assert (actor_lp - ref_lp)[mask].abs().mean() > 1e-3
    assert all(mod.lora_enabled for mod in lora_modules(m.actor).values())


def test_lora_reference_is_the_actor_with_adapters_off(tiny_assets, tmp_path):
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    run_distributed(_reference_body, 2, str(tiny_assets), str(tmp_path), timeout=600)


def _run(assets, run, reward, *extra):
    code = cli.main(demo_args(assets, run, "trainer.n_gpus_per_node=1", f"custom_reward_function.path={reward}",
                              *COMMON, *LORA, *extra))
    assert code == 0


def test_lora_resume_reproduces_the_uninterrupted_run_and_exports_peft(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    from models import Transformer
    from models.lora import LoRAConfig, inject_lora, load_peft_adapter, read_peft_adapter

    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(tiny_assets, straight, reward, "trainer.total_training_steps=4")
    _run(tiny_assets, split, reward, "trainer.total_training_steps=2", "trainer.export_hf_at_end=false")
    saved = checkpoint_keys(split / "checkpoints" / "global_step_2")
    assert any(k.startswith("model.") for k in saved) and any(k.startswith("optim.") for k in saved), saved[:8]
    held = [k for k in saved if k.startswith(("model.", "optim.state.")) and "lora_" not in k]
    assert not held, f"the checkpoint holds base weights or their optimizer state: {held[:4]}"
    _run(tiny_assets, split, reward, "trainer.total_training_steps=4")  # resume_mode=auto: from global_step_2
    assert_resumed_run_matches(straight, split, 4)
    # each checkpoint also holds the adapters as a peft directory (actor/lora_adapter/, verl's model_merger's): step 4's
    # are the run's final export
    for step in (2, 4):
        assert read_peft_adapter(split / "checkpoints" / f"global_step_{step}" / "actor" / "lora_adapter")[0] == \
            LoRAConfig(4, 8.0, ["q_proj", "v_proj", "down_proj"])
    in_checkpoint = read_peft_adapter(split / "checkpoints" / "global_step_4" / "actor" / "lora_adapter")[1]
    exported = read_peft_adapter(split / "lora_adapter")[1]
    assert in_checkpoint.keys() == exported.keys()
    assert all(torch.equal(in_checkpoint[k], exported[k]) for k in exported)

    # the end of training: the merged model equals the base with the exported peft adapter
    cfg, tensors = read_peft_adapter(straight / "lora_adapter")
    assert cfg == LoRAConfig(4, 8.0, ["q_proj", "v_proj", "down_proj"])
    assert max(t.abs().max().item() for n, t in tensors.items() if n.endswith("lora_B")) > 1e-4  # trained
    adapted = Transformer.from_pretrained(tiny_assets / "sft_model")
    inject_lora(adapted, cfg)
    load_peft_adapter(adapted, straight / "lora_adapter")
    merged = Transformer.from_pretrained(straight / "hf_actor")
    ids = torch.randint(0, merged.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(ids), merged(ids)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

    # lora_adapter_path starts a run from that adapter: at lr 0 its export is the same model again. The
    # LoRA options at their defaults, as verl's example sets only the path: the adapter's own are used.
    again = tmp_path / "from_adapter"
    _run(tiny_assets, again, reward, "trainer.total_training_steps=1", "actor_rollout_ref.actor.optim.lr=0",
         "actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora_alpha=16",
         "actor_rollout_ref.model.target_modules=all-linear",
         f"actor_rollout_ref.model.lora_adapter_path={straight / 'lora_adapter'}")
    assert read_peft_adapter(again / "lora_adapter")[0] == cfg
    first, second = (load_file(str(d / "hf_actor" / "model.safetensors")) for d in (straight, again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
