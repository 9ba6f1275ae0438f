"""verl's options that meshppo accepts for compatibility, in sections that it has no machinery for:
agent-loop servers, multi-token prediction, mixture-of-experts routing, rollout
tracing and metrics servers, weight-transfer backends, user dataset and sampler classes, Ray's
transfer queue, a remote sandbox, verl's newer reward-manager section, the reward model's
inference server. Each option loads at verl's default; set otherwise it is refused naming the key
(`unsupported`) or, where it truly changes nothing, said at start-up (`no_effect`). verl 0.9.1's
`reward` section is here too: its options that act are newer names of options meshppo reads at
their older places, where `trainer.config` resolves them. The sections are part of
`trainer.config`'s tree, which imports them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from data.dataset import AGENT_NAMES
from rewards.managers import REWARD_MANAGERS
from trainer.configlib import opt, other_than, section


def read_only_with(switch: str, why: str = ""):
    """The `no_effect` reason of an option that verl reads only with `switch` on, which meshppo refuses."""
    return f"read only with {switch}, which meshppo does not support{why}"


_MTP_WHY = read_only_with("mtp.enable")


@dataclass
class MtpConfig:
    """verl's `mtp`: a multi-token-prediction head, trained and used as the draft of speculative
    decoding."""

    enable: bool = opt(False, "not supported: must be false (verl: the model's multi-token-prediction layers)",
                       unsupported=bool)
    enable_train: bool = opt(False, "not supported: must be false (verl: train the MTP layers)", unsupported=bool)
    enable_rollout: bool = opt(False, "not supported: must be false (verl: speculative decoding with the MTP layers)",
                               unsupported=bool)
    detach_encoder: bool = opt(False, "verl: stop the MTP loss's gradient at the encoder", no_effect=_MTP_WHY)
    mtp_loss_scaling_factor: float = opt(0.1, "verl: the MTP loss's weight", no_effect=_MTP_WHY)
    speculative_algorithm: str = opt("EAGLE", "verl: the engine's speculative-decoding algorithm", no_effect=_MTP_WHY)
    speculative_num_steps: int = opt(3, "verl: draft steps", no_effect=_MTP_WHY)
    speculative_eagle_topk: int = opt(1, "verl: draft branches per step", no_effect=_MTP_WHY)
    speculative_num_draft_tokens: int = opt(4, "verl: draft tokens verified at once", no_effect=_MTP_WHY)
    method: str = opt("mtp", "verl: the speculative method's name", no_effect=_MTP_WHY)
    num_speculative_tokens: int = opt(1, "verl: tokens drafted per step", no_effect=_MTP_WHY)


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


def _routing_file(what: str):
    """One of verl's `router_replay` files (its record / replay of routing through a file), which meshppo does not
    read or write: null only."""
    return opt(None, f"not supported: must be null (verl: {what})", unsupported=lambda v: v is not None)


@dataclass
class RouterReplayConfig:
    """verl's `router_replay` of the actor: replay a mixture-of-experts model's routing in its forwards."""

    mode: str = opt("disabled", "R3: the actor's old-log-prob pass and its update replay the experts the rollout engine "
                                "routed each token to (their weights the router's softmax at those experts, so it "
                                "still learns); needs rollout.enable_rollout_routing_replay=true and a "
                                "mixture-of-experts model. R2: the old-log-prob pass records the experts its routers "
                                "choose for every token and every mini-batch and epoch of the update replays them "
                                "(pi_old's routing; the rollout's record, if on, is not used); needs a "
                                "mixture-of-experts model and the pass (not algorithm.rollout_correction.bypass_mode; "
                                "an on-policy update that skips the pass routes itself: its one optimizer step's "
                                "forwards all run pi_old). disabled: the routers route. The reference and the critic "
                                "route themselves",
                    choices=ROUTER_REPLAY_MODES)
    record_file: str | None = _routing_file("dump the recorded routing to a file")
    replay_file: str | None = _routing_file("replay routing loaded from a file")


@dataclass
class RefRouterReplayConfig:
    """verl's `router_replay` of the reference: meshppo's reference routes itself, as verl's R3 leaves it."""

    mode: str = opt("disabled", "not supported: must be disabled (meshppo's reference routes with its own routers; "
                                "routing replay is the actor's, actor.router_replay.mode)",
                    unsupported=other_than("disabled"))
    record_file: str | None = _routing_file("dump the recorded routing to a file")
    replay_file: str | None = _routing_file("replay routing loaded from a file")


_SERVERS_WHY = "meshppo runs no agent-loop servers or workers: its rollouts, multi-turn ones too, run in-process"


@dataclass
class CustomAsyncServerConfig:
    path: str | None = opt(None, "not supported: must be null (verl: a module of its own rollout server)",
                           unsupported=lambda v: v is not None)
    name: str | None = opt(None, "not supported: must be null (verl: the server class in path)",
                           unsupported=lambda v: v is not None)


@dataclass
class AgentLoopConfig:
    """verl's `rollout.agent`: the agent loops and the workers of its async rollouts."""

    num_workers: int = opt(8, "verl: agent-loop workers", ge=1, no_effect=_SERVERS_WHY)
    default_agent_loop: str = opt("single_turn_agent", "the rollout loop of rows without an agent_name field: "
                                                       "single_turn_agent, or tool_agent (multi-turn with tool calls, "
                                                       "rollout.multi_turn)", choices=AGENT_NAMES)
    agent_loop_config_path: str | None = opt(None, "not supported: must be null (verl: agent loops of its own)",
                                             unsupported=lambda v: v is not None)
    custom_async_server: CustomAsyncServerConfig = section(CustomAsyncServerConfig, "verl's own rollout server")
    agent_loop_manager_class: str | None = opt(None, "not supported: must be null (verl: the import path of a user's "
                                                     "own AgentLoopManager class)", unsupported=lambda v: v is not None)


@dataclass
class CheckpointEngineConfig:
    """verl's `rollout.checkpoint_engine`: how the trained weights reach the rollout engine."""

    backend: str = opt("naive", "naive only: the engine shares the trainer's GPUs and gets the weights in-process "
                                "(meshppo's resharder)", unsupported=other_than("naive"))
    update_weights_bucket_megabytes: int = opt(2048, "verl: the size of a weight-transfer bucket", ge=1,
                                               no_effect="meshppo's resharder sizes its buckets itself, by layers")
    engine_kwargs: dict = opt(default_factory=dict, help="verl: arguments of the transfer backend",
                              no_effect="meshppo's resharder has no backend to configure")
    custom_backend_module: str | None = opt(None, "not supported: must be null (verl: a module of the user's, "
                                                  "imported to register a transfer backend)",
                                            unsupported=lambda v: v is not None)


_TRACE_WHY = read_only_with("trace.backend")


@dataclass
class TraceConfig:
    """verl's `rollout.trace`: rollouts traced to weave or mlflow."""

    backend: str | None = opt(None, "not supported: must be null (verl: trace the rollouts to weave or mlflow; "
                                    "meshppo writes them with trainer.rollout_data_dir)",
                              unsupported=lambda v: v is not None)
    token2text: bool = opt(False, "verl: decode the traced tokens", no_effect=_TRACE_WHY)
    max_samples_per_step_per_worker: int | None = opt(None, "verl: traced samples per step and worker",
                                                      no_effect=_TRACE_WHY)
    project_name: str | None = opt(None, "verl: the traces' project; null (or trainer.project_name, verl's default): "
                                         "trainer.project_name", no_effect=_TRACE_WHY)
    experiment_name: str | None = opt(None, "verl: the traces' experiment; null (or trainer.experiment_name, verl's "
                                            "default): trainer.experiment_name", no_effect=_TRACE_WHY)


_PROMETHEUS_WHY = read_only_with("prometheus.enable")


@dataclass
class PrometheusConfig:
    """verl's `rollout.prometheus`: the rollout servers' metrics scraped by Prometheus."""

    enable: bool = opt(False, "not supported: must be false (meshppo runs no rollout servers; its metrics go to "
                              "trainer.logger)", unsupported=bool)
    port: int = opt(9090, "verl: Prometheus's port", no_effect=_PROMETHEUS_WHY)
    file: str = opt("/tmp/ray/session_latest/metrics/prometheus/prometheus.yml", "verl: Prometheus's config file",
                    no_effect=_PROMETHEUS_WHY)
    served_model_name: str | None = opt(None, "verl: the model's name in the metrics; null (or the model path, "
                                              "verl's default): actor_rollout_ref.model.path",
                                        no_effect=_PROMETHEUS_WHY, path=True)


@dataclass
class DataClassConfig:
    """verl's `data.custom_cls` and `data.datagen`: a class of the user's from a file."""

    path: str | None = opt(None, "not supported: must be null (meshppo reads the prompts with its own dataset)",
                           unsupported=lambda v: v is not None)
    name: str | None = opt(None, "verl: the class in path", no_effect="read only with path, which meshppo does not "
                                                                     "support")


@dataclass
class SamplerClassConfig:
    """verl's `data.sampler`: a sampler class of the user's (curricula). verl also takes `sampler:
    null` (no sampler of the user's): here the section's defaults."""

    NULL_IS_DEFAULT: ClassVar[bool] = True

    class_path: str | None = opt(None, "not supported: must be null (meshppo orders the prompts by shuffle and seed)",
                                 unsupported=lambda v: v is not None)
    class_name: str | None = opt(None, "verl: the class in class_path",
                                 no_effect="read only with class_path, which meshppo does not support")


_IN_PROCESS_WHY = "meshppo passes a step's batch between its phases in-process"


@dataclass
class TransferQueueMetricsConfig:
    enabled: bool = opt(False, "verl: the transfer queue's metrics", no_effect=_IN_PROCESS_WHY)
    port: int = opt(0, "verl: the port of the queue's metrics", no_effect=_IN_PROCESS_WHY)


def _transfer_queue_backend() -> dict:
    """verl 0.9.1's default `transfer_queue.backend`: its storage and their settings."""
    return {"storage_backend": "SimpleStorage",
            "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 8},
            "MooncakeStore": {"auto_init": False, "metadata_server": "localhost:50123",
                              "master_server_address": "localhost:50124", "local_hostname": "localhost",
                              "protocol": "tcp", "global_segment_size": 4294967296,
                              "local_buffer_size": 1073741824, "device_name": ""}}


@dataclass
class TransferQueueConfig:
    """verl's `transfer_queue`: batches passed between its workers through a queue (0.9.1's trainer
    always uses it)."""

    enable: bool = opt(False, "verl: pass the batches through its transfer queue", no_effect=_IN_PROCESS_WHY)
    metrics: TransferQueueMetricsConfig = section(TransferQueueMetricsConfig, "verl: the queue's metrics")
    backend: dict = opt(default_factory=_transfer_queue_backend, help="verl: the queue's storage",
                        no_effect=_IN_PROCESS_WHY)


@dataclass
class SandboxFusionConfig:
    """verl's remote code-execution service of its rewards (`reward.sandbox_fusion`; before 0.9.1
    `reward_model.sandbox_fusion`, and 0.9.1's deprecated top-level `sandbox_fusion`, all null). A
    null size is verl's default."""

    url: str | None = opt(None, "not supported: meshppo's rewards are computed in-process (a custom reward function "
                                "may call such a service itself)", unsupported=lambda v: v is not None)
    max_concurrent: int | None = opt(64, "verl: the service's concurrent calls", ge=1, no_effect="read only with url")
    memory_limit_mb: int | None = opt(1024, "verl: the service's memory limit", ge=1, no_effect="read only with url")


@dataclass
class RewardManagerModuleConfig:
    path: str | None = opt(None, "verl: the file of a reward-manager class", no_effect="read only with source importlib")
    name: str = opt("custom_reward_manager", "verl: the class in that file", no_effect="read only with source importlib")


@dataclass
class RewardManagerConfig:
    """verl's reward-manager section (`reward.reward_manager` in 0.9.1, a top-level `reward_manager`
    before), its newer home of `reward_model.reward_manager`."""

    source: str | None = opt("register", "register only: name is one of meshppo's managers (verl's importlib loads "
                                         "a verl manager class, which works on verl's DataProto); null: register",
                             choices=("register", "importlib", None), unsupported=other_than("register"))
    name: str | None = opt(None, "the reward manager: reward_model.reward_manager's newer name in verl (set one of "
                                 "them, or all the same); null: that option", choices=(*REWARD_MANAGERS, None))
    module: RewardManagerModuleConfig = section(RewardManagerModuleConfig, "verl: a reward-manager class to import")


_NEW_NAME = "verl 0.9.1's name of {old} (set one of them, or both the same); null: that option"

_RM_SERVER_WHY = "meshppo runs the reward model as an FSDP2 forward on the training ranks, with no inference server"
_RM_SAMPLING_WHY = ("verl samples with it where a custom reward function asks the reward model's server to generate "
                    "(a generative reward model); meshppo runs no such server")
_RM_LENGTH_WHY = (f"{_RM_SERVER_WHY}; the reward model reads each rendered chat whole, or cut at "
                  "reward_model.max_length")


@dataclass
class DisaggregationConfig:
    """verl 0.9.1's `disaggregation` of an inference server: prefill and decode on replicas of their own."""

    enabled: bool = opt(False, "not supported: must be false (verl: prefill and decode on separate engine replicas; "
                               "meshppo's engine runs both on every rank, in-process)", unsupported=bool)
    prefill_replicas: int = opt(1, "verl: the prefill replicas", no_effect=read_only_with("disaggregation.enabled"))
    decode_replicas: int = opt(1, "verl: the decode replicas", no_effect=read_only_with("disaggregation.enabled"))
    decode_tensor_model_parallel_size: int | None = opt(None, "verl: the decode replicas' TP size",
                                                        no_effect=read_only_with("disaggregation.enabled"))
    transfer_backend: str = opt("nixl", "verl: the KV transfer backend",
                                no_effect=read_only_with("disaggregation.enabled"))
    bootstrap_port: int | None = opt(None, "verl: the KV transfer's bootstrap port",
                                     no_effect=read_only_with("disaggregation.enabled"))
    ib_device: str | None = opt(None, "verl: the InfiniBand device of the KV transfer",
                                no_effect=read_only_with("disaggregation.enabled"))
    mooncake_protocol: str = opt("nvlink", "verl: mooncake's transfer protocol",
                                 no_effect=read_only_with("disaggregation.enabled"))


@dataclass
class RewardModelRolloutConfig:
    """verl 0.9.1's `reward.reward_model.rollout` (and its older place `reward_model.rollout`, whose
    keys move here): the inference server verl's reward loop scores with. meshppo runs the reward
    model as an FSDP2 forward on the training ranks (`reward_model.model.fsdp_config`,
    `micro_batch_size_per_gpu`, `max_length`): the server's options change nothing, those that would
    change the scores are refused, and full_determinism acts."""

    name: str | None = opt(None, "verl: the server's engine (vllm, sglang); verl's default ??? loads as null",
                           no_effect=_RM_SERVER_WHY)
    dtype: str = opt("bfloat16", "verl: the server's dtype: bfloat16 only (meshppo's reward model computes in "
                                 "reward_model.model.fsdp_config.mixed_precision.param_dtype, bf16 by default)",
                     unsupported=lambda v: v not in ("bfloat16", "bf16"))
    gpu_memory_utilization: float = opt(0.5, "verl: the server's share of GPU memory", no_effect=_RM_SERVER_WHY)
    enforce_eager: bool = opt(True, "verl: the server without CUDA graphs", no_effect=_RM_SERVER_WHY)
    cudagraph_capture_sizes: list[int] | None = opt(None, "verl: the server's CUDA-graph sizes",
                                                    no_effect=_RM_SERVER_WHY)
    free_cache_engine: bool = opt(True, "verl: the server sleeps between scorings", no_effect=_RM_SERVER_WHY)
    data_parallel_size: int = opt(1, "verl: the server's data parallelism", no_effect=_RM_SERVER_WHY)
    expert_parallel_size: int = opt(1, "verl: the server's expert parallelism", no_effect=_RM_SERVER_WHY)
    tensor_model_parallel_size: int = opt(2, "verl: the server's tensor parallelism", no_effect=_RM_SERVER_WHY)
    pipeline_model_parallel_size: int = opt(1, "verl: the server's pipeline parallelism", no_effect=_RM_SERVER_WHY)
    max_num_batched_tokens: int = opt(8192, "verl: the server's token budget of a step",
                                      no_effect=f"{_RM_SERVER_WHY}; reward_model.micro_batch_size_per_gpu or "
                                                "use_dynamic_bsz batch its forwards")
    max_model_len: int | None = opt(None, "verl: the server's context", no_effect=_RM_LENGTH_WHY)
    max_num_seqs: int = opt(1024, "verl: the server's sequences at once", no_effect=_RM_SERVER_WHY)
    load_format: str = opt("auto", "verl: how the server loads the weights; a dummy format (random weights) is not "
                                   "supported: meshppo reads the reward model's checkpoint",
                           unsupported=lambda v: v.startswith("dummy"), no_effect=_RM_SERVER_WHY)
    layered_summon: bool = opt(False, "verl: gather the weights layer by layer", no_effect=_RM_SERVER_WHY)
    scheduling_policy: str = opt("fcfs", "verl: the server's scheduling", no_effect=_RM_SERVER_WHY)
    full_determinism: bool = opt(False, "deterministic reward-model scores (with reward_model.enable, as in verl): "
                                        "true turns on meshppo's full determinism, one switch for the process, as "
                                        "each role's fsdp_config.full_determinism does")
    seed: int = opt(42, "verl: the server's sampling seed", no_effect="the reward model's forward draws nothing")
    multi_stage_wake_up: bool = opt(False, "verl: the server wakes its weights before its cache",
                                    no_effect=_RM_SERVER_WHY)
    engine_kwargs: dict = opt(default_factory=dict, help="verl: the server engine's arguments", no_effect=_RM_SERVER_WHY)
    limit_images: int | None = opt(None, "verl: the most images a prompt may hold",
                                   no_effect="meshppo's models take text only")
    enable_chunked_prefill: bool = opt(True, "verl: the server's chunked prefill", no_effect=_RM_SERVER_WHY)
    enable_prefix_caching: bool = opt(True, "verl: the server's prefix cache", no_effect=_RM_SERVER_WHY)
    disable_log_stats: bool = opt(True, "verl: the server's statistics log", no_effect=_RM_SERVER_WHY)
    skip_tokenizer_init: bool = opt(False, "not supported: must be false (verl asserts it for a reward model: the "
                                           "server renders the chat)", unsupported=bool)
    ignore_eos: bool = opt(False, "verl: a generative reward model's sampling", no_effect=_RM_SAMPLING_WHY)
    temperature: float = opt(1.0, "verl: a generative reward model's sampling", no_effect=_RM_SAMPLING_WHY)
    top_k: int = opt(-1, "verl: a generative reward model's sampling", no_effect=_RM_SAMPLING_WHY)
    top_p: float = opt(1.0, "verl: a generative reward model's sampling", no_effect=_RM_SAMPLING_WHY)
    do_sample: bool = opt(True, "verl: a generative reward model's sampling", no_effect=_RM_SAMPLING_WHY)
    n: int = opt(1, "verl: a generative reward model's sampling", no_effect=_RM_SAMPLING_WHY)
    prompt_length: int = opt(2048, "verl: the server's prompt budget", no_effect=_RM_LENGTH_WHY)
    response_length: int = opt(2048, "verl: the server's response budget", no_effect=_RM_LENGTH_WHY)
    quantization: str | None = opt(None, "not supported: must be null (verl: a quantized reward-model server, whose "
                                         "scores move; meshppo's reward model computes unquantized)",
                                   unsupported=lambda v: v is not None)
    quantization_config_file: str | None = opt(None, "not supported: must be null (verl: the server's quantization)",
                                               unsupported=lambda v: v is not None)
    mtp: MtpConfig | None = opt(None, "verl: the server's speculative decoding; null or disabled")
    disaggregation: DisaggregationConfig = section(DisaggregationConfig, "verl: the server's prefill / decode split")


@dataclass
class RewardFunctionConfig:
    """verl 0.9.1's `reward.custom_reward_function`: the newer names of `custom_reward_function`."""

    path: str | None = opt(None, _NEW_NAME.format(old="custom_reward_function.path"), path=True)
    name: str | None = opt(None, _NEW_NAME.format(old="custom_reward_function.name") + " (verl's default: "
                                                                                        "compute_score)")
    reward_kwargs: dict | None = opt(None, _NEW_NAME.format(old="custom_reward_function.reward_kwargs"))


@dataclass
class RewardLoopModelConfig:
    """verl 0.9.1's `reward.reward_model`: the reward model of its reward loop."""

    enable: bool | None = opt(None, _NEW_NAME.format(old="reward_model.enable"))
    enable_resource_pool: bool = opt(False, "not supported: must be false (verl: the reward model on GPUs of its own, "
                                            "n_gpus_per_node x nnodes; meshppo runs it on the training ranks)",
                                     unsupported=bool)
    n_gpus_per_node: int = opt(8, "verl: GPUs a node of the reward model's own pool", ge=0,
                               no_effect=read_only_with("enable_resource_pool"))
    nnodes: int = opt(0, "verl: nodes of the reward model's own pool", ge=0,
                      no_effect=read_only_with("enable_resource_pool"))
    model_path: str | None = opt(None, _NEW_NAME.format(old="reward_model.model.path"), path=True)
    rollout: RewardModelRolloutConfig = section(RewardModelRolloutConfig, "verl: the reward model's inference server")


@dataclass
class RewardConfig:
    """verl 0.9.1's `reward` section, the newer home of `custom_reward_function`, `reward_model`'s
    switch and path, its reward manager and `sandbox_fusion`. Each option that acts is a newer name
    of one meshppo reads at its older place (where a resolved config holds it); the others change
    nothing (said at start-up) or are refused."""

    num_workers: int = opt(8, "verl: the reward-loop workers", ge=1,
                           no_effect="meshppo scores on every training rank, without reward-loop workers")
    custom_reward_function: RewardFunctionConfig = section(RewardFunctionConfig, "the reward function")
    reward_manager: RewardManagerConfig = section(RewardManagerConfig, "how the reward function is called")
    reward_model: RewardLoopModelConfig = section(RewardLoopModelConfig, "the reward model")
    sandbox_fusion: SandboxFusionConfig = section(SandboxFusionConfig, "verl's remote code-execution service")
    reward_kwargs: dict | None = opt(None, _NEW_NAME.format(old="reward_model.reward_kwargs") + " (verl 0.9.1's dapo "
                                                                                               "manager reads it here)")


_QAT_WHY = read_only_with("qat.enable")


@dataclass
class QATConfig:
    """verl 0.9.1's `qat`: quantization-aware training (fake-quantized weights in training, a
    quantized engine)."""

    enable: bool = opt(False, "not supported: must be false (verl: quantization-aware training, w4a16 or w4a4)",
                       unsupported=bool)
    mode: str = opt("w4a16", "verl: the quantization", no_effect=_QAT_WHY)
    group_size: int = opt(16, "verl: the block size of the quantization", no_effect=_QAT_WHY)
    ignore_patterns: list[str] = opt(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"],
                                     help="verl: the modules left unquantized", no_effect=_QAT_WHY)
    activation_observer: str = opt("static_minmax", "verl: the activations' scale observer", no_effect=_QAT_WHY)
    quantization_config_path: str | None = opt(None, "verl: the engine's quantization config", no_effect=_QAT_WHY)


_MEGATRON_LORA_WHY = read_only_with("lora.rank > 0", " (meshppo's LoRA is lora_rank, lora_alpha and target_modules)")


@dataclass
class MegatronLoRAConfig:
    """verl 0.9.1's `model.lora`: its Megatron workers' LoRA (its FSDP workers, as meshppo, take
    `lora_rank`, `lora_alpha` and `target_modules`)."""

    type: str = opt("lora", "verl: the adapter kind", no_effect=_MEGATRON_LORA_WHY)
    merge: bool = opt(False, "verl: merge the adapters into the weights the engine gets",
                      no_effect="meshppo's engine always gets the merged weights of a LoRA actor")
    rank: int = opt(0, "not supported: must be 0 (verl: the Megatron workers' LoRA rank; meshppo's is lora_rank)",
                    unsupported=bool)
    alpha: int = opt(32, "verl: the Megatron LoRA's alpha", no_effect=_MEGATRON_LORA_WHY)
    dropout: float = opt(0.0, "verl: the Megatron LoRA's dropout", no_effect=_MEGATRON_LORA_WHY)
    target_modules: list[str] = opt(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                                    help="verl: the Megatron modules with adapters", no_effect=_MEGATRON_LORA_WHY)
    exclude_modules: list[str] = opt(default_factory=list, help="verl: the Megatron modules without",
                                     no_effect=_MEGATRON_LORA_WHY)
    dropout_position: str = opt("pre", "verl: where the dropout applies", no_effect=_MEGATRON_LORA_WHY)
    lora_A_init_method: str = opt("xavier", "verl: the A matrices' initialisation", no_effect=_MEGATRON_LORA_WHY)
    lora_B_init_method: str = opt("zero", "verl: the B matrices' initialisation", no_effect=_MEGATRON_LORA_WHY)
    a2a_experimental: bool = opt(False, "verl: Megatron's experimental all-to-all", no_effect=_MEGATRON_LORA_WHY)
    dtype: str | None = opt(None, "verl: the adapters' dtype", no_effect=_MEGATRON_LORA_WHY)
    adapter_path: str | None = opt(None, "verl: a Megatron adapter to start from", no_effect=_MEGATRON_LORA_WHY)
    freeze_vision_model: bool = opt(True, "verl: a vision-language model's vision tower frozen",
                                    no_effect=_MEGATRON_LORA_WHY)
    freeze_vision_projection: bool = opt(True, "verl: its projection frozen", no_effect=_MEGATRON_LORA_WHY)
    freeze_language_model: bool = opt(True, "verl: the language model's base frozen", no_effect=_MEGATRON_LORA_WHY)


_DISTILLATION_WHY = read_only_with("distillation.enabled")
# verl's teacher inference options that copy the actor's rollout's (its interpolations), null here
# where they are the rollout's (`trainer.config` resolves them so)
TEACHER_ROLLOUT_COPIES = ("name", "dtype", "prompt_length", "response_length", "temperature")


def _teacher_models() -> dict:
    """verl 0.9.1's default `distillation.teacher_models`, the copies of the rollout's options null."""
    inference = {"name": None, "dtype": None, "gpu_memory_utilization": 0.5, "enforce_eager": True,
                 "cudagraph_capture_sizes": None, "free_cache_engine": True, "data_parallel_size": 1,
                 "expert_parallel_size": 1, "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192,
                 "max_model_len": None, "max_num_seqs": 1024, "load_format": "auto", "engine_kwargs": {},
                 "limit_images": None, "enable_chunked_prefill": True, "enable_prefix_caching": True,
                 "disable_log_stats": True, "skip_tokenizer_init": True, "prompt_length": None,
                 "response_length": None, "temperature": None}
    return {"teacher_model": {"key": None, "model_path": None, "num_replicas": 0, "inference": inference}}


@dataclass
class DistillationLossConfig:
    loss_mode: str = opt("k3", "verl: the distillation loss", no_effect=_DISTILLATION_WHY)
    topk: int = opt(32, "verl: the teacher's top-k log-probs", no_effect=_DISTILLATION_WHY)
    use_task_rewards: bool = opt(True, "verl: keep the task rewards", no_effect=_DISTILLATION_WHY)
    distillation_loss_coef: float = opt(1.0, "verl: the loss's weight", no_effect=_DISTILLATION_WHY)
    loss_max_clamp: float | None = opt(None, "verl: the loss's clamp", no_effect=_DISTILLATION_WHY)
    log_prob_min_clamp: float | None = opt(None, "verl: the log-probs' clamp", no_effect=_DISTILLATION_WHY)
    use_policy_gradient: bool = opt(False, "verl: the loss as a policy gradient", no_effect=_DISTILLATION_WHY)
    policy_loss_mode: str = opt("vanilla", "verl: that policy loss", no_effect=_DISTILLATION_WHY)
    clip_ratio: float = opt(0.2, "verl: its clip", no_effect=_DISTILLATION_WHY)
    clip_ratio_low: float = opt(0.2, "verl: its lower clip", no_effect=_DISTILLATION_WHY)
    clip_ratio_high: float = opt(0.2, "verl: its upper clip", no_effect=_DISTILLATION_WHY)


@dataclass
class DistillationConfig:
    """verl 0.9.1's `distillation`: on-policy distillation from teacher models served beside the
    actor."""

    enabled: bool = opt(False, "not supported: must be false (verl: distil teacher models' log-probs into the actor)",
                        unsupported=bool)
    distillation_loss: DistillationLossConfig = section(DistillationLossConfig, "verl: the distillation loss")
    n_gpus_per_node: int = opt(8, "verl: GPUs a node of the teachers' pool", no_effect=_DISTILLATION_WHY)
    nnodes: int = opt(0, "verl: nodes of the teachers' pool", no_effect=_DISTILLATION_WHY)
    teacher_models: dict = opt(default_factory=_teacher_models, help="verl: the teacher models and their inference "
                                                                    "servers (options copying the actor's rollout's: "
                                                                    "null, or the rollout's)",
                               no_effect=_DISTILLATION_WHY)
    teacher_key: str = opt("data_source", "verl: the field that picks a row's teacher", no_effect=_DISTILLATION_WHY)


_SKIP_WHY = read_only_with("its enable")


@dataclass
class SkipStageConfig:
    enable: bool = opt(False, "not supported: must be false (verl: dump this stage's outputs, or replay a dump in "
                              "their place)", unsupported=bool)
    dump_dir: str = opt("~/.verl/rollout_dump", "verl: the dumps' directory", no_effect=_SKIP_WHY)
    steps: list[int] = opt(default_factory=list, help="verl: the steps dumped or replayed", no_effect=_SKIP_WHY)
    action: str = opt("cache", "verl: dump or replay", no_effect=_SKIP_WHY)


@dataclass
class SkipConfig:
    """verl 0.9.1's `skip`: stages whose outputs are dumped and replayed (its newer
    `rollout.skip_rollout`)."""

    rollout: SkipStageConfig = section(SkipStageConfig, "verl: the rollouts")
    rollout_tq: SkipStageConfig = section(SkipStageConfig, "verl: the rollouts through its transfer queue")
    async_rollout: SkipStageConfig = section(SkipStageConfig, "verl: the asynchronous rollouts")


_ASYNC_WHY = read_only_with("trainer.v1.trainer_mode colocate_async or separate_async")


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int = opt(1, "verl: batches generated ahead", no_effect=_ASYNC_WHY)


@dataclass
class HybridRolloutConfig:
    enable_switch: bool = opt(False, "verl: switch rollout replicas between training and generation",
                              no_effect=_ASYNC_WHY)
    switch_threshold_ratio: float = opt(0.4, "verl: the switch's threshold", no_effect=_ASYNC_WHY)
    adaptive_switch_threshold: bool = opt(True, "verl: an adaptive threshold", no_effect=_ASYNC_WHY)
    switch_threshold_step_up: float = opt(0.05, "verl: its step up", no_effect=_ASYNC_WHY)
    switch_threshold_step_down: float = opt(0.03, "verl: its step down", no_effect=_ASYNC_WHY)
    switch_threshold_release_steps: int = opt(2, "verl: steps before a release", no_effect=_ASYNC_WHY)
    switch_cost_window_size: int = opt(3, "verl: the cost's window", no_effect=_ASYNC_WHY)


@dataclass
class SeparateAsyncConfig:
    num_warmup_batches: int = opt(1, "verl: batches generated ahead", no_effect=_ASYNC_WHY)
    parameter_sync_step: int = opt(4, "verl: steps between weight syncs", no_effect=_ASYNC_WHY)
    hybrid_rollout: HybridRolloutConfig = section(HybridRolloutConfig, "verl: replicas that switch roles")


@dataclass
class CustomSamplerConfig:
    path: str | None = opt(None, "not supported: must be null (verl: a replay-buffer class of the user's)",
                           unsupported=lambda v: v is not None)
    name: str | None = opt(None, "verl: the class in path", no_effect=read_only_with("path"))


@dataclass
class V1SamplerConfig:
    max_off_policy_threshold: int | None = opt(8, "verl: the most model versions a trajectory may span",
                                               no_effect=_ASYNC_WHY)
    max_off_policy_strategy: str = opt("drop", "verl: what happens to an older one", no_effect=_ASYNC_WHY)
    sync_refill_failed_groups: bool = opt(False, "verl: replace the groups whose rollout sessions failed",
                                          no_effect="meshppo's rollouts run in-process: no session fails")
    custom_sampler: CustomSamplerConfig = section(CustomSamplerConfig, "verl: a replay buffer of the user's")
    sampler_kwargs: dict = opt(default_factory=dict, help="verl: the custom sampler's arguments",
                               no_effect=read_only_with("custom_sampler.path"))


@dataclass
class TrainerV1Config:
    """verl 0.9.1's `trainer.v1`: its newer trainer's modes."""

    trainer_mode: str = opt("sync", "sync only (meshppo's steps generate and then train); verl's colocate_async and "
                                    "separate_async are not supported",
                            choices=("sync", "colocate_async", "separate_async"), unsupported=other_than("sync"))
    sync: dict = opt(default_factory=dict, help="verl: options of its sync mode",
                     no_effect="meshppo's trainer takes none")
    colocate_async: ColocateAsyncConfig = section(ColocateAsyncConfig, "verl: its colocated asynchronous mode")
    separate_async: SeparateAsyncConfig = section(SeparateAsyncConfig, "verl: its separated asynchronous mode")
    sampler: V1SamplerConfig = section(V1SamplerConfig, "verl: its replay buffer")
