"""The options of verl's complete default config (its generated ppo_trainer.yaml) that its example
scripts rarely set: each loads at verl's default without a note; set otherwise it is implemented
(fsdp_config.dtype, model.tokenizer_path, verl's copies of rollout.n and model.use_remove_padding,
critic.enable), said at start-up to change nothing, or refused naming the key."""

import dataclasses
import os

import pytest
import torch

from trainer.config import PPOConfig, config_notes, full_determinism_sections, validate
from trainer.configlib import ConfigError, build_dataclass, load_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                    "demo.yaml")
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _round_trips(cfg):
    return dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)


# verl's defaults as its generated ppo_trainer.yaml writes them (interpolations resolved against the demo:
# rollout.n=8, model.use_remove_padding=true, model.path=runs/demo_assets/sft_model)
VERL_DEFAULTS = [
    f"{A}.optim.optimizer=AdamW", f"{A}.optim.optimizer_impl=torch.optim", f"{A}.optim.override_optimizer_config=null",
    "critic.optim.optimizer=AdamW", "critic.optim.override_optimizer_config={}",
    *(f"{s}.fsdp_config.{k}" for s in (A, "actor_rollout_ref.ref", "critic.model")
      for k in ("dtype=bfloat16", "seed=42", "full_determinism=false", "ulysses_sequence_parallel_size=1",
                "use_torch_compile=true", "strategy=fsdp")),
    f"{A}.fsdp_config.forward_only=false", "actor_rollout_ref.ref.fsdp_config.forward_only=true",
    "critic.model.fsdp_config.forward_only=false",
    f"{A}.rollout_n=8", "actor_rollout_ref.ref.rollout_n=8", "critic.rollout_n=8", f"{A}.use_remove_padding=true",
    f"{A}.use_fused_kernels=false", f"{A}.data_loader_seed=42", "critic.data_loader_seed=42",
    f"{A}.freeze_vision_tower=false", f"{A}.use_prefix_grouper=false", f"{A}.calculate_sum_pi_squared=false",
    f"{A}.sum_pi_squared_checkpointing=false", f"{A}.router_replay.mode=disabled",
    "actor_rollout_ref.ref.router_replay.replay_file=null", "critic.enable=null",
    "actor_rollout_ref.model.hf_config_path=null", "actor_rollout_ref.model.tokenizer_path=null",
    "actor_rollout_ref.model.exclude_modules=null", "actor_rollout_ref.model.use_liger=false",
    "actor_rollout_ref.model.tiled_mlp={enabled: false, num_shards: 4}", "critic.model.tiled_mlp.num_shards=4",
    "actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.speculative_algorithm=EAGLE",
    "critic.model.external_lib=null", "critic.model.trust_remote_code=false", "critic.model.use_shm=false",
    *(f"{s}.override_config={{}}" for s in ("actor_rollout_ref.model", "critic.model", "reward_model.model")),
    f"{R}.engine_kwargs={{vllm: {{}}, sglang: {{}}, trtllm: {{}}}}", f"{R}.multi_stage_wake_up=false",
    f"{R}.enable_prefix_caching=true", f"{R}.disable_log_stats=true", f"{R}.logprobs_mode=processed_logprobs",
    f"{R}.scheduling_policy=fcfs", f"{R}.over_sample_rate=0", f"{R}.agent.num_workers=8",
    f"{R}.agent.default_agent_loop=single_turn_agent", f"{R}.agent.custom_async_server.path=null",
    f"{R}.multi_turn.enable=false", f"{R}.multi_turn.max_tool_response_length=256", f"{R}.multi_turn.format=hermes",
    f"{R}.checkpoint_engine={{backend: naive, update_weights_bucket_megabytes: 2048, engine_kwargs: {{}}}}",
    f"{R}.trace={{backend: null, token2text: false, max_samples_per_step_per_worker: null}}",
    f"{R}.skip_rollout=false", f"{R}.skip_dump_dir=/tmp/rollout_dump", f"{R}.skip_tokenizer_init=true",
    f"{R}.enable_rollout_routing_replay=false", f"{R}.quantization_config_file=null",
    f"{R}.prometheus={{enable: false, port: 9090, served_model_name: runs/demo_assets/sft_model}}",
    f"{R}.mtp={{enable: false, enable_train: false, num_speculative_tokens: 1}}",
    "data.use_shm=false", "data.return_raw_input_ids=false", "data.return_raw_chat=true", "data.image_key=images",
    "data.video_key=videos",
    "data.image_patch_size=14", "data.return_multi_modal_inputs=true", "data.tool_config_path=null",
    "data.custom_cls={path: null, name: null}", "data.datagen.path=null", "data.sampler.class_path=null",
    "trainer.esi_redundant_time=0", "trainer.default_hdfs_dir=null", "trainer.del_local_ckpt_after_load=false",
    "trainer.ray_wait_register_center_timeout=300",
    "ray_kwargs={ray_init: {num_cpus: null, runtime_env: {py_executable: null}}, timeline_json_file: null}",
    "transfer_queue.enable=false",
    # verl 0.9.1's, as its generated yaml writes them (the interpolations resolve to the actor's)
    f"{A}.optim.zero_indexed_step=true", "critic.optim.zero_indexed_step=true",
    f"{A}.entropy_from_logits_chunk_size=2048", f"{A}.pad_to_length=false",
    "actor_rollout_ref.ref.entropy_from_logits_chunk_size=2048",
    "actor_rollout_ref.ref.pad_to_length=${oc.select:actor_rollout_ref.actor.pad_to_length,False}",
    f"{A}.fsdp_config.entropy_from_logits_chunk_size=${{oc.select:{A}.entropy_from_logits_chunk_size,2048}}",
    f"{A}.fsdp_config.pad_to_length=${{oc.select:{A}.pad_to_length,False}}", f"{A}.fsdp_config.pad_to_length_bucket=1024",
    f"{A}.fsdp_config.use_no_sync_for_gradient_accumulation=false",
    "actor_rollout_ref.ref.fsdp_config.pad_to_length_bucket=${oc.select:" + A + ".fsdp_config.pad_to_length_bucket,1024}",
    f"{R}.seed=42", "data.mm_processor_kwargs={}", "trainer.use_v1=true", "trainer.checkpoint_callback_class=null",
    "algorithm.filter_groups.metric=reward",
]


def test_verls_defaults_load_without_notes_and_change_nothing():
    plain, cfg = _cfg(), _cfg(*VERL_DEFAULTS)
    assert config_notes(cfg) == config_notes(plain) == []
    assert _round_trips(cfg)
    # verl's copies and aliases resolve away: the config is the demo's, but for an empty
    # override_optimizer_config (which reads as verl's null)
    cfg.critic.optim.override_optimizer_config = None
    assert dataclasses.asdict(cfg) == dataclasses.asdict(plain)


def test_zero_indexed_step_false_is_refused_with_the_cosine_schedule():
    """verl's zero_indexed_step=false counts the cosine schedule's steps from 1; meshppo's counts from 0."""
    with pytest.raises(ConfigError, match=f"{A}.optim: zero_indexed_step=false is not supported"):
        _cfg(f"{A}.optim.zero_indexed_step=false", f"{A}.optim.lr_scheduler_type=cosine")


@pytest.mark.parametrize("override", [
    f"{A}.optim.optimizer=SGD", "critic.optim.optimizer_impl=bitsandbytes.optim",
    f"{A}.optim.override_optimizer_config={{foreach: false}}",
    f"{A}.fsdp_config.forward_only=true", "actor_rollout_ref.ref.fsdp_config.forward_only=false",
    "actor_rollout_ref.ref.router_replay.mode=R3",
    f"{A}.router_replay.replay_file=r.pt", "actor_rollout_ref.ref.router_replay.record_file=r.pt",
    "actor_rollout_ref.model.hf_config_path=/cfg",
    "actor_rollout_ref.model.mtp.enable=true", f"{R}.mtp.enable_rollout=true",
    "critic.model.external_lib=my_lib", "critic.model.trust_remote_code=true",
    f"{R}.logprobs_mode=raw_logprobs", f"{R}.logprobs_mode=processed_logits", f"{R}.scheduling_policy=priority",
    f"{R}.over_sample_rate=0.1", f"{R}.agent.agent_loop_config_path=a.yaml",
    f"{R}.agent.custom_async_server.path=srv.py", f"{R}.checkpoint_engine.backend=nccl",
    f"{R}.trace.backend=weave", f"{R}.skip_rollout=true",
    f"{R}.quantization_config_file=q.json", f"{R}.prometheus.enable=true",
"data.custom_cls.path=ds.py", "data.datagen.path=gen.py",
    "data.sampler.class_path=sampler.py", "trainer.default_hdfs_dir=hdfs://x", "trainer.del_local_ckpt_after_load=true",
    "trainer.checkpoint_callback_class=my.Callback",
])
def test_what_meshppo_does_not_implement_is_refused_naming_the_key(override):
    key, value = override.split("=", 1)
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert str(e.value).startswith(f"{key}=") and " is not supported by meshppo" in str(e.value), str(e.value)


@pytest.mark.parametrize("override, note", [
    (f"{A}.fsdp_config.pad_to_length=true", f"{A}.fsdp_config.pad_to_length=true has no effect: meshppo's packed "
     "micro-batches keep their own length; padding to a bucket would add masked tokens only"),
    (f"{A}.entropy_from_logits_chunk_size=512", f"{A}.entropy_from_logits_chunk_size=512 has no effect: meshppo's LM "
     "head computes the entropy chunk by chunk from the hidden states, never from full logits"),
    ("critic.model.fsdp_config.use_no_sync_for_gradient_accumulation=true",
     "critic.model.fsdp_config.use_no_sync_for_gradient_accumulation=true has no effect: meshppo always reduces a "
     "mini-batch's gradients once, in its last micro-batch's backward"),
    (f"{R}.seed=3", f"{R}.seed=3 has no effect: meshppo's engine draws its samples from trainer.seed and the step"),
    ("data.filter_overlong_prompts_workers=null", "data.filter_overlong_prompts_workers=null has no effect: meshppo "
     "measures the prompts once at load, each rank its share of them"),  # null as a config writes it
    ("algorithm.filter_groups.metric=null", "algorithm.filter_groups.metric=null has no effect: "
     "algorithm.filter_groups.enable is false"),
    ("trainer.use_v1=false", "trainer.use_v1=false has no effect: meshppo has one trainer"),
    ("data.mm_processor_kwargs={max_pixels: 10}", "data.mm_processor_kwargs={max_pixels: 10} has no effect: "
     "meshppo's models are text-only: it reads no images or videos"),
    (f"{A}.optim.zero_indexed_step=false", f"{A}.optim.zero_indexed_step=false has no effect: "
     f"{A}.optim.lr_scheduler_type=constant (they shape the cosine schedule)"),
    (f"{A}.fsdp_config.seed=7", f"{A}.fsdp_config.seed=7 has no effect: meshppo's draws follow trainer.seed "
                                "(the prompt order and the max_samples choice data.seed), with or without "
                                "full_determinism"),
    ("critic.model.fsdp_config.strategy=fsdp2", "critic.model.fsdp_config.strategy=fsdp2 has no effect: meshppo "
                                                "shards with FSDP2 whatever the strategy"),
    ("actor_rollout_ref.ref.fsdp_config.use_torch_compile=false",
     "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false has no effect: meshppo's LM head computes the entropy "
     "with its own kernels (actor.use_torch_compile and ref.use_torch_compile compile the transformer blocks)"),
    (f"{A}.data_loader_seed=3", f"{A}.data_loader_seed=3 has no effect: meshppo seeds that shuffle with trainer.seed "
                                "plus the step (a new order every step)"),
    (f"{A}.freeze_vision_tower=true", f"{A}.freeze_vision_tower=true has no effect: meshppo's models are text-only: "
                                      "there is no vision tower"),
    (f"{A}.use_fused_kernels=true", f"{A}.use_fused_kernels=true has no effect: meshppo's LM head always computes "
                                    "them so: chunk by chunk, with its own kernels"),
    ("actor_rollout_ref.model.use_liger=true", "actor_rollout_ref.model.use_liger=true has no effect: meshppo's model "
     "is its own (models/), not the Hugging Face classes Liger patches, and has its own fused kernels"),
    ("actor_rollout_ref.model.tiled_mlp.num_shards=8", "actor_rollout_ref.model.tiled_mlp.num_shards=8 has no effect: "
     "read only with actor_rollout_ref.model.tiled_mlp.enabled=true"),
    ("critic.model.tiled_mlp.num_shards=2", "critic.model.tiled_mlp.num_shards=2 has no effect: "  # (the demo's: no
                                            "algorithm.adv_estimator=grpo trains no critic"),       # critic)
    (f"{R}.enable_prefix_caching=false", f"{R}.enable_prefix_caching=false has no effect: meshppo's engine prefills "
     "each prompt once for its n samples, which share its KV blocks copy-on-write (rollout/block_manager.py); it "
     "keeps no cache across prompts (a multi-turn sample keeps its own K/V between its turns)"),
    (f"{R}.engine_kwargs.vllm={{swap_space: 4}}",  # a dotted key into a dict field replaces the dict
     f"{R}.engine_kwargs={{vllm: {{swap_space: 4}}}} has no effect: meshppo generates with its own engine, which "
     "takes none of them"),
    (f"{R}.multi_stage_wake_up=true", f"{R}.multi_stage_wake_up=true has no effect: meshppo's engine always does: the "
     "weights come back at the reshard, the KV cache when generation starts, after the actor's training states are "
     "offloaded"),
    (f"{R}.multi_turn.use_inference_chat_template=true", f"{R}.multi_turn.use_inference_chat_template=true has no "
     "effect: verl 0.9.1 reads it nowhere (only the request schema of its removed SGLang multi-turn rollout, unused, "
     "names it); meshppo keeps each turn's tokens as the model generated them (what false meant there)"),
    (f"{R}.multi_turn.tokenization_sanity_check_mode=disable", f"{R}.multi_turn.tokenization_sanity_check_mode=disable "
     "has no effect: verl 0.9.1 reads it nowhere (only the request schema of its removed SGLang multi-turn rollout, "
     "unused, names it); meshppo checks nothing at the end of a rollout: the messages it inserts are rendered alone "
     "and appended after the model's turn, and after what the chat template writes after that turn's end-of-turn "
     "token (docs/VERL.md)"),
    (f"{R}.agent.num_workers=2", f"{R}.agent.num_workers=2 has no effect: meshppo runs no agent-loop servers or "
                                 "workers: its rollouts, multi-turn ones too, run in-process"),
    (f"{R}.prometheus.served_model_name=policy", f"{R}.prometheus.served_model_name=policy has no effect: read only "
     "with prometheus.enable, which meshppo does not support"),
    ("data.image_patch_size=16", "data.image_patch_size=16 has no effect: meshppo's models are text-only: it reads "
                                 "no images or videos"),
    ("data.return_raw_chat=false", "data.return_raw_chat=false has no effect: meshppo always keeps them"),
    ("trainer.esi_redundant_time=600", "trainer.esi_redundant_time=600 has no effect: meshppo reads no instance "
                                       "expiry: it saves on SIGTERM or SIGUSR1 (preemption_grace_s)"),
    ("ray_kwargs.ray_init.num_cpus=8",
     "ray_kwargs={ray_init: {num_cpus: 8}} has no effect: meshppo runs without Ray (torchrun launches it)"),
    ("transfer_queue.enable=true", "transfer_queue.enable=true has no effect: meshppo passes a step's batch between "
                                   "its phases in-process"),
])
def test_inert_options_say_so_when_set(override, note):
    assert config_notes(_cfg(override)) == [note]


def test_fsdp_dtype_is_the_compute_dtype():
    """verl computes in fsdp_config.dtype where mixed_precision gives no param_dtype: meshppo's
    param_dtype at its default (bf16, verl's dtype default) takes it; a param_dtype of the user's
    wins over dtype, as verl's mixed_precision does."""
    fc = _cfg("critic.model.fsdp_config.dtype=float32").critic.model.fsdp_config  # the demo's critic: defaults
    assert fc.mixed_precision.param_dtype == "float32" and fc.param_torch_dtype == torch.float32
    assert _round_trips(_cfg("critic.model.fsdp_config.dtype=fp32"))
    # the demo sets param_dtype fp32: it wins over verl's default dtype, and the same dtype agrees with it
    for dtype in ("bfloat16", "fp32"):
        fc = _cfg(f"actor_rollout_ref.ref.fsdp_config.dtype={dtype}").actor_rollout_ref.ref.fsdp_config
        assert fc.mixed_precision.param_dtype == "fp32"
    # without a dtype of verl's other than its default, meshppo's bf16 stays
    assert _cfg().critic.model.fsdp_config.param_torch_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.fsdp_config: fsdp_config.dtype='float16' is not "
                                          "supported: fp16 needs loss scaling"):
        _cfg(f"{A}.fsdp_config.dtype=float16")


def test_tiled_mlp_is_accepted_and_its_tiles_checked():
    """tiled_mlp is implemented (models/tiled_mlp.py): enabled loads without a note for the actor
    (and reference) and the critic (of a run that trains one), its num_shards is read; a tile count below 1 is refused
    naming the key."""
    cfg = _cfg("actor_rollout_ref.model.tiled_mlp={enabled: true, num_shards: 8}", "critic.model.tiled_mlp.enabled=true",
               "algorithm.adv_estimator=gae")
    assert (cfg.actor_rollout_ref.model.tiled_mlp.enabled, cfg.actor_rollout_ref.model.tiled_mlp.num_shards) == (True, 8)
    assert (cfg.critic.model.tiled_mlp.enabled, cfg.critic.model.tiled_mlp.num_shards) == (True, 4)
    assert config_notes(cfg) == [] and _round_trips(cfg)
    for key in ("actor_rollout_ref.model.tiled_mlp.num_shards", "critic.model.tiled_mlp.num_shards"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            _cfg(f"{key.rsplit('.', 1)[0]}.enabled=true", f"{key}=0")


def test_full_determinism_is_one_switch_for_the_process():
    """fsdp_config.full_determinism is implemented (trainer.ppo_trainer.enable_full_determinism):
    the roles share their processes, so true on every role the run builds loads without a note, and
    true on some of them says that it covers the others too, naming them."""
    both = _cfg(f"{A}.fsdp_config.full_determinism=true", "actor_rollout_ref.ref.fsdp_config.full_determinism=true")
    assert config_notes(both) == [] and _round_trips(both)
    some = _cfg("critic.model.fsdp_config.full_determinism=true", "algorithm.adv_estimator=gae", f"{R}.n=1")
    assert config_notes(some) == [
        "critic.model.fsdp_config.full_determinism=true makes every role deterministic: the roles share their "
        "processes (also actor_rollout_ref.actor.fsdp_config, actor_rollout_ref.ref.fsdp_config)"]


def test_the_references_full_determinism_under_lora_is_unread():
    """Under LoRA the reference is the actor with its adapters off, not a model the run builds: its
    fsdp_config (full_determinism too, as in verl, which builds no reference worker then) is unread, as the
    note says, and does not turn the process deterministic; the actor's does, naming no reference."""
    lora = ("actor_rollout_ref.model.lora_rank=8",)
    ref_only = _cfg(*lora, "actor_rollout_ref.ref.fsdp_config.full_determinism=true")
    assert not any(s.full_determinism for s in full_determinism_sections(ref_only).values())
    assert config_notes(ref_only) == [
        "actor_rollout_ref.ref.fsdp_config unused: with LoRA the reference is the actor with its adapters off, not a "
        "model of its own"]
    actor = _cfg(*lora, f"{A}.fsdp_config.full_determinism=true")
    assert list(full_determinism_sections(actor)) == [f"{A}.fsdp_config", R]
    assert [n for n in config_notes(actor) if "deterministic" in n] == []


def test_model_tokenizer_path_is_data_tokenizer():
    cfg = _cfg("actor_rollout_ref.model.tokenizer_path=/tok")
    assert (cfg.data.tokenizer, cfg.actor_rollout_ref.model.tokenizer_path, cfg.critic.model.tokenizer_path) == \
        ("/tok", None, "/tok")
    assert _round_trips(cfg)
    assert _cfg("data.tokenizer=/tok", "actor_rollout_ref.model.tokenizer_path=/tok").data.tokenizer == "/tok"
    with pytest.raises(ConfigError, match="data.tokenizer=/a and actor_rollout_ref.model.tokenizer_path=/b: both name"):
        _cfg("data.tokenizer=/a", "actor_rollout_ref.model.tokenizer_path=/b")


@pytest.mark.parametrize("override, message", [
    (f"{A}.rollout_n=4", f"{A}.rollout_n=4 differs from {R}.n=8: it is verl's copy"),
    ("actor_rollout_ref.ref.rollout_n=1", f"actor_rollout_ref.ref.rollout_n=1 differs from {R}.n=8"),
    ("critic.rollout_n=2", f"critic.rollout_n=2 differs from {R}.n=8"),
    (f"{A}.use_remove_padding=false", f"{A}.use_remove_padding=false differs from "
                                      "actor_rollout_ref.model.use_remove_padding=true"),
    ("critic.enable=true", "critic.enable=true with algorithm.adv_estimator=grpo: meshppo trains a critic exactly when "
                           "adv_estimator is gae"),
])
def test_verls_copies_must_agree(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(override)


def test_verls_copies_follow_their_option():
    cfg = _cfg(f"{R}.n=4", "algorithm.adv_estimator=gae", "critic.enable=true",
               "actor_rollout_ref.model.use_remove_padding=false")
    arr = cfg.actor_rollout_ref
    assert (arr.actor.rollout_n, arr.ref.rollout_n, cfg.critic.rollout_n, arr.actor.use_remove_padding) == \
        (4, 4, 4, False)
    assert _cfg("algorithm.adv_estimator=gae", "critic.enable=null").uses_critic
    assert _round_trips(cfg)


def test_truncated_sampling_notes_the_log_probs_differ_from_vllms():
    """Where the engine's log-probs are read (here by calculate_log_probs)."""
    assert config_notes(_cfg(f"{R}.top_p=0.9")) == []
    assert config_notes(_cfg(f"{R}.top_p=0.9", f"{R}.calculate_log_probs=true")) == [
        f"{R}.logprobs_mode=processed_logprobs with top_k=-1, top_p=0.9: meshppo's engine log-probs are those of the "
        "whole softmax(logits / temperature); vLLM's are renormalised to the top-k / top-p tokens"]
    # greedy: nothing is truncated (top_k itself has no effect)
    assert config_notes(_cfg(f"{R}.top_k=5", f"{R}.temperature=0", f"{R}.calculate_log_probs=true")) == [
        f"{R}.top_k=5 has no effect: the training rollouts decode greedily ({R}.temperature=0)"]


def test_do_sample_is_verls_hf_rollout_switch():
    """verl reads rollout.do_sample and val_kwargs.do_sample only in its hf rollout: its vLLM and
    SGLang rollouts (meshppo's engine for either name) sample at the temperature, val_kwargs'
    for validation, and decode greedily at 0. A setting that asks for what the temperature does
    not is noted at start-up."""
    from types import SimpleNamespace

    from trainer.ppo_trainer import PPOTrainer

    def sampling(*overrides, validate):
        return PPOTrainer._sampling(SimpleNamespace(cfg=_cfg(*overrides)), validate)

    # verl's scripts: a validation temperature and n without do_sample (its default false)
    val = (f"{R}.val_kwargs.temperature=0.6", f"{R}.val_kwargs.n=4", f"{R}.val_kwargs.top_p=0.9")
    for name in ("native", "vllm", "sglang"):
        assert sampling(f"{R}.name={name}", *val, validate=True) == dict(n=4, temperature=0.6, top_p=0.9, top_k=-1)
    assert not [n for n in config_notes(_cfg(*val)) if "do_sample" in n]
    assert sampling(f"{R}.name=hf", *val, validate=True)["temperature"] == 0.0
    assert sampling(f"{R}.name=hf", *val, f"{R}.val_kwargs.do_sample=true", validate=True)["temperature"] == 0.6
    # training: do_sample=false decodes greedily only in the hf rollout
    assert sampling(f"{R}.do_sample=false", f"{R}.temperature=0.8", validate=False)["temperature"] == 0.8
    assert sampling(f"{R}.name=hf", f"{R}.do_sample=false", f"{R}.temperature=0.8", validate=False)["temperature"] == 0
    assert config_notes(_cfg(f"{R}.do_sample=false", f"{R}.temperature=0.8")) == [
        f"{R}.do_sample=false has no effect with rollout.name=native: as in verl, whose vLLM and SGLang rollouts (its "
        "agent loop) do not read it (its hf rollout does), the training rollout samples at temperature 0.8; "
        f"{R}.temperature decides"]
    assert config_notes(_cfg(f"{R}.val_kwargs.do_sample=true")) == [
        f"{R}.val_kwargs.do_sample=true has no effect with rollout.name=native: as in verl, whose vLLM and SGLang "
        "rollouts (its agent loop) do not read it (its hf rollout does), the validation rollout decodes greedily "
        f"(temperature 0); {R}.val_kwargs.temperature decides"]
    assert not [n for n in config_notes(_cfg(f"{R}.name=hf", f"{R}.do_sample=false", f"{R}.temperature=0.8"))
                if "do_sample" in n]


def test_verls_reward_manager_section_names_the_manager():
    """verl's top-level reward_manager.name is the newer name of reward_model.reward_manager: either
    sets it (the reward kwargs are then checked against it), both set the same load, both set
    otherwise is an error; neither: naive. Its importlib source (a verl manager class) is refused."""
    kwargs = ["+reward_model.reward_kwargs.max_resp_len=8"]
    cfg = _cfg("reward_manager.name=dapo", *kwargs)
    assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_manager.name is None and _round_trips(cfg)
    assert _cfg("reward_model.reward_manager=dapo", "reward_manager.name=dapo", *kwargs).reward_model.reward_manager \
        == "dapo"
    assert _cfg().reward_model.reward_manager == "naive"
    with pytest.raises(ConfigError, match="reward_model.reward_manager=batch and reward_manager.name=dapo: both name "
                                          "the same setting"):
        _cfg("reward_model.reward_manager=batch", "reward_manager.name=dapo")
    with pytest.raises(ConfigError, match=r"reward_model.reward_kwargs is set \(max_resp_len\) but "
                                          "reward_manager=naive takes none"):
        _cfg(*kwargs)
    with pytest.raises(ConfigError, match="reward_manager.source=importlib is not supported"):
        _cfg("reward_manager.source=importlib")
    assert "reward_manager.module.path=/x.py has no effect: read only with source importlib" in \
        config_notes(_cfg("reward_manager.module.path=/x.py"))


def test_the_rollout_and_reward_model_profilers_tool_config_is_verls_copy_of_the_actors():
    same = {"torch": {"contents": ["cuda"], "discrete": False}}
    cfg = _cfg(f"{A}.profiler.tool_config={same}", f"{R}.profiler.tool_config={same}",
               f"reward_model.profiler.tool_config={same}")
    assert cfg.actor_rollout_ref.rollout.profiler.tool_config == cfg.actor_rollout_ref.actor.profiler.tool_config
    assert _round_trips(cfg)
    # option by option (verl 0.9.1's rollout copies some of the actor's, each an interpolation)
    with pytest.raises(ConfigError, match=rf"^{R}.profiler.tool_config.torch.contents=\[cpu\] differs from "
                                          rf"{A}.profiler.tool_config.torch.contents=\[\]: it is verl's copy"):
        _cfg(f"{R}.profiler.tool_config={{torch: {{contents: [cpu]}}}}")
    assert _cfg(f"{R}.profiler.tool_config={{npu: {{level: level0}}}}").actor_rollout_ref.rollout.profiler.tool_config \
        == _cfg().actor_rollout_ref.actor.profiler.tool_config


def test_data_tool_config_path_is_the_rollouts_or_refused():
    """verl's `data.tool_config_path` (the tools its overlong filter renders): meshppo renders the
    tool agent's prompts, filter included, with the rollout's tools, so it may only name the same file."""
    cfg = _cfg("data.tool_config_path=t.yaml", f"{R}.multi_turn.tool_config_path=t.yaml", f"{R}.multi_turn.enable=true")
    assert config_notes(cfg) == [
        "data.tool_config_path=t.yaml has no effect: meshppo renders the tool agent's prompts with the tools of "
        "actor_rollout_ref.rollout.multi_turn.tool_config_path, and the overlong-prompt filter counts them so"]
    with pytest.raises(ConfigError, match="data.tool_config_path=t.yaml differs from actor_rollout_ref.rollout."
                                          "multi_turn.tool_config_path=null: "):
        validate(_cfg("data.tool_config_path=t.yaml"), 2)


def test_data_tool_config_path_may_spell_the_rollouts_file_another_way(tmp_path, monkeypatch):
    """The same file through another spelling (`./configs/tools/x.yaml`, a link) is the rollout's file,
    whether or not it exists yet; another file is still refused."""
    monkeypatch.chdir(tmp_path)
    same = {"./configs/tools/x.yaml": "configs/tools/x.yaml", "configs/tools/../tools/x.yaml": "configs/tools/x.yaml",
            str(tmp_path / "configs/tools/x.yaml"): "configs/tools/x.yaml", "link.yaml": "configs/tools/x.yaml"}
    for exists in (False, True):
        if exists:
            (tmp_path / "configs/tools").mkdir(parents=True)
            (tmp_path / "configs/tools/x.yaml").write_text("tools: []\n")
            os.symlink(tmp_path / "configs/tools/x.yaml", tmp_path / "link.yaml")
        for data, rollout in same.items():
            if data == "link.yaml" and not exists:
                continue
            validate(_cfg(f"data.tool_config_path={data}", f"{R}.multi_turn.tool_config_path={rollout}"), 2)
        with pytest.raises(ConfigError, match="data.tool_config_path=configs/tools/y.yaml differs from "
                                              "actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/"
                                              "x.yaml: "):
            validate(_cfg("data.tool_config_path=configs/tools/y.yaml",
                          f"{R}.multi_turn.tool_config_path=configs/tools/x.yaml"), 2)


def test_options_of_a_switch_that_is_off_are_noted():
    """The KL-in-reward options without use_kl_in_reward, the KL-loss options without use_kl_loss,
    and a validation frequency without validation files: accepted (verl's scripts set them), said
    at start-up; nothing when they stay at their defaults or their switch is on."""
    assert config_notes(_cfg("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.01",
                             "algorithm.kl_penalty=mse")) == [
        "algorithm.kl_ctrl.type=adaptive, algorithm.kl_ctrl.kl_coef=0.01, algorithm.kl_penalty=mse has no effect: "
        "algorithm.use_kl_in_reward=false (it sets the KL penalty in the reward)"]
    assert config_notes(_cfg("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive")) == [
        "algorithm.use_kl_in_reward=true and actor_rollout_ref.actor.use_kl_loss=true: the KL to the reference is "
        "penalised twice, in the reward and in the loss"]  # the demo's KL loss: only that note
    assert config_notes(_cfg("actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.kl_loss_type=k3"))[0] \
        == ("actor_rollout_ref.actor.kl_loss_coef=0.01, actor_rollout_ref.actor.kl_loss_type=k3 has no effect: "
            "actor_rollout_ref.actor.use_kl_loss=false (it sets the KL loss)")  # the demo's coefficient too
    assert config_notes(_cfg("trainer.test_freq=5", "data.val_files=[]")) == [
        "trainer.test_freq=5: data.val_files is empty, so no validation runs (verl refuses a run without validation "
        "data)", "trainer.log_val_generations=3 has no effect: data.val_files is empty, so no validation runs"]
    assert config_notes(_cfg("trainer.test_freq=5")) == [] and config_notes(_cfg()) == []


def test_a_context_beyond_the_models_positions_is_noted(tmp_path):
    """The engine's context (prompt + response by default) past the actor's max_position_embeddings
    is said at start-up (vLLM refuses it); an override of max_position_embeddings that covers it,
    or a shorter context, says nothing; an unreadable model directory is the ranks' error, not this."""
    from models import ModelArgs
    from trainer.setup import model_notes

    model = tmp_path / "m"
    ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64).to_hf_config().save_pretrained(model)
    path = f"actor_rollout_ref.model.path={model}"
    assert model_notes(_cfg(path, "data.max_prompt_length=60", "data.max_response_length=10")) == [
        "actor_rollout_ref.rollout.max_model_len=70 (data.max_prompt_length + rollout.response_length unless set) is "
        f"beyond the max_position_embeddings of the actor's model (64, {model}): its positions past that were never "
        "trained (vLLM refuses such a context); shorten the prompts or responses, or set "
        "actor_rollout_ref.model.override_config.max_position_embeddings where its RoPE is scaled for more"]
    assert model_notes(_cfg(path, "data.max_prompt_length=54", "data.max_response_length=10")) == []
    assert model_notes(_cfg(path, "data.max_prompt_length=60", "data.max_response_length=10",
                            "actor_rollout_ref.model.override_config={max_position_embeddings: 128}")) == []
    assert model_notes(_cfg(f"actor_rollout_ref.model.path={tmp_path / 'none'}")) == []
    # a max_model_len set past the longest prompt and response: lowering it is the remedy, not shorter prompts
    assert model_notes(_cfg(path, "data.max_prompt_length=54", "data.max_response_length=10", f"{R}.max_model_len=80")) \
        == ["actor_rollout_ref.rollout.max_model_len=80 (data.max_prompt_length + rollout.response_length unless set) is "
            f"beyond the max_position_embeddings of the actor's model (64, {model}): its positions past that were never "
            "trained (vLLM refuses such a context); lower actor_rollout_ref.rollout.max_model_len (the longest prompt "
            "and response take 64), or set actor_rollout_ref.model.override_config.max_position_embeddings where its "
            "RoPE is scaled for more"]
    # rollout.name=hf has no engine and reads no max_model_len (a config note says so): its longest sequence counts
    hf = (path, f"{R}.name=hf", "data.max_prompt_length=54", "data.max_response_length=10")
    assert model_notes(_cfg(*hf, f"{R}.max_model_len=100")) == []
    assert model_notes(_cfg(*hf[:2], "data.max_prompt_length=60", "data.max_response_length=10")) == [
        "data.max_prompt_length + actor_rollout_ref.rollout.response_length = 70 (the longest sequence rollout.name=hf "
        f"generates) is beyond the max_position_embeddings of the actor's model (64, {model}): its positions past that "
        "were never trained (vLLM refuses such a context); shorten the prompts or responses, or set "
        "actor_rollout_ref.model.override_config.max_position_embeddings where its RoPE is scaled for more"]


def test_a_dropout_the_models_do_not_apply_is_noted(tmp_path):
    """config.json's dropout probabilities above 0 (a Granite's attention_dropout) are said at start-up, as meshppo's
    models have none where verl's actor drops in its updates; override_config's 0 for a key, a 0 in the file or an
    unreadable directory says nothing."""
    import json

    from models import ModelArgs
    from trainer.setup import model_notes

    model = tmp_path / "m"
    ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1).to_hf_config().save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1, "hidden_dropout": 0.0,
                                                   "embd_pdrop": 0.05}))
    path = f"actor_rollout_ref.model.path={model}"
    note = ("actor_rollout_ref.model.path {!r}: config.json's {}={} is not applied: meshppo's models have no dropout, "
            "where verl's actor drops in its updates; actor_rollout_ref.model.override_config.{}=0 trains the same in "
            "both and leaves this note out")
    assert model_notes(_cfg(path)) == [note.format(str(model), "attention_dropout", 0.1, "attention_dropout"),
                                       note.format(str(model), "embd_pdrop", 0.05, "embd_pdrop")]
    assert model_notes(_cfg(path, "actor_rollout_ref.model.override_config={attention_dropout: 0}")) == [
        note.format(str(model), "embd_pdrop", 0.05, "embd_pdrop")]
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.0}))
    assert model_notes(_cfg(path)) == []


def test_more_options_of_a_switch_that_is_off_are_noted():
    """gamma and lam where the estimator does not discount, group filtering, PF-PPO and truncated
    importance weights switched off, the cosine's shape under a constant schedule: one line each."""
    assert config_notes(_cfg("algorithm.gamma=0.9", "algorithm.lam=0.95")) == [
        "algorithm.gamma=0.9, algorithm.lam=0.95 has no effect with algorithm.adv_estimator=grpo (gamma discounts "
        "gae's and reinforce_plus_plus's returns, lam is gae's)"]
    assert config_notes(_cfg("algorithm.adv_estimator=reinforce_plus_plus", f"{R}.n=1", "algorithm.gamma=0.9")) == []
    assert config_notes(_cfg("algorithm.adv_estimator=gae", f"{R}.n=1", "algorithm.gamma=0.9",
                             "algorithm.lam=0.95")) == []
    assert config_notes(_cfg("algorithm.filter_groups.metric=acc", "algorithm.pf_ppo.weight_pow=3",
                             "algorithm.rollout_correction.rollout_is_threshold=3.0",
                             "actor_rollout_ref.actor.optim.num_cycles=1.0")) == [
        "algorithm.filter_groups.metric=acc has no effect: algorithm.filter_groups.enable is false",
        "algorithm.pf_ppo.weight_pow=3.0 has no effect: algorithm.use_pf_ppo is false",
        "algorithm.rollout_correction.rollout_is_threshold=3.0 has no effect: algorithm.rollout_correction.rollout_is "
        "is null",
        "actor_rollout_ref.actor.optim.num_cycles=1.0 has no effect: actor_rollout_ref.actor.optim.lr_scheduler_type="
        "constant (they shape the cosine schedule)"]
    assert config_notes(_cfg("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                             "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                             "actor_rollout_ref.actor.optim.num_cycles=1.0")) == []


def test_verls_other_rollout_options_load_and_are_said_or_refused():
    """Fields of verl's RolloutConfig that its scripts set and meshppo did not know (an unknown-key
    error): verl's fully-async recipe's +enable_sleep_mode, its server yaml's server section, TensorRT-LLM
    as the rollout name. Each loads at verl's default without a note; set otherwise it is said to change
    nothing. repetition_penalty too: verl 0.9.1's agent loop asks its engines for 1.0 whatever the
    option says, so a verl script that sets it samples without a penalty, as meshppo does."""
    cfg = _cfg(f"{R}.name=trtllm", f"+{R}.enable_sleep_mode=false", f"{R}.sglang_engine_mode=remote",
               f"{R}.limit_images=2", f"{R}.server={{timeout: 60}}", f"{R}.custom={{x: 1}}", f"{R}.layer_name_map={{a: b}}")
    validate(cfg)
    assert cfg.actor_rollout_ref.rollout.engine == "native" and _round_trips(cfg)
    notes = config_notes(cfg)
    assert any(n.startswith(f"{R}.name=trtllm: meshppo generates with its own engine (native)") for n in notes), notes
    for key in ("enable_sleep_mode=false", "sglang_engine_mode=remote", "limit_images=2", "server=", "custom=",
                "layer_name_map="):
        assert any(n.startswith(f"{R}.{key}") and "has no effect" in n for n in notes), (key, notes)
    assert not any("has no effect" in n for n in config_notes(_cfg(f"{R}.repetition_penalty=1.0", f"{R}.custom=null")))
    assert [n for n in config_notes(_cfg(f"{R}.repetition_penalty=1.1")) if "repetition_penalty" in n] == [
        f"{R}.repetition_penalty=1.1 has no effect: verl 0.9.1's agent loop asks its engines for 1.0 whatever it says "
        "(only its standalone generation script reads it); meshppo's engine applies no penalty either"]
    with pytest.raises(ConfigError, match=rf"{R}.repetition_penalty: 0.0 is out of range; allowed: > 0"):
        _cfg(f"{R}.repetition_penalty=0")


def test_chunked_prefill_off_is_vllms_option_only():
    """verl passes enable_chunked_prefill to vLLM only: its SGLang scripts that set it false with a
    token budget below the model length run in verl, and were refused here by vLLM's rule. Under
    sglang / trtllm it changes nothing (a note); under vllm and the native engine the rule stands."""

    small = [f"{R}.enable_chunked_prefill=false", f"{R}.max_num_batched_tokens=8", f"{R}.max_model_len=64"]
    for name in ("sglang", "trtllm"):
        cfg = _cfg(f"{R}.name={name}", *small)
        validate(cfg)
        assert cfg.actor_rollout_ref.rollout.chunked_prefill
        assert f"{R}.enable_chunked_prefill=false has no effect with rollout.name={name}" in " ".join(config_notes(cfg))
    for name in ("vllm", "native"):
        cfg = _cfg(f"{R}.name={name}", *small)
        assert not cfg.actor_rollout_ref.rollout.chunked_prefill
        assert not any("enable_chunked_prefill" in n for n in config_notes(cfg))
        with pytest.raises(ConfigError, match=rf"{R}.enable_chunked_prefill=false with max_num_batched_tokens=8 < "
                                              "max_model_len=64"):
            validate(cfg)


def test_verls_rollout_fields_outside_its_yaml_load():
    """Fields of verl 0.9.1's RolloutConfig (and AgentLoopConfig) that its rollout.yaml leaves out,
    set with `+` by its fully-async recipe or a user's own classes: each loads at verl's default; a
    standalone replica's memory share changes nothing here (a note); an MoE TP size and a user's
    manager classes are refused naming the key (they were unknown keys, one 'meant'
    gpu_memory_utilization)."""
    cfg = _cfg(f"+{R}.standalone_gpu_memory_utilization=0.7", f"+{R}.moe_tensor_parallel_size=1",
               f"+{R}.checkpoint_manager_class=null", f"+{R}.agent.agent_loop_manager_class=null")
    validate(cfg)
    assert _round_trips(cfg)
    assert [n for n in config_notes(cfg) if "standalone" in n] == [
        f"{R}.standalone_gpu_memory_utilization=0.7 has no effect: meshppo's engine runs on the training GPUs: "
        "gpu_memory_utilization sizes it"]
    for key, value in (("moe_tensor_parallel_size", "2"), ("checkpoint_manager_class", "my.Manager"),
                       ("agent.agent_loop_manager_class", "my.Manager")):
        with pytest.raises(ConfigError, match=rf"^{R}.{key}={value} is not supported by meshppo(:| \(|$)"):
            _cfg(f"+{R}.{key}={value}")


def test_ignore_eos_under_verls_sglang_and_trtllm_names_is_said():
    """verl's vLLM server passes rollout.ignore_eos to its sampling; its SGLang and TensorRT-LLM
    servers do not (they stop at EOS). meshppo's engine honours it under every name, and says so
    at start-up where verl's engine of that name would not."""
    for name in ("sglang", "trtllm"):
        assert [n for n in config_notes(_cfg(f"{R}.name={name}", f"{R}.ignore_eos=true")) if "ignore_eos" in n] == [
            f"{R}.ignore_eos=true with rollout.name={name}: meshppo's engine generates past EOS, as verl's vLLM "
            f"server does; verl's {name} server does not pass the option on, and stops at EOS"]
    for name in ("vllm", "native", "hf"):
        assert not [n for n in config_notes(_cfg(f"{R}.name={name}", f"{R}.ignore_eos=true")) if "ignore_eos" in n]
    assert not [n for n in config_notes(_cfg(f"{R}.name=sglang")) if "ignore_eos" in n]


def test_verls_other_loggers_are_named_as_verls():
    """verl's trainer.logger takes mlflow, swanlab, vemlp_wandb, clearml, trackio and rl_insight too: each was
    'unknown' (rl_insight, verl 0.9.1's, until later); now named as verl's and refused. verl's file logger is
    meshppo's too (test_tracking.py's file logger tests)."""
    for name in ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio", "rl_insight"):
        with pytest.raises(ConfigError, match=rf"^trainer.logger: verl's {name} logger is not supported; use console, "
                                              "jsonl, file, tensorboard or wandb$"):
            validate(_cfg(f"trainer.logger=[console,{name}]"))
    validate(_cfg("trainer.logger=[console,file]"))
    with pytest.raises(ConfigError, match=r"^trainer.logger: tracking is verl's deprecated name of wandb: use wandb$"):
        validate(_cfg("trainer.logger=[tracking]"))
    with pytest.raises(ConfigError, match=r"^trainer.logger: unknown logger 'nope'"):
        validate(_cfg("trainer.logger=[nope]"))
