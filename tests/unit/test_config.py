"""The config system: strict keys, types, choices, unsupported verl options, cross checks, CLI."""

import dataclasses
import os
from pathlib import Path
import subprocess
import sys

import pytest

from trainer.config import PPOConfig, config_notes, validate
from trainer.configlib import (ConfigError, build_dataclass, iter_options, load_config, parse_override, shown,
                               to_commented_yaml)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def test_demo_config_loads_and_validates():
    cfg = _cfg()
    validate(cfg, 2, 2)
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.uses_ref and not cfg.uses_critic


def test_the_default_run_directory_is_one_per_experiment():
    """Without trainer.default_local_dir, two experiments of a project get two run directories
    (verl's default is checkpoints/<project>/<experiment>): the second never resumes the first's
    checkpoint. A resolved config keeps it, and a set one stays as set."""
    first = load_config(PPOConfig, None, ["trainer.project_name=proj", "trainer.experiment_name=expA"])
    second = load_config(PPOConfig, None, ["trainer.project_name=proj", "trainer.experiment_name=expB"])
    assert (first.trainer.default_local_dir, second.trainer.default_local_dir) == (os.path.join("runs", "proj", "expA"),
                                                                                   os.path.join("runs", "proj", "expB"))
    assert build_dataclass(PPOConfig, dataclasses.asdict(second)) == second
    assert _cfg("trainer.experiment_name=expB").trainer.default_local_dir == "runs/demo"  # the demo's own


def test_dotted_override_types():
    cfg = _cfg("trainer.total_training_steps=7", "actor_rollout_ref.actor.optim.lr=3e-5",
               "trainer.logger=[console]", "actor_rollout_ref.rollout.top_k=5")
    assert cfg.trainer.total_training_steps == 7
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.trainer.logger == ["console"]
    assert cfg.actor_rollout_ref.rollout.top_k == 5


@pytest.mark.parametrize("override,message", [
    ("actor_rollout_ref.actor.ppo_mini_batchsize=4", "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'"),
    ("trainer.total_epoch=3", "did you mean 'trainer.total_epochs'"),
    ("algorithm.kl_ctrl.kl_coeff=0.1", "did you mean 'algorithm.kl_ctrl.kl_coef'"),
    ("trainer.total_training_steps=abc", "trainer.total_training_steps: expected an integer"),
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "expected true or false"),
    ("actor_rollout_ref.rollout.name=tgi", "'tgi' is not one of ['native', 'hf', 'vllm', 'sglang', 'trtllm']"),
    ("algorithm.adv_estimator=ppo2", "is not one of"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=0", "out of range; allowed: >= 1"),
    ("actor_rollout_ref.model.lora_rank=-1", "actor_rollout_ref.model.lora_rank: -1 is out of range; allowed: >= 0"),
    ("actor_rollout_ref.model.lora_rank=2.5", "actor_rollout_ref.model.lora_rank: expected an integer"),
    ("actor_rollout_ref.model.lora_alpha=0", "actor_rollout_ref.model.lora_alpha: 0.0 is out of range; allowed: > 0"),
    ("actor_rollout_ref.actor.fsdp_config.wrap_policy={foo: 1}", "not supported"),
    ("noequals", "must look like dotted.key=value"),
    ("actor_rollout_ref.actor.optim.lr=-1e-6", "actor_rollout_ref.actor.optim.lr: -1e-06 is out of range; allowed: >= 0"),
    ("actor_rollout_ref.actor.clip_ratio=0", "actor_rollout_ref.actor.clip_ratio: 0.0 is out of range; allowed: (0, 1]"),
    ("actor_rollout_ref.actor.clip_ratio_c=0", "clip_ratio_c: 0.0 is out of range; allowed: > 0"),
    ("algorithm.gamma=1.5", "algorithm.gamma: 1.5 is out of range; allowed: [0, 1]"),
    ("algorithm.lam=-0.1", "algorithm.lam: -0.1 is out of range; allowed: [0, 1]"),
    ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef: -1.0 is out of range; allowed: >= 0"),
    ("algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl: 0.0 is out of range; allowed: > 0"),
    ("actor_rollout_ref.actor.kl_loss_coef=-0.1", "kl_loss_coef: -0.1 is out of range; allowed: >= 0"),
    ("actor_rollout_ref.rollout.temperature=-1", "rollout.temperature: -1.0 is out of range; allowed: >= 0"),
    ("actor_rollout_ref.rollout.top_p=0", "rollout.top_p: 0.0 is out of range; allowed: (0, 1]"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "gpu_memory_utilization: 1.5 is out of range; allowed: (0, 1]"),
    ("data.train_batch_size=0", "data.train_batch_size: 0 is out of range; allowed: >= 1"),
    ("critic.ppo_micro_batch_size_per_gpu=0", "critic.ppo_micro_batch_size_per_gpu: 0 is out of range"),
    ("actor_rollout_ref.actor.optim.betas=[0.9, 1.0]", "optim.betas[1]: 1.0 is out of range; allowed: [0, 1)"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "optim.betas: expected a list of 2 values"),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes=[1, 0]", "cudagraph_capture_sizes[1]: 0 is out of range"),
    # an empty ladder failed in the engine, after the models loaded
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes=[]", "actor_rollout_ref.rollout.cudagraph_capture_sizes=[] "
                                                             "lists no decode batch size to capture"),
    ("algorithm.gamma=.nan", "algorithm.gamma: expected a finite number, got nan"),
    ("trainer.preemption_grace_s=-5", "trainer.preemption_grace_s: -5.0 is out of range; allowed: >= 0"),
    # a string option keeps an override's text (2025-01-01 stays a string); the others still reject text
    ("trainer.seed=abc", "trainer.seed: expected an integer, got 'abc'"),
    ("trainer.seed=on", "trainer.seed: expected an integer, got True"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr: expected a number, got 'fast'"),
    ("trainer.experiment_name=null", "trainer.experiment_name: expected a string, got None"),
    # verl's data options that meshppo has no use for: accepted at verl's default only
    ("data.trust_remote_code=true", "data.trust_remote_code"),
    ("data.return_full_prompt=true", "data.return_full_prompt"),
    ("data.validation_shuffle=true", "data.validation_shuffle"),
    ("data.truncation=center", "'center' is not one of ['error', 'left', 'right', 'middle']"),
    # Hydra's {key:value} is one key without a value in YAML: a free-form option passed it on silently
    ("data.apply_chat_template_kwargs={enable_thinking:false}",
     "{enable_thinking:false} is one key with no value in YAML; write {enable_thinking: false}"),
    ("actor_rollout_ref.actor.optim={lr:1e-5}", "write {lr: 1e-5} (a space after the colon)"),
])
def test_bad_overrides_name_the_problem(override, message):
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert message in str(e.value)


def test_an_unsupported_value_is_refused_with_what_the_option_takes():
    """The refusal carries the option's own account of what it takes and why (its help text), not only
    'not supported'."""
    for override, message in (
            ("data.validation_shuffle=true", "data.validation_shuffle=true is not supported by meshppo: must be false "
                                             "(validation prompts go in file order, or in the order val_max_samples "
                                             "drew them)"),
            ("data.trust_remote_code=true", "data.trust_remote_code=true is not supported by meshppo (tokenizers load "
                                            "without remote code): must be false"),
            ("actor_rollout_ref.model.external_lib=x",
             "actor_rollout_ref.model.external_lib=x is not supported by meshppo")):
        with pytest.raises(ConfigError) as e:
            _cfg(override)
        assert str(e.value) == message


def test_clip_ratio_c_at_or_below_1_truncates_dppos_ratio():
    """verl asserts clip_ratio_c > 1 in its dual-clip (vanilla) loss only: dppo_tv / dppo_kl take it as the bound of
    their truncated ratio, 1 or less included; bypass mode's reinforce does not read it."""
    for mode in ("dppo_tv", "dppo_kl"):
        cfg = _cfg(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", "actor_rollout_ref.actor.clip_ratio_c=0.8")
        validate(cfg)
        assert cfg.actor_rollout_ref.actor.clip_ratio_c == 0.8
    validate(_cfg("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
                  "actor_rollout_ref.actor.clip_ratio_c=1.0"))
    with pytest.raises(ConfigError, match="clip_ratio_c=1.0 with policy_loss.loss_mode=vanilla"):
        validate(_cfg("algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.actor.clip_ratio_c=1.0"))


@pytest.mark.parametrize("overrides,message", [
    (["data.train_batch_size=30"], "must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size"),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "actor_rollout_ref.actor.clip_ratio_c=0.5 with policy_loss.loss_mode="
                                                   "vanilla: the dual clip's bound on a negative advantage's ratio must "
                                                   "be > 1"),
    (["actor_rollout_ref.model.lora_adapter_path=/x"],
     "actor_rollout_ref.model.lora_adapter_path: lora_adapter_path '/x' has no adapter_config.json"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], "tensor_model_parallel_size=3 must divide the FSDP "
                                                                 "shard-group size"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=48"], "multiple of"),
    (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=grpo_passk"], "grpo_passk needs groups"),
    (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=opo"], "opo needs groups"),
    (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=rloo_vectorized"], "rloo_vectorized needs groups"),
    (["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.temperature=0"],
     "every response is remax's greedy baseline itself"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=33", "actor_rollout_ref.rollout.n=2",
      "trainer.n_gpus_per_node=4"], "must split evenly over 4 ranks"),
    (["reward_model.enable=true"], "needs reward_model.model.path"),
    (["algorithm.use_pf_ppo=true"], "algorithm.use_pf_ppo=true with algorithm.adv_estimator=grpo: verl redraws the "
                                    "batch for gae only"),
    (["data.train_max_samples=100", "data.seed=null"], "data.train_max_samples=100 with data.shuffle=true and "
                                                        "data.seed=null: verl draws that subset unseeded"),
    (["data.val_max_samples=5", "data.seed=null"], "data.val_max_samples=5 with data.shuffle=true and data.seed=null"),
    (["custom_reward_function.reward_kwargs={scale: 2}"], "custom_reward_function.reward_kwargs is set but "
                                                          "custom_reward_function.path is not"),
    (["trainer.resume_from_path=/x/global_step_5", "trainer.resume_mode=disable"],
     "trainer.resume_from_path is set but trainer.resume_mode=disable does not read it"),
    # greedy decoding: the n responses of a group are identical, every group advantage is zero
    (["actor_rollout_ref.rollout.temperature=0"], "rollout.temperature=0 decodes greedily"),
    (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.do_sample=false"],
     "rollout.do_sample=false with rollout.name=hf decodes greedily"),
    (["actor_rollout_ref.actor.fsdp_config.fsdp_size=3", "trainer.n_gpus_per_node=4"],
     "fsdp_size=3 does not divide the world size 4"),
    (["trainer.val_only=true", "trainer.resume_mode=disable"], "trainer.val_only=true with "
                                                                 "trainer.resume_mode=disable would delete the run"),
    (["actor_rollout_ref.ref.fsdp_config.fsdp_size=1"], "actor_rollout_ref.ref.fsdp_config.fsdp_size=1: every model "
                                                        "shares the actor's training mesh, shard groups of 2 ranks "
                                                        "(actor_rollout_ref.actor.fsdp_config.fsdp_size=-1); use -1 or 2"),
    # two nodes of 4: a TP group of 8 would span both
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=8"],
     "larger than the 4 ranks of one node"),
    # engine options with no engine, and an e4m3 KV cache under a float16 engine
    (["actor_rollout_ref.rollout.quantization=fp8", "actor_rollout_ref.rollout.name=hf"],
     "rollout.quantization=fp8 needs rollout.name=native"),
    (["actor_rollout_ref.rollout.kv_cache_dtype=fp8", "actor_rollout_ref.rollout.name=hf"],
     "rollout.kv_cache_dtype=fp8 needs rollout.name=native"),
    # TP with the plain loop: every rank would generate every prompt (same outputs, twice the work)
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=hf"],
     "rollout.tensor_model_parallel_size=2 needs rollout.name=native"),
    (["actor_rollout_ref.rollout.kv_cache_dtype=fp8", "actor_rollout_ref.rollout.dtype=float16"],
     "kv_cache_dtype=fp8 needs rollout.dtype bfloat16 or float32"),
    # an engine context shorter than the longest admitted prompt + the response budget
    (["data.max_prompt_length=64", "actor_rollout_ref.rollout.prompt_length=63"],
     "actor_rollout_ref.rollout.prompt_length=63 is below data.max_prompt_length=64"),
    (["data.max_prompt_length=64", "data.max_response_length=32", "actor_rollout_ref.rollout.max_model_len=95"],
     "actor_rollout_ref.rollout.max_model_len=95 is below data.max_prompt_length + rollout.response_length = 64 + 32"),
    # without chunked prefill a prompt must fit in one step: the engine refused it after the models were built
    (["actor_rollout_ref.rollout.enable_chunked_prefill=false", "actor_rollout_ref.rollout.max_num_batched_tokens=10"],
     "actor_rollout_ref.rollout.enable_chunked_prefill=false with max_num_batched_tokens=10 < max_model_len="),
    # a temperature whose reciprocal overflows float32 failed at the first rollout
    (["actor_rollout_ref.rollout.temperature=1e-40"], "actor_rollout_ref.rollout.temperature=1e-40: a positive "
                                                      "temperature below 1e-06 is greedy decoding in all but name"),
    (["actor_rollout_ref.rollout.val_kwargs.temperature=1e-9"], "actor_rollout_ref.rollout.val_kwargs.temperature=1e-09"),
    # the critic's micro-batch: unset, or not dividing, each said with its numbers (one vague message before)
    (["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=true",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "critic.use_dynamic_bsz=false"],
     "set critic.ppo_micro_batch_size_per_gpu or critic.use_dynamic_bsz=true"),
    (["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=3"],
     "critic sequences per rank per mini-batch (64) must be a multiple of critic.ppo_micro_batch_size_per_gpu (3)"),
    # the log-prob forwards without a size or dynamic batching ran a rank's whole share at once (verl refuses them)
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
      "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"],
     "set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu or log_prob_use_dynamic_bsz=true (null "
     "inherits actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, null here)"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
      "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false"],
     "set actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu or log_prob_use_dynamic_bsz=true (null inherits "
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu, null here)"),
])
def test_impossible_combinations(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(*overrides))
    assert message in str(e.value)


def test_a_models_fsdp_size_may_name_the_actors_mesh_either_way():
    """On 2 ranks -1 and 2 are the same shard groups (FULL_SHARD): a reference or critic may say
    either, whichever the actor says."""
    for actor in ("-1", "2"):
        for other in ("-1", "2"):
            validate(_cfg(f"actor_rollout_ref.actor.fsdp_config.fsdp_size={actor}",
                          f"actor_rollout_ref.ref.fsdp_config.fsdp_size={other}",
                          f"critic.model.fsdp_config.fsdp_size={other}"))


def test_an_fsdp_size_above_the_launch_shards_over_every_rank_as_verl():
    """verl's device mesh reads an fsdp_size of at least the world size as FULL_SHARD (its 8-node
    scripts set 32): on the demo's 2 ranks each model's 8 or 32 resolves to -1, so the reference's and
    critic's agree with the actor's mesh and apply_fsdp gets -1, and the start-up notes say so."""
    cfg = _cfg("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.fsdp_config.fsdp_size=32",
               "actor_rollout_ref.ref.fsdp_config.fsdp_size=8", "critic.model.fsdp_config.fsdp_size=2")
    validate(cfg, 2, 2)
    arr = cfg.actor_rollout_ref
    assert (arr.actor.fsdp_config.fsdp_size, arr.ref.fsdp_config.fsdp_size, cfg.critic.model.fsdp_config.fsdp_size) \
        == (-1, -1, 2)
    notes = [n for n in config_notes(cfg) if "fsdp_size" in n]
    assert notes == [f"actor_rollout_ref.{role}.fsdp_config.fsdp_size={size} is more than the 2 ranks of this launch: "
                     f"the models shard over all 2 (FULL_SHARD), as verl does for an fsdp_size of at least the world "
                     "size" for role, size in (("actor", 32), ("ref", 8))]
    assert build_dataclass(PPOConfig, dataclasses.asdict(cfg)) == cfg


ULYSSES_REPRO = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                 "actor_rollout_ref.rollout.n=3"]


@pytest.mark.parametrize("role, sp_key, micro_key", [
    ("actor", "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("critic", "critic.ulysses_sequence_parallel_size", "critic.ppo_micro_batch_size_per_gpu"),
])
def test_a_ulysses_mini_batch_splits_over_the_data_parallel_groups(role, sp_key, micro_key):
    """A Ulysses group's ranks pool their rows, so a mini-batch splits over world / sp groups (verl's
    engine divides it by its data-parallel size): on 2 ranks in one group of 2, 1 prompt x 3 responses is
    one group's 3 sequences, which micro-batches of 3 cut. It was refused as 3 sequences over 2 ranks.
    The micro-batch check that follows still reads the group's share; 4 ranks in 2 groups are 2 shares."""
    # the critic's own mini-batch of 1 prompt, the actor's of 2 (6 sequences: one share of 3 per group)
    own = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"] if role == "critic" else []
    validate(_cfg(*ULYSSES_REPRO, *own, f"{sp_key}=2", f"{micro_key}=3"), 2, 2)
    where = "critic " if role == "critic" else ""
    with pytest.raises(ConfigError, match=rf"{where}sequences per group of 2 ranks \(Ulysses\) per mini-batch \(3\) must "
                                          rf"be a multiple of {micro_key} \(2\)"):
        validate(_cfg(*ULYSSES_REPRO, *own, f"{sp_key}=2", f"{micro_key}=2"))
    mini = "critic.ppo_mini_batch_size" if role == "critic" else "actor_rollout_ref.actor.ppo_mini_batch_size"
    with pytest.raises(ConfigError, match=rf"= 3 sequences must split evenly over 2 data-parallel groups \(4 ranks in "
                                          rf"Ulysses groups of 2\): change {mini}$"):
        validate(_cfg(*ULYSSES_REPRO, *own, "data.train_batch_size=4", "trainer.n_gpus_per_node=4", f"{sp_key}=2",
                      f"{micro_key}=3"))
    with pytest.raises(ConfigError, match=rf"= 3 sequences must split evenly over 2 ranks: change {mini}$"):
        validate(_cfg(*ULYSSES_REPRO, *own, f"{micro_key}=3"))


def test_lora_options_build_the_actor_lora_config():
    cfg = _cfg("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[v_proj, q_proj]")
    validate(cfg)
    lora = cfg.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.targets) == (8, 16.0, ("q_proj", "v_proj"))
    assert _cfg().actor_rollout_ref.model.lora is None
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model: target_modules has \['qkv'\]"):
        _cfg("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj, qkv]")


def test_exclude_modules_takes_projections_out_of_the_actor_and_critic_lora_as_in_peft():
    """verl 0.9.1 passes model.exclude_modules (actor and critic) to peft's LoraConfig; it was refused.
    Now peft's reading: a regex re.fullmatch'ed on whole names, a list entry the name or its end after a dot."""
    A, C = "actor_rollout_ref.model", "critic.model"
    cfg = _cfg(f"{A}.lora_rank=8", f"{A}.exclude_modules=[mlp.down_proj, o_proj]", f"{C}.lora_rank=4",
               f"{C}.target_modules=[q_proj, v_proj, up_proj]", rf"{C}.exclude_modules=.*\.mlp\..*",
               "algorithm.adv_estimator=gae")
    validate(cfg)
    assert cfg.actor_rollout_ref.model.lora.targets == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert cfg.critic.model.lora.targets == ("q_proj", "v_proj")
    with pytest.raises(ConfigError, match=rf"^{A}: exclude_modules has \['q_prj'\], which names no module"):
        _cfg(f"{A}.lora_rank=8", f"{A}.exclude_modules=[q_prj]")
    with pytest.raises(ConfigError, match=rf"^{C}: target_modules='all-linear' with exclude_modules="
                                          r"\['layers.0.mlp.up_proj'\] selects"):
        _cfg(f"{C}.lora_rank=8", f"{C}.exclude_modules=[layers.0.mlp.up_proj]", "algorithm.adv_estimator=gae")
    assert [n for n in config_notes(_cfg(f"{A}.exclude_modules=[o_proj]")) if "exclude_modules" in n] == [
        f"{A}.exclude_modules=[o_proj] has no effect: {A}.lora_rank=0 (no LoRA adapters)"]


def test_lora_adapter_path_gives_lora_its_rank_alpha_and_targets_as_in_verl(tmp_path):
    """verl turns LoRA on for a lora_adapter_path and takes r, lora_alpha and target_modules from the
    adapter (PeftModel.from_pretrained), whatever lora_rank says: its example that continues from an
    adapter sets no lora_rank. meshppo refused lora_rank 0, then any configured value the adapter did
    not share. Now the adapter's are used; a configured value that differs is said at start-up, as is a
    dropout the adapter was trained with."""
    import json

    import torch
    from models.lora import LoRAConfig, save_peft_adapter
    from trainer.config import config_notes

    adapter = tmp_path / "adapter"
    save_peft_adapter(adapter, {"layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 8)},
                      LoRAConfig(4, alpha=8.0, target_modules=["q_proj", "v_proj"]), model_type="qwen2")
    key = "actor_rollout_ref.model"

    def notes(*overrides):
        cfg = _cfg(f"{key}.lora_adapter_path={adapter}", *overrides)
        validate(cfg)
        assert cfg.actor_rollout_ref.model.lora == LoRAConfig(4, alpha=8.0, target_modules=["q_proj", "v_proj"])
        return [n for n in config_notes(cfg) if "lora_adapter_path" in n]

    assert notes() == []  # verl's example: only the path
    assert notes(f"{key}.lora_rank=4", f"{key}.lora_alpha=8", f"{key}.target_modules=[v_proj,q_proj]") == []
    assert notes(f"{key}.target_modules=[q_proj,v_proj,o_proj]", f"{key}.exclude_modules=[o_proj]") == []
    assert notes(f"{key}.exclude_modules=[o_proj]") == [
        f"{key}.exclude_modules=[o_proj] not used: the adapter at {key}.lora_adapter_path has r=4, lora_alpha=8 and "
        "target_modules=[q_proj, v_proj], which LoRA takes (as in verl)"]
    # not read, so not refused (an error escaped the start-up notes, naming no key)
    assert notes(f"{key}.target_modules=[lm_head]", f"{key}.exclude_modules=[qq]") == [
        f"{key}.target_modules=[lm_head], exclude_modules=[qq] not used: the adapter at {key}.lora_adapter_path "
        "has r=4, lora_alpha=8 and target_modules=[q_proj, v_proj], which LoRA takes (as in verl)"]
    assert notes(f"{key}.lora_rank=8", f"{key}.lora_alpha=32", f"{key}.target_modules=[q_proj]") == [
        f"{key}.lora_rank=8, lora_alpha=32.0, target_modules=[q_proj] not used: the adapter at "
        f"{key}.lora_adapter_path has r=4, lora_alpha=8 and target_modules=[q_proj, v_proj], which LoRA takes "
        "(as in verl)"]
    raw = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**raw, "lora_dropout": 0.05}))
    assert notes() == [f"the adapter at {key}.lora_adapter_path was trained with lora_dropout=0.05: meshppo's "
                       "adapters have no dropout, so its training continues without it"]
    # an option meshppo's adapters lack, peft's newer ones too, is refused naming the key
    for extra in ({"alora_invocation_tokens": [7, 8]}, {"use_dora": True}, {"some_future_option": 1}):
        (adapter / "adapter_config.json").write_text(json.dumps({**raw, **extra}))
        (name, value), = extra.items()
        with pytest.raises(ConfigError, match=rf"^{key}.lora_adapter_path: .*adapter_config.json: {name}="
                                              rf"{value!r} is not supported by meshppo's LoRA$".replace("[", r"\[")):
            validate(_cfg(f"{key}.lora_adapter_path={adapter}"))
    (adapter / "adapter_config.json").write_text(json.dumps({**raw, "qalora_group_size": 16, "megatron_core":
                                                             "megatron.core", "use_qalora": False}))
    assert notes() == []  # peft's defaults of options that are off
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"^{key}.lora_adapter_path: lora_adapter_path '{empty}' has no "
                                          r"adapter_config.json$"):
        validate(_cfg(f"{key}.lora_adapter_path={empty}"))


def test_greedy_rollouts_without_groups_are_valid():
    validate(_cfg("actor_rollout_ref.rollout.temperature=0", "algorithm.adv_estimator=gae",
                  "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"))


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml")))
def test_shipped_configs_validate_against_the_launch_they_describe(name):
    cfg = load_config(PPOConfig, os.path.join(ROOT, "configs", name))
    validate(cfg)
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    validate(cfg, world, cfg.trainer.n_gpus_per_node)  # the real launch, when it matches
    with pytest.raises(ConfigError, match=f"this launch has {world + 1} processes but the config describes"):
        validate(cfg, world + 1)


def test_the_launch_must_match_the_config():
    with pytest.raises(ConfigError, match="1 process per node but the config describes trainer.n_gpus_per_node = 2"):
        validate(_cfg("trainer.nnodes=2", "trainer.n_gpus_per_node=2", "data.train_batch_size=32"), 4, 1)
    # several nodes launched on one (the single-node launcher): the advice is the multi-node launch
    with pytest.raises(ConfigError) as e:
        validate(_cfg("trainer.nnodes=2", "trainer.n_gpus_per_node=2", "data.train_batch_size=32"), 2, 2)
    assert "launch trainer.nnodes=2 nodes of n_gpus_per_node ranks each (launch/slurm/multi_node.sbatch" in str(e.value)
    assert "run_single_node" not in str(e.value)


def test_offload_policy_supersedes_the_manual_offloads():
    """verl's FSDP2 recipe sets offload_policy with param_offload: accepted, as in verl, with one note."""
    key = "actor_rollout_ref.actor.fsdp_config"
    cfg = _cfg(f"{key}.offload_policy=true", f"{key}.param_offload=true", f"{key}.optimizer_offload=true")
    fc = cfg.actor_rollout_ref.actor.fsdp_config
    assert fc.offload_policy and not fc.param_offload and not fc.optimizer_offload
    assert config_notes(cfg) == [
        f"{key}.offload_policy=true supersedes param_offload=true and optimizer_offload=true (as in verl): parameters, "
        "gradients and optimizer states stay on CPU for the whole run (FSDP2 CPUOffloadPolicy) and are not moved "
        "between phases"]
    assert config_notes(_cfg(f"{key}.offload_policy=true")) == []
    ref = "actor_rollout_ref.ref.fsdp_config"  # a frozen model (the demo's KL reference): parameters only
    assert config_notes(_cfg(f"{ref}.offload_policy=true", f"{ref}.param_offload=true")) == [
        f"{ref}.offload_policy=true supersedes param_offload=true (as in verl): its parameters stay on CPU for the whole "
        "run (FSDP2 CPUOffloadPolicy) and are not moved between phases"]


def test_fsdp_options_of_models_the_run_does_not_build_are_unread():
    """A model the run does not build (the critic without gae, the reward model without reward_model.enable, the
    reference without KL or under LoRA) reads no fsdp_config: its offload_policy, an fsdp_size past the launch or
    one that differs from the actor's mesh are named once as unread, not said to keep states on CPU or to shard
    over every rank, and not refused as a mesh mismatch."""
    c, r = "critic.model.fsdp_config", "reward_model.model.fsdp_config"
    cfg = _cfg(f"{c}.offload_policy=true", f"{c}.param_offload=true", f"{c}.fsdp_size=8", f"{r}.offload_policy=true",
               f"{r}.fsdp_size=1")
    validate(cfg, 2, 2)
    assert config_notes(cfg) == [  # (param_offload too, which offload_policy would supersede: said once)
        f"{c}.param_offload=true, {c}.offload_policy=true, {c}.fsdp_size=8 has no effect: algorithm.adv_estimator=grpo "
        "trains no critic",
        f"{r}.offload_policy=true, {r}.fsdp_size=1 has no effect: reward_model.enable is false"]
    ref = "actor_rollout_ref.ref.fsdp_config"
    assert config_notes(load_config(PPOConfig, None, [f"{ref}.offload_policy=true", f"{ref}.param_offload=true",
                                                      f"{r}.offload_policy=true", f"{r}.optimizer_offload=true"])) == [
        f"{r}.optimizer_offload=true, {r}.offload_policy=true has no effect: reward_model.enable is false",
        f"{ref}.param_offload=true, {ref}.offload_policy=true has no effect: the run has no reference "
        "(actor_rollout_ref.actor.use_kl_loss=false, algorithm.use_kl_in_reward=false)"]
    ref = "actor_rollout_ref.ref.fsdp_config"
    lora = _cfg("actor_rollout_ref.model.lora_rank=8", f"{ref}.fsdp_size=1")
    validate(lora, 2, 2)
    assert config_notes(lora) == ["actor_rollout_ref.ref.fsdp_config unused: with LoRA the reference is the actor "
                                  "with its adapters off, not a model of its own"]
    with pytest.raises(ConfigError, match=r"critic.model.fsdp_config.fsdp_size=1: every model shares the actor's"):
        validate(_cfg("algorithm.adv_estimator=gae", f"{c}.fsdp_size=1"), 2, 2)  # a critic the run builds


@pytest.mark.parametrize("logger,package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_preflight_names_a_missing_logger_package(monkeypatch, logger, package):
    import importlib.util

    from trainer import setup

    real = importlib.util.find_spec
    monkeypatch.setattr(setup.importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError, match=f"trainer.logger includes {logger} but the {package} package is not "
                                          f"installed"):
        setup.preflight(_cfg(f"trainer.logger=[console, {logger}]"))
    setup.preflight(_cfg("trainer.logger=[console, jsonl]"))


def test_every_option_is_documented():
    missing = [key for key, _, _, help_ in iter_options(PPOConfig) if not help_]
    assert not missing, f"options without a help line: {missing}"


def test_commented_yaml_round_trips():
    import yaml

    cfg = _cfg("trainer.total_training_steps=3")
    text = to_commented_yaml(cfg)
    again = build_dataclass(PPOConfig, yaml.safe_load(text))
    assert again == cfg


def test_parse_override_yaml_values():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=null") == (["a"], None)


_SHOWN_TEXTS = ["vllm", "", "1", "1.5", "1e-3", "true", "on", "null", "~", "2025-01-01", "a, b", "x: y", "a:b", "[x]",
                "{x}", "#c", "a#b", " lead", "trail ", "- x", "*a", "&a", "!t", "'", '"', "it's", "a=b", "line\nbreak",
                "tab\t", "é"]


@pytest.mark.parametrize("value", [
    None, True, False, 0, -3, 2**70, 0.3, 1e-05, -2.5e+20, 100.0, float("inf"), float("-inf"), [], {},
    *_SHOWN_TEXTS, [*_SHOWN_TEXTS], {t or "k": t for t in _SHOWN_TEXTS},
    ["model", "extra"], {"gpu_memory_utilization": 0.3, "x": None, "on": [1e-5, True, None, "1", {"a, b": ["x: y"]}]},
    {1: "one", "nested": {"deeper": [[], {}, [["true", 2]]]}},
])
def test_a_value_as_a_message_spells_it_reads_back_as_an_override(value):
    """`shown(value)`, a message's `key=value`, pasted back as an override gives the same value."""
    assert parse_override(f"k={shown(value)}") == (["k"], value)


def test_a_value_as_a_message_spells_it():
    """Lists and mappings as a dotted override writes them (YAML's flow style), not Python's repr."""
    assert shown(["model", "extra"]) == "[model, extra]"
    assert shown({"gpu_memory_utilization": 0.3, "x": None, "on": True}) == "{gpu_memory_utilization: 0.3, x: null, 'on': true}"
    assert shown({"a": [{"b": "null"}, 1e-05, "1", "a, b", "x: y", " s"]}) == "{a: [{b: 'null'}, 1e-05, '1', 'a, b', 'x: y', ' s']}"
    assert shown(("q_proj", "v_proj")) == "[q_proj, v_proj]"
    assert (shown(None), shown(False), shown(2), shown(1e-05), shown(float("inf"))) == ("null", "false", "2", "1e-05", ".inf")
    assert (shown("vllm"), shown("a, b"), shown("1"), shown("true"), shown("")) == ("vllm", "a, b", "'1'", "'true'", "''")
    assert shown("a\nb") == '"a\\nb"' and shown(Path("/x/y")) == "/x/y"
    same = [1]
    assert shown([same, same]) == "[[1], [1]]"  # no YAML anchor for an object met twice
    import numpy as np
    assert shown({"lr": np.float64(0.25), "n": np.int64(3)}) == "{lr: 0.25, n: 3}"  # numbers, not quoted text
    assert shown({"b", "a"}) == "[a, b]"  # not YAML's !!set {a: null, b: null}
    assert shown(PPOConfig().algorithm.kl_ctrl) == "{type: fixed, kl_coef: 0.001, horizon: 10000, target_kl: 0.1}"


def test_a_text_threshold_is_spelled_as_its_override():
    """A refused value of a `str | float` option reads as the override that sets it (no Python quotes)."""
    with pytest.raises(ConfigError, match=r"^algorithm.rollout_correction: rollout_rs_threshold=0.5_2.0 needs "
                                          r"rollout_rs$"):
        _cfg("algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0")


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_ppo.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_print_config_exits_zero():
    r = _cli("--config", DEMO, "--print-config")
    assert r.returncode == 0, r.stderr
    assert "adv_estimator: grpo" in r.stdout
    assert "# advantage estimator" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["trainer.total_epoch=2"], "did you mean 'trainer.total_epochs'"),
    (["data.train_batch_size=30"], "must be a multiple of"),
])
def test_cli_user_errors_have_no_traceback(args, message):
    r = _cli("--config", DEMO, "--print-config", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    r = _cli("--config", str(bad), "--print-config")
    assert r.returncode == 2 and "is not valid YAML" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--config", str(tmp_path / "missing.yaml"), "--print-config")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_config_reference_is_current():
    from tools.config_doc import PATH, render

    with open(PATH) as f:
        assert f.read() == render(), "docs/CONFIG.md is stale: run python -m tools.config_doc"


def test_resolve_fills_inherited_values_once_and_keeps_explicit_ones():
    cfg = load_config(PPOConfig, DEMO, ["actor_rollout_ref.actor.ppo_epochs=3", "critic.ppo_micro_batch_size_per_gpu=4",
                                        "data.max_response_length=9"])
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    assert critic.ppo_epochs == 3 and critic.ppo_mini_batch_size == arr.actor.ppo_mini_batch_size == 16
    assert critic.ppo_micro_batch_size_per_gpu == 4 and critic.forward_micro_batch_size_per_gpu == 4
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == arr.ref.log_prob_micro_batch_size_per_gpu == 64
    assert arr.rollout.response_length == cfg.response_length == 9 and arr.rollout.max_model_len == 16 + 9
    assert cfg.data.tokenizer == critic.model.path == critic.model.tokenizer_path == arr.model.path
    assert arr.ref.use_torch_compile is arr.actor.use_torch_compile is False
    again = build_dataclass(PPOConfig, dataclasses.asdict(cfg))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_optimizer_learning_rates_default_to_verls():
    """verl's defaults (_generated_ppo_trainer.yaml): actor_rollout_ref.actor.optim.lr 1e-6, critic.optim.lr 1e-5;
    the critic's section takes every option of the actor's."""
    cfg = load_config(PPOConfig, None, ["actor_rollout_ref.model.path=/m", "data.train_files=[t.jsonl]"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert {f.name for f in dataclasses.fields(cfg.critic.optim)} == {
        f.name for f in dataclasses.fields(cfg.actor_rollout_ref.actor.optim)}
    assert _cfg("critic.optim.lr=3e-6").critic.optim.lr == 3e-6


@pytest.mark.parametrize("section", ["actor_rollout_ref.actor", "critic"])
def test_verls_current_optimizer_names(section):
    """verl's FSDPOptimizerConfig names: lr_scheduler_type (warmup_style, when set, replaces it), num_cycles, and
    clip_grad, the optimizer-section name of the section's grad_clip."""
    def get(cfg):
        return cfg.actor_rollout_ref.actor if section == "actor_rollout_ref.actor" else cfg.critic

    def _cfg(*overrides):  # no grad_clip set (configs/demo.yaml sets the actor's)
        return load_config(PPOConfig, None, ["actor_rollout_ref.model.path=/m", *overrides])

    cfg = get(_cfg(f"{section}.optim.lr_scheduler_type=cosine", f"{section}.optim.num_cycles=1.5"))
    assert (cfg.optim.lr_scheduler_type, cfg.optim.num_cycles) == ("cosine", 1.5)
    assert get(_cfg(f"{section}.optim.warmup_style=cosine")).optim.lr_scheduler_type == "cosine"
    assert get(_cfg(f"{section}.optim.lr_scheduler_type=cosine",
                    f"{section}.optim.warmup_style=null")).optim.lr_scheduler_type == "cosine"
    assert get(_cfg(f"{section}.optim.clip_grad=0.3")).grad_clip == 0.3
    assert get(_cfg(f"{section}.grad_clip=0.3", f"{section}.optim.clip_grad=0.3")).grad_clip == 0.3
    assert get(_cfg(f"{section}.grad_clip=0.3")).grad_clip == 0.3
    assert get(_cfg()).grad_clip == 1.0
    # verl 0.9.1 reads optim.clip_grad, never the section's grad_clip: the optimizer's name wins, with a note
    cfg = _cfg(f"{section}.grad_clip=0.5", f"{section}.optim.clip_grad=0.3")
    assert get(cfg).grad_clip == 0.3
    assert f"{section}.grad_clip=0.5 not read: gradients are clipped at {section}.optim.clip_grad=0.3" in \
        "\n".join(config_notes(cfg))
    assert not any("not read: gradients" in n for n in config_notes(_cfg(f"{section}.grad_clip=0.3",
                                                                         f"{section}.optim.clip_grad=0.3")))
    # verl's optimizer section also takes its deprecated optim.grad_clip, which wins over clip_grad (as in verl)
    assert get(_cfg(f"{section}.optim.grad_clip=0.4")).grad_clip == 0.4
    assert get(_cfg(f"{section}.optim.grad_clip=0.4", f"{section}.optim.clip_grad=0.4")).grad_clip == 0.4
    cfg = _cfg(f"{section}.optim.clip_grad=0.3", f"{section}.optim.grad_clip=0.4", f"{section}.grad_clip=0.4")
    assert get(cfg).grad_clip == 0.4
    assert f"{section}.optim.clip_grad=0.3 not read: gradients are clipped at {section}.optim.grad_clip=0.4" in \
        "\n".join(config_notes(cfg))
    # verl's FSDP optimizer default min_lr_ratio: null, which its cosine schedule reads as 0 (it was refused)
    assert get(_cfg(f"{section}.optim.min_lr_ratio=null")).optim.min_lr_ratio == 0.0
    with pytest.raises(ConfigError, match=rf"{section}.optim.lr_scheduler_type: 'linear' is not one of"):
        _cfg(f"{section}.optim.lr_scheduler_type=linear")
    # the resolved config holds each value under one name and resolves to itself
    cfg = _cfg(f"{section}.optim.warmup_style=cosine", f"{section}.optim.grad_clip=0.3")
    assert (get(cfg).optim.warmup_style, get(cfg).optim.clip_grad, get(cfg).optim.grad_clip) == (None, None, None)
    assert dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)


def test_preflight_refuses_slurm_gpus_the_config_leaves_idle(monkeypatch):
    """sbatch's --gpus-per-node must be the config's trainer.n_gpus_per_node: a job given 8 GPUs for a
    2-GPU config would hold 6 idle; the same job on the CPU, or given exactly 2, is accepted."""
    from trainer import setup

    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    with pytest.raises(ConfigError, match=r"this SLURM job has 8 GPUs on the node but trainer.n_gpus_per_node=2 uses "
                                          r"2: submit with --gpus-per-node=2, or set trainer.n_gpus_per_node=8"):
        setup.preflight(_cfg("trainer.device=auto", "trainer.n_gpus_per_node=2"))
    setup.preflight(_cfg("trainer.device=cpu", "trainer.n_gpus_per_node=2"))
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    setup.preflight(_cfg("trainer.device=auto", "trainer.n_gpus_per_node=2"))


def test_notes_name_the_settings_a_run_does_not_use():
    """The engine's tuning knobs under rollout.name=hf (a config tuned for the engine may switch to the
    plain loop for a comparison) and the reference model's settings under LoRA are noted at start-up."""
    hf = config_notes(_cfg("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.block_size=32",
                           "actor_rollout_ref.rollout.enforce_eager=true"))
    assert any(n.startswith("actor_rollout_ref.rollout.enforce_eager, actor_rollout_ref.rollout.block_size tune "
                            "meshppo's engine; rollout.name=hf does not use them") for n in hf), hf
    assert not any("tune meshppo's engine" in n for n in config_notes(_cfg("actor_rollout_ref.rollout.block_size=32")))
    lora = config_notes(_cfg("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.ref.use_torch_compile=true"))
    assert any(n.startswith("actor_rollout_ref.ref.use_torch_compile") and "unused: with LoRA the reference is the "
               "actor with its adapters off" in n for n in lora), lora
    assert not any("unused: with LoRA" in n for n in config_notes(_cfg("actor_rollout_ref.ref.use_torch_compile=true")))


def test_notes_for_settings_that_act_on_nothing():
    """Each of these is accepted and would change nothing: a start-up note names it (and is absent when the
    setting does act)."""
    hf = "actor_rollout_ref.rollout.name=hf"

    def noted(text, *overrides):
        return any(text in n for n in config_notes(_cfg(*overrides)))

    # engine settings the plain loop never reads, the resolved ones only when set to a value of their own
    assert noted("actor_rollout_ref.rollout.block_size, actor_rollout_ref.rollout.free_cache_engine, "
                 "actor_rollout_ref.rollout.free_engine_weights, actor_rollout_ref.rollout.prompt_length, "
                 "actor_rollout_ref.rollout.max_model_len tune meshppo's engine", hf,
                 "actor_rollout_ref.rollout.free_cache_engine=false",
                 "actor_rollout_ref.rollout.free_engine_weights=false", "actor_rollout_ref.rollout.prompt_length=1000",
                 "actor_rollout_ref.rollout.max_model_len=5000")
    assert noted("actor_rollout_ref.rollout.block_size tune meshppo's engine; rollout.name=hf does not use them",
                 hf)  # the demo's own block size; prompt_length and max_model_len as resolved are not named
    # parameter offload under hf (the actor generates); not with the engine
    assert noted("param_offload=true frees nothing with rollout.name=hf", hf,
                 "actor_rollout_ref.actor.fsdp_config.param_offload=true")
    assert not noted("frees nothing", "actor_rollout_ref.actor.fsdp_config.param_offload=true")
    # data.max_response_length overridden by rollout.response_length
    assert noted("data.max_response_length=64 is not used: actor_rollout_ref.rollout.response_length=16",
                 "data.max_response_length=64", "actor_rollout_ref.rollout.response_length=16")
    assert not noted("is not used", "data.max_response_length=64")
    # optimizer offload of frozen models (of those the run builds: `test_frozen_offload_of_unbuilt_models_is_noted_once`)
    assert noted("actor_rollout_ref.ref.fsdp_config.optimizer_offload, reward_model.model.fsdp_config.optimizer_offload: "
                 "a frozen model has no optimizer states", "actor_rollout_ref.ref.fsdp_config.optimizer_offload=true",
                 "reward_model.enable=true", "reward_model.model.path=/rm",
                 "reward_model.model.fsdp_config.optimizer_offload=true")
    # the KL guard without a reference (the demo tunes the guard and uses the KL loss)
    assert noted("algorithm.kl_guard watches the KL to the reference, and this run has none",
                 "actor_rollout_ref.actor.use_kl_loss=false")
    assert not noted("kl_guard watches")
    assert not noted("kl_guard watches", "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true")


def test_frozen_offload_of_unbuilt_models_is_noted_once():
    """optimizer_offload of a frozen model the run does not build (no reference, no reward model, the reference
    under LoRA) is named once, with that section's unread options: not also as a frozen model's offload."""
    ref, rm = "actor_rollout_ref.ref.fsdp_config", "reward_model.model.fsdp_config"
    assert not load_config(PPOConfig, None, []).uses_ref  # verl's defaults: no KL, so no reference
    assert config_notes(load_config(PPOConfig, None, [f"{ref}.optimizer_offload=true"])) == [
        f"{ref}.optimizer_offload=true has no effect: the run has no reference (actor_rollout_ref.actor.use_kl_loss="
        "false, algorithm.use_kl_in_reward=false)"]
    assert config_notes(load_config(PPOConfig, None, [f"{rm}.optimizer_offload=true"])) == [
        f"{rm}.optimizer_offload=true has no effect: reward_model.enable is false"]
    assert config_notes(load_config(PPOConfig, None, ["actor_rollout_ref.model.lora_rank=8",
                                                      "actor_rollout_ref.actor.use_kl_loss=true",
                                                      f"{ref}.optimizer_offload=true"])) == [
        "actor_rollout_ref.ref.fsdp_config unused: with LoRA the reference is the actor with its adapters off, not a "
        "model of its own"]


def test_verl_data_options_are_accepted():
    """verl's data options at their defaults (and the ones meshppo implements at any value) load and validate;
    dataloader_num_workers sets the shuffle's draws (verl's order), so no start-up note says it changes nothing."""
    cfg = _cfg("data.trust_remote_code=false", "data.return_full_prompt=false", "data.validation_shuffle=false",
               "data.dataloader_num_workers=8", "data.seed=null", "data.train_max_samples=-1",
               "data.val_max_samples=-1", "data.truncation=middle", "data.apply_chat_template_kwargs={enable_thinking: false}")
    validate(cfg)
    assert cfg.data.seed is None and cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    validate(_cfg("data.train_max_samples=16", "data.seed=null", "data.shuffle=false"))  # the first 16: no draw
    assert not any("dataloader_num_workers" in n for n in config_notes(cfg))
    assert not any("dataloader_num_workers" in n for n in config_notes(_cfg("data.dataloader_num_workers=0")))


def test_verl_script_options_are_accepted_and_said():
    """Options every verl example script sets, at verl's values: the server engines and async mode run
    meshppo's own engine in-process, the load formats and the worker switch change nothing; each that
    reads otherwise is said at start-up. Parallel sizes meshppo has no such engine for are refused."""
    cfg = _cfg("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
               "actor_rollout_ref.rollout.load_format=dummy", "actor_rollout_ref.rollout.layered_summon=true",
               "trainer.use_legacy_worker_impl=disable", "data.filter_overlong_prompts_workers=4",
               "actor_rollout_ref.rollout.max_num_seqs=4")
    assert cfg.actor_rollout_ref.rollout.engine == "native"
    validate(cfg)  # n=8 samples of a prompt above max_num_seqs=4 run in groups of 4, as in vLLM
    notes = config_notes(cfg)
    for text in ("rollout.name=vllm: meshppo generates with its own engine (native); vllm is not used",
                 "rollout.mode=async: meshppo's engine runs in-process", "layered_summon=true has no effect",
                 "trainer.use_legacy_worker_impl=disable has no effect",
                 "data.filter_overlong_prompts_workers=4 has no effect"):
        assert any(text in n for n in notes), (text, notes)
    plain = _cfg("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.load_format=safetensors",
                 "trainer.use_legacy_worker_impl=auto", "data.filter_overlong_prompts_workers=1")
    validate(plain)
    assert plain.actor_rollout_ref.rollout.engine == "native" and _cfg().actor_rollout_ref.rollout.engine == "native"
    assert _cfg("actor_rollout_ref.rollout.name=hf").actor_rollout_ref.rollout.engine == "hf"
    assert not any("no effect" in n or "in-process" in n for n in config_notes(plain))
    for key in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size"):
        _cfg(f"actor_rollout_ref.rollout.{key}=1")
        with pytest.raises(ConfigError, match=f"rollout.{key}"):
            _cfg(f"actor_rollout_ref.rollout.{key}=2")



def test_verls_reward_model_section_loads_and_its_serving_options_are_said():
    """verl's reward-model layout (`reward_model.model.*`, as examples/ppo_trainer/run_qwen2-7b_rm.sh
    sets it): the options meshppo reads act, verl's server / worker options load and each one set
    is said at start-up to have no effect, the rest are refused naming the key; max_length cuts the
    reward model's own rendering, so it needs input_tokenizer."""
    rm = ["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=8"]
    cfg = _cfg(*rm, "reward_model.use_reward_loop=true", "+reward_model.rollout.name=vllm",
               "+reward_model.rollout.gpu_memory_utilization=0.8", "+reward_model.rollout.tensor_model_parallel_size=1",
               "reward_model.num_workers=8", "reward_model.model.use_remove_padding=false",
               "reward_model.model.fsdp_config.param_offload=true", "reward_model.max_length=512")
    validate(cfg)
    assert cfg.reward_model.model.path == "/rm" and cfg.reward_model.max_length == 512
    # verl's default, the interpolation ${actor_rollout_ref.model.path}, resolved as a config file resolves it
    assert cfg.reward_model.model.input_tokenizer == cfg.actor_rollout_ref.model.path
    assert dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)
    assert not cfg.reward_model.model.use_remove_padding and cfg.reward_model.model.fsdp_config.param_offload
    notes = [n for n in config_notes(cfg) if n.startswith("reward_model.")]
    assert notes == ["reward_model.num_workers=8 has no effect: meshppo scores on every training rank, without "
                     "reward-loop workers",
                     "reward_model.rollout={name: vllm, gpu_memory_utilization: 0.8, "
                     "tensor_model_parallel_size: 1} has no effect: meshppo runs the reward model as an FSDP2 "
                     "forward on the training ranks"], notes
    assert not [n for n in config_notes(_cfg(*rm)) if n.startswith("reward_model.")]
    with pytest.raises(ConfigError, match=r"reward_model.max_length=512 with reward_model.model.input_tokenizer=null"):
        validate(_cfg(*rm, "reward_model.max_length=512", "reward_model.model.input_tokenizer=null"))
    with pytest.raises(ConfigError, match="unknown config key 'reward_model.path'; did you mean "
                                          "'reward_model.model.path'"):
        _cfg("reward_model.path=/rm")
    for refused in ("reward_model.enable_resource_pool=true", "reward_model.sandbox_fusion.url=http://x",
                    "reward_model.reward_loop_source=importlib",
                    "reward_model.model.trust_remote_code=true"):
        with pytest.raises(ConfigError, match=f"{refused.split('=')[0]}=.* is not supported"):
            _cfg(refused)

def test_verl_dumped_configs_hydra_targets_are_metadata():
    """A config dumped by verl names each section's class in `_target_`: a verl class name is not
    an option and loads; anything else under that key is still an unknown key."""
    cfg = _cfg("actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig",
               "algorithm._target_=verl.trainer.config.AlgoConfig")
    assert cfg.algorithm == _cfg().algorithm
    with pytest.raises(ConfigError, match="unknown config key 'algorithm._target_'"):
        _cfg("algorithm._target_=mypkg.Algo")


def test_refused_settings_that_would_waste_or_break_a_run():
    # critic warm-up steps without a critic would train nothing
    with pytest.raises(ConfigError, match=r"trainer.critic_warmup=2 trains only the critic .*adv_estimator=grpo has "
                                          "no critic"):
        validate(_cfg("trainer.critic_warmup=2"))
    validate(_cfg("trainer.critic_warmup=2", "algorithm.adv_estimator=gae"))
    # an adaptive KL controller whose multiplier 1 + e * responses / horizon can reach 0 (32 x 8 responses a step:
    # at e = -0.2 the factor is 1 - 256 / (5 horizon))
    kl = ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=false",
          "algorithm.kl_ctrl.type=adaptive"]
    with pytest.raises(ConfigError, match=r"algorithm.kl_ctrl.horizon=51 with 256 responses a step .* use a horizon "
                                          "above 51"):
        validate(_cfg(*kl, "algorithm.kl_ctrl.horizon=51"))
    validate(_cfg(*kl, "algorithm.kl_ctrl.horizon=52"))
    validate(_cfg("algorithm.kl_ctrl.horizon=51"))  # no KL in reward: the controller does not run


def test_load_contents_help_says_what_reads_it_besides_a_resume():
    """checkpoint.load_contents is read by every load of a checkpoint (CheckpointManager.load): a resume, a
    restart of the launch under any resume_mode (disable too), and a KL-guard rollback, which loads the model
    and optimizer (keep_progress; refused unless both are listed) and never extra: the help says each, so
    that load_contents with resume_mode=disable is not read as unused."""
    from trainer.config import CheckpointConfig
    from trainer.configlib import describe

    text = describe(CheckpointConfig.__dataclass_fields__["load_contents"].metadata)
    for said in ("a restart of the launch resuming its own newest checkpoint", "also disable",
                 "A KL-guard rollback (algorithm.kl_guard) loads model and optimizer, which it needs listed here",
                 "never extra: the LR schedules and RNG carry on"):
        assert said in text, said


def test_checkpoint_contents_are_verls_items():
    actor, critic = "actor_rollout_ref.actor.checkpoint", "critic.checkpoint"
    cfg = _cfg()  # verl's defaults, and load_contents follows save_contents (verl's ${.save_contents})
    for c in (cfg.actor_rollout_ref.actor.checkpoint, cfg.critic.checkpoint):
        assert c.save_contents == c.load_contents == ["model", "optimizer", "extra"] and not c.async_save
    # as verl's example scripts write it (a quoted Python list), and each section on its own
    cfg = _cfg(f"{actor}.save_contents=['model','optimizer','extra','hf_model']", f"{critic}.save_contents=[model]")
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ["model", "optimizer", "extra", "hf_model"]
    assert cfg.critic.checkpoint.load_contents == ["model"]
    c = _cfg(f"{actor}.save_contents=[hf_model]", f"{actor}.load_contents=[model,extra]").actor_rollout_ref.actor
    assert (c.checkpoint.save_contents, c.checkpoint.load_contents) == (["hf_model"], ["model", "extra"])
    assert _cfg(f"{actor}.load_contents=[]").actor_rollout_ref.actor.checkpoint.load_contents == []
    with pytest.raises(ConfigError, match=rf"^{actor}.save_contents: unknown item 'weights'; allowed: model, "
                                          "optimizer, extra, hf_model$"):
        _cfg(f"{actor}.save_contents=[model,weights]")
    with pytest.raises(ConfigError, match=rf"^{critic}.load_contents: unknown item 'hf'; allowed: model, "):
        _cfg(f"{critic}.load_contents=[hf]")
    with pytest.raises(ConfigError, match=rf"^{critic}.save_contents=\[optimizer, extra\]: 'optimizer' needs "
                                          "'model'"):
        _cfg(f"{critic}.save_contents=[optimizer,extra]")
    with pytest.raises(ConfigError, match=rf"^{actor}.load_contents=\[optimizer\]: 'optimizer' needs 'model'"):
        _cfg(f"{actor}.load_contents=[optimizer]")
    with pytest.raises(ConfigError, match=rf"^{actor}.async_save=true is not supported by meshppo: verl implements "
                                          "it for Megatron only"):
        _cfg(f"{actor}.async_save=true")
    _cfg(f"{critic}.async_save=false")
    # a KL-guard rollback reloads the models and their optimizers: their checkpoints must hold them and a
    # resume load them (without the optimizer it went on with the abandoned branch's moments)
    rollback = ["algorithm.kl_guard.explode_action=rollback", "trainer.save_freq=1"]
    validate(_cfg(*rollback))
    with pytest.raises(ConfigError, match=rf"rollback reloads the models and their optimizers of an earlier checkpoint, "
                                          rf"but {actor}.save_contents and {actor}.load_contents lack 'model'"):
        validate(_cfg(*rollback, f"{actor}.save_contents=[hf_model]"))
    with pytest.raises(ConfigError, match=rf"but {critic}.load_contents lack 'model'"):
        validate(_cfg(*rollback, "algorithm.adv_estimator=gae", f"{critic}.load_contents=[extra]"))
    with pytest.raises(ConfigError, match=rf"but {actor}.load_contents lack 'optimizer'"):
        validate(_cfg(*rollback, f"{actor}.load_contents=[model,extra]"))
    validate(_cfg(*rollback, f"{critic}.load_contents=[extra]"))  # no critic in a GRPO run
    validate(_cfg(f"{actor}.save_contents=[hf_model]"))  # no rollback: an export-only checkpoint is fine


def test_kl_guard_rollback_that_no_kept_checkpoint_can_serve_is_refused():
    # A rollback at step K needs a checkpoint of step K-1-L at the newest (L: 1 for explode_action, which a
    # non-finite KL fires at once; patience for warn_action), and the run keeps the newest
    # max_actor_ckpt_to_keep of every save_freq-th step: one can serve iff keep x save_freq > L.
    explode, warn = "algorithm.kl_guard.explode_action=rollback", "algorithm.kl_guard.warn_action=rollback"
    with pytest.raises(ConfigError, match=r"^algorithm.kl_guard.explode_action=rollback loads a checkpoint from "
                                          r"before the KL streak began, but trainer.save_freq=-1 writes one only at "
                                          r"the last step: set trainer.save_freq > 0$"):
        validate(_cfg(explode))  # the default save_freq
    with pytest.raises(ConfigError, match=r"trainer.save_freq=0 writes one only"):
        validate(_cfg(warn, "trainer.save_freq=0"))
    never = r"^algorithm.kl_guard.{}=rollback can never roll back: at step K it needs the checkpoint of step K-{} "
    with pytest.raises(ConfigError, match=never.format("explode_action", 2) + r".*trainer.max_actor_ckpt_to_keep=1 "
                                          r"with trainer.save_freq=1 keeps none older than step K-1: .* "
                                          r"max_actor_ckpt_to_keep x save_freq > 1$"):
        validate(_cfg(explode, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1"))
    with pytest.raises(ConfigError, match=r"max_actor_ckpt_to_keep=1 \(trainer.remove_previous_ckpt_in_save=true\)"):
        validate(_cfg(explode, "trainer.save_freq=1", "trainer.remove_previous_ckpt_in_save=true"))
    validate(_cfg(explode, "trainer.save_freq=2", "trainer.max_actor_ckpt_to_keep=1"))  # 2 x 1 > 1
    validate(_cfg(explode, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2"))  # 1 x 2 > 1
    validate(_cfg(explode, "trainer.save_freq=1"))  # every checkpoint kept
    # warn_action: the streak is `patience` steps at least
    patience = "algorithm.kl_guard.patience=3"
    with pytest.raises(ConfigError, match=never.format("warn_action", 4) + r"or an earlier one \(the streak is "
                                          r"algorithm.kl_guard.patience=3 steps at least;.* keeps none older than "
                                          r"step K-3: .* > 3$"):
        validate(_cfg(warn, patience, "trainer.save_freq=3", "trainer.max_actor_ckpt_to_keep=1"))
    with pytest.raises(ConfigError, match=never.format("warn_action", 4)):
        validate(_cfg(warn, patience, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=3"))
    validate(_cfg(warn, patience, "trainer.save_freq=4", "trainer.max_actor_ckpt_to_keep=1"))  # 4 > 3
    validate(_cfg(warn, patience, "trainer.save_freq=2", "trainer.max_actor_ckpt_to_keep=2"))  # 4 > 3
    # explode_action's shortest streak is one step, whatever the patience
    validate(_cfg(explode, patience, "trainer.save_freq=2", "trainer.max_actor_ckpt_to_keep=1"))
    # a rollback that is not configured, or a guard that is off, asks for no checkpoint
    validate(_cfg("algorithm.kl_guard.explode_action=stop"))
    validate(_cfg(explode, "algorithm.kl_guard.enable=false"))


def test_kl_guard_rollback_rule_matches_the_checkpoints_a_run_keeps():
    """The refusal's rule, checked against a simulation of the saves, the rotation and the guard's
    bound: whether any step of a long run finds a checkpoint a rollback may load."""
    from kl import KLGuard, KLGuardConfig

    def ever_served(save_freq, keep, shortest):
        kept = []
        for step in range(1, 60):
            # the guard's check at `step`, for the latest streak start of `shortest` steps
            guard = KLGuard(KLGuardConfig(explode_action="rollback"))
            if guard.rollback_target(kept, step, step - shortest + 1) is not None:
                return True
            if step % save_freq == 0:
                kept = (kept + [step])[-keep:]
        return False

    for save_freq in range(1, 6):
        for keep in range(1, 6):
            for patience in range(1, 6):
                overrides = ["algorithm.kl_guard.warn_action=rollback", f"algorithm.kl_guard.patience={patience}",
                             f"trainer.save_freq={save_freq}", f"trainer.max_actor_ckpt_to_keep={keep}"]
                try:
                    validate(_cfg(*overrides))
                    accepted = True
                except ConfigError:
                    accepted = False
                assert accepted == ever_served(save_freq, keep, patience), overrides


def test_kl_guard_thresholds_above_the_clamped_kl_are_refused():
    # actor/ref_kl, the guard's KL, is a mean of k3 values clamped to 10: an explode_kl of 10 never fires
    with pytest.raises(ConfigError, match=r"^algorithm.kl_guard: KLGuardConfig.explode_kl=10.0 can never be exceeded.*"
                                          r"set algorithm.kl_guard.explode_kl below 10$"):
        _cfg("algorithm.kl_guard.explode_kl=10")
    with pytest.raises(ConfigError, match=r"KLGuardConfig.warn_kl=11.0 can never be exceeded.*actor/ref_kl.*"
                                          r"set algorithm.kl_guard.warn_kl below 10$"):
        _cfg("algorithm.kl_guard.warn_kl=11", "algorithm.kl_guard.explode_kl=12")
    assert _cfg("algorithm.kl_guard.explode_kl=9.5").algorithm.kl_guard.explode_kl == 9.5


def test_config_file_and_launcher_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from trainer import launch
    from trainer.configlib import read_yaml

    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_yaml(binary)
    with pytest.raises(ConfigError, match="is a directory"):
        read_yaml(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("")
    common = ["--config", DEMO, "--print-config", "trainer.n_gpus_per_node=1"]
    for argv, env, message in (
            (["--max-restarts", "-1"], None, "--max-restarts must be at least 0, got -1"),
            (["--nnodes", "2", "trainer.nnodes=2"], None, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
            ([], "abc", "MESHPPO_PEER_GRACE_S='abc': give the seconds as a number >= 0"),
            (["--log-dir", str(afile / "logs")], None, f"--log-dir (LOG_DIR)={afile / 'logs'} is under {afile}, a file")):
        if env is None:
            monkeypatch.delenv(launch.PEER_GRACE_ENV, raising=False)
        else:
            monkeypatch.setenv(launch.PEER_GRACE_ENV, env)
        assert launch.main(argv + common) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    monkeypatch.delenv(launch.PEER_GRACE_ENV, raising=False)
    assert launch.main(["--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job1", "trainer.nnodes=2"]
                       + common) == 0


def test_the_launcher_reads_each_rank_logs_error_lines(tmp_path):
    """The error lines of a rank's log, as the launcher compares them between ranks (it shows another
    rank's only when rank 0 did not say it): one after a progress bar's redraw counts, a relayed one
    is the other rank's message, other lines are not errors."""
    from agent.loop import FIRST_TP_RANK
    from trainer.launch import _error_messages

    log = tmp_path / "rank0.log"
    log.write_text("run directory: x (fresh start)\n"
                   "\rppo:   0%|          | 0/2 [00:00<?, ?it/s]meshppo: error (rank 0): resume path 'p' does not exist\n"
                   "meshppo: error (rank 0): (on rank 1) reward function f raised\n"
                   f"meshppo: error (rank 1): {FIRST_TP_RANK} tool 't' broke\n"
                   "meshppo: config error (rank 1): data.train_batch_size (32) is larger than the training set\n"
                   "meshppo: config error: unknown config key 'x'\n"
                   "meshppo: error (rank 1): (on engine replica 0) the KV pool would hold 0 blocks\n"
                   "a line about meshppo: errors in general\n")
    assert _error_messages(str(log)) == [
        ("error", "resume path 'p' does not exist"), ("error", "reward function f raised"), ("error", "tool 't' broke"),
        ("config error", "data.train_batch_size (32) is larger than the training set"),
        ("config error", "unknown config key 'x'"), ("error", "the KV pool would hold 0 blocks")]
    assert _error_messages(str(tmp_path / "rank1.log")) == []


# verl's DAPO example scripts (examples/*/test_dapo_*.sh) with data.max_response_length=6
DAPO = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4", "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "+reward_model.reward_kwargs.max_resp_len=6"]
OBC = "reward_model.reward_kwargs.overlong_buffer_cfg"


def test_verls_dapo_reward_kwargs_load():
    cfg = _cfg(*DAPO)
    validate(cfg)
    assert cfg.reward_model.reward_kwargs == {"overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0,
                                                                      "log": False}, "max_resp_len": 6}
    kwargs = cfg.reward_model.manager_kwargs()
    b = kwargs["overlong_buffer_cfg"]
    assert kwargs["max_resp_len"] == 6 and (b.enable, b.len, b.penalty_factor, b.log) == (True, 4, 1.0, False)
    assert not any("reward_kwargs" in n for n in config_notes(cfg))
    # the buffer switched off, as the scripts write it, still carries verl's required keys; no buffer at all is none
    off = _cfg("reward_model.reward_manager=dapo", f"+{OBC}.enable=False", f"+{OBC}.len=4",
               "+reward_model.reward_kwargs.max_resp_len=6").reward_model.manager_kwargs()
    assert off["overlong_buffer_cfg"].enable is False
    assert _cfg("reward_model.reward_manager=dapo").reward_model.manager_kwargs() == {"max_resp_len": None,
                                                                                      "overlong_buffer_cfg": None}
    # batch: any keywords, for the function
    cfg = _cfg("reward_model.reward_manager=batch", "+reward_model.reward_kwargs.margin=0.5",
               "custom_reward_function.path=x.py")
    validate(cfg)
    assert cfg.reward_model.manager_kwargs() == {"margin": 0.5}
    assert _cfg("reward_model.reward_manager=prime").reward_model.manager_kwargs() == {}


@pytest.mark.parametrize("overrides,message", [
    ([*DAPO, f"+{OBC}.lenght=3"], f"unknown config key '{OBC}.lenght'; did you mean '{OBC}.len'?"),
    ([*DAPO, "+reward_model.reward_kwargs.max_response_len=6"],
     "unknown config key 'reward_model.reward_kwargs.max_response_len'; did you mean "
     "'reward_model.reward_kwargs.max_resp_len'?"),
    ([*DAPO[:-1]], f"{OBC} is set but reward_model.reward_kwargs.max_resp_len is not (verl's dapo manager asserts it)"),
    ([*DAPO[:-1], "+reward_model.reward_kwargs.max_resp_len=3"],
     f"{OBC}.len=4 is larger than reward_model.reward_kwargs.max_resp_len=3 (verl's dapo manager asserts "
     "max_resp_len >= len)"),
    ([DAPO[0], f"+{OBC}.enable=true", f"+{OBC}.len=4", "+reward_model.reward_kwargs.max_resp_len=6"],
     f"{OBC} needs penalty_factor and log: verl's dapo manager reads them when enable=true"),
    ([DAPO[0], f"+{OBC}.enable=false", "+reward_model.reward_kwargs.max_resp_len=6"],
     f"{OBC} needs len: verl's dapo manager reads it"),
    ([*DAPO, f"+{OBC}.len=0"], f"{OBC}.len: 0 is out of range; allowed: >= 1"),
    ([*DAPO, f"+{OBC}.penalty_factor=-1"], f"{OBC}.penalty_factor: -1.0 is out of range; allowed: >= 0"),
    ([*DAPO, f"+{OBC}.enable=yes please"], f"{OBC}.enable: expected true or false"),
    ([*DAPO, f"+{OBC}=4"], f"{OBC}: expected a mapping (a config section), got 4 (or null)"),
    (["+reward_model.reward_kwargs.max_resp_len=6"],
     "reward_model.reward_kwargs is set (max_resp_len) but reward_manager=naive takes none"),
    (["reward_model.reward_manager=prime", "+reward_model.reward_kwargs.timeout=5"],
     "reward_model.reward_kwargs is set (timeout) but reward_manager=prime takes none"),
    (["reward_model.reward_manager=batch", "+reward_model.reward_kwargs.extra_infos=[]"],
     "reward_model.reward_kwargs sets extra_infos: the batch manager passes data_sources, solution_strs, "
     "ground_truths, extra_infos itself"),
    (["reward_model.reward_manager=remote"], "'remote' is not one of ['naive', 'dapo', 'batch', 'prime', 'gdpo', None]"),
])
def test_reward_kwargs_are_checked_as_the_config_loads(overrides, message):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    assert message in str(e.value)


def test_batch_needs_a_function_of_lists():
    with pytest.raises(ConfigError, match=r"reward_model.reward_manager=batch calls custom_reward_function once per "
                                          r"batch, with lists .*: set custom_reward_function.path"):
        validate(_cfg("reward_model.reward_manager=batch"))


def test_reward_manager_notes():
    """A dapo buffer that ends elsewhere than the responses' limit, a max_resp_len that nothing reads and a
    manager the reward model replaces are said at start-up."""
    def notes(*overrides):
        return [n for n in config_notes(_cfg(*overrides)) if "reward" in n]

    assert notes(*DAPO[:-1], "+reward_model.reward_kwargs.max_resp_len=5") == [
        "reward_model.reward_kwargs.max_resp_len=5 is not actor_rollout_ref.rollout.response_length=6: as in verl, "
        "the overlong penalty starts at 5 - 4 = 1 tokens and reaches -1 at 5 tokens, and keeps falling up to the "
        "longest response (6 tokens)"]
    assert "beyond the longest response (6 tokens)" in notes(*DAPO[:-1], "+reward_model.reward_kwargs.max_resp_len=9")[0]
    assert notes(*DAPO, f"+{OBC}.enable=false") == []
    assert notes("reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.max_resp_len=6") == [
        "reward_model.reward_kwargs.max_resp_len has no effect without reward_model.reward_kwargs.overlong_buffer_cfg"]
    assert notes(*DAPO, "reward_model.enable=true", "reward_model.model.path=/rm") == [
        "reward_model.reward_manager=dapo is not used: the reward model replaces the rule reward "
        "(reward_model.combine=replace; in verl the manager passes the model's scores on)"]
    assert notes(*DAPO, "reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.combine=add") == []


def test_verls_null_spellings_of_data_options_are_accepted():
    """verl takes data.filter_overlong_prompts_workers and data.sampler as null (both were refused)."""
    cfg = _cfg("data.filter_overlong_prompts_workers=null", "data.sampler=null")
    assert cfg.data.filter_overlong_prompts_workers is None
    assert (cfg.data.sampler.class_path, cfg.data.sampler.class_name) == (None, None)
    assert _cfg("data.apply_chat_template_kwargs={enable_thinking: false}").data.apply_chat_template_kwargs == {
        "enable_thinking": False}


def test_resume_from_path_under_auto_is_said_unread_as_verl_ignores_it():
    """verl's resume_mode=auto resumes the run directory's latest checkpoint and ignores resume_from_path
    (one of its example scripts sets both); meshppo refused the pair, now it says so at start-up."""
    from trainer.config import config_notes

    cfg = _cfg("trainer.resume_from_path=/x/global_step_5")
    validate(cfg)
    assert "trainer.resume_from_path=/x/global_step_5 is not read with trainer.resume_mode=auto (as in verl)" in \
        " ".join(config_notes(cfg))
    assert not any("resume_from_path" in n for n in config_notes(_cfg()))


def test_grpo_and_rloo_run_at_one_response_per_prompt_as_in_verl():
    """verl runs GRPO and RLOO at rollout.n=1 (its tuning scripts for small models do): a group of one has
    mean 0 (and std 1), so the advantage is the raw score. meshppo refused it as needing groups; now it
    says so at start-up. The estimators that need a group (pass@k, OPO, ...) are still refused."""
    from trainer.config import config_notes

    for adv in ("grpo", "grpo_vectorized", "rloo"):
        cfg = _cfg("actor_rollout_ref.rollout.n=1", f"algorithm.adv_estimator={adv}",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
        validate(cfg)
        assert any(n.startswith(f"algorithm.adv_estimator={adv} with actor_rollout_ref.rollout.n=1: every group holds "
                                "one response, whose advantage is its score as it is") for n in config_notes(cfg))
    assert not any("rollout.n=1" in n for n in config_notes(_cfg()))


def test_log_prob_forwards_need_a_micro_batch_size_or_dynamic_batching():
    """Each forward-only pass batches by a size (its own or the one it inherits) or by tokens: a dynamic actor
    leaves the inherited sizes null, and a pass set back to sequence counts without a size is refused, as the
    actor's update is (and as verl refuses it). The reference's only where the run has one."""
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"]
    validate(_cfg(*dynamic))
    validate(_cfg(*dynamic, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"))  # the reference inherits 8
    validate(_cfg(*dynamic, "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
                  "actor_rollout_ref.actor.use_kl_loss=false"))  # no reference pass
    validate(_cfg("reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.use_dynamic_bsz=true"))
    validate(_cfg("reward_model.micro_batch_size_per_gpu=null"))  # no reward model


def _notes_with(text, *overrides):
    return [n for n in config_notes(_cfg(*overrides)) if text in n]


def test_the_default_and_the_shipped_configs_get_none_of_these_notes():
    texts = ("trains no critic", "reward_model.enable is false", "multi_turn.enable is false", "kl_ctrl.type=fixed",
             "norm_adv_by_std_in_grpo", "clip_ratio_low and clip_ratio_high are both set", "loss_scale_factor",
             "lora_rank=0", "kl_guard.enable is false", "kl_guard.warn_action nor", "penalised twice",
             "can change no KL coefficient")
    configs = [load_config(PPOConfig, None, []), _cfg()]
    configs += [load_config(PPOConfig, os.path.join(ROOT, "configs", name), [])
                for name in sorted(os.listdir(os.path.join(ROOT, "configs"))) if name.endswith(".yaml")]
    for cfg in configs:
        notes = config_notes(cfg)
        assert not [n for n in notes if any(t in n for t in texts)], notes


def test_critic_options_without_a_critic_are_noted():
    """The critic's options the user set, by their leaf keys, when the estimator trains no critic; not those
    it inherits (the actor's batch sizes, the model path, verl's copies), nor with a critic."""
    set_ = ("critic.optim.lr=2e-5", "critic.ppo_micro_batch_size_per_gpu=2",
            "critic.model.enable_gradient_checkpointing=true")
    assert _notes_with("trains no critic", *set_) == [
        "critic.optim.lr=2e-05, critic.model.enable_gradient_checkpointing=true, critic.ppo_micro_batch_size_per_gpu=2 "
        "has no effect: algorithm.adv_estimator=grpo trains no critic"]
    # its value forward inherits ppo_micro_batch_size_per_gpu, load_contents save_contents, the role's Ulysses size
    # its fsdp_config copy: only what was set is named
    assert _notes_with("trains no critic", "critic.ppo_micro_batch_size_per_gpu=2",
                       "critic.checkpoint.save_contents=[model]",
                       "critic.model.fsdp_config.ulysses_sequence_parallel_size=2") == [
        "critic.model.fsdp_config.ulysses_sequence_parallel_size=2, critic.ppo_micro_batch_size_per_gpu=2, "
        "critic.checkpoint.save_contents=[model] has no effect: algorithm.adv_estimator=grpo trains no critic"]
    inherited = ("critic.rollout_n=8", "critic.strategy=fsdp", "critic.model.path=runs/demo_assets/sft_model",
                 "critic.ppo_mini_batch_size=16", "critic.loss_agg_mode=token-mean", "critic.use_dynamic_bsz=false",
                 "critic.shuffle=false", "critic.ppo_epochs=1", "critic.ppo_micro_batch_size_per_gpu=64",
                 "critic.enable=false", "critic.optim.lr=1e-5", "critic.optim.override_optimizer_config={}")
    assert _notes_with("trains no critic", *inherited) == []
    assert _notes_with("trains no critic") == [] and _notes_with("critic", "global_profiler.tool=torch") == []
    assert _notes_with("critic.optim", "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", *set_) == []


def test_reward_model_options_without_a_reward_model_are_noted():
    """reward_model's options when it is off: not the rule reward's manager and its arguments, which act
    either way, nor those inherited (the profiler's, input_tokenizer's actor path)."""
    assert _notes_with("reward_model.enable is false", "reward_model.model.path=/rm", "reward_model.micro_batch_size=4",
                       "reward_model.model.input_tokenizer=null", "reward_model.combine=add") == [
        "reward_model.model.path=/rm, reward_model.model.input_tokenizer=null, "
        "reward_model.micro_batch_size=4, reward_model.combine=add has no effect: reward_model.enable is false"]  # as set
    assert _notes_with("reward_model", "reward_model.reward_manager=batch", "custom_reward_function.path=x.py",
                       "reward_model.reward_kwargs.scale=2", "global_profiler.tool=torch",
                       "global_profiler.save_path=/p", "reward_model.strategy=fsdp2",
                       "reward_model.model.input_tokenizer=runs/demo_assets/sft_model") == []
    assert _notes_with("reward_model") == []
    assert _notes_with("enable is false", "reward_model.enable=true", "reward_model.model.path=/rm",
                       "reward_model.micro_batch_size=4") == []


def test_model_overrides_and_tiled_mlp_of_a_model_the_run_lacks_are_noted():
    """critic.model's override_config and tiled_mlp without a critic, reward_model.model's override_config without
    a reward model: noted with the section's other options, once; an override that acts (rope_theta) was said
    nowhere. With the model, the overrides and the tiled MLP are read and get no such note."""
    set_ = ("critic.model.override_config.rope_theta=5000.0", "critic.model.tiled_mlp.enabled=true",
            "critic.model.tiled_mlp.num_shards=8", "critic.model.override_config.initializer_range=0.5")
    assert [n for n in config_notes(_cfg(*set_)) if "critic.model" in n] == [
        "critic.model.override_config={rope_theta: 5000.0, initializer_range: 0.5}, critic.model.tiled_mlp.enabled=true, "
        "critic.model.tiled_mlp.num_shards=8 has no effect: algorithm.adv_estimator=grpo trains no critic"]
    gae = ("algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1")
    assert _notes_with("trains no critic", *gae, *set_) == []
    rm = "reward_model.model.override_config.rope_theta=5000.0"
    assert [n for n in config_notes(_cfg(rm)) if "reward_model" in n] == [
        "reward_model.model.override_config={rope_theta: 5000.0} has no effect: reward_model.enable is false"]
    assert _notes_with("enable is false", "reward_model.enable=true", "reward_model.model.path=/rm", rm) == []


def test_reference_options_without_a_reference_are_noted():
    """The reference's options the user set, when the run has no reference (no KL loss, no KL in the reward):
    not those it inherits (the actor's and the rollout's sizes, verl's copies), nor with a reference."""
    off = ("actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.kl_loss_coef=0.001")
    why = ("has no effect: the run has no reference (actor_rollout_ref.actor.use_kl_loss=false, "
           "algorithm.use_kl_in_reward=false)")
    demo = "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32"  # (the demo's)
    set_ = ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.ref.use_torch_compile=true",
            "actor_rollout_ref.ref.fsdp_config.param_offload=true")
    assert _notes_with("has no reference", *off, *set_) == [
        f"actor_rollout_ref.ref.fsdp_config.param_offload=true, {demo}, "
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4, actor_rollout_ref.ref.use_torch_compile=true {why}"]
    inherited = ("actor_rollout_ref.ref.rollout_n=8", "actor_rollout_ref.ref.strategy=fsdp",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64", "actor_rollout_ref.ref.use_torch_compile=false",
                 "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false")
    assert _notes_with("has no reference", *off, *inherited) == _notes_with("has no reference", *off) == [f"{demo} {why}"]
    assert [n for n in config_notes(load_config(PPOConfig, None, [])) if "has no reference" in n] == []
    assert _notes_with("has no reference", *set_) == []  # the demo's KL loss: a reference
    lora = _notes_with("actor_rollout_ref.ref", *off, "actor_rollout_ref.model.lora_rank=8", *set_)
    assert len(lora) == 1 and "has no reference" in lora[0], lora  # not also LoRA's note


def test_validation_options_without_validation_files_are_noted():
    """Without data.val_files no validation runs: the options only validation reads, set, are said at start-up
    (trainer.test_freq has its own note); with validation files, or at their defaults, nothing is said. With
    validation files but none scheduled (val_before_train=false, test_freq <= 0, no val_only) they and the
    files are unread too."""
    set_ = ("data.val_batch_size=4", "data.val_max_samples=3", "trainer.log_val_generations=2",
            "trainer.validation_data_dir=/tmp/val", "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.7")
    none = ("data.val_files=[]", "trainer.test_freq=-1", "trainer.log_val_generations=0")  # (the demo's: 5, 3)
    assert _notes_with("so no validation", *none, *set_) == [
        "data.val_batch_size=4, data.val_max_samples=3, trainer.log_val_generations=2, "
        "trainer.validation_data_dir=/tmp/val, actor_rollout_ref.rollout.val_kwargs.temperature=0.7, "
        "actor_rollout_ref.rollout.val_kwargs.n=4 has no effect: data.val_files is empty, so no validation runs"]
    assert _notes_with("so no validation", *none, "trainer.val_before_train=false") == []
    assert _notes_with("so no validation", *set_) == []  # the demo's validation files
    assert [n for n in config_notes(load_config(PPOConfig, None, [])) if "validation" in n] == []
    # validation files, but no validation scheduled (nor val_only): they too are unread
    assert _notes_with("so no validation", "trainer.val_before_train=false", "trainer.test_freq=-1") == [
        "data.val_files=[runs/demo_assets/val.jsonl], trainer.log_val_generations=3 has no effect: "
        "trainer.val_before_train=false and trainer.test_freq=-1, so no validation runs"]
    assert _notes_with("so no validation", "trainer.val_before_train=false") == []  # the demo's test_freq 5
    assert _notes_with("so no validation", *none, "trainer.test_freq=5") == [
        "trainer.test_freq=5: data.val_files is empty, so no validation runs (verl refuses a run without validation "
        "data)"]


def test_validation_sampling_options_are_noted_once_where_no_validation_runs():
    """Where no validation runs (no data.val_files, or none scheduled), val_kwargs' top_k and do_sample are named
    once, in the note that no validation runs: not also as unread by a greedy validation rollout (which never
    runs). Where validation runs, that greedy rollout's note names them."""
    R = "actor_rollout_ref.rollout"
    set_ = (f"{R}.val_kwargs.top_k=5", f"{R}.val_kwargs.do_sample=true")
    unscheduled = load_config(PPOConfig, DEMO, ["trainer.val_before_train=false", "trainer.test_freq=-1", *set_])
    assert config_notes(unscheduled) == [
        f"data.val_files=[runs/demo_assets/val.jsonl], trainer.log_val_generations=3, {R}.val_kwargs.top_k=5, "
        f"{R}.val_kwargs.do_sample=true has no effect: trainer.val_before_train=false and trainer.test_freq=-1, so no "
        "validation runs"]
    no_files = load_config(PPOConfig, None, ["data.val_files=[]", *set_])
    assert config_notes(no_files) == [
        f"{R}.val_kwargs.top_k=5, {R}.val_kwargs.do_sample=true has no effect: data.val_files is empty, so no "
        "validation runs"]
    assert config_notes(_cfg(*set_)) == [  # the demo validates (greedily: val_kwargs.temperature=0)
        f"{R}.val_kwargs.do_sample=true has no effect with rollout.name=native: as in verl, whose vLLM and SGLang "
        "rollouts (its agent loop) do not read it (its hf rollout does), the validation rollout decodes greedily "
        f"(temperature 0); {R}.val_kwargs.temperature decides",
        f"{R}.val_kwargs.top_k=5 has no effect: the validation rollouts decode greedily ({R}.val_kwargs.temperature=0)"]


def test_a_reward_function_name_without_its_file_is_noted():
    """custom_reward_function.name (or verl 0.9.1's reward.custom_reward_function.name) names a function of path's
    file: without a path the built-in scorers score, and the name is said to have no effect."""
    why = ("has no effect: custom_reward_function.path is null (the built-in scorers score each row by its "
           "data_source)")
    assert _notes_with("custom_reward_function", "custom_reward_function.name=my_score") == [
        f"custom_reward_function.name=my_score {why}"]
    assert _notes_with("custom_reward_function", "reward.custom_reward_function.name=my_score") == [
        f"reward.custom_reward_function.name=my_score {why}"]  # named as the user set it
    assert _notes_with("custom_reward_function", "custom_reward_function.name=compute_score") == []
    assert _notes_with("custom_reward_function", "custom_reward_function.path=x.py",
                       "custom_reward_function.name=my_score") == []


def test_a_warm_up_ratio_under_a_warm_up_count_is_noted():
    """optim.lr_warmup_steps > 0 sets the warm-up (as verl reads them): a lr_warmup_steps_ratio beside it is not
    read, and is said so; -1 or 0 leaves the ratio to act. The critic's only with a critic."""
    A = "actor_rollout_ref.actor.optim"
    assert _notes_with("lr_warmup", f"{A}.lr_warmup_steps=5", f"{A}.lr_warmup_steps_ratio=0.1") == [
        f"{A}.lr_warmup_steps_ratio=0.1 has no effect: {A}.lr_warmup_steps=5 sets the warm-up (a count above 0 "
        "wins over the ratio, as in verl)"]
    for steps in (-1, 0):
        assert _notes_with("lr_warmup", f"{A}.lr_warmup_steps={steps}", f"{A}.lr_warmup_steps_ratio=0.1") == []
    assert _notes_with("lr_warmup", f"{A}.lr_warmup_steps=5") == []
    gae = ("algorithm.adv_estimator=gae", "critic.optim.lr_warmup_steps=3", "critic.optim.lr_warmup_steps_ratio=0.2")
    assert _notes_with("critic.optim.lr_warmup", *gae) == [
        "critic.optim.lr_warmup_steps_ratio=0.2 has no effect: critic.optim.lr_warmup_steps=3 sets the warm-up (a "
        "count above 0 wins over the ratio, as in verl)"]
    assert not [n for n in _notes_with("critic.optim", *gae[1:]) if "sets the warm-up" in n]  # no critic


def test_top_k_and_top_p_of_greedy_decoding_are_noted():
    """top_k / top_p truncate a sampled distribution: where the training or the validation rollouts decode
    greedily (temperature 0; with rollout.name=hf also do_sample=false) they have no effect, said at start-up."""
    R = "actor_rollout_ref.rollout"
    assert _notes_with("greedily", f"{R}.temperature=0", f"{R}.top_k=5", f"{R}.top_p=0.9") == [
        f"{R}.top_k=5, {R}.top_p=0.9 has no effect: the training rollouts decode greedily ({R}.temperature=0)"]
    assert _notes_with("greedily", f"{R}.val_kwargs.top_p=0.5") == [  # the demo validates at temperature 0
        f"{R}.val_kwargs.top_p=0.5 has no effect: the validation rollouts decode greedily ({R}.val_kwargs.temperature=0)"]
    assert _notes_with("greedily", f"{R}.name=hf", f"{R}.val_kwargs.temperature=0.7", f"{R}.val_kwargs.top_k=3") == [
        f"{R}.val_kwargs.top_k=3 has no effect: the validation rollouts decode greedily ({R}.val_kwargs.do_sample=false "
        "with rollout.name=hf)"]
    assert _notes_with("greedily", f"{R}.top_k=5", f"{R}.top_p=0.9", f"{R}.val_kwargs.temperature=0.7",
                       f"{R}.val_kwargs.top_k=0", f"{R}.val_kwargs.top_p=0.5") == []
    assert _notes_with("greedily", f"{R}.temperature=0", f"{R}.top_k=0", f"{R}.top_k=-1") == []


def test_a_data_seed_without_shuffle_is_noted():
    """data.seed orders the shuffle and draws the max_samples rows: with data.shuffle=false neither happens (the
    first rows, in file order), and a seed other than the default is said to have no effect."""
    assert _notes_with("data.seed", "data.shuffle=false", "data.seed=7", "data.train_max_samples=4") == [
        "data.seed=7 has no effect: data.shuffle=false (the prompts go in file order; train_max_samples and "
        "val_max_samples take the first rows)"]
    assert _notes_with("data.seed", "data.shuffle=false", "data.seed=null") == [
        "data.seed=null has no effect: data.shuffle=false (the prompts go in file order; train_max_samples and "
        "val_max_samples take the first rows)"]
    assert _notes_with("data.seed", "data.shuffle=false", "data.seed=1") == []
    assert _notes_with("data.seed", "data.shuffle=true", "data.seed=7") == []


def test_a_truncation_under_the_overlong_filter_is_noted():
    """data.filter_overlong_prompts=true drops every prompt over data.max_prompt_length, so data.truncation (what is
    done with those not filtered) never acts: a value other than error is said to have no effect."""
    assert _notes_with("data.truncation", "data.filter_overlong_prompts=true", "data.truncation=left") == [
        "data.truncation=left has no effect: data.filter_overlong_prompts=true drops the prompts longer than "
        "data.max_prompt_length (truncation cuts those not filtered)"]
    assert _notes_with("data.truncation", "data.filter_overlong_prompts=true", "data.truncation=error") == []
    assert _notes_with("data.truncation", "data.filter_overlong_prompts=false", "data.truncation=middle") == []


def test_token_budgets_without_dynamic_micro_batches_are_noted():
    """A token budget is read only by dynamic micro-batches: one set where its pass batches by sequence counts is
    said to have no effect, naming the switch; an inherited one, or one a dynamic pass reads, is not."""
    A, R, F = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    why = "has no effect: {} (a token budget is read by dynamic micro-batches only)"
    assert _notes_with("token budget", f"{A}.ppo_max_token_len_per_gpu=4096", f"{R}.log_prob_max_token_len_per_gpu=2048",
                       f"{F}.log_prob_max_token_len_per_gpu=1024") == [
        f"{A}.ppo_max_token_len_per_gpu=4096 " + why.format(f"{A}.use_dynamic_bsz=false, and no log-prob pass packs "
                                                            "by tokens"),
        f"{R}.log_prob_max_token_len_per_gpu=2048 " + why.format(f"{R}.log_prob_use_dynamic_bsz=false"),
        f"{F}.log_prob_max_token_len_per_gpu=1024 " + why.format(f"{F}.log_prob_use_dynamic_bsz=false")]
    # the old-log-prob pass packs by tokens and inherits the actor's budget: read
    assert _notes_with("token budget", f"{A}.ppo_max_token_len_per_gpu=4096", f"{R}.log_prob_use_dynamic_bsz=true") == []
    assert _notes_with("token budget", f"{A}.use_dynamic_bsz=true", f"{A}.ppo_micro_batch_size_per_gpu=null",
                       f"{A}.ppo_max_token_len_per_gpu=4096", f"{R}.log_prob_max_token_len_per_gpu=2048") == []
    gae = ("algorithm.adv_estimator=gae", "critic.ppo_max_token_len_per_gpu=8192", "critic.forward_max_token_len_per_gpu=4096")
    assert _notes_with("token budget", *gae) == [
        "critic.ppo_max_token_len_per_gpu=8192, critic.forward_max_token_len_per_gpu=4096 "
        + why.format("critic.use_dynamic_bsz=false")]
    assert _notes_with("token budget", *gae, "critic.use_dynamic_bsz=true") == []
    rm = ("reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=4",
          "reward_model.forward_max_token_len_per_gpu=1000")
    assert _notes_with("token budget", *rm) == [
        "reward_model.forward_max_token_len_per_gpu=1000 " + why.format("reward_model.use_dynamic_bsz=false")]
    assert _notes_with("token budget", *rm[:2], rm[3]) == []  # no micro-batch size: packed by tokens


def test_micro_batch_sizes_of_dynamic_micro_batches_are_noted():
    """A micro-batch size is not read where its pass packs by tokens: one set there is said to have no effect,
    naming the switch; one a pass that batches by sequences inherits (the old-log-prob pass, the reference, the
    critic) is read."""
    A, R, F = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    why = "has no effect: {} (its micro-batches are packed by token budget)"
    dyn = f"{A}.use_dynamic_bsz=true"  # (the log-prob passes inherit it; the demo's size: 64)
    assert _notes_with("packed by token budget", dyn) == [
        f"{A}.ppo_micro_batch_size_per_gpu=64 " + why.format(dyn)]
    assert _notes_with("packed by token budget", dyn, f"{A}.ppo_micro_batch_size_per_gpu=null") == []
    # the old-log-prob pass batches by sequences with the actor's size: read
    assert _notes_with("packed by token budget", dyn, f"{R}.log_prob_use_dynamic_bsz=false") == []
    assert _notes_with("packed by token budget", dyn, f"{A}.ppo_micro_batch_size_per_gpu=null",
                       f"{R}.log_prob_micro_batch_size_per_gpu=8", f"{F}.log_prob_micro_batch_size_per_gpu=4") == [
        f"{R}.log_prob_micro_batch_size_per_gpu=8 " + why.format(f"{R}.log_prob_use_dynamic_bsz=true"),
        f"{F}.log_prob_micro_batch_size_per_gpu=4 " + why.format(f"{F}.log_prob_use_dynamic_bsz=true")]
    # the reference batches by sequences with the rollout's size: read
    assert _notes_with("packed by token budget", dyn, f"{A}.ppo_micro_batch_size_per_gpu=null",
                       f"{R}.log_prob_micro_batch_size_per_gpu=8", f"{F}.log_prob_use_dynamic_bsz=false") == []
    gae = ("algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.ppo_micro_batch_size_per_gpu=16",
           "critic.forward_micro_batch_size_per_gpu=32")
    assert _notes_with("packed by token budget", *gae) == [
        "critic.ppo_micro_batch_size_per_gpu=16, critic.forward_micro_batch_size_per_gpu=32 "
        + why.format("critic.use_dynamic_bsz=true")]
    # the actor packs by tokens, the critic inherits its size and batches by sequences: read
    assert _notes_with("packed by token budget", dyn, "algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=false") == []
    rm = ("reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=4")
    assert _notes_with("packed by token budget", *rm, "reward_model.use_dynamic_bsz=true") == [
        "reward_model.micro_batch_size_per_gpu=4 " + why.format("reward_model.use_dynamic_bsz=true")]
    assert _notes_with("packed by token budget", *rm) == [] and _notes_with("packed by token budget") == []


def test_fsdp_unit_options_of_one_rank_shard_groups_are_noted():
    """Shard groups of one rank (one GPU, or fsdp_size=1) build no FSDP units (sharding.replicate): the models'
    forward_prefetch and wrap_policy, set, are said to have no effect there, of the models the run builds."""
    A = "actor_rollout_ref.actor.fsdp_config"
    set_ = (f"{A}.forward_prefetch=true", f"{A}.wrap_policy.min_num_params=1000",
            "actor_rollout_ref.ref.fsdp_config.forward_prefetch=true", "critic.model.fsdp_config.forward_prefetch=true")
    why = "has no effect: the shard groups are of one rank ({}): no FSDP units are built, each rank holds every parameter whole"
    assert _notes_with("no FSDP units", "trainer.n_gpus_per_node=1", *set_) == [  # (no critic in the demo)
        f"{A}.forward_prefetch=true, {A}.wrap_policy={{min_num_params: 1000}}, "
        "actor_rollout_ref.ref.fsdp_config.forward_prefetch=true "
        + why.format("trainer.nnodes x trainer.n_gpus_per_node = 1 rank")]
    assert _notes_with("no FSDP units", f"{A}.fsdp_size=1", set_[0]) == [
        f"{A}.forward_prefetch=true " + why.format(f"{A}.fsdp_size=1")]
    assert _notes_with("no FSDP units", *set_) == []  # the demo's 2 ranks: FULL_SHARD over both
    assert _notes_with("no FSDP units", "trainer.n_gpus_per_node=1") == []


def test_multi_turn_options_with_multi_turn_off_are_noted():
    mt = "actor_rollout_ref.rollout.multi_turn"
    assert _notes_with("enable is false", f"{mt}.max_assistant_turns=3", f"{mt}.tool_config_path=t.yaml",
                       f"{mt}.format=hermes") == [
        f"{mt}.max_assistant_turns=3, {mt}.tool_config_path=t.yaml has no effect: {mt}.enable is false"]
    assert _notes_with("multi_turn", f"{mt}.enable=true", f"{mt}.max_assistant_turns=3") == []
    # with verl's data.tool_config_path naming the same file: no tools are loaded with multi-turn off, so both are
    # unread (the data's, said by its own note, as ever)
    tools = os.path.join(ROOT, "configs", "tools", "gsm8k_tool.yaml")
    assert config_notes(_cfg(f"{mt}.tool_config_path={tools}", f"data.tool_config_path={tools}")) == [
        f"{mt}.tool_config_path={tools} has no effect: {mt}.enable is false",
        f"data.tool_config_path={tools} has no effect: meshppo renders the tool agent's prompts with the tools of "
        f"{mt}.tool_config_path, and the overlong-prompt filter counts them so"]
    assert _notes_with("multi_turn") == []


def test_options_their_algorithm_does_not_read_are_noted():
    """The adaptive controller's options with a fixed one, Dr. GRPO's switch with another estimator, clip_ratio
    under both explicit bounds, loss_scale_factor with another aggregation, LoRA's shape without LoRA."""
    kl = "algorithm.use_kl_in_reward=true"
    assert _notes_with("kl_ctrl", kl, "algorithm.kl_ctrl.target_kl=0.2", "algorithm.kl_ctrl.horizon=500") == [
        "algorithm.kl_ctrl.horizon=500, algorithm.kl_ctrl.target_kl=0.2 has no effect: algorithm.kl_ctrl.type=fixed "
        "(they steer the adaptive controller)"]
    assert _notes_with("kl_ctrl", kl, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.2") == []
    assert _notes_with("kl_ctrl", kl) == []

    assert _notes_with("norm_adv", "algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=false") == [
        "algorithm.norm_adv_by_std_in_grpo=false has no effect with algorithm.adv_estimator=rloo (only grpo, "
        "grpo_vectorized and grpo_passk divide by the group std)"]
    for adv in ("grpo", "grpo_vectorized", "grpo_passk"):
        assert _notes_with("norm_adv", f"algorithm.adv_estimator={adv}",
                           "algorithm.norm_adv_by_std_in_grpo=false") == []
    assert _notes_with("norm_adv", "algorithm.adv_estimator=rloo") == []

    A = "actor_rollout_ref.actor"
    bounds = (f"{A}.clip_ratio_low=0.2", f"{A}.clip_ratio_high=0.28")
    assert _notes_with("clip_ratio", f"{A}.clip_ratio=0.3", *bounds) == [
        f"{A}.clip_ratio=0.3 has no effect: clip_ratio_low and clip_ratio_high are both set (clip_ratio is their "
        "default)"]
    assert _notes_with("clip_ratio", f"{A}.clip_ratio=0.3", f"{A}.clip_ratio_high=0.28") == []
    assert _notes_with("clip_ratio", *bounds) == []
    assert _notes_with("both set", f"{A}.clip_ratio=0.3", *bounds, f"{A}.policy_loss.loss_mode=sapo") == []  # unread

    assert _notes_with("loss_scale_factor", f"{A}.loss_scale_factor=512") == [
        f"{A}.loss_scale_factor=512 has no effect: {A}.loss_agg_mode=token-mean (it is seq-mean-token-sum-norm's "
        "divisor)"]
    assert _notes_with("loss_scale_factor", f"{A}.loss_scale_factor=512",
                       f"{A}.loss_agg_mode=seq-mean-token-sum-norm") == []
    # a critic inherits the actor's factor (null): its seq-mean-token-sum-norm divides by it, whatever the actor's mode
    gae = ("algorithm.adv_estimator=gae", f"{A}.loss_scale_factor=512")
    assert config_notes(_cfg(*gae, "critic.loss_agg_mode=seq-mean-token-sum-norm")) == []
    assert _cfg(*gae).critic.loss_scale_factor == 512
    assert config_notes(_cfg(*gae)) == [  # both aggregate by token-mean: neither reads it
        f"{A}.loss_scale_factor=512 has no effect: {A}.loss_agg_mode=token-mean (it is seq-mean-token-sum-norm's "
        "divisor)"]
    assert config_notes(_cfg(*gae, "critic.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_scale_factor=64")) \
        == [f"{A}.loss_scale_factor=512 has no effect: {A}.loss_agg_mode=token-mean (it is seq-mean-token-sum-norm's "
            "divisor)"]  # the critic's own

    M = "actor_rollout_ref.model"
    gae = ("algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1")
    assert _notes_with("lora_rank=0", f"{M}.lora_alpha=32", f"{M}.target_modules=[q_proj]", *gae,
                       "critic.model.lora_alpha=8") == [
        f"{M}.lora_alpha=32.0, {M}.target_modules=[q_proj] has no effect: {M}.lora_rank=0 (no LoRA adapters)",
        "critic.model.lora_alpha=8.0 has no effect: critic.model.lora_rank=0 (no LoRA adapters)"]
    assert _notes_with("lora_alpha", f"{M}.lora_alpha=32", f"{M}.lora_rank=8", *gae, "critic.model.lora_alpha=8",
                       "critic.model.lora_rank=4") == []
    assert _notes_with("lora_rank=0", *gae) == []


def test_kl_guard_settings_that_do_not_act_are_noted():
    """A disabled guard reads none of its settings; the coefficient's and the learning rate's factors act only
    through their actions. Without a reference the one note that says the guard never acts stays alone."""
    G = "algorithm.kl_guard"
    assert _notes_with("kl_guard", f"{G}.enable=false") == [  # the demo's thresholds and action
        f"{G}.warn_kl=0.3, {G}.explode_kl=1.0, {G}.explode_action=raise_coef has no effect: {G}.enable is false"]
    assert _notes_with("kl_guard", f"{G}.lr_multiplier=0.3", f"{G}.coef_multiplier=3", f"{G}.max_kl_coef=2") == [
        f"{G}.lr_multiplier=0.3 has no effect: neither {G}.warn_action nor explode_action is lower_lr (which reads it)"]
    assert _notes_with("kl_guard", f"{G}.coef_multiplier=3", f"{G}.max_kl_coef=2", f"{G}.explode_action=warn") == [
        f"{G}.coef_multiplier=3.0, {G}.max_kl_coef=2.0 has no effect: neither {G}.warn_action nor explode_action is "
        "raise_coef (which reads it)"]
    assert _notes_with("kl_guard", f"{G}.lr_multiplier=0.3", f"{G}.warn_action=lower_lr") == []
    assert _notes_with("kl_guard") == []
    assert _notes_with("kl_guard", f"{G}.enable=false", "actor_rollout_ref.actor.use_kl_loss=false") == [
        "algorithm.kl_guard watches the KL to the reference, and this run has none (actor_rollout_ref.actor."
        "use_kl_loss=false, algorithm.use_kl_in_reward=false): it never acts"]


def test_kl_penalised_twice_is_noted():
    """verl prints a notice when both the KL in the reward and the KL loss are on; so does meshppo."""
    assert _notes_with("penalised twice", "algorithm.use_kl_in_reward=true") == [
        "algorithm.use_kl_in_reward=true and actor_rollout_ref.actor.use_kl_loss=true: the KL to the reference is "
        "penalised twice, in the reward and in the loss"]
    assert _notes_with("penalised twice", "algorithm.use_kl_in_reward=true",
                       "actor_rollout_ref.actor.use_kl_loss=false") == []
    assert _notes_with("penalised twice") == []  # the demo: the KL loss alone


def test_a_raise_coef_that_can_change_no_coefficient_is_noted():
    """raise_coef multiplies each enabled KL coefficient, capped at max_kl_coef and never lowered: one
    that is 0, or a fixed one already at the cap or above, cannot change; where none can, a note says so.
    The adaptive in-reward controller may lower its coefficient below the cap, so it can change."""
    G, LOSS, REWARD = "algorithm.kl_guard", "actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef"
    raise_ = f"{G}.explode_action=raise_coef"  # the demo's (its KL loss coefficient 0.001 can be raised)
    assert _notes_with("can change no KL", raise_) == []
    tail = " (raise_coef multiplies a coefficient up to max_kl_coef and never lowers it)"
    assert _notes_with("can change no KL", raise_, f"{LOSS}=0") == [
        f"{G}.explode_action=raise_coef can change no KL coefficient: {LOSS}=0.0 stays 0 when multiplied" + tail]
    assert _notes_with("can change no KL", raise_, f"{LOSS}=1") == [  # at the cap
        f"{G}.explode_action=raise_coef can change no KL coefficient: {LOSS}=1.0 is already at {G}.max_kl_coef=1.0 "
        "or above" + tail]
    both = (f"{G}.warn_action=raise_coef", raise_, f"{LOSS}=0", "algorithm.use_kl_in_reward=true", f"{REWARD}=3")
    assert _notes_with("can change no KL", *both) == [
        f"{G}.warn_action=raise_coef and {G}.explode_action=raise_coef can change no KL coefficient: {LOSS}=0.0 "
        f"stays 0 when multiplied, {REWARD}=3.0 is already at {G}.max_kl_coef=1.0 or above" + tail]
    assert _notes_with("can change no KL", *both, f"{G}.max_kl_coef=5") == []  # the reward's can rise to 5
    assert _notes_with("can change no KL", *both, "algorithm.kl_ctrl.type=adaptive") == []  # it may fall below 1
    assert _notes_with("can change no KL", *both, f"{REWARD}=0", "algorithm.kl_ctrl.type=adaptive") != []  # not from 0
    assert _notes_with("can change no KL", f"{G}.explode_action=warn", f"{LOSS}=0") == []  # no raise_coef
    assert _notes_with("can change no KL", raise_, f"{LOSS}=0", f"{G}.enable=false") == []  # its own note


def test_gdpo_settings():
    """verl's gdpo needs algorithm.gdpo_reward_keys (the reward function's dict keys of the components) and
    takes one weight per key; its keys with another estimator, and the KL in the reward with it, are noted.
    Refused naming the keys: `score` among the keys (a dict result's score is never one of the extras the
    components are read from), and a reward model that replaces the rule reward (no function runs, so
    there are no components)."""
    keys = "algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]"
    with pytest.raises(ConfigError, match="algorithm: adv_estimator=gdpo needs gdpo_reward_keys"):
        _cfg("algorithm.adv_estimator=gdpo")
    with pytest.raises(ConfigError, match="gdpo_reward_weights has 1 weights for 2 gdpo_reward_keys"):
        _cfg("algorithm.adv_estimator=gdpo", keys, "algorithm.gdpo_reward_weights=[1.0]")
    cfg = _cfg("algorithm.adv_estimator=gdpo", keys, "algorithm.gdpo_reward_weights=[1.0,0.5]")
    assert cfg.algorithm.gdpo_reward_keys == ["format_reward", "accuracy_reward"]
    validate(cfg)
    with pytest.raises(ConfigError, match=r"^algorithm: gdpo_reward_keys holds 'score': a dict result's 'score' is "
                                          "the reward itself"):
        _cfg("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format_reward,score]")
    assert _cfg(keys[:-1] + ",score]").algorithm.gdpo_reward_keys[-1] == "score"  # (another estimator: a note)
    reward_model = ["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=1"]
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator=gdpo with reward_model.enable=true and "
                                          r"reward_model.combine=replace: .* no components under "
                                          "algorithm.gdpo_reward_keys"):
        validate(_cfg("algorithm.adv_estimator=gdpo", keys, *reward_model))
    validate(_cfg("algorithm.adv_estimator=gdpo", keys, *reward_model, "reward_model.combine=add"))
    assert [n for n in config_notes(_cfg(keys)) if "gdpo" in n] == [
        "algorithm.gdpo_reward_keys=[format_reward, accuracy_reward] has no effect: algorithm.adv_estimator=grpo "
        "(they are gdpo's)"]
    assert [n for n in config_notes(_cfg("algorithm.adv_estimator=gdpo", keys, "algorithm.use_kl_in_reward=true",
                                         "algorithm.norm_adv_by_std_in_grpo=false")) if "gdpo" in n] == [
        "algorithm.norm_adv_by_std_in_grpo=false has no effect with algorithm.adv_estimator=gdpo (gdpo always "
        "divides each reward component by its group std, as verl's)",
        "algorithm.use_kl_in_reward=true does not reach the advantages: algorithm.adv_estimator=gdpo normalises the "
        "reward components (gdpo_reward_keys), not the token rewards (as in verl)"]


def test_inherited_micro_batch_sizes_say_so_in_their_help():
    from trainer.config import ActorRolloutRefConfig, CriticConfig

    def help_(cls, name):
        return cls.__dataclass_fields__[name].metadata["help"]

    arr = ActorRolloutRefConfig()
    assert help_(CriticConfig, "ppo_micro_batch_size_per_gpu").endswith(
        "null: the actor's ppo_micro_batch_size_per_gpu")
    assert help_(type(arr.rollout), "log_prob_micro_batch_size_per_gpu").endswith(
        "null: the actor's ppo_micro_batch_size_per_gpu")
    assert help_(type(arr.ref), "log_prob_micro_batch_size_per_gpu").endswith(
        "null: the rollout's log_prob_micro_batch_size_per_gpu")


def test_the_critics_tokenizer_is_the_actors_however_spelled(tmp_path, monkeypatch):
    """critic.model.tokenizer_path must be the actor's tokenizer: the same directory written with a
    trailing slash, relatively or through `..` is it; another directory is refused naming the key."""
    actor = tmp_path / "actor"
    (actor / "x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    base = [f"actor_rollout_ref.model.path={actor}", "algorithm.adv_estimator=gae"]
    for spelling in (f"{actor}/", "actor", f"{actor}/x/.."):
        validate(_cfg(*base, f"critic.model.tokenizer_path={spelling}"), 2, 2)
    with pytest.raises(ConfigError, match=r"critic.model.tokenizer_path \(.*x\) must be the actor's tokenizer"):
        validate(_cfg(*base, f"critic.model.tokenizer_path={actor}/x"), 2, 2)


@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
@pytest.mark.parametrize("files, index", [("", 0), ("['']", 0), ("['  ']", 0), ("[data/a.jsonl,'']", 1)])
def test_an_empty_data_file_entry_is_refused_naming_the_key(key, files, index):
    """An unset shell variable (`data.train_files=$TRAIN`) or a stray '' in the list reads as an empty
    path: refused at validation naming the key and the entry, not at load as a file type of ''."""
    with pytest.raises(ConfigError, match=rf"^{key}\[{index}\] is empty"):
        validate(_cfg(f"{key}={files}"))


@pytest.mark.parametrize("names", [
    # verl's examples/ppo_trainer/run_qwen2-7b_rm.sh (the older names) and verl 0.9.1's reward section
    ("reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.use_reward_loop=true",
     "reward_model.rollout.name=vllm", "reward_model.rollout.gpu_memory_utilization=0.8",
     "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=2048",
     "reward_model.rollout.response_length=1024", "reward_model.num_workers=8"),
    ("reward.reward_model.enable=true", "reward.reward_model.model_path=/rm"),
])
def test_a_reward_model_without_a_micro_batch_size_packs_its_forwards(names):
    """verl 0.9.1 scores with its reward-loop servers and has no reward-model micro-batch option, so its
    scripts set none (they were refused): the reward model's forwards then pack by token count."""
    cfg = _cfg(*names)
    validate(cfg, 2, 2)
    rm = cfg.reward_model
    assert rm.use_dynamic_bsz and rm.micro_batch_size_per_gpu is None and rm.forward_max_token_len_per_gpu == 32768
    sized = _cfg(*names, "reward_model.micro_batch_size_per_gpu=4").reward_model
    assert (sized.use_dynamic_bsz, sized.micro_batch_size_per_gpu) == (False, 4)


MEGATRON_REFUSED = "is not supported: meshppo has no Megatron engine (it trains with FSDP2"


@pytest.mark.parametrize("override, named", [
    # as verl's examples/grpo_trainer/run_qwen2-7b_math_megatron.sh passes them (strategy from its config name)
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
     "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method"),
    ("actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
     "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size"),
    ("critic.megatron={param_offload: true}", "critic.megatron.param_offload"),
    ("reward_model.megatron.tensor_model_parallel_size=2", "reward_model.megatron.tensor_model_parallel_size"),
    ("actor_rollout_ref.actor.optim.lr_decay_style=cosine", "actor_rollout_ref.actor.optim.lr_decay_style"),
    ("critic.optim.min_lr=0.0", "critic.optim.min_lr"),
    ("actor_rollout_ref.actor.optim.muon_momentum=0.95", "actor_rollout_ref.actor.optim.muon_momentum"),
    ("critic.checkpoint.mbridge_config={memory_efficient: true}", "critic.checkpoint.mbridge_config.memory_efficient"),
    ("critic.nccl_timeout=1200", "critic.nccl_timeout"),
    ("actor_rollout_ref.actor.load_weight=true", "actor_rollout_ref.actor.load_weight"),
])
def test_verls_megatron_keys_are_refused_as_megatron(override, named):
    """A verl Megatron script's keys say Megatron is not supported, naming the key given, not the
    nearest FSDP option's name (`did you mean 'actor_rollout_ref.actor.qat'?`)."""
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert str(e.value).startswith(f"{named} {MEGATRON_REFUSED}") and "did you mean" not in str(e.value)


def test_a_verl_config_composing_the_megatron_defaults_is_refused_as_megatron(tmp_path):
    """verl's examples/sglang_multiturn/config/gsm8k_multiturn_megatron_grpo.yaml composes
    ppo_megatron_trainer."""
    config = tmp_path / "gsm8k_multiturn_megatron_grpo.yaml"
    config.write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\ndata:\n  train_batch_size: 256\n")
    with pytest.raises(ConfigError, match=r"defaults \['ppo_megatron_trainer', '_self_'\] "
                                          + MEGATRON_REFUSED.replace("(", r"\(")):
        load_config(PPOConfig, config)
    # keys near Megatron's but meshppo's own still suggest the closest option
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.actor.optim.lr'"):
        _cfg("actor_rollout_ref.actor.optim.lrr=1e-6")
