"""The trainer's configuration: verl's sections and option names, typed and validated.

Every field has a one-line help string (shown by `train_ppo.py --print-config` and in
`docs/CONFIG.md`). Options that verl has and meshppo does not implement are accepted only
at their neutral value; anything else fails with "not supported" instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from kl import VALID_KL_PENALTIES as KL_TYPES
from kl.guards import KLGuardConfig
from ppo.configlib import ConfigError, opt, section
from ppo.core_algos import ADV_ESTIMATORS, LOSS_AGG_MODES
from sharding.fsdp import FSDPConfig
DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32")


def _not(value):
    return lambda v: v != value


@dataclass
class DataConfig:
    tokenizer: str | None = opt(None, "tokenizer directory; default: actor_rollout_ref.model.path")
    train_files: list[str] = opt(default_factory=list, help="training prompt files (.jsonl or .parquet, verl format)")
    val_files: list[str] = opt(default_factory=list, help="validation prompt files (.jsonl or .parquet)")
    prompt_key: str = opt("prompt", "field holding the prompt (text or chat messages)")
    reward_fn_key: str = opt("data_source", "field that selects the rule-based reward function (only data_source)",
                             choices=("data_source",))
    max_prompt_length: int = opt(512, "prompts longer than this (in tokens) are filtered or truncated")
    max_response_length: int = opt(512, "maximum generated tokens per response")
    train_batch_size: int = opt(1024, "prompts per PPO step (all ranks together)")
    val_batch_size: int | None = opt(None, "prompts per validation generate call; default: the whole validation set")
    shuffle: bool = opt(True, "shuffle the training prompts every epoch")
    seed: int = opt(1, "seed of the prompt shuffle")
    filter_overlong_prompts: bool = opt(False, "drop (and count) prompts longer than max_prompt_length")
    truncation: str = opt("error", "overlong prompts when not filtered: error, left or right",
                          choices=("error", "left", "right"))
    return_raw_chat: bool = opt(False, "accepted for verl compatibility; meshppo always keeps the raw prompt")
    apply_chat_template: bool = opt(True, "apply the tokenizer's chat template to chat-message prompts")


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, "peak learning rate (AdamW)")
    lr_warmup_steps: int = opt(-1, "linear warm-up steps; -1: use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = opt(0.0, "warm-up steps as a fraction of the total training steps")
    min_lr_ratio: float = opt(0.0, "final learning rate of the cosine schedule as a fraction of lr")
    warmup_style: str = opt("constant", "schedule after warm-up: constant or cosine", choices=("constant", "cosine"))
    weight_decay: float = opt(0.01, "AdamW weight decay")
    betas: list[float] = opt(default_factory=lambda: [0.9, 0.999], help="AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    total_training_steps: int = opt(-1, "set by the trainer from the data; leave at -1")


@dataclass
class ModelConfig:
    path: str = opt("", "Hugging Face model directory (config.json + safetensors)")
    load_format: str = opt("auto", "auto: read the safetensors; dummy: random weights drawn on each rank's shards "
                                   "(benchmarks: only config.json is read)", choices=("auto", "dummy"))
    override_config: dict = opt(default_factory=dict, help="not supported: must stay empty",
                                unsupported=lambda v: bool(v))
    enable_gradient_checkpointing: bool = opt(False, "recompute each transformer block's activations in backward")
    enable_activation_offload: bool = opt(False, "keep saved activations on CPU between forward and backward")
    use_remove_padding: bool = opt(True, "padding-free packed forwards (variable-length attention)")
    trust_remote_code: bool = opt(False, "not supported (models are built by meshppo)", unsupported=bool)
    lora_rank: int = opt(0, "LoRA is not supported: must be 0", unsupported=_not(0))
    external_lib: str | None = opt(None, "not supported", unsupported=lambda v: v is not None)


@dataclass
class ActorConfig:
    strategy: str = opt("fsdp2", "training backend: fsdp or fsdp2 (both mean FSDP2 here)", choices=("fsdp", "fsdp2"))
    ppo_mini_batch_size: int = opt(256, "prompts per optimizer step (global; multiplied by rollout.n)")
    ppo_micro_batch_size_per_gpu: int | None = opt(None, "sequences per forward/backward on one GPU")
    use_dynamic_bsz: bool = opt(False, "pack micro-batches by token count instead of sequence count")
    ppo_max_token_len_per_gpu: int = opt(16384, "token budget of one micro-batch with use_dynamic_bsz")
    grad_clip: float = opt(1.0, "gradient-norm clipping threshold")
    clip_ratio: float = opt(0.2, "PPO clip range epsilon")
    clip_ratio_low: float | None = opt(None, "lower clip range; default clip_ratio")
    clip_ratio_high: float | None = opt(None, "upper clip range; default clip_ratio (DAPO's clip-higher)")
    clip_ratio_c: float = opt(3.0, "dual-clip constant for negative advantages (> 1)")
    loss_agg_mode: str = opt("token-mean", "how token losses are aggregated", choices=LOSS_AGG_MODES)
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient")
    use_kl_loss: bool = opt(False, "add a KL(actor || ref) loss term (GRPO style)")
    kl_loss_coef: float = opt(0.001, "coefficient of the KL loss")
    kl_loss_type: str = opt("low_var_kl", "KL estimator of the KL loss", choices=KL_TYPES)
    ppo_epochs: int = opt(1, "passes over each batch of rollouts")
    shuffle: bool = opt(False, "shuffle sequences before splitting mini-batches")
    use_torch_compile: bool = opt(False, "torch.compile each transformer block of the actor (and, by default, of "
                                         "the reference model and critic)")
    ulysses_sequence_parallel_size: int = opt(1, "sequence parallelism is not supported: must be 1",
                                              unsupported=_not(1))
    optim: OptimConfig = section(OptimConfig, "actor optimizer")
    fsdp_config: FSDPConfig = section(FSDPConfig, "actor FSDP2 settings")


@dataclass
class RefConfig:
    fsdp_config: FSDPConfig = section(FSDPConfig, "reference model FSDP2 settings")
    log_prob_micro_batch_size_per_gpu: int | None = opt(None, "sequences per reference forward on one GPU")
    log_prob_use_dynamic_bsz: bool = opt(False, "pack reference forwards by token count")
    log_prob_max_token_len_per_gpu: int = opt(16384, "token budget of one reference forward with dynamic bsz")
    use_torch_compile: bool | None = opt(None, "torch.compile each block of the reference model; null: the actor's "
                                              "setting")


@dataclass
class SamplingOverrides:
    top_k: int = opt(-1, "top-k for validation (-1: off)")
    top_p: float = opt(1.0, "top-p for validation")
    temperature: float = opt(0.0, "validation temperature (0: greedy)")
    n: int = opt(1, "samples per validation prompt")
    do_sample: bool = opt(False, "sample during validation (false: greedy)")


@dataclass
class RolloutConfig:
    name: str = opt("native", "generation engine: native (meshppo's paged-KV engine) or hf (plain loop, reference)",
                    choices=("native", "hf"))
    mode: str = opt("sync", "only sync (colocated SPMD) rollouts", choices=("sync",))
    temperature: float = opt(1.0, "sampling temperature")
    top_k: int = opt(-1, "top-k sampling (-1: off)")
    top_p: float = opt(1.0, "nucleus sampling threshold")
    do_sample: bool = opt(True, "sample (false: greedy)")
    n: int = opt(1, "responses per prompt")
    prompt_length: int | None = opt(None, "defaults to data.max_prompt_length")
    response_length: int | None = opt(None, "defaults to data.max_response_length")
    dtype: str = opt("bfloat16", "engine weight dtype (CPU runs use float32)", choices=DTYPES)
    gpu_memory_utilization: float = opt(0.5, "fraction of free GPU memory for the KV cache")
    ignore_eos: bool = opt(False, "keep generating after EOS (benchmarks)")
    enforce_eager: bool = opt(False, "disable CUDA graphs for decode")
    free_cache_engine: bool = opt(True, "release the KV cache (and engine weights) after generation")
    tensor_model_parallel_size: int = opt(1, "TP degree of the generation engine")
    max_num_batched_tokens: int = opt(8192, "token budget of one engine step (chunked prefill)")
    max_num_seqs: int = opt(256, "sequences decoded at once")
    max_model_len: int | None = opt(None, "context limit of the engine; default prompt + response length")
    enable_chunked_prefill: bool = opt(True, "split long prefills across engine steps")
    block_size: int = opt(16, "tokens per KV-cache block")
    cudagraph_capture_sizes: list[int] | None = opt(None, "decode batch sizes captured as CUDA graphs")
    log_prob_micro_batch_size_per_gpu: int | None = opt(None, "sequences per old-log-prob forward on one GPU")
    log_prob_use_dynamic_bsz: bool = opt(False, "pack old-log-prob forwards by token count")
    log_prob_max_token_len_per_gpu: int = opt(16384, "token budget of one old-log-prob forward with dynamic bsz")
    calculate_log_probs: bool = opt(False, "also log the engine's own log-probs vs the actor's (metric rollout/logprob_diff)")
    load_format: str = opt("dtensor", "accepted for verl compatibility: weights always come from the resharder",
                           choices=("dtensor", "auto", "dummy_dtensor"))
    val_kwargs: SamplingOverrides = section(SamplingOverrides, "sampling settings for validation")


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = opt(True, "actor and engine share the GPUs (the only mode)", unsupported=lambda v: not v)
    model: ModelConfig = section(ModelConfig, "policy model")
    actor: ActorConfig = section(ActorConfig, "actor training")
    ref: RefConfig = section(RefConfig, "reference model")
    rollout: RolloutConfig = section(RolloutConfig, "generation")


@dataclass
class CriticModelConfig:
    path: str | None = opt(None, "critic checkpoint; default: the actor's model path (value head starts at zero)")
    tokenizer_path: str | None = opt(None, "critic tokenizer; must be the actor's (checked), null: the actor's")
    override_config: dict = opt(default_factory=dict, help="not supported: must stay empty",
                                unsupported=lambda v: bool(v))
    enable_gradient_checkpointing: bool = opt(False, "recompute each block's activations in backward")
    enable_activation_offload: bool = opt(False, "keep saved activations on CPU between forward and backward")
    use_remove_padding: bool = opt(True, "padding-free packed forwards")
    fsdp_config: FSDPConfig = section(FSDPConfig, "critic FSDP2 settings")


@dataclass
class CriticConfig:
    strategy: str = opt("fsdp2", "training backend", choices=("fsdp", "fsdp2"))
    optim: OptimConfig = section(OptimConfig, "critic optimizer")
    model: CriticModelConfig = section(CriticModelConfig, "critic model")
    ppo_mini_batch_size: int | None = opt(None, "prompts per critic optimizer step; default: the actor's")
    ppo_micro_batch_size_per_gpu: int | None = opt(None, "sequences per critic forward/backward on one GPU")
    forward_micro_batch_size_per_gpu: int | None = opt(None, "sequences per value forward on one GPU")
    use_dynamic_bsz: bool = opt(False, "pack critic micro-batches by token count")
    ppo_max_token_len_per_gpu: int = opt(32768, "token budget of one critic micro-batch")
    forward_max_token_len_per_gpu: int = opt(32768, "token budget of one value forward")
    ppo_epochs: int | None = opt(None, "critic passes per batch; default: the actor's")
    shuffle: bool = opt(False, "shuffle sequences before mini-batches")
    grad_clip: float = opt(1.0, "gradient-norm clipping threshold")
    cliprange_value: float = opt(0.5, "value clipping range")
    loss_agg_mode: str = opt("token-mean", "aggregation of the value loss", choices=LOSS_AGG_MODES)


@dataclass
class RewardModelConfig:
    enable: bool = opt(False, "score responses with a reward model instead of (or added to) the rule reward")
    path: str | None = opt(None, "reward model: meshppo value-model or HF *ForSequenceClassification directory")
    micro_batch_size_per_gpu: int | None = opt(None, "sequences per reward-model forward")
    max_length: int | None = opt(None, "not supported (prompt + response length bounds the input): must be null",
                                 unsupported=lambda v: v is not None)
    use_dynamic_bsz: bool = opt(False, "pack reward-model forwards by token count")
    forward_max_token_len_per_gpu: int = opt(32768, "token budget of one reward-model forward")
    reward_manager: str = opt("naive", "how rule rewards are computed (naive: one call per response)",
                              choices=("naive",))
    combine: str = opt("replace", "with a rule reward too: replace it or add to it", choices=("replace", "add"))
    fsdp_config: FSDPConfig = section(FSDPConfig, "reward model FSDP2 settings")


@dataclass
class CustomRewardConfig:
    path: str | None = opt(None, "Python file with a reward function (verl signature)")
    name: str = opt("compute_score", "function name in that file")


@dataclass
class KLCtrlConfig:
    type: str = opt("fixed", "KL coefficient controller", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "initial / fixed KL coefficient for KL-in-reward")
    horizon: int = opt(10000, "adaptive controller horizon (Ziegler et al.)")
    target_kl: float = opt(0.1, "adaptive controller target KL")


@dataclass
class AlgorithmConfig:
    gamma: float = opt(1.0, "discount factor")
    lam: float = opt(1.0, "GAE lambda")
    adv_estimator: str = opt("gae", "advantage estimator", choices=ADV_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool = opt(True, "divide GRPO advantages by the group std (false: Dr. GRPO)")
    use_kl_in_reward: bool = opt(False, "subtract kl_coef * KL(actor || ref) from the token rewards")
    kl_penalty: str = opt("kl", "KL estimator for KL-in-reward", choices=KL_TYPES)
    kl_ctrl: KLCtrlConfig = section(KLCtrlConfig, "KL-in-reward controller")
    kl_guard: KLGuardConfig = section(KLGuardConfig, "reactions when KL crosses thresholds")


@dataclass
class TrainerConfig:
    project_name: str = opt("meshppo", "project name (loggers)")
    experiment_name: str = opt("run", "experiment name (loggers)")
    logger: list[str] = opt(default_factory=lambda: ["console", "jsonl"],
                            help="any of console, jsonl, tensorboard, wandb")
    total_epochs: int = opt(1, "passes over the training prompts")
    total_training_steps: int | None = opt(None, "stop after this many steps (overrides total_epochs)")
    nnodes: int = opt(1, "nodes (checked against the launch)")
    n_gpus_per_node: int = opt(1, "processes per node (checked against the launch)")
    device: str = opt("auto", "cuda, cpu, or auto (cuda when available)", choices=("auto", "cuda", "cpu"))
    balance_batch: bool = opt(True, "reorder sequences so ranks get balanced token counts")
    critic_warmup: int = opt(0, "steps that train only the critic")
    test_freq: int = opt(-1, "validate every this many steps (-1: never)")
    val_before_train: bool = opt(True, "validate once before the first step")
    save_freq: int = opt(-1, "checkpoint every this many steps (-1: only at the end)")
    default_local_dir: str = opt("runs/default", "run directory: checkpoints, metrics.jsonl, logs")
    resume_mode: str = opt("auto", "auto (latest checkpoint if any), disable, or resume_path",
                           choices=("auto", "disable", "resume_path"))
    resume_from_path: str | None = opt(None, "checkpoint directory for resume_mode=resume_path")
    max_actor_ckpt_to_keep: int | None = opt(None, "keep at most this many checkpoints (None: all)")
    max_critic_ckpt_to_keep: int | None = opt(None, "not supported: the critic is saved and rotated with the actor "
                                              "(max_actor_ckpt_to_keep)", unsupported=lambda v: v is not None)
    log_val_generations: int = opt(0, "validation samples printed to the log")
    seed: int = opt(1, "global seed (model init, sampling)")
    export_hf_at_end: bool = opt(True, "also write the final actor as a Hugging Face directory")
    max_nonfinite_steps: int = opt(3, "stop after this many consecutive steps with a non-finite loss or grad norm")
    preemption_grace_s: float = opt(120.0, "after SIGTERM/SIGUSR1, a step whose updates would end later than this "
                                    "is abandoned (redone on resume) so the checkpoint is written in time")
    nccl_timeout: int = opt(600, "seconds a collective may wait for the other ranks before the run fails with a "
                                 "message naming the rank and the phase (the process group's timeout; gloo too)")


@dataclass
class PPOConfig:
    data: DataConfig = section(DataConfig, "prompt data")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "policy, reference and generation")
    critic: CriticConfig = section(CriticConfig, "value model")
    reward_model: RewardModelConfig = section(RewardModelConfig, "model-based reward")
    custom_reward_function: CustomRewardConfig = section(CustomRewardConfig, "user reward function")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and KL")
    trainer: TrainerConfig = section(TrainerConfig, "the run")

    # --------------------------------------------------------------- derived views
    @property
    def uses_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def uses_ref(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def response_length(self) -> int:
        r = self.actor_rollout_ref.rollout.response_length
        return r if r is not None else self.data.max_response_length

    @property
    def prompt_length(self) -> int:
        p = self.actor_rollout_ref.rollout.prompt_length
        return p if p is not None else self.data.max_prompt_length


def validate(cfg: PPOConfig, world_size: int) -> None:
    """Cross-field checks that need the world size. Raises ConfigError saying what to change."""
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    n = rollout.n
    bs = cfg.data.train_batch_size
    if not arr.model.path:
        raise ConfigError("actor_rollout_ref.model.path is required (a Hugging Face model directory)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one .jsonl or .parquet file")
    for key, value in (("data.train_batch_size", bs), ("actor_rollout_ref.actor.ppo_mini_batch_size",
                       actor.ppo_mini_batch_size), ("actor_rollout_ref.rollout.n", n),
                       ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs)):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs groups: set "
                          "actor_rollout_ref.rollout.n >= 2")
    if bs % actor.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size ({bs}) must be a multiple of "
                          f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size})")
    mini_seqs = actor.ppo_mini_batch_size * n
    if mini_seqs % world_size:
        raise ConfigError(f"ppo_mini_batch_size x rollout.n = {mini_seqs} sequences must split evenly over "
                          f"{world_size} ranks: change actor_rollout_ref.actor.ppo_mini_batch_size")
    if not actor.use_dynamic_bsz:
        micro = actor.ppo_micro_batch_size_per_gpu
        if micro is None:
            raise ConfigError("set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or use_dynamic_bsz=true")
        if (mini_seqs // world_size) % micro:
            raise ConfigError(f"sequences per rank per mini-batch ({mini_seqs // world_size}) must be a multiple of "
                              f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu ({micro})")
    tp = rollout.tensor_model_parallel_size
    if tp < 1 or world_size % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the "
                          f"world size ({world_size})")
    if (bs * n) % world_size:
        raise ConfigError(f"data.train_batch_size x rollout.n ({bs * n}) must be a multiple of the world size "
                          f"({world_size})")
    if cfg.uses_critic:
        critic = cfg.critic
        cmini = (critic.ppo_mini_batch_size or actor.ppo_mini_batch_size)
        if bs % cmini:
            raise ConfigError(f"data.train_batch_size ({bs}) must be a multiple of critic.ppo_mini_batch_size ({cmini})")
        if (cmini * n) % world_size:
            raise ConfigError(f"critic.ppo_mini_batch_size x rollout.n ({cmini * n}) must split over {world_size} ranks")
        if not critic.use_dynamic_bsz:
            cmicro = critic.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
            if cmicro is None or ((cmini * n) // world_size) % cmicro:
                raise ConfigError("critic.ppo_micro_batch_size_per_gpu must divide the critic's sequences per rank "
                                  "per mini-batch (or set critic.use_dynamic_bsz=true)")
    if actor.clip_ratio_c <= 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1, got {actor.clip_ratio_c}")
    tok = cfg.data.tokenizer or arr.model.path
    if cfg.critic.model.tokenizer_path not in (None, tok):
        raise ConfigError(f"critic.model.tokenizer_path ({cfg.critic.model.tokenizer_path}) must be the actor's "
                          f"tokenizer ({tok}) or null: the critic scores the actor's tokens")
    if cfg.reward_model.enable and not cfg.reward_model.path:
        raise ConfigError("reward_model.enable=true needs reward_model.path")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    for name in cfg.trainer.logger:
        if name not in ("console", "jsonl", "tensorboard", "wandb"):
            raise ConfigError(f"trainer.logger: unknown logger {name!r}; use console, jsonl, tensorboard or wandb")
