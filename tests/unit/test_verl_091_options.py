"""verl 0.9.1's options (tests/unit/data/verl_0.9.1_options.yaml: every option path of its generated
ppo_trainer.yaml with its default): each is an option, and all load together at their defaults as
verl's own config; set otherwise it acts (critic.fsdp, rollout.full_determinism, filter_groups.metric=reward,
data.audio_key), is said at start-up to change nothing, or is refused naming the key."""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
import yaml

from trainer.config import PPOConfig, config_notes, full_determinism_sections, validate
from trainer.configlib import ConfigError, build_dataclass, iter_options, load_config

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(os.path.dirname(os.path.dirname(HERE)), "configs", "demo.yaml")
OPTIONS = os.path.join(HERE, "data", "verl_0.9.1_options.yaml")
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
# the one option verl's defaults leave ??? that meshppo reads: every verl script names its engine
ENGINE = f"{R}.name"


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _round_trips(cfg):
    return dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)


def _verl_options() -> dict:
    with open(OPTIONS, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _nested(flat: dict) -> dict:
    tree = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def test_verl_091s_generated_config_loads_as_a_whole(tmp_path):
    """verl 0.9.1's complete default config, as a file (its interpolations, nested ones included, resolved):
    it loads, resolves to itself, and says only what differs from meshppo's own behaviour."""
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(_nested(_verl_options())))
    cfg = load_config(PPOConfig, path, [f"{ENGINE}=vllm"])
    assert _round_trips(cfg)
    assert config_notes(cfg) == [
        f"{ENGINE}=vllm: meshppo generates with its own engine (native); vllm is not used, and the rollout options it "
        "shares with verl tune meshppo's engine",
        f"{R}.mode=async: meshppo's engine runs in-process on every rank; the single-turn rollouts are the same as "
        "with sync (verl's agent-loop servers are not used)"]
    # the values that act are verl's defaults where they were null at the older reward places
    assert (cfg.reward_model.enable, cfg.reward_model.reward_manager, cfg.custom_reward_function.name) == \
        (False, "naive", "compute_score")
    assert cfg.critic.fsdp is None and cfg.critic.model.fsdp_config == _cfg().critic.model.fsdp_config


def test_every_verl_091_option_path_is_a_meshppo_option():
    """The generated config's paths are options (or lie in a free-form mapping option, as verl's
    engine_kwargs, or in an optional section, null by default); `lora` of a model is verl's Megatron
    LoRA section."""
    known = {key for key, *_ in iter_options(PPOConfig)}
    mappings = {key for key, tp, *_ in iter_options(PPOConfig) if tp.startswith("dict") or "section" in tp}
    for key in _verl_options():  # (an interpolation of a section, as rollout.mtp's, is that section)
        assert key in known or any(key.startswith(m + ".") for m in mappings) or \
            any(k.startswith(key + ".") for k in known), key
    assert "actor_rollout_ref.model.lora.rank" in known and "critic.model.lora.merge" in known


@pytest.mark.parametrize("override", [
    f"{A}.fsdp_config.qat.enable=true", "actor_rollout_ref.ref.fsdp_config.qat.enable=true", f"{A}.qat.enable=true",
    "critic.fsdp.qat.enable=true", f"{R}.qat.enable=true", f"{A}.fsdp_config.strategy=fsdp_turbo",
    "actor_rollout_ref.model.lora.rank=8", "critic.model.lora.rank=8",
    f"{R}.nnodes=1", f"{R}.moe_load_balance_metrics_interval=10", f"{R}.disaggregation.enabled=true",
    f"{R}.multi_turn.function_tool_path=tools.py", "data.function_tool_path=tools.py",
    f"{R}.checkpoint_engine.custom_backend_module=my.backend",
    "critic.model.hf_config_path=/cfg", "critic.model.lora_adapter_path=/a",
    "critic.model.mtp.enable=true",
    "distillation.enabled=true", "skip.rollout.enable=true", "skip.rollout_tq.enable=true",
    "skip.async_rollout.enable=true",
    "trainer.v1.trainer_mode=colocate_async", "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.sampler.custom_sampler.path=buffer.py",
    "algorithm.filter_groups.max_inflight_gen_batches=2",
    "global_profiler.finish_hook_cmd=upload.sh", f"{A}.profiler.finish_hook_cmd=upload.sh",
    f"{R}.profiler.finish_hook_cmd=upload.sh", f"{A}.profiler.tool_config.torch.schedule.active=2",
    f"{R}.profiler.tool_config.torch.profile_token_start=10", f"{R}.profiler.tool_config.torch.profile_token_end=20",
    "global_profiler.global_tool_config.torch_memory.memory_snapshot_num_steps=2",
    "critic.profiler.tool_config.torch_memory.memory_snapshot_num_steps=3",
    "global_profiler.global_tool_config.precision_debugger.config_path=msprobe.json",
    f"{A}.profiler.tool_config.precision_debugger.config_path=msprobe.json",
])
def test_what_meshppo_does_not_have_is_refused_naming_the_key(override):
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert str(e.value).startswith(f"{key}=") and " is not supported by meshppo" in str(e.value), str(e.value)


NOT_SUPPORTED = "which meshppo does not support"


@pytest.mark.parametrize("override, note", [
    (f"{A}.checkpoint.strict=false", f"{A}.checkpoint.strict=false has no effect: verl reads it in its Megatron "
     "checkpoint manager only; its FSDP workers, as meshppo, do not"),
    (f"{A}.fsdp_config.qat.mode=w4a4", f"{A}.fsdp_config.qat.mode=w4a4 has no effect: read only with qat.enable, "
     f"{NOT_SUPPORTED}"),
    (f"{A}.fsdp_config.turbo_config={{distributed: {{tensor_parallel_size: 2}}}}",
     f"{A}.fsdp_config.turbo_config={{distributed: {{tensor_parallel_size: 2}}}} has no effect: read only with "
     f"strategy=fsdp_turbo, {NOT_SUPPORTED}"),
    ("actor_rollout_ref.model.lora.merge=true", "actor_rollout_ref.model.lora.merge=true has no effect: meshppo's "
     "engine always gets the merged weights of a LoRA actor"),
    ("critic.model.lora.alpha=16", "critic.model.lora.alpha=16 has no effect: read only with lora.rank > 0, "
     f"{NOT_SUPPORTED} (meshppo's LoRA is lora_rank, lora_alpha and target_modules)"),
    (f"{R}.n_gpus_per_node=4", f"{R}.n_gpus_per_node=4 has no effect: read only with rollout.nnodes > 0, "
     f"{NOT_SUPPORTED}"),
    (f"{R}.router_config_path=router.yaml", f"{R}.router_config_path=router.yaml has no effect: meshppo's engine "
     "runs in-process, behind no router"),
    (f"{R}.trace.project_name=other", f"{R}.trace.project_name=other has no effect: read only with trace.backend, "
     f"{NOT_SUPPORTED}"),
    (f"{R}.disaggregation.decode_replicas=2", f"{R}.disaggregation.decode_replicas=2 has no effect: read only with "
     f"disaggregation.enabled, {NOT_SUPPORTED}"),
    ("critic.model.custom_chat_template=x", "critic.model.custom_chat_template=x has no effect: the critic reads the "
     "actor's token ids, rendered with the actor's template"),
    ("critic.model.use_liger=true", "critic.model.use_liger=true has no effect: meshppo's model is its own (models/), "
     "not the Hugging Face classes Liger patches, and has its own fused kernels"),
    ("critic.model.use_fused_kernels=true", "critic.model.use_fused_kernels=true has no effect: a critic has no LM "
     "head"),
    ("critic.model.mtp.method=eagle", "critic.model.mtp.method=eagle has no effect: read only with mtp.enable, "
     f"{NOT_SUPPORTED}"),
    ("distillation.teacher_key=ability", "distillation.teacher_key=ability has no effect: read only with "
     f"distillation.enabled, {NOT_SUPPORTED}"),
    ("distillation.distillation_loss.topk=8", "distillation.distillation_loss.topk=8 has no effect: read only with "
     f"distillation.enabled, {NOT_SUPPORTED}"),
    ("skip.rollout.dump_dir=/dumps", f"skip.rollout.dump_dir=/dumps has no effect: read only with its enable, "
     f"{NOT_SUPPORTED}"),
    ("trainer.v1.separate_async.parameter_sync_step=2", "trainer.v1.separate_async.parameter_sync_step=2 has no "
     f"effect: read only with trainer.v1.trainer_mode colocate_async or separate_async, {NOT_SUPPORTED}"),
    ("trainer.v1.sampler.sync_refill_failed_groups=true", "trainer.v1.sampler.sync_refill_failed_groups=true has no "
     "effect: meshppo's rollouts run in-process: no session fails"),
    ("transfer_queue.metrics.enabled=true", "transfer_queue.metrics.enabled=true has no effect: meshppo passes a "
     "step's batch between its phases in-process"),
    ("global_profiler.relocate_results=true", "global_profiler.relocate_results=true has no effect: meshppo writes "
     "its traces and snapshots into save_path itself; an nsys report goes where nsys profile -o puts it"),
    ("critic.profiler.finish_hook_ranks=[0]", f"critic.profiler.finish_hook_ranks=[0] has no effect: read only with "
     f"finish_hook_cmd, {NOT_SUPPORTED}"),
    (f"{A}.profiler.tool_config.torch.schedule.wait=1", f"{A}.profiler.tool_config.torch.schedule.wait=1 has no "
     f"effect: read only with schedule.active > 0, {NOT_SUPPORTED}"),
    ("global_profiler.global_tool_config.precision_debugger.stages=[actor_update]",
     "global_profiler.global_tool_config.precision_debugger.stages=[actor_update] has no effect: read only with "
     f"precision_debugger.config_path, {NOT_SUPPORTED}"),
])
def test_what_changes_nothing_is_said_at_start_up(override, note):
    cfg = _cfg(override)
    assert note in config_notes(cfg), config_notes(cfg)
    assert _round_trips(cfg)


def test_verls_copies_of_another_option_load_silently_where_they_copy_it():
    """The options verl's generated config interpolates from another (a role's profiler finish hook from the
    global's, the rollout's GPUs a node from the trainer's, its trace's names; the distillation teachers'
    engine options from the rollout's: the whole config's test) are said only where they differ from it."""
    copies = [f"{R}.n_gpus_per_node=2", f"{R}.trace.project_name=meshppo", f"{R}.trace.experiment_name=run",
              f"{A}.profiler.finish_hook_ranks=[1]", "global_profiler.finish_hook_ranks=[1]",
              f"{R}.profiler.relocate_results=true", f"{A}.profiler.relocate_results=true"]
    cfg = _cfg(*copies)
    notes = config_notes(cfg)
    assert [n for n in notes if n.startswith((f"{R}.n_gpus_per_node", f"{R}.trace", "distillation"))] == []
    assert [n.split(" has no effect")[0] for n in notes if "finish_hook" in n or "relocate" in n] == [
        f"{A}.profiler.relocate_results=true", "global_profiler.finish_hook_ranks=[1]"], notes
    assert _round_trips(cfg)


def test_critic_fsdp_is_verls_newer_name_of_the_critics_fsdp_config():
    """verl 0.9.1's critic engine config `critic.fsdp`: its options set what critic.model.fsdp_config sets
    (one resolved config either way); both set otherwise is an error naming both."""
    older = _cfg("algorithm.adv_estimator=gae", "critic.model.fsdp_config.param_offload=true",
                 "critic.model.fsdp_config.ulysses_sequence_parallel_size=2", "critic.model.fsdp_config.fsdp_size=8")
    newer = _cfg("algorithm.adv_estimator=gae", "critic.fsdp.param_offload=true",
                 "critic.fsdp.ulysses_sequence_parallel_size=2", "critic.fsdp.fsdp_size=8")
    assert dataclasses.asdict(newer) == dataclasses.asdict(older) and newer.critic.fsdp is None
    fc = newer.critic.model.fsdp_config
    assert (fc.param_offload, fc.fsdp_size, newer.critic.ulysses_sequence_parallel_size) == (True, -1, 2)
    # (fsdp_size 8 over the demo's 2 ranks: the same note, naming the key as set)
    assert config_notes(newer) == [n.replace("critic.model.fsdp_config.", "critic.fsdp.") for n in config_notes(older)]
    assert any(n.startswith("critic.fsdp.fsdp_size=8 ") for n in config_notes(newer))
    both = _cfg("critic.fsdp.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true")
    assert both.critic.model.fsdp_config.param_offload and both.critic.model.fsdp_config.optimizer_offload
    with pytest.raises(ConfigError, match=r"^critic.fsdp.model_dtype=bf16 and critic.model.fsdp_config.model_dtype=float32: "
                                          "both name the same setting"):
        _cfg("critic.fsdp.model_dtype=bf16", "critic.model.fsdp_config.model_dtype=float32")
    validate(newer)
    # the merged section's own rules apply to the merged values: offload_policy from one name supersedes
    # an offload flag from the other, as within one section
    split = _cfg("algorithm.adv_estimator=gae", "critic.fsdp.offload_policy=true",
                 "critic.model.fsdp_config.param_offload=true")
    one = _cfg("algorithm.adv_estimator=gae", "critic.model.fsdp_config.offload_policy=true",
               "critic.model.fsdp_config.param_offload=true")
    assert dataclasses.asdict(split) == dataclasses.asdict(one)
    assert split.critic.model.fsdp_config.superseded == one.critic.model.fsdp_config.superseded == ["param_offload"]
    assert config_notes(split) == [  # (each named as set)
        "critic.fsdp.offload_policy=true supersedes critic.model.fsdp_config.param_offload=true (as in verl): "
        "parameters, gradients and optimizer states stay on CPU for the whole run (FSDP2 CPUOffloadPolicy) and are "
        "not moved between phases"]
    assert config_notes(one) == [config_notes(split)[0].replace("critic.fsdp.offload_policy=true supersedes "
                                                                "critic.model.fsdp_config.param_offload",
                                                                "critic.model.fsdp_config.offload_policy=true "
                                                                "supersedes param_offload")]


def test_rollout_full_determinism_is_the_process_switch():
    """verl's rollout.full_determinism makes its vLLM server batch-invariant; meshppo's engine runs in the training
    processes, so it turns their one switch on (trainer.ppo_trainer reads full_determinism_sections), said to cover
    the roles."""
    cfg = _cfg(f"{R}.full_determinism=true")
    assert any(s.full_determinism for s in full_determinism_sections(cfg).values())
    assert config_notes(cfg) == [f"{R}.full_determinism=true makes every role deterministic: the roles share their "
                                 f"processes (also {A}.fsdp_config, actor_rollout_ref.ref.fsdp_config)"]
    assert not any(s.full_determinism for s in full_determinism_sections(_cfg()).values())


def test_filter_groups_reward_is_verl_091s_name_of_the_summed_reward():
    """verl 0.9.1's metric `reward` is the default, as verl's, so verl's plain `filter_groups.enable=true` runs:
    it is the summed reward before any KL, meshppo's seq_reward, the first column of the trainer's filter
    metrics. An explicit null is refused naming the key and the accepted names, `reward` among them."""
    from trainer.ppo_trainer import PPOTrainer

    cfg = _cfg("algorithm.filter_groups.enable=true")
    assert cfg.algorithm.filter_groups.metric == "reward"
    validate(cfg)
    cols = torch.tensor([[1.0, 0.5, 3.0], [0.0, 0.25, 4.0]], dtype=torch.float64)
    trainer = SimpleNamespace(cfg=cfg)
    assert PPOTrainer._filter_metric(trainer, cols, ["acc"], None).tolist() == [1.0, 0.0]
    trainer.cfg = _cfg("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward")
    assert PPOTrainer._filter_metric(trainer, cols, ["acc"], None).tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError) as e:
        validate(_cfg("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=null"))
    assert str(e.value) == ("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric: seq_reward, "
                            "seq_final_reward, score, reward, or a numeric extra key of the reward function's result "
                            "(e.g. acc)")


def test_a_checkpoint_from_before_the_reward_default_resumes():
    """filter_groups.metric defaulted to null before it defaulted to verl's `reward`: a run saved then ran with
    null, which only filter_groups.enable=false allowed (the metric unread), so it resumes under the new default;
    a metric that differs otherwise still stops the resume."""
    from trainer.checkpointing import run_differences

    saved = dataclasses.asdict(_cfg("algorithm.filter_groups.metric=null"))
    assert run_differences(saved, dataclasses.asdict(_cfg())) == []
    assert run_differences(saved, dataclasses.asdict(_cfg("algorithm.filter_groups.metric=acc"))) == [
        ("algorithm.filter_groups.metric", None, "acc")]


# The options verl 0.9.1's default trainer (its v1, trainer.use_v1=true) leaves aside with dynamic sampling: it
# warns that it ignores max_num_gen_batches and sets data.gen_batch_size to 1 (it refills prompt by prompt).
# meshppo reads both as verl's DAPO recipe does; their help and VERL.md's list must say so.
V1_LEAVES_ASIDE = {"algorithm.filter_groups.max_num_gen_batches": "ignores it",
                   "data.gen_batch_size": "sets it to 1"}


def _verl_md_leaves_aside() -> str:
    """VERL.md's bullet of the options meshppo reads where verl's trainer leaves them aside."""
    with open(os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "VERL.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("- **Where meshppo reads an option verl's trainer leaves aside:**")
    return text[start:text.index("\n\n", start)]


@pytest.mark.parametrize("key", sorted(V1_LEAVES_ASIDE))
def test_options_verls_v1_trainer_leaves_aside_say_what_verl_does(key):
    help_ = next(h for k, _, _, h in iter_options(PPOConfig) if k == key)
    assert f"verl 0.9.1's default trainer {V1_LEAVES_ASIDE[key]}" in help_ and "verl's DAPO recipe" in help_, help_
    assert f"`{key}`" in " ".join(_verl_md_leaves_aside().split())


def test_a_row_with_audio_is_refused_naming_its_field(tmp_path):
    """verl 0.9.1's data.audio_key: a row with audio is refused at load, as one with images or videos (meshppo's
    models are text-only); the data section's media_keys names the three fields."""
    transformers = pytest.importorskip("transformers")
    from data import DatasetError, RLHFDataset, write_jsonl
    from data.demo import DATA_SOURCE, build_demo_tokenizer

    build_demo_tokenizer(tmp_path / "tok")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    row = {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": "1+1="}],
           "reward_model": {"ground_truth": "2"}}
    data = _cfg("data.audio_key=sounds").data
    assert data.media_keys == ("images", "videos", "sounds")
    for keys, field in ((None, "audios"), (data.media_keys, "sounds")):
        path = write_jsonl([row, {**row, field: [{"audio": "a.wav"}]}], tmp_path / "d.jsonl")
        with pytest.raises(DatasetError, match=rf"d.jsonl:2: field '{field}' holds media: meshppo's models are "
                                               "text-only"):
            RLHFDataset([path], tokenizer, **({} if keys is None else {"media_keys": keys}))
    assert len(RLHFDataset([write_jsonl([row, {**row, "audios": []}], tmp_path / "e.jsonl")], tokenizer)) == 2
