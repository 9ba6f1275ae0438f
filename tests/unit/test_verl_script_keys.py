"""verl options its example scripts set: the deprecated global micro-batch sizes (divided by the
data-parallel size, as verl's workers divided them before 0.9.1), verl's name of the collective timeout, the options that
change nothing here (accepted, said at start-up when set), and the ones accepted at the only value
meshppo has."""

import dataclasses
import os

import pytest

from trainer.config import PPOConfig, config_notes, validate
from trainer.configlib import ConfigError, build_dataclass, load_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                    "demo.yaml")
EIGHT_RANKS = ("trainer.nnodes=2", "trainer.n_gpus_per_node=4")


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _round_trips(cfg):
    return dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)


def test_global_micro_batch_sizes_become_per_gpu_ones():
    """The demo has no per-GPU size but the actor's (64): each global size over 2 x 4 ranks."""
    cfg = _cfg(*EIGHT_RANKS, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
               "actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.rollout.log_prob_micro_batch_size=32",
               "actor_rollout_ref.ref.log_prob_micro_batch_size=8", "critic.ppo_micro_batch_size=24",
               "critic.forward_micro_batch_size=40")
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    assert (arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.log_prob_micro_batch_size_per_gpu,
            arr.ref.log_prob_micro_batch_size_per_gpu, critic.ppo_micro_batch_size_per_gpu,
            critic.forward_micro_batch_size_per_gpu) == (2, 4, 1, 3, 5)
    # the global forms are spent: a resolved config names each size once and resolves to itself
    assert (arr.actor.ppo_micro_batch_size, arr.rollout.log_prob_micro_batch_size, arr.ref.log_prob_micro_batch_size,
            critic.ppo_micro_batch_size, critic.forward_micro_batch_size) == (None,) * 5
    assert _round_trips(cfg)
    validate(cfg, 8, 4)  # 16 prompts x 8 samples / 8 ranks = 16 sequences a rank: micro-batches of 2


def test_a_derived_size_is_inherited_as_a_given_one():
    """The old-log-prob, reference and critic sizes default to the actor's (the critic's value forward to
    the critic's), whichever form set it."""
    cfg = _cfg(*EIGHT_RANKS, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
               "actor_rollout_ref.actor.ppo_micro_batch_size=32")
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    assert (arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.log_prob_micro_batch_size_per_gpu,
            arr.ref.log_prob_micro_batch_size_per_gpu, critic.ppo_micro_batch_size_per_gpu,
            critic.forward_micro_batch_size_per_gpu) == (4, 4, 4, 4, 4)
    cfg = _cfg(*EIGHT_RANKS, "critic.ppo_micro_batch_size=16")
    assert (cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.forward_micro_batch_size_per_gpu) == (2, 2)
    # one rank: the global size is the per-GPU one
    assert _cfg("trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.log_prob_micro_batch_size=12") \
        .actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 12
    rm = _cfg(*EIGHT_RANKS, "reward_model.micro_batch_size=64").reward_model
    assert (rm.micro_batch_size_per_gpu, rm.micro_batch_size) == (8, None)


def test_global_sizes_divide_by_the_data_parallel_size_under_ulysses():
    """A Ulysses group reads one micro-batch: verl's workers divide a global size by the ranks over
    the role's Ulysses size (the actor's for the rollout's and reference's log-probs), the reward
    model's by all ranks (verl's fsdp_workers)."""
    cfg = _cfg(*EIGHT_RANKS, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
               "critic.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
               "actor_rollout_ref.actor.ppo_micro_batch_size=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
               "actor_rollout_ref.ref.log_prob_micro_batch_size=6", "critic.ppo_micro_batch_size=8",
               "critic.forward_micro_batch_size=16", "reward_model.micro_batch_size=64")
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    assert (arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.log_prob_micro_batch_size_per_gpu,
            arr.ref.log_prob_micro_batch_size_per_gpu, critic.ppo_micro_batch_size_per_gpu,
            critic.forward_micro_batch_size_per_gpu, cfg.reward_model.micro_batch_size_per_gpu) == (2, 4, 3, 2, 4, 8)
    assert _round_trips(cfg)
    # a size that does not split over the 2 data-parallel groups (4, above, splits over them and not over 8 ranks)
    with pytest.raises(ConfigError) as e:
        _cfg(*EIGHT_RANKS, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "actor_rollout_ref.actor.ppo_micro_batch_size=3")
    assert str(e.value) == ("actor_rollout_ref.actor.ppo_micro_batch_size=3 does not split into "
                            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu over trainer.nnodes x "
                            "trainer.n_gpus_per_node = 2 x 4 = 8 ranks in Ulysses groups of 4 "
                            "(actor_rollout_ref.actor.ulysses_sequence_parallel_size): 2 data-parallel groups: use a "
                            "multiple of 2, or set ppo_micro_batch_size_per_gpu")
    with pytest.raises(ConfigError) as e:
        _cfg(*EIGHT_RANKS, "critic.ulysses_sequence_parallel_size=3", "critic.ppo_micro_batch_size=6")
    assert str(e.value) == ("critic.ulysses_sequence_parallel_size=3 does not divide the trainer.nnodes x "
                            "trainer.n_gpus_per_node = 2 x 4 = 8 ranks")


GLOBAL_SIZES = [("actor_rollout_ref.actor", "ppo_micro_batch_size"),
                ("actor_rollout_ref.rollout", "log_prob_micro_batch_size"),
                ("actor_rollout_ref.ref", "log_prob_micro_batch_size"),
                ("critic", "ppo_micro_batch_size"),
                ("critic", "forward_micro_batch_size"),
                ("reward_model", "micro_batch_size")]


@pytest.mark.parametrize("key,name", GLOBAL_SIZES)
def test_global_and_per_gpu_sizes_together_are_an_error(key, name):
    with pytest.raises(ConfigError) as e:
        _cfg(f"{key}.{name}=16", f"{key}.{name}_per_gpu=2")
    assert str(e.value) == (f"{key}.{name}=16 and {key}.{name}_per_gpu=2: both set the micro-batch size ({name}, "
                            "verl's deprecated form, over all ranks together); set one")


@pytest.mark.parametrize("key,name", GLOBAL_SIZES)
def test_a_global_size_must_split_over_the_ranks(key, name):
    with pytest.raises(ConfigError) as e:
        _cfg(*EIGHT_RANKS, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", f"{key}.{name}=12")
    assert str(e.value) == (f"{key}.{name}=12 does not split into {key}.{name}_per_gpu over trainer.nnodes x "
                            "trainer.n_gpus_per_node = 2 x 4 = 8 ranks: use a multiple of 8, or set "
                            f"{name}_per_gpu")
    with pytest.raises(ConfigError, match=f"{key}.{name}: 0 is out of range; allowed: >= 1"):
        _cfg(f"{key}.{name}=0")


def test_verls_nccl_timeout_is_the_runs_one_timeout():
    assert _cfg().trainer.nccl_timeout == 600  # verl's and torch's default
    for overrides in (["actor_rollout_ref.nccl_timeout=1800"], ["trainer.nccl_timeout=1800"],
                      ["actor_rollout_ref.nccl_timeout=1800", "trainer.nccl_timeout=1800"]):
        cfg = _cfg(*overrides)
        assert cfg.trainer.nccl_timeout == 1800 and cfg.actor_rollout_ref.nccl_timeout is None, overrides
        assert _round_trips(cfg)
    with pytest.raises(ConfigError) as e:
        _cfg("actor_rollout_ref.nccl_timeout=1800", "trainer.nccl_timeout=900")
    assert str(e.value) == ("trainer.nccl_timeout=900 and actor_rollout_ref.nccl_timeout=1800: both name the timeout "
                            "of the run's process groups (meshppo's models share them); set one of them, or both to "
                            "the same value")
    with pytest.raises(ConfigError, match="actor_rollout_ref.nccl_timeout: 0 is out of range; allowed: >= 1"):
        _cfg("actor_rollout_ref.nccl_timeout=0")


LM_HEAD = "meshppo's LM head"
# key: (a value that changes nothing, why); verl's default is false where not listed in VERL_DEFAULTS
NO_EFFECT = {
    "actor_rollout_ref.model.use_shm": (
        "true", "meshppo reads the safetensors files where they are, memory-mapped, one tensor at a time (the page "
                "cache shares them among a node's ranks): there is no copy to make"),
    "actor_rollout_ref.model.use_fused_kernels": (
        "true", f"{LM_HEAD} always computes them so: chunk by chunk, with its own kernels"),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": (
        "triton", f"{LM_HEAD} picks its kernels itself: Triton on CUDA when triton is installed, else PyTorch "
                  "(MESHPPO_LM_HEAD=torch forces it)"),
    **{f"actor_rollout_ref.{s}.entropy_from_logits_with_chunking": (
        "true", f"{LM_HEAD} computes the entropy chunk by chunk from the hidden states, never from full logits")
       for s in ("actor", "ref", "actor.fsdp_config", "ref.fsdp_config")},
    **{f"actor_rollout_ref.{s}.entropy_checkpointing": (
        "true", f"{LM_HEAD} keeps no logits for backward: it recomputes each chunk's logits there, the entropy's "
                "included")
       for s in ("actor", "ref", "actor.fsdp_config", "ref.fsdp_config")},
    **{f"{s}.fsdp_config.use_orig_params": (
        "true", "it is an FSDP1 option; meshppo shards with FSDP2, whose parameters always are the original ones (as "
                "DTensors)")
       for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")},
    "actor_rollout_ref.rollout.layered_summon": ("true", "the resharder moves the weights bucket by bucket"),
    "trainer.use_legacy_worker_impl": (
        "disable", "meshppo has one implementation, whose losses are normalised as verl's engine workers do (README)"),
    "data.filter_overlong_prompts_workers": ("4", "meshppo measures the prompts once at load, each rank its share of them"),
}
VERL_DEFAULTS = {"actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch",
                 "trainer.use_legacy_worker_impl": "auto",
                 "data.filter_overlong_prompts_workers": "1"}


@pytest.mark.parametrize("key", sorted(NO_EFFECT))
def test_options_that_change_nothing_are_said_when_set(key):
    value, why = NO_EFFECT[key]
    cfg = _cfg(f"{key}={value}")
    validate(cfg)
    assert set(config_notes(cfg)) - set(config_notes(_cfg())) == {f"{key}={value} has no effect: {why}"}


def test_options_that_change_nothing_at_verls_defaults_say_nothing():
    defaults = [f"{key}={VERL_DEFAULTS.get(key, 'false')}" for key in NO_EFFECT]
    assert config_notes(_cfg(*defaults)) == config_notes(_cfg())
    assert not any("has no effect" in n for n in config_notes(_cfg(*defaults)))


def test_impl_backend_takes_verls_backends_only():
    with pytest.raises(ConfigError, match=r"impl_backend: 'cuda' is not one of \['torch', 'triton'\]"):
        _cfg("actor_rollout_ref.model.fused_kernel_options.impl_backend=cuda")


def test_reference_strategy():
    for strategy in ("fsdp", "fsdp2"):
        assert _cfg(f"actor_rollout_ref.ref.strategy={strategy}").actor_rollout_ref.ref.strategy == strategy
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.ref.strategy: 'deepspeed' is not one of \['fsdp', "
                                          r"'fsdp2'\]"):
        _cfg("actor_rollout_ref.ref.strategy=deepspeed")
    for key in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model"):
        with pytest.raises(ConfigError, match=rf"^{key}.strategy=megatron is not supported: meshppo has no Megatron "
                                              r"engine \(it trains with FSDP2"):
            _cfg(f"{key}.strategy=megatron")


GAE = ("algorithm.adv_estimator=gae",)


def test_critic_checkpoints_are_kept_with_the_actors():
    validate(_cfg(*GAE, "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2"))
    validate(_cfg(*GAE, "trainer.max_actor_ckpt_to_keep=2"))
    for actor_keep, hint in (("2", " or 2"), ("null", "")):
        with pytest.raises(ConfigError) as e:
            validate(_cfg(*GAE, f"trainer.max_actor_ckpt_to_keep={actor_keep}", "trainer.max_critic_ckpt_to_keep=1"))
        assert str(e.value) == (f"trainer.max_critic_ckpt_to_keep=1 differs from trainer.max_actor_ckpt_to_keep="
                                f"{actor_keep}: meshppo saves the critic in the actor's checkpoints and rotates them "
                                f"together; set it to null{hint}")


def test_critic_checkpoint_notes():
    def notes(*overrides):
        return [n for n in config_notes(_cfg(*overrides)) if "max_critic_ckpt_to_keep" in n]

    # null keeps every critic checkpoint in verl: here the actor's rotation takes them
    assert notes(*GAE, "trainer.max_actor_ckpt_to_keep=3") == [
        "trainer.max_critic_ckpt_to_keep=null: the critic is saved in the actor's checkpoints, so the last 3 are kept "
        "(trainer.max_actor_ckpt_to_keep; verl would keep every critic checkpoint)"]
    assert notes(*GAE, "trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=3") == []
    assert notes(*GAE) == []
    # no critic (the demo's grpo): any value is accepted and said to do nothing
    cfg = _cfg("trainer.max_critic_ckpt_to_keep=1")
    validate(cfg)
    assert notes("trainer.max_critic_ckpt_to_keep=1") == [
        "trainer.max_critic_ckpt_to_keep=1 has no effect: algorithm.adv_estimator=grpo trains no critic"]
    assert notes("trainer.max_actor_ckpt_to_keep=3") == []


def test_zero_checkpoints_to_keep_keeps_all_as_in_verl(tmp_path):
    """verl's checkpoint manager rotates only for a positive max_*_ckpt_to_keep: 0 keeps every checkpoint,
    as null does. meshppo refused 0 (out of range); it now resolves to null, the critic's too, and the
    checkpoints are all kept."""
    from trainer.checkpointing import CheckpointManager

    cfg = _cfg(*GAE, "trainer.max_actor_ckpt_to_keep=0", "trainer.max_critic_ckpt_to_keep=0")
    validate(cfg)
    assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (None, None)
    assert _round_trips(cfg)
    manager = CheckpointManager(str(tmp_path), fingerprint={}, config=cfg, keep=cfg.trainer.max_actor_ckpt_to_keep,
                                log=lambda s: None)
    for step in (1, 2, 3):
        manager.save(step)
    assert manager.complete_steps() == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"trainer.max_actor_ckpt_to_keep: -1 is out of range; allowed: >= 0"):
        _cfg("trainer.max_actor_ckpt_to_keep=-1")


def test_remove_previous_ckpt_in_save_keeps_one_checkpoint_as_in_verl(tmp_path):
    """verl 0.9.1's trainer still reads its deprecated `trainer.remove_previous_ckpt_in_save` (a `+` key: its
    config has no such option): true keeps one actor and one critic checkpoint, whatever max_actor_ckpt_to_keep
    and max_critic_ckpt_to_keep say, with a warning that the switch is deprecated. meshppo does the same, and its
    start-up note names the keys that replace it."""
    from trainer.checkpointing import CheckpointManager

    flag = "+trainer.remove_previous_ckpt_in_save=true"
    cfg = _cfg(*GAE, flag, "trainer.max_actor_ckpt_to_keep=5", "trainer.max_critic_ckpt_to_keep=5")
    validate(cfg)
    assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (1, 1)
    assert _round_trips(cfg)
    assert ("trainer.remove_previous_ckpt_in_save=true keeps only the newest checkpoint, over any "
            "trainer.max_actor_ckpt_to_keep or trainer.max_critic_ckpt_to_keep (as verl 0.9.1 does, which deprecates "
            "the switch): set trainer.max_actor_ckpt_to_keep=1 and trainer.max_critic_ckpt_to_keep=1 instead"
            ) in config_notes(cfg)
    manager = CheckpointManager(str(tmp_path), fingerprint={}, config=cfg, keep=cfg.trainer.max_actor_ckpt_to_keep,
                                log=lambda s: None)
    for step in (1, 2, 3):
        manager.save(step)
    assert manager.complete_steps() == [3]
    # no critic (the demo's grpo): the actor's count alone; a critic count is still said to do nothing
    cfg = _cfg(flag, "trainer.max_critic_ckpt_to_keep=3")
    validate(cfg)
    assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (1, 3)
    assert [n for n in config_notes(cfg) if "ckpt" in n] == [
        "trainer.remove_previous_ckpt_in_save=true keeps only the newest checkpoint, over any "
        "trainer.max_actor_ckpt_to_keep (as verl 0.9.1 does, which deprecates the switch): set "
        "trainer.max_actor_ckpt_to_keep=1 instead",
        "trainer.max_critic_ckpt_to_keep=3 has no effect: algorithm.adv_estimator=grpo trains no critic"]
    # verl's default, false, changes nothing
    assert dataclasses.asdict(_cfg("+trainer.remove_previous_ckpt_in_save=false")) == dataclasses.asdict(_cfg())


def test_notes_and_errors_name_an_option_as_the_user_set_it():
    """verl's other names of an option (the optimizer's clip_grad / grad_clip, warmup_style, critic.fsdp, the
    reward section's) resolve to one key; a note or an error names the key the config or command line set
    (each with its value where several were set), not the one the value ends at."""
    unbuilt = config_notes(_cfg("critic.optim.clip_grad=0.5", "critic.optim.grad_clip=0.4", "critic.fsdp.fsdp_size=8",
                                "critic.optim.warmup_style=cosine"))
    assert unbuilt == ["critic.optim.warmup_style=cosine, critic.fsdp.fsdp_size=8, critic.optim.grad_clip=0.4, "
                       "critic.optim.clip_grad=0.5 has no effect: algorithm.adv_estimator=grpo trains no critic"]
    assert config_notes(_cfg("critic.grad_clip=0.4")) == [
        "critic.grad_clip=0.4 has no effect: algorithm.adv_estimator=grpo trains no critic"]
    critic = config_notes(_cfg("algorithm.adv_estimator=gae", "critic.fsdp.offload_policy=true",
                               "critic.fsdp.optimizer_offload=true", "critic.model.fsdp_config.param_offload=true",
                               "critic.fsdp.fsdp_size=64"))
    assert critic == [
        "critic.fsdp.fsdp_size=64 is more than the 2 ranks of this launch: the models shard over all 2 (FULL_SHARD), "
        "as verl does for an fsdp_size of at least the world size",
        "critic.fsdp.offload_policy=true supersedes critic.model.fsdp_config.param_offload=true and "
        "optimizer_offload=true (as in verl): parameters, gradients and optimizer states stay on CPU for the whole run (FSDP2 CPUOffloadPolicy) and "
        "are not moved between phases"]
    assert config_notes(_cfg("reward.reward_manager.name=dapo", "reward.reward_kwargs={max_resp_len: 10}")) == [
        "reward.reward_kwargs.max_resp_len has no effect without reward.reward_kwargs.overlong_buffer_cfg"]
    assert config_notes(_cfg("reward.reward_model.model_path=/rm")) == [
        "reward.reward_model.model_path=/rm has no effect: reward_model.enable is false"]
    assert config_notes(_cfg("reward.reward_model.enable=false", "reward_model.model.path=/rm")) == [
        "reward_model.model.path=/rm has no effect: reward.reward_model.enable is false"]
    with pytest.raises(ConfigError, match=r"^reward.reward_kwargs is set \(max_resp_len\) but reward_manager=naive"):
        _cfg("reward.reward_kwargs={max_resp_len: 10}")
    with pytest.raises(ConfigError, match=r"^reward.reward_kwargs.overlong_buffer_cfg needs len"):
        _cfg("reward.reward_manager.name=dapo", "reward.reward_kwargs={max_resp_len: 10, overlong_buffer_cfg: "
                                                "{enable: false}}")
    with pytest.raises(ConfigError, match=r"^reward.reward_manager.name=batch calls custom_reward_function"):
        validate(_cfg("reward.reward_manager.name=batch"), 2, 2)
    with pytest.raises(ConfigError, match=r"^reward.reward_model.enable=true needs reward_model.model.path"):
        validate(_cfg("reward.reward_model.enable=true"), 2, 2)
    # both names set (the same value): both named
    assert config_notes(_cfg("critic.optim.clip_grad=0.4", "critic.grad_clip=0.4")) == [
        "critic.optim.clip_grad=0.4, critic.grad_clip=0.4 has no effect: algorithm.adv_estimator=grpo trains no "
        "critic"]
    assert config_notes(_cfg("algorithm.adv_estimator=gae", "critic.fsdp.full_determinism=true")) == [
        "critic.fsdp.full_determinism=true makes every role deterministic: the roles share their processes (also "
        "actor_rollout_ref.actor.fsdp_config, actor_rollout_ref.ref.fsdp_config)"]


def test_a_global_micro_batch_size_is_named_as_set():
    """verl's deprecated global micro-batch sizes become the per-GPU ones (over the demo's 2 ranks); a note or an
    error names the global key with the value written, not the per-GPU key the user did not set."""
    assert config_notes(_cfg("critic.ppo_micro_batch_size=16", "critic.forward_micro_batch_size=8")) == [
        "critic.ppo_micro_batch_size=16, critic.forward_micro_batch_size=8 has no effect: algorithm.adv_estimator=grpo "
        "trains no critic"]
    a = "actor_rollout_ref.actor"
    assert config_notes(_cfg(f"{a}.use_dynamic_bsz=true", f"{a}.ppo_micro_batch_size_per_gpu=null",
                             f"{a}.ppo_micro_batch_size=16")) == [
        f"{a}.ppo_micro_batch_size=16 has no effect: {a}.use_dynamic_bsz=true (its micro-batches are packed by token "
        "budget)"]
    with pytest.raises(ConfigError, match=rf"^sequences per rank per mini-batch \(64\) must be a multiple of "
                                          rf"{a}.ppo_micro_batch_size=6 \(3 per GPU\)$"):
        validate(_cfg(f"{a}.ppo_micro_batch_size_per_gpu=null", f"{a}.ppo_micro_batch_size=6"))
    with pytest.raises(ConfigError, match=r"must be a multiple of critic.ppo_micro_batch_size=6 \(3 per GPU\)$"):
        validate(_cfg("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=6"))
    with pytest.raises(ConfigError, match=rf"must be a multiple of {a}.ppo_micro_batch_size_per_gpu \(3\)$"):
        validate(_cfg(f"{a}.ppo_micro_batch_size_per_gpu=3"))


def test_a_ulysses_size_set_in_fsdp_config_is_named_there():
    """verl's copy of a role's Ulysses size in its fsdp_config (critic.fsdp's too) sets the role's: an error names
    the key the user set, and a copy of 1 (which leaves the role's) is not named."""
    a = "actor_rollout_ref.actor"
    with pytest.raises(ConfigError, match=rf"^{a}.fsdp_config.ulysses_sequence_parallel_size=2 with "
                                          r"actor_rollout_ref.model.use_remove_padding=false: "):
        validate(_cfg(f"{a}.fsdp_config.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"))
    with pytest.raises(ConfigError, match=r"^critic.fsdp.ulysses_sequence_parallel_size=3 does not divide the 2 ranks"):
        validate(_cfg("algorithm.adv_estimator=gae", "critic.fsdp.ulysses_sequence_parallel_size=3"))
    with pytest.raises(ConfigError, match=rf"^{a}.ulysses_sequence_parallel_size=3 does not divide the 2 ranks"):
        validate(_cfg(f"{a}.ulysses_sequence_parallel_size=3", f"{a}.fsdp_config.ulysses_sequence_parallel_size=1"))
    with pytest.raises(ConfigError, match=r"^critic.fsdp.ulysses_sequence_parallel_size=2 differs from "
                                          r"critic.ulysses_sequence_parallel_size=4: "):
        _cfg("critic.fsdp.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=4")
