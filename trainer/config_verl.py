"""verl's options that meshppo accepts for compatibility, in sections that it has no machinery for:
agent-loop servers, multi-token prediction, mixture-of-experts routing, rollout
tracing and metrics servers, weight-transfer backends, user dataset and sampler classes, Ray's
transfer queue, a remote sandbox, verl's newer reward-manager section. Each option loads at
verl's default; set otherwise it is refused naming the key (`unsupported`) or, where it truly
changes nothing, said at start-up (`no_effect`). The sections are part of `trainer.config`'s
tree, which imports them from here.
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


MOE_WHY = " (meshppo has no mixture-of-experts models)"


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
    speculative_num_steps: int = opt(2, "verl: draft steps", no_effect=_MTP_WHY)
    speculative_eagle_topk: int = opt(2, "verl: draft branches per step", no_effect=_MTP_WHY)
    speculative_num_draft_tokens: int = opt(4, "verl: draft tokens verified at once", no_effect=_MTP_WHY)
    method: str = opt("mtp", "verl: the speculative method's name", no_effect=_MTP_WHY)
    num_speculative_tokens: int = opt(1, "verl: tokens drafted per step", no_effect=_MTP_WHY)


@dataclass
class RouterReplayConfig:
    """verl's `router_replay`: record or replay a mixture-of-experts model's routing."""

    mode: str = opt("disabled", "not supported: must be disabled" + MOE_WHY, unsupported=other_than("disabled"))
    record_file: str | None = opt(None, "not supported: must be null" + MOE_WHY, unsupported=lambda v: v is not None)
    replay_file: str | None = opt(None, "not supported: must be null" + MOE_WHY, unsupported=lambda v: v is not None)


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


@dataclass
class CheckpointEngineConfig:
    """verl's `rollout.checkpoint_engine`: how the trained weights reach the rollout engine."""

    backend: str = opt("naive", "naive only: the engine shares the trainer's GPUs and gets the weights in-process "
                                "(meshppo's resharder)", unsupported=other_than("naive"))
    update_weights_bucket_megabytes: int = opt(2048, "verl: the size of a weight-transfer bucket", ge=1,
                                               no_effect="meshppo's resharder sizes its buckets itself, by layers")
    engine_kwargs: dict = opt(default_factory=dict, help="verl: arguments of the transfer backend",
                              no_effect="meshppo's resharder has no backend to configure")


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
                                        no_effect=_PROMETHEUS_WHY)


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


@dataclass
class TransferQueueConfig:
    """verl's `transfer_queue`: batches passed between its workers through a queue."""

    enable: bool = opt(False, "verl: pass the batches through its transfer queue",
                       no_effect="meshppo passes a step's batch between its phases in-process")


@dataclass
class SandboxFusionConfig:
    url: str | None = opt(None, "not supported: meshppo's rewards are computed in-process (a custom reward function "
                                "may call such a service itself)", unsupported=lambda v: v is not None)
    max_concurrent: int = opt(64, "verl: the service's concurrent calls", ge=1, no_effect="read only with url")
    memory_limit_mb: int = opt(1024, "verl: the service's memory limit", ge=1, no_effect="read only with url")


@dataclass
class RewardManagerModuleConfig:
    path: str | None = opt(None, "verl: the file of a reward-manager class", no_effect="read only with source importlib")
    name: str = opt("custom_reward_manager", "verl: the class in that file", no_effect="read only with source importlib")


@dataclass
class RewardManagerConfig:
    """verl's top-level `reward_manager` section, its newer home of `reward_model.reward_manager`."""

    source: str = opt("register", "register only: name is one of meshppo's managers (verl's importlib loads a verl "
                                  "manager class, which works on verl's DataProto)", choices=("register", "importlib"),
                      unsupported=other_than("register"))
    name: str | None = opt(None, "the reward manager: reward_model.reward_manager's newer name in verl (set one of "
                                 "them, or both the same); null: that option", choices=(*REWARD_MANAGERS, None))
    module: RewardManagerModuleConfig = section(RewardManagerModuleConfig, "verl: a reward-manager class to import")
