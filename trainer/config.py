"""The trainer's configuration: verl's sections and option names, typed and validated.

Every field has a one-line help string (shown by `train_ppo.py --print-config` and in
`docs/CONFIG.md`). Options that verl has and meshppo does not implement are accepted only
at their neutral value; anything else fails with "not supported" instead of being ignored.

It imports light modules only (the options' names and checks; torch for dtypes): no model, FSDP,
engine or kernel implementation, so that a config error is said before any of them loads
(docs/ARCHITECTURE.md, import directions).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass

from agent.tool_parser import FORMATS, VERL_OTHER_FORMATS
from agent.tools import TRUNCATE_SIDES
from data.dataset import RENDERING_ARGS, TRUNCATION_MODES, check_chat_template_kwargs
from kl import VALID_KL_PENALTIES as KL_TYPES
from kl.guards import KLGuardConfig
from models import torch_dtypes
from models.args import OUTPUT_KEYS, check_overrides, flat_overrides
from models.lora import LoRAConfig, read_peft_adapter_config, read_peft_adapter_shapes
from trainer.configlib import (ConfigError, build_dataclass, given_option, opt, option_key, other_than, section,
                               shown)
from trainer.config_profiler import (FINISH_HOOK_OPTIONS, GlobalProfilerConfig, RoleProfilerConfig,
                                    SharedProfilerConfig)
from trainer.config_verl import (AgentLoopConfig, CheckpointEngineConfig, DataClassConfig, DisaggregationConfig,
                                 DistillationConfig, MegatronLoRAConfig, MtpConfig, PrometheusConfig, QATConfig,
                                 RewardConfig, RewardManagerConfig, RewardModelRolloutConfig, RefRouterReplayConfig,
                                 RouterReplayConfig,
                                 SamplerClassConfig, SandboxFusionConfig, SkipConfig, TraceConfig, TrainerV1Config,
                                 TransferQueueConfig, TEACHER_ROLLOUT_COPIES, read_only_with)
from trainer.profiling import check_profiler_ranks, profile_plan, profiling_notes
from ppo.core_algos import (ADV_ESTIMATORS, BYPASS_LOSS_TYPES, PolicyLossParams, LOSS_AGG_MODES, POLICY_LOSSES, ROLLOUT_IS_LEVELS,
                            parse_rollout_is_threshold, parse_rollout_rs)
from rewards.managers import BATCH_FN_ARGS, REWARD_MANAGERS
from rollout.config import KV_CACHE_DTYPES, MIN_TEMPERATURE, QUANTIZATIONS, TEMPERATURE_BOUND
from sharding.fsdp_config import FSDPConfig, MixedPrecisionConfig, torch_dtype
from sharding.mesh import ParallelDims, full_shard_note
from sharding.ulysses import check_sequence_parallel

DTYPES = tuple(torch_dtypes())


# Why verl's entropy options change nothing here: meshppo's LM head (models/lm_head.py) never
# materialises the full logits of the actor's or the reference's forwards.
_ENTROPY_CHUNKING_WHY = ("meshppo's LM head computes the entropy chunk by chunk from the hidden states, never from "
                         "full logits")
_ENTROPY_CHECKPOINTING_WHY = ("meshppo's LM head keeps no logits for backward: it recomputes each chunk's logits "
                              "there, the entropy's included")


# The estimators of kl.kl_penalty, for actor.kl_loss_type and algorithm.kl_penalty (d = log pi - log pi_ref per token).
_KL_ESTIMATORS_HELP = ("kl / k1: d, abs: |d|, mse / k2: d^2 / 2, low_var_kl / k3: exp(-d) + d - 1 clamped to [-10, 10] "
                       "(d = log pi - log pi_ref of the sampled token); a '+' suffix gives that value forward and k2's "
                       "gradient backward. verl's full (not implemented there either) is refused")


def _entropy_chunking():
    return opt(False, "verl: compute the entropy from the full logits in chunks (lower peak memory)",
               no_effect=_ENTROPY_CHUNKING_WHY)


def _entropy_checkpointing():
    return opt(False, "verl: recompute the entropy in backward instead of keeping its activations",
               no_effect=_ENTROPY_CHECKPOINTING_WHY)


def _entropy_chunk_size():
    return opt(2048, "verl: the chunk of entropy_from_logits_with_chunking, in tokens", no_effect=_ENTROPY_CHUNKING_WHY)


def _pad_to_length():
    return opt(False, "verl: round every packed micro-batch up to a multiple of fsdp_config.pad_to_length_bucket "
                      "tokens (fixed shapes)", no_effect=_PAD_TO_LENGTH_WHY)


_PAD_TO_LENGTH_WHY = ("meshppo's packed micro-batches keep their own length; padding to a bucket would add masked "
                      "tokens only")


def _turbo_config() -> dict:
    """verl 0.9.1's default `fsdp_config.turbo_config` (its FSDP-Turbo engine's, strategy fsdp_turbo)."""
    plan = {"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "bf16", "fsdp_implementation": "native",
            "num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}
    return {"distributed": {"fully_shard_parallel_size": 16, "tensor_parallel_size": 1, "expert_parallel_size": 1,
                            "expert_fully_shard_parallel_size": 1, "ulysses_parallel_size": 1, "fsdp_plan": plan}}


# verl's `fsdp_config.dtype` default (`FSDPOptions._map_dtype`).
_VERL_COMPUTE_DTYPE = "bfloat16"


_SP_HELP = ("Ulysses sequence parallelism: this many consecutive ranks (inside a node) run each packed micro-batch "
            "together, each on its shard of the tokens, attention split by heads through all-to-alls; they pool their "
            "rows, so the role has world / size data-parallel groups, and a dynamic micro-batch's token budget is per "
            "GPU (times size a group). Needs use_remove_padding; must divide the model's attention heads, and its "
            "key/value heads must be a multiple of it or divide it (repeated)")


@dataclass
class FSDPOptions(FSDPConfig):
    """`fsdp_config` as a verl config writes it. As in verl, `offload_policy` supersedes
    `param_offload` / `optimizer_offload` (verl's FSDP2 recipe sets them together): with the
    policy the states live on CPU for the whole run, so the manual moves between phases are
    turned off here; `superseded` names what was turned off, for `config_notes`."""

    fsdp_size: int = opt(-1, "-1, or the world size or more: FULL_SHARD over all ranks (verl's mesh reads any size of "
                             "at least the world's so; a larger one is said at start-up); N below the world size: "
                             "HYBRID_SHARD, shard over groups of N ranks, replicate across. The actor's value builds "
                             "the one training mesh every model shares: the reference's, critic's and reward model's "
                             "must give the actor's shard groups or be -1, which means the actor's (verl's -1 shards "
                             "that model over all ranks; said at start-up where the actor's is HYBRID_SHARD)")
    use_orig_params: bool = opt(False, "verl: FSDP1's use_orig_params", no_effect="it is an FSDP1 option; meshppo "
                                "shards with FSDP2, whose parameters always are the original ones (as DTensors)")
    entropy_from_logits_with_chunking: bool = _entropy_chunking()
    entropy_checkpointing: bool = _entropy_checkpointing()
    dtype: str = opt(_VERL_COMPUTE_DTYPE, "the compute dtype where mixed_precision gives no param_dtype (verl 0.9.1's "
                                          "FSDP engine does not read it: its Megatron engine's): "
                                          "another value than bfloat16 sets mixed_precision.param_dtype when that is "
                                          "at its default (bf16); a param_dtype set otherwise wins",
                     choices=DTYPES)
    strategy: str = opt("fsdp", "verl's engine backend: fsdp or fsdp2 (fsdp_turbo, verl's FSDP-Turbo engine, is not "
                                "supported)", choices=("fsdp", "fsdp2", "fsdp_turbo"),
                        unsupported=lambda v: v == "fsdp_turbo", no_effect="meshppo shards with FSDP2 whatever the "
                                                                             "strategy")
    forward_only: bool = opt(False, "verl: the engine runs forwards only (its reference's); the actor and the critic "
                                    "train: must be false", unsupported=bool)
    use_torch_compile: bool = opt(True, "verl: torch.compile the engine's entropy-from-logits function",
                                  no_effect="meshppo's LM head computes the entropy with its own kernels "
                                            "(actor.use_torch_compile and ref.use_torch_compile compile the "
                                            "transformer blocks)")
    ulysses_sequence_parallel_size: int = opt(1, "verl's copy of the role's ulysses_sequence_parallel_size (its "
                                                 "engine workers read this one): 1, or the role's value; another "
                                                 "value than 1 sets the role's where that is 1", ge=1)
    full_determinism: bool = opt(False, "deterministic kernels: torch's deterministic algorithms "
                                        "(FlashAttention's deterministic backward among them), cuBLAS with a fixed "
                                        "workspace, no cuDNN autotuning; the same config, data, world size and "
                                        "hardware then give bitwise the same run. The roles share their processes, "
                                        "so any role's true makes the whole run deterministic. Costs speed in the "
                                        "attention's backward")
    seed: int = opt(42, "verl: the seed full_determinism sets", no_effect="meshppo's draws follow trainer.seed (the "
                                                                         "prompt order and the max_samples choice "
                                                                         "data.seed), with or without "
                                                                         "full_determinism")
    entropy_from_logits_chunk_size: int = _entropy_chunk_size()
    use_no_sync_for_gradient_accumulation: bool = opt(
        False, "verl: skip the gradient reduction in all but a mini-batch's last micro-batch",
        no_effect="meshppo always reduces a mini-batch's gradients once, in its last micro-batch's backward")
    pad_to_length: bool = _pad_to_length()
    pad_to_length_bucket: int = opt(1024, "verl: the bucket of pad_to_length, in tokens", no_effect=_PAD_TO_LENGTH_WHY)
    qat: QATConfig = section(QATConfig, "verl 0.9.1's quantization-aware training of the engine")
    turbo_config: dict = opt(default_factory=_turbo_config, help="verl 0.9.1: its FSDP-Turbo engine's settings",
                             no_effect=read_only_with("strategy=fsdp_turbo"))

    def __post_init__(self):
        self.full_shard_note = None  # an fsdp_size above the launch's ranks, read as -1 (`_full_shard_sizes`)
        self.superseded = [k for k in ("param_offload", "optimizer_offload") if self.offload_policy and getattr(self, k)]
        for k in self.superseded:
            setattr(self, k, False)
        super().__post_init__()
        self._map_dtype()

    def _map_dtype(self):
        """verl's `dtype` as `mixed_precision.param_dtype`: verl computes in `dtype` where
        mixed_precision gives no param_dtype. meshppo's always gives one, bf16 by default as verl's
        `dtype`: a `dtype` other than that default replaces a param_dtype at its default; a
        param_dtype of the user's wins (as verl's mixed_precision does)."""
        mp = self.mixed_precision
        if (torch_dtype(self.dtype, "fsdp_config.dtype") != torch_dtype(_VERL_COMPUTE_DTYPE, "")
                and torch_dtype(mp.param_dtype, "") == torch_dtype(MixedPrecisionConfig().param_dtype, "")):
            mp.param_dtype = self.dtype


@dataclass
class FrozenFSDPOptions(FSDPOptions):
    """A frozen model's `fsdp_config` (the reference's, the reward model's): verl marks the reference's
    engine forward-only, as meshppo's frozen models are."""

    forward_only: bool = opt(True, "verl: the engine runs forwards only; a frozen model (the reference, the reward "
                                   "model) always does: must be true", unsupported=lambda v: not v)


_TEXT_ONLY_WHY = "meshppo's models are text-only: it reads no images or videos"


@dataclass
class DataConfig:
    tokenizer: str | None = opt(None, "tokenizer directory; default: actor_rollout_ref.model.path", path=True)
    train_files: list[str] = opt(default_factory=list, help="training prompt files (.jsonl, .json: JSON lines or one "
                                                             "array of rows, or .parquet; verl format)", path=True)
    val_files: list[str] = opt(default_factory=list, help="validation prompt files (.jsonl, .json or .parquet)",
                               path=True)
    prompt_key: str = opt("prompt", "field holding the prompt (text or chat messages)")
    reward_fn_key: str = opt("data_source", "field that selects the rule-based reward function (only data_source)",
                             choices=("data_source",))
    max_prompt_length: int = opt(512, "prompts longer than this (in tokens) are dropped (filter_overlong_prompts), "
                                      "else cut or refused at load as truncation says (its default, error, refuses "
                                      "them)", ge=1)
    max_response_length: int = opt(512, "maximum generated tokens per response: the default of "
                                        "actor_rollout_ref.rollout.response_length, which is what generation uses", ge=1)
    train_batch_size: int = opt(1024, "prompts per PPO step (all ranks together)", ge=1)
    gen_batch_size: int | None = opt(None, "prompts per generation round with algorithm.filter_groups (DAPO's "
                                           "dynamic sampling: rounds repeat until train_batch_size prompts are "
                                           "kept), as verl's DAPO recipe reads it (verl 0.9.1's default trainer "
                                           "sets it to 1 with filter_groups: it refills prompt by prompt); null: "
                                           "train_batch_size. Without filter_groups it must be null or "
                                           "train_batch_size", ge=1)
    val_batch_size: int | None = opt(None, "prompts per validation generate call; default: the whole validation set",
                                     ge=1)
    train_max_samples: int = opt(-1, "use this many training rows (-1: all): with shuffle, a seeded random choice "
                                     "(numpy default_rng(seed).choice, verl's), else the first ones; before "
                                     "filtering", ge=-1)
    val_max_samples: int = opt(-1, "use this many validation rows (-1: all), chosen as train_max_samples chooses",
                               ge=-1)
    shuffle: bool = opt(True, "shuffle the training prompts every epoch, in the order verl's loader takes them "
                              "(seed; dataloader_num_workers)")
    seed: int | None = opt(1, "seed of the prompt shuffle and of the max_samples choice; null: the seed an unseeded "
                              "torch.Generator has, as verl's sampler with seed null", ge=0)
    validation_shuffle: bool = opt(False, "not supported: must be false (validation prompts go in file order, or in the order val_max_samples drew them)",
                                   unsupported=bool)
    dataloader_num_workers: int = opt(8, "verl: its prompt loader's worker processes. meshppo has none (it tokenizes "
                                         "the prompts once at load) but shuffles as verl's loader then does: with "
                                         "workers (above 0) verl's sampler draws two permutations an epoch and uses "
                                         "the second, without them one; a resumed run keeps the order it was saved "
                                         "with", ge=0)
    filter_overlong_prompts_workers: int | None = opt(1, "accepted for verl compatibility (null too, as verl)", ge=1,
                                                      no_effect="meshppo measures the prompts once at load, each rank "
                                                                "its share of them")
    trust_remote_code: bool = opt(False, "not supported (tokenizers load without remote code): must be false",
                                  unsupported=bool)
    return_full_prompt: bool = opt(False, "not supported: must be false", unsupported=bool)
    filter_overlong_prompts: bool = opt(False, "drop (and count) prompts longer than max_prompt_length")
    truncation: str = opt("error", "overlong prompts when not filtered: error; left keeps the last max_prompt_length "
                                   "tokens, right the first, middle the first half and the last half",
                          choices=TRUNCATION_MODES)
    return_raw_chat: bool = opt(True, "verl: keep each row's chat messages (its reward model needs them)",
                                no_effect="meshppo always keeps them")
    apply_chat_template: bool = opt(True, "apply the tokenizer's chat template to chat-message prompts")
    apply_chat_template_kwargs: dict = opt(default_factory=dict, help="extra keyword arguments of the chat template "
                                                                       "(training and validation prompts), e.g. "
                                                                       "{enable_thinking: false}; not "
                                                                       f"{', '.join(RENDERING_ARGS)}, which the "
                                                                       "rendering sets itself")
    use_shm: bool = opt(False, "verl: copy the data files to /dev/shm first",
                        no_effect="meshppo reads the prompt files once at start-up, where they are")
    return_raw_input_ids: bool = opt(False, "verl: also pass the prompts' token ids on, for a reward model of another "
                                            "tokenizer",
                                     no_effect="a reward model of another tokenizer re-renders the chat with its own "
                                               "(reward_model.model.input_tokenizer)")
    image_key: str = opt("images", "the field of a row's images: a row that has any is refused at load (meshppo's "
                                   "models are text-only)")
    video_key: str = opt("videos", "the field of a row's videos: a row that has any is refused at load")
    image_patch_size: int = opt(14, "verl: the vision encoder's patch size", no_effect=_TEXT_ONLY_WHY)
    return_multi_modal_inputs: bool = opt(True, "verl: pass the rows' processed images on", no_effect=_TEXT_ONLY_WHY)
    mm_processor_kwargs: dict = opt(default_factory=dict, help="verl: keyword arguments of the multi-modal processor",
                                    no_effect=_TEXT_ONLY_WHY)
    tool_config_path: str | None = opt(None, "verl: the tools whose schemas the overlong-prompt filter renders; "
                                             "null or actor_rollout_ref.rollout.multi_turn.tool_config_path",
                                       no_effect="meshppo renders the tool agent's prompts with the tools of "
                                                 "actor_rollout_ref.rollout.multi_turn.tool_config_path, and the "
                                                 "overlong-prompt filter counts them so", path=True)
    audio_key: str = opt("audios", "the field of a row's audio: a row that has any is refused at load (meshppo's "
                                   "models are text-only)")
    function_tool_path: str | None = opt(None, "not supported: must be null (verl 0.9.1's copy of "
                                               "actor_rollout_ref.rollout.multi_turn.function_tool_path)",
                                         unsupported=lambda v: v is not None)
    custom_cls: DataClassConfig = section(DataClassConfig, "verl's dataset class of the user's")
    datagen: DataClassConfig = section(DataClassConfig, "verl's prompt generator of the user's")
    sampler: SamplerClassConfig = section(SamplerClassConfig, "verl's sampler class of the user's")

    @property
    def media_keys(self) -> tuple[str, str, str]:
        """The fields of a row's images, videos and audio, which the dataset refuses (`data.dataset.RLHFDataset`)."""
        return self.image_key, self.video_key, self.audio_key


def _global_micro_batch(per_gpu: str):
    """verl's deprecated global form of the micro-batch size `per_gpu` (`_per_gpu_micro_batch`)."""
    return opt(None, f"verl's deprecated global form of {per_gpu}: sequences over all ranks together; {per_gpu} "
                     "becomes it divided by the data-parallel size (trainer.nnodes x trainer.n_gpus_per_node over the "
                     "Ulysses group size of the model that runs it: the actor's for the rollout's and reference's "
                     "log-probs; the reward model's: over all ranks), which must divide "
                     f"it, as earlier verl's workers divided it (verl 0.9.1's read only {per_gpu}: a global size "
                     f"alone stops its start-up); not with {per_gpu}", ge=1)


def _per_gpu_micro_batch(key: str, section, name: str, trainer, sp_key: str | None, sp: int) -> None:
    """Section `key`'s global micro-batch size `name` as its `{name}_per_gpu`: divided by the
    data-parallel size, the ranks the `trainer` section describes over the role's Ulysses group
    size `sp` (option `sp_key`; a Ulysses group reads one micro-batch), as earlier verl's workers
    divided it (verl 0.9.1's do not); then null, so a resolved config resolves to itself. Setting
    both is an error, as in verl."""
    total, per_gpu = getattr(section, name), f"{name}_per_gpu"
    if total is None:
        return
    if getattr(section, per_gpu) is not None:
        raise ConfigError(f"{key}.{name}={total} and {key}.{per_gpu}={getattr(section, per_gpu)}: both set the "
                          f"micro-batch size ({name}, verl's deprecated form, over all ranks together); set one")
    ranks = trainer.nnodes * trainer.n_gpus_per_node
    launch = f"trainer.nnodes x trainer.n_gpus_per_node = {trainer.nnodes} x {trainer.n_gpus_per_node} = {ranks} ranks"
    if ranks % sp:
        raise ConfigError(f"{sp_key}={sp} does not divide the {launch}")
    dp = ranks // sp
    if total % dp:
        over = launch if sp == 1 else f"{launch} in Ulysses groups of {sp} ({sp_key}): {dp} data-parallel groups"
        raise ConfigError(f"{key}.{name}={total} does not split into {key}.{per_gpu} over {over}: use a multiple of "
                          f"{dp}, or set {per_gpu}")
    setattr(section, per_gpu, total // dp)
    setattr(section, name, None)


def _lr(default: float):
    return opt(default, "peak learning rate (AdamW)", ge=0)


@dataclass
class OptimConfig:
    lr: float = _lr(1e-6)
    lr_warmup_steps: int = opt(-1, "linear warm-up steps; -1 or 0: use lr_warmup_steps_ratio (as verl)", ge=-1)
    lr_warmup_steps_ratio: float = opt(0.0, "warm-up steps as a fraction of the total training steps", ge=0, le=1)
    min_lr_ratio: float | None = opt(0.0, "final learning rate of the cosine schedule as a fraction of lr (null: 0, "
                                          "as verl's schedule reads it)", ge=0, le=1)
    lr_scheduler_type: str = opt("constant", "schedule after warm-up: constant or cosine",
                                 choices=("constant", "cosine"))
    warmup_style: str | None = opt(None, "verl's older name of lr_scheduler_type: when set, it replaces "
                                         "lr_scheduler_type (as in verl); null: lr_scheduler_type decides",
                                   choices=(None, "constant", "cosine"))
    num_cycles: float = opt(0.5, "cosine waves over the steps after warm-up: 0.5 falls once from lr to min_lr_ratio "
                                 "x lr, 1 falls and rises back", ge=0)
    weight_decay: float = opt(0.01, "AdamW weight decay", ge=0)
    betas: list[float] = opt(default_factory=lambda: [0.9, 0.999], help="AdamW betas", ge=0, lt=1, length=2)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0)
    clip_grad: float | None = opt(None, "gradient-norm clipping threshold, the name verl 0.9.1 reads (its workers "
                                        "read no other); it wins over the section's grad_clip. null: grad_clip",
                                  gt=0)
    grad_clip: float | None = opt(None, "verl's deprecated name of clip_grad, which wins over it when set (as in "
                                        "verl)", gt=0)
    total_training_steps: int = opt(-1, "length in steps of the learning-rate schedule (warm-up ratio, cosine); -1 or "
                                        "0: the run's total steps", ge=-1)
    optimizer: str = opt("AdamW", "the optimizer: AdamW only (verl may name another torch.optim class)",
                         unsupported=other_than("AdamW"))
    optimizer_impl: str = opt("torch.optim", "the optimizer's module: torch.optim only (meshppo's AdamW is torch's)",
                              unsupported=other_than("torch.optim"))
    override_optimizer_config: dict | None = opt(None, "not supported: must be null or empty (verl: more keyword "
                                                       "arguments of the optimizer)", unsupported=bool)
    zero_indexed_step: bool = opt(True, "the cosine schedule counts update steps from 0 (verl's default); false "
                                        "(from 1) is not supported with lr_scheduler_type=cosine")

    def __post_init__(self):
        # As verl's FSDPOptimizerConfig: a warmup_style replaces lr_scheduler_type. Its value moves
        # there, so a resolved config has one name for it (and resolves to itself).
        if self.warmup_style is not None:
            self.lr_scheduler_type, self.warmup_style = self.warmup_style, None
        if self.min_lr_ratio is None:  # verl's default; its cosine schedule reads None as 0
            self.min_lr_ratio = 0.0
        if self.lr_scheduler_type == "cosine" and not self.zero_indexed_step:
            raise ValueError("zero_indexed_step=false is not supported: meshppo's cosine schedule counts update steps "
                             "from 0 (verl's default, true)")


@dataclass
class CriticOptimConfig(OptimConfig):
    """`critic.optim`: the actor's options, with verl's critic default learning rate."""

    lr: float = _lr(1e-5)


# The actor's and the critic's `grad_clip` (`_resolve_grad_clip`).
_GRAD_CLIP_HELP = ("gradient-norm clipping threshold, read where optim.clip_grad and optim.grad_clip are null (verl "
                   "0.9.1 never reads it; earlier verl did); null: 1.0")


def _resolve_grad_clip(key: str, section) -> None:
    """The actor's or critic's (`key`) gradient-norm clipping threshold from verl's three names of it:
    `optim.grad_clip` (deprecated) over `optim.clip_grad`, as verl 0.9.1 reads them, then the section's
    `grad_clip` (which only earlier verl read), 1.0 when none is set. It ends in grad_clip, the
    optimizer's null (so a resolved config resolves to itself); a name set to another value, and so
    not read, is kept for its start-up note (`section.grad_clip_note`)."""
    names = [(f"{key}.optim.grad_clip", section.optim.grad_clip), (f"{key}.optim.clip_grad", section.optim.clip_grad),
             (f"{key}.grad_clip", section.grad_clip)]
    given = [(name, v) for name, v in names if v is not None]
    acting, value = given[0] if given else (None, 1.0)
    unread = [f"{name}={v}" for name, v in given[1:] if v != value]
    section.grad_clip_note = (f"{' and '.join(unread)} not read: gradients are clipped at {acting}={value}, as verl "
                              "0.9.1 reads its names (optim.grad_clip over optim.clip_grad, never the section's "
                              "grad_clip)") if unread else None
    section.grad_clip = value
    section.optim.clip_grad = section.optim.grad_clip = None


# The actor's, reference's and critic's `model.enable_activation_offload` (sharding.ac.ActivationOffloader).
_ACTIVATION_OFFLOAD_HELP = ("keep each block's saved activations in pinned host memory between forward and backward, "
                           "copied on side streams; with gradient checkpointing only the block inputs move")


# What a checkpoint of the actor or critic may hold (verl's CheckpointConfig items).
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
_DEFAULT_CHECKPOINT_CONTENTS = ["model", "optimizer", "extra"]


@dataclass
class CheckpointConfig:
    """verl's `checkpoint` section of the actor and the critic (`trainer.checkpointing` reads it)."""

    save_contents: list[str] = opt(
        default_factory=lambda: list(_DEFAULT_CHECKPOINT_CONTENTS),
        help="what each checkpoint holds of this model: model (sharded weights), optimizer (its state; needs "
             "model), extra (LR scheduler; the actor's also every rank's RNG), hf_model (a Hugging Face directory "
             "of the full weights, config and tokenizer in the checkpoint's <role>/huggingface/). The step, data "
             "position, KL coefficients and KL guard are always saved")
    load_contents: list[str] | None = opt(
        None, "what a resume loads of this model (trainer.resume_mode auto or resume_path; under any mode, also "
              "disable, a restart of the launch resuming its own newest checkpoint); the rest starts fresh: without "
              "model the weights of the model path, without optimizer an empty optimizer state, without extra a new "
              "LR schedule (and RNG). A KL-guard rollback (algorithm.kl_guard) loads model and optimizer, which "
              "it needs listed here (and in save_contents), never extra: the LR schedules and RNG carry on. hf_model loads nothing (as in verl). An item the checkpoint lacks "
              "is an error. null: save_contents (verl's ${.save_contents})")
    strict: bool = opt(True, "verl: strict checks of its Megatron checkpoints' Hugging Face export",
                       no_effect="verl reads it in its Megatron checkpoint manager only; its FSDP workers, as meshppo, "
                                 "do not")
    async_save: bool = opt(False, "not supported: must be false (verl implements it for Megatron only; meshppo "
                                  "writes a checkpoint before the run goes on, so that it is complete and published "
                                  "when the step ends)")

    def __post_init__(self):
        if self.load_contents is None:
            self.load_contents = list(self.save_contents)


def _check_checkpoint(key: str, c: CheckpointConfig) -> None:
    """The items of `key`.checkpoint (verl's names), refused before any work starts."""
    for name in ("save_contents", "load_contents"):
        items = getattr(c, name)
        unknown = [i for i in items if i not in CHECKPOINT_CONTENTS]
        if unknown:
            raise ConfigError(f"{key}.checkpoint.{name}: unknown item {unknown[0]!r}; allowed: "
                              f"{', '.join(CHECKPOINT_CONTENTS)}")
        if "optimizer" in items and "model" not in items:
            raise ConfigError(f"{key}.checkpoint.{name}={shown(items)}: 'optimizer' needs 'model' (meshppo keeps the "
                              "optimizer state with the weights it was computed for; Adam moments without them do "
                              "not resume anything)")
    if c.async_save:
        raise ConfigError(f"{key}.checkpoint.async_save=true is not supported by meshppo: verl implements it for "
                          "Megatron only, and meshppo writes each checkpoint before the run goes on (complete and "
                          "published when the step ends); set it to false")


@dataclass
class FusedKernelOptions:
    impl_backend: str = opt("torch", "verl: the fused kernels' implementation (with use_fused_kernels)",
                            choices=("torch", "triton"),
                            no_effect="meshppo's LM head picks its kernels itself: Triton on CUDA when triton is "
                                      "installed, else PyTorch (MESHPPO_LM_HEAD=torch forces it)")


def _hf_config_path():
    return opt(None, "not supported: must be null (verl: a config.json elsewhere than path; meshppo reads path's)",
               unsupported=lambda v: v is not None)


def _exclude_modules():
    return opt(None, "modules of those target_modules selects that get no adapter, as peft reads it: a regular "
                     "expression (re.fullmatch on whole names: model.layers.0.mlp.down_proj) or a list (an entry "
                     "excludes the module of that name or whose name ends with '.' + it: down_proj, mlp.down_proj); "
                     "what is left must be the same projections in every layer; null: none")


def _use_liger():
    return opt(False, "verl: patch the Hugging Face model with Liger's fused kernels",
               no_effect="meshppo's model is its own (models/), not the Hugging Face classes Liger patches, and has "
                         "its own fused kernels")


_SHM_WHY = ("meshppo reads the safetensors files where they are, memory-mapped, one tensor at a time (the page cache "
            "shares them among a node's ranks): there is no copy to make")
_FUSED_KERNELS_WHY = "meshppo's LM head always computes them so: chunk by chunk, with its own kernels"


def _override_config(built: str, others: str):
    """A model section's `override_config`; `others`: what the keys the outputs do not read change."""
    return opt(default_factory=dict,
               help=f"verl's Hugging Face config overrides, set on the checkpoint's config before {built} built: "
                    "rope_theta, rope_scaling (rope_type default, linear, llama3 or yarn with its parameters: replaces "
                    f"the checkpoint's, also a type meshppo refuses such as dynamic; null drops it; a Gemma 3's "
                    "full_attention layers') and rms_norm_eps change the outputs; sliding_window (null: none) sets "
                    "the window of the layers config.json windows (each of their positions attends to the last that "
                    "many, itself included, in training and rollout); a Mixtral's router_jitter_noise, 0 only, "
                    "replaces config.json's (which is refused above 0); a Gemma's attn_logit_softcapping / "
                    "final_logit_softcapping (null: none) replace config.json's caps of the attention scores / "
                    f"logits; {others}; attn_implementation, use_cache "
                    "and dropouts of 0 are accepted and change nothing; keys of the architecture or the tensors' "
                    "shapes are refused. verl's nested form, model_config: {...}, gives the same keys")


# verl's three model sections: each has its `override_config`.
MODEL_SECTIONS = ("actor_rollout_ref.model", "critic.model", "reward_model.model")


def paths_read(cfg) -> list[str]:
    """The directories a run reads its models, adapters and tokenizer from (those it sets)."""
    arr = cfg.actor_rollout_ref
    return [p for p in (arr.model.path, arr.model.lora_adapter_path, cfg.data.tokenizer, cfg.critic.model.path,
                        cfg.reward_model.model.path) if p]


def paths_read_under(cfg, directory: str | os.PathLike) -> list[str]:
    """The `paths_read` that are `directory` or lie inside it (links and `..` resolved): what deleting
    or replacing `directory` would take from the run."""
    root = os.path.realpath(directory)
    return [p for p in paths_read(cfg) if os.path.commonpath([root, os.path.realpath(p)]) == root]


# The run's final exports in its directory (trainer.export_hf_at_end): the actor, and a LoRA actor's adapters alone.
HF_EXPORT, ADAPTER_EXPORT = "hf_actor", "lora_adapter"


def check_final_exports(cfg) -> None:
    """A ConfigError when the run's final export (`trainer.export_hf_at_end`) would replace a directory the run
    reads its model, adapter or tokenizer from (a second stage trained from the first's `hf_actor/` in the same
    run directory): its base would be gone at the end, and the run's checkpoints could no longer resume."""
    if not cfg.trainer.export_hf_at_end:
        return
    for name in (HF_EXPORT, ADAPTER_EXPORT):
        out = os.path.join(cfg.trainer.default_local_dir, name)
        inside = paths_read_under(cfg, out)
        if inside:
            raise ConfigError(f"trainer.export_hf_at_end=true would replace {out} at the end of the run, and this run "
                              f"reads {inside[0]!r} there (actor_rollout_ref.model.path, lora_adapter_path, "
                              "data.tokenizer, critic.model.path or reward_model.model.path): copy it out of the run "
                              "directory, train in another trainer.default_local_dir, or set "
                              "trainer.export_hf_at_end=false")


def model_sections(cfg) -> dict:
    """`MODEL_SECTIONS` of `cfg`, by key."""
    return {key: functools.reduce(getattr, key.split("."), cfg) for key in MODEL_SECTIONS}


def models_run(cfg) -> tuple[str, ...]:
    """The keys of `MODEL_SECTIONS` whose model the run builds (`built_fsdp_sections`): the actor's, the
    critic's with a critic (adv_estimator gae), the reward model's with reward_model.enable."""
    built = built_fsdp_sections(cfg)
    return tuple(key for key in MODEL_SECTIONS if key == "actor_rollout_ref.model" or key in built)


_RM_UNREAD_WHY = "the reward model's scores do not read it, and it is neither exported nor drawn at random"


def acting_overrides(key: str, overrides: dict) -> dict:
    """The overrides of model section `key` that change something (`models.args.check_overrides`):
    the reward model's, which is neither exported nor drawn at random, only those its scores read."""
    acting = check_overrides(overrides)[0]
    return {k: v for k, v in acting.items() if k in OUTPUT_KEYS} if key == "reward_model.model" else acting


def _check_override_config(key: str, overrides: dict) -> dict:
    """A model section's `override_config` checked (`models.args.check_overrides`), naming the key, and
    in its flat form (verl's nested `model_config: {...}` as its keys: `models.args.flat_overrides`)."""
    try:
        check_overrides(overrides, f"{key}.override_config")
        return flat_overrides(overrides, f"{key}.override_config")
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class TiledMLPConfig:
    """verl's `model.tiled_mlp`: each block's MLP over the tokens in tiles (`models/tiled_mlp.py`)."""

    enabled: bool = opt(False, "compute each block's MLP in num_shards tiles of the micro-batch's tokens: its "
                               "[tokens, intermediate_size] activations (gate, up, their SwiGLU product) exist for one "
                               "tile at a time, in forward and backward, and backward keeps only the MLP's input. Costs "
                               "recomputing gate and up in backward: +2/3 of the MLP's forward FLOPs, about +2/9 of its "
                               "forward and backward")
    num_shards: int = opt(4, "tiles of tiled_mlp (near-equal token counts; with enabled)", ge=1)


@dataclass
class ModelConfig:
    path: str = opt("", "Hugging Face model directory (config.json + safetensors)", path=True)
    load_format: str = opt("auto", "auto: read the safetensors; dummy: random weights drawn on each rank's shards "
                                   "(benchmarks: only config.json is read)", choices=("auto", "dummy"))
    override_config: dict = _override_config(
        "the actor, the reference and the engine are",
        "max_position_embeddings and bos/eos/pad_token_id only the exported config.json and the start-up line on a "
        "context beyond max_position_embeddings (the engine's context is rollout.max_model_len; generation stops "
        "at the EOS ids of the checkpoint and the tokenizer), "
        "initializer_range only dummy weights")
    enable_gradient_checkpointing: bool = opt(False, "recompute each transformer block's activations in backward")
    enable_activation_offload: bool = opt(False, _ACTIVATION_OFFLOAD_HELP)
    use_remove_padding: bool = opt(True, "padding-free packed forwards (variable-length attention)")
    trust_remote_code: bool = opt(False, "not supported (models are built by meshppo)", unsupported=bool)
    custom_chat_template: str | None = opt(None, "a Jinja chat template in place of the tokenizer's (verl's): the "
                                                 "chat prompts are rendered with it, and the exported Hugging Face "
                                                 "tokenizer carries it; null: the tokenizer's own")
    lora_rank: int = opt(0, "LoRA adapter rank on the actor; 0: full fine-tuning. With the KL's reference, the "
                            "reference is the actor with its adapters off (no second model)", ge=0)
    lora_alpha: float = opt(16.0, "LoRA scaling numerator: the adapter output is scaled by lora_alpha / lora_rank",
                            gt=0)
    target_modules: str | list[str] = opt("all-linear", "projections that get adapters, as peft selects them: "
                                                         "all-linear (any case), a list (an entry selects the module "
                                                         "of that name or whose name ends with '.' + it: q_proj, "
                                                         "self_attn.q_proj) or a regular expression (re.fullmatch on "
                                                         "whole names: model.layers.0.self_attn.q_proj); only the "
                                                         "decoder layers' projections, the same ones in every layer")
    lora_adapter_path: str | None = opt(None, "peft adapter directory to start from (adapter_config.json + "
                                              "adapter_model.safetensors): LoRA with the adapter's own r, lora_alpha, "
                                              "target_modules and exclude_modules, as in verl (lora_rank, lora_alpha, "
                                              "target_modules and exclude_modules are then not read)", path=True)
    external_lib: str | None = opt(None, "not supported", unsupported=lambda v: v is not None)
    use_shm: bool = opt(False, "verl: copy the checkpoint to /dev/shm and load it from there", no_effect=_SHM_WHY)
    use_fused_kernels: bool = opt(False, "verl: the actor's and reference's log-probs and entropy by fused kernels "
                                         "from the hidden states, without the full logits",
                                  no_effect=_FUSED_KERNELS_WHY)
    fused_kernel_options: FusedKernelOptions = section(FusedKernelOptions, "verl's fused-kernel settings")
    tokenizer_path: str | None = opt(None, "verl's name of data.tokenizer (the tokenizer directory): setting both to "
                                           "different directories is an error; null: data.tokenizer", path=True)
    hf_config_path: str | None = _hf_config_path()
    exclude_modules: str | list[str] | None = _exclude_modules()
    use_liger: bool = _use_liger()
    tiled_mlp: TiledMLPConfig = section(TiledMLPConfig, "the tiled MLP of the actor and the reference")
    mtp: MtpConfig = section(MtpConfig, "verl's multi-token prediction")
    megatron_lora: MegatronLoRAConfig = section(MegatronLoRAConfig, "verl 0.9.1's Megatron LoRA", key="lora")

    def __post_init__(self):
        self.override_config = _check_override_config("actor_rollout_ref.model", self.override_config)
        _lora_config("actor_rollout_ref.model", self)  # a bad target_modules / lora_alpha fails here, naming the key

    @property
    def adapted(self) -> bool:
        """Whether the actor trains LoRA adapters (`lora` is not None), without reading an adapter's file."""
        return self.lora_adapter_path is not None or bool(self.lora_rank)

    @property
    def lora(self) -> LoRAConfig | None:
        """The actor's `LoRAConfig`: that of the adapter at lora_adapter_path when one is given (as verl's
        `PeftModel.from_pretrained` takes it), else of lora_rank, lora_alpha and target_modules (None when
        lora_rank is 0)."""
        if self.lora_adapter_path is not None:
            return adapter_lora(self.lora_adapter_path)[0]
        return _lora_config("actor_rollout_ref.model", self)


def adapter_lora(path: str) -> tuple[LoRAConfig, dict]:
    """`models.lora.read_peft_adapter_config` of the actor's lora_adapter_path (a small file, read
    anew each time), a `ConfigError` naming the key when it cannot be used."""
    try:
        return read_peft_adapter_config(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"actor_rollout_ref.model.lora_adapter_path: {e}") from None


def _adapter_notes(model) -> list[str]:
    """What the actor's lora_adapter_path decides instead of the config: the configured LoRA values it
    replaces, and a dropout meshppo's adapters do not have."""
    if model.lora_adapter_path is None:
        return []
    lora, raw = adapter_lora(model.lora_adapter_path)
    key, notes = "actor_rollout_ref.model", []
    default = LoRAConfig(1)  # lora_rank's default is 0 (off); the others' are LoRAConfig's
    unused = [f"{name}={shown(ours)}" for name, ours, theirs, unset in (
        ("lora_rank", model.lora_rank, lora.rank, 0), ("lora_alpha", model.lora_alpha, lora.alpha, default.alpha))
        if ours not in (theirs, unset)]
    try:
        same = LoRAConfig(1, target_modules=model.target_modules, exclude_modules=model.exclude_modules).targets \
            == lora.targets
    except ValueError:  # a selection meshppo cannot take, not read: the adapter's is used
        same = False
    if not same:
        unused += [f"{k}={shown(v)}" for k, v in _non_default(model, ("target_modules", "exclude_modules")).items()]
    if unused:
        notes.append(f"{key}.{', '.join(unused)} not used: the adapter at {key}.lora_adapter_path has r={lora.rank}, "
                     f"lora_alpha={lora.alpha:g} and target_modules={shown(lora.targets)}, which LoRA takes (as in verl)")
    dropout = raw.get("lora_dropout") or 0.0
    if dropout:
        notes.append(f"the adapter at {key}.lora_adapter_path was trained with lora_dropout={dropout:g}: meshppo's "
                     "adapters have no dropout, so its training continues without it")
    return notes


def _lora_config(key: str, model) -> LoRAConfig | None:
    """The `LoRAConfig` of a model section's `lora_rank`, `lora_alpha`, `target_modules` and `exclude_modules` (None
    when lora_rank is 0); a bad value is a `ConfigError` naming the section `key`."""
    if not model.lora_rank:
        return None
    try:
        return LoRAConfig(model.lora_rank, model.lora_alpha, model.target_modules, model.exclude_modules)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


_LOSS_DEFAULTS = PolicyLossParams()  # verl's defaults, kept once in ppo.core_algos


@dataclass
class PolicyLossConfig:
    """verl's `actor.policy_loss`: the policy-gradient loss and the parameters of its clip_cov,
    kl_cov and dro modes (sapo's are the actor's tau_pos / tau_neg, as in verl). Every mode is normalised by
    the mini-batch's global counts (loss_agg_mode); clip_cov and kl_cov choose their tokens by a
    covariance over each micro-batch, as verl does."""

    loss_mode: str = opt("vanilla", "policy-gradient loss (verl's modes): vanilla (PPO's clipped ratio, dual clip), "
                                    "dppo_tv and dppo_kl (DPPO: -A log pi weighed by the ratio truncated at "
                                    "clip_ratio_c, detached, no gradient for a token whose probability moved past "
                                    "clip_ratio_low/high in its advantage's direction, measured as a probability "
                                    "difference or as the binary KL), "
                                    "gspo (PPO's clip on the sequence's ratio, the geometric mean of its token ratios; "
                                    "verl's recipes clip at clip_ratio_low/high 3e-4/4e-4), sapo (a smooth gate "
                                    "sigmoid(tau (r - 1)) 4 / tau instead of a clip: tau_pos, tau_neg), gpg (the plain "
                                    "policy gradient -A log pi), clip_cov (PPO's clip, and the gradient of a few "
                                    "high-covariance tokens detached), kl_cov (no clip; an abs(log-ratio) penalty on the "
                                    "tokens of highest covariance), geo_mean (GMPO: the geometric mean of the "
                                    "log-space-clipped token ratios times the sequence's mean advantage), dro (-A log pi "
                                    "plus dro_beta / 2 times the squared log-ratio), cispo (the "
                                    "clipped ratio, detached, weighs -A log pi). As in verl, sapo aggregates its term "
                                    "seq-mean-token-mean, whatever loss_agg_mode; geo_mean takes the mean over the "
                                    "mini-batch's non-empty responses (verl: a mean per micro-batch, see docs/VERL.md), "
                                    "whatever loss_agg_mode (which still aggregates the entropy and KL terms); gspo follows "
                                    "loss_agg_mode (the GSPO paper's is seq-mean-token-mean). Not with "
                                    "algorithm.rollout_correction.bypass_mode, whose loss_type picks the loss",
                         choices=POLICY_LOSSES)
    clip_cov_ratio: float = opt(_LOSS_DEFAULTS.clip_cov_ratio, "clip_cov: share of a micro-batch's valid tokens (at least one) whose gradient "
                                        "is detached, drawn at random among the unclipped ones whose covariance lies "
                                        "in (clip_cov_lb, clip_cov_ub); the draw comes from a generator seeded by "
                                        "trainer.seed, the step and the rank (verl draws from torch's global "
                                        "generator)", gt=0, le=1)
    clip_cov_lb: float = opt(_LOSS_DEFAULTS.clip_cov_lb, "clip_cov: lower bound of a detachable token's covariance term (A - mean A) (log pi "
                                  "- mean log pi), the means over the micro-batch's valid tokens")
    clip_cov_ub: float = opt(_LOSS_DEFAULTS.clip_cov_ub, "clip_cov: upper bound of that covariance term; above clip_cov_lb")
    kl_cov_ratio: float = opt(_LOSS_DEFAULTS.kl_cov_ratio, "kl_cov: share of a micro-batch's valid tokens (at least one), those of the "
                                      "largest covariance term (A - mean A) (log pi - mean log pi), that get the "
                                      "ppo_kl_coef abs(log pi - log pi_old) penalty", gt=0, le=1)
    ppo_kl_coef: float = opt(_LOSS_DEFAULTS.ppo_kl_coef, "kl_cov: coefficient of the abs(log pi - log pi_old) penalty", ge=0)
    dro_beta: float | None = opt(_LOSS_DEFAULTS.dro_beta, "dro: coefficient beta of the (beta / 2) (log pi - log "
                                                          "pi_old)^2 penalty; required with loss_mode=dro", gt=0)

    def __post_init__(self):
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise ValueError("loss_mode=dro needs dro_beta (> 0), the coefficient of its squared log-ratio penalty")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}: clip_cov "
                             "detaches tokens whose covariance lies between them")


def _data_loader_seed():
    return opt(42, "verl: the seed of the shuffle of sequences into mini-batches (with shuffle)",
               no_effect="meshppo seeds that shuffle with trainer.seed plus the step (a new order every step)")


@dataclass
class ActorConfig:
    strategy: str = opt("fsdp2", "training backend: fsdp or fsdp2 (both mean FSDP2 here)", choices=("fsdp", "fsdp2"))
    ppo_mini_batch_size: int = opt(256, "prompts per optimizer step (global; multiplied by rollout.n)", ge=1)
    ppo_micro_batch_size_per_gpu: int | None = opt(None, "sequences per forward/backward on one GPU; null is "
                                                         "refused unless use_dynamic_bsz=true (micro-batches by "
                                                         "token budget) or ppo_micro_batch_size gives it", ge=1)
    ppo_micro_batch_size: int | None = _global_micro_batch("ppo_micro_batch_size_per_gpu")
    use_dynamic_bsz: bool = opt(False, "pack micro-batches by token count instead of sequence count")
    ppo_max_token_len_per_gpu: int = opt(16384, "token budget of one micro-batch with use_dynamic_bsz (a sequence "
                                                "longer than it is a micro-batch of its own; verl stops there)", ge=1)
    grad_clip: float | None = opt(None, _GRAD_CLIP_HELP, gt=0)
    clip_ratio: float = opt(0.2, "PPO clip range epsilon: the default of clip_ratio_low and clip_ratio_high (verl's "
                                 "yaml sets both to 0.2, so there clip_ratio alone does not change the clip range)",
                            gt=0, le=1)
    clip_ratio_low: float | None = opt(None, "lower clip range; null: clip_ratio. 1 or more: no ratio is clipped "
                                             "from below (verl's CISPO script sets 10)", gt=0)
    clip_ratio_high: float | None = opt(None, "upper clip range (DAPO's clip-higher); null: clip_ratio", gt=0)
    clip_ratio_c: float = opt(3.0, "dual-clip constant for negative advantages (policy_loss.loss_mode=vanilla, "
                                   "and bypass mode's ppo_clip: > 1); dppo_tv and dppo_kl: the bound of their "
                                   "truncated ratio (> 0, as in verl 1 or less too)", gt=0)
    tau_pos: float = opt(_LOSS_DEFAULTS.tau_pos, "sapo: gate temperature of tokens with a positive advantage", gt=0)
    tau_neg: float = opt(_LOSS_DEFAULTS.tau_neg, "sapo: gate temperature of the other tokens", gt=0)
    loss_agg_mode: str = opt("token-mean", "how token losses are aggregated: token-mean (every token weighs the "
                                           "same), token-sum (the sum over the mini-batch's tokens, no average), "
                                           "seq-mean-token-sum, seq-mean-token-mean (every sequence weighs the "
                                           "same), seq-mean-token-sum-norm (Dr. GRPO). Normalised by the token "
                                           "(token-mean) or non-empty sequence count of the whole mini-batch across "
                                           "micro-batches and ranks, so the gradient does not depend on "
                                           "micro-batching, as verl's engine workers (whose sequence count includes "
                                           "empty responses). policy_loss.loss_mode sapo and geo_mean aggregate "
                                           "their policy-gradient term their own way (as verl)",
                             choices=LOSS_AGG_MODES)
    loss_scale_factor: int | None = opt(
        None, "seq-mean-token-sum-norm's constant divisor T (Dr. GRPO): the loss is sum_i (sum_t L_i,t / T) / N_seqs "
              "over the mini-batch, as verl's; null: the response length (rollout.response_length), where verl's "
              "null divides by the longest response of each micro-batch, which varies with the batch layout", ge=1)
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient", ge=0)
    calculate_entropy: bool = opt(False, "log the update's own entropy as actor/entropy_loss (each mini-batch's, "
                                         "averaged), as verl does then; always so with entropy_coeff != 0 (verl's "
                                         "rule); actor/entropy stays the recompute pass's (the update's first "
                                         "mini-batch's where that pass is skipped)")
    use_kl_loss: bool = opt(False, "add a KL(actor, ref) loss term (GRPO style)")
    kl_loss_coef: float = opt(0.001, "coefficient of the KL loss", ge=0)
    kl_loss_type: str = opt("low_var_kl", "KL estimator of the KL loss: " + _KL_ESTIMATORS_HELP, choices=KL_TYPES)
    ppo_epochs: int = opt(1, "passes over each batch of rollouts", ge=1)
    shuffle: bool = opt(False, "shuffle sequences before splitting mini-batches")
    use_torch_compile: bool = opt(False, "torch.compile each transformer block of the actor and of the critic (the "
                                         "reference model's too unless ref.use_torch_compile says otherwise)")
    ulysses_sequence_parallel_size: int = opt(1, _SP_HELP + " (the reference's too)", ge=1)
    entropy_from_logits_with_chunking: bool = _entropy_chunking()
    entropy_checkpointing: bool = _entropy_checkpointing()
    entropy_from_logits_chunk_size: int = _entropy_chunk_size()
    pad_to_length: bool = _pad_to_length()
    rollout_n: int | None = opt(None, "verl's copy of rollout.n: must equal it; null: rollout.n", ge=1)
    use_remove_padding: bool | None = opt(None, "verl's copy of model.use_remove_padding: must equal it; null: "
                                                "model.use_remove_padding")
    use_fused_kernels: bool = opt(False, "verl's copy of model.use_fused_kernels", no_effect=_FUSED_KERNELS_WHY)
    data_loader_seed: int = _data_loader_seed()
    freeze_vision_tower: bool = opt(False, "verl: keep a vision-language model's vision tower frozen",
                                    no_effect="meshppo's models are text-only: there is no vision tower")
    use_prefix_grouper: bool = opt(False, "the actor's and the reference's forwards (old and reference log-probs, "
                                          "the update) lay out the responses of one prompt after a single copy of "
                                          "it in each micro-batch, their attention reading its keys: the prompt's "
                                          "tokens run once instead of once per response, with the same log-probs "
                                          "and gradients; dynamic micro-batches keep a prompt's rows together. "
                                          "Needs model.use_remove_padding=true (earlier verl's actor shared the "
                                          "prompt with it false; verl 0.9.1's engine workers share none: there the "
                                          "option only balances whole prompt groups in its legacy trainer)")
    calculate_sum_pi_squared: bool = opt(False, "the old-log-prob pass also computes each response token's sum of "
                                                "squared probabilities (at the rollout temperature), chunk by chunk "
                                                "in the LM head: the optimal-token-baseline estimators' input, and "
                                                "verl's variance_proxy/* metrics; the pass then always runs (never "
                                                "skipped for an on-policy update)")
    sum_pi_squared_checkpointing: bool = opt(False, "verl: recompute the sum of squared probabilities in backward",
                                             no_effect="meshppo computes it in the forward-only old-log-prob pass, "
                                                       "chunk by chunk without a graph: nothing to recompute")
    router_replay: RouterReplayConfig = section(RouterReplayConfig, "verl's mixture-of-experts routing replay")
    qat: QATConfig = section(QATConfig, "verl 0.9.1's quantization-aware training (its legacy actor's)")
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "the policy-gradient loss")
    optim: OptimConfig = section(OptimConfig, "actor optimizer")
    fsdp_config: FSDPOptions = section(FSDPOptions, "actor FSDP2 settings")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "what the actor's checkpoints hold and a resume loads")
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling of the actor (global_profiler)")

    def __post_init__(self):
        _resolve_grad_clip("actor_rollout_ref.actor", self)
        _check_checkpoint("actor_rollout_ref.actor", self.checkpoint)


@dataclass
class RefConfig:
    strategy: str = opt("fsdp2", "backend of the reference model: fsdp or fsdp2 (both mean FSDP2 here)",
                        choices=("fsdp", "fsdp2"))
    fsdp_config: FrozenFSDPOptions = section(FrozenFSDPOptions, "reference model FSDP2 settings")
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling of the reference (global_profiler)")
    log_prob_micro_batch_size_per_gpu: int | None = opt(None, "sequences per reference forward on one GPU; null: "
                                                              "the rollout's log_prob_micro_batch_size_per_gpu", ge=1)
    log_prob_micro_batch_size: int | None = _global_micro_batch("log_prob_micro_batch_size_per_gpu")
    log_prob_use_dynamic_bsz: bool | None = opt(None, "pack reference forwards by token count; null: the actor's "
                                                      "use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = opt(None, "token budget of one reference forward with dynamic bsz; "
                                                           "null: the actor's ppo_max_token_len_per_gpu", ge=1)
    use_torch_compile: bool | None = opt(None, "torch.compile each block of the reference model; null: the actor's "
                                              "setting")
    ulysses_sequence_parallel_size: int | None = opt(None, "the reference's Ulysses group size: the actor's (verl "
                                                           "runs both in one group); null: the actor's", ge=1)
    entropy_from_logits_with_chunking: bool = _entropy_chunking()
    entropy_checkpointing: bool = _entropy_checkpointing()
    entropy_from_logits_chunk_size: int = _entropy_chunk_size()
    pad_to_length: bool = _pad_to_length()
    rollout_n: int | None = opt(None, "verl's copy of rollout.n: must equal it; null: rollout.n", ge=1)
    router_replay: RefRouterReplayConfig = section(RefRouterReplayConfig, "verl's mixture-of-experts routing replay")


@dataclass
class SamplingOverrides:
    top_k: int = opt(-1, "top-k for validation (-1 or 0: off)", ge=-1)
    top_p: float = opt(1.0, "top-p for validation", gt=0, le=1)
    temperature: float = opt(0.0, "validation temperature (0: greedy)", ge=0)
    n: int = opt(1, "samples per validation prompt", ge=1)
    do_sample: bool = opt(False, "verl's hf-rollout switch: with rollout.name=hf, false decodes the validation "
                                 "greedily whatever temperature says; the other engines sample at temperature (0: "
                                 "greedy), as verl's vLLM and SGLang rollouts do (its agent loop, since its sync "
                                 "rollouts, which read it, were retired)")


_UNREAD_IN_VERL = ("verl 0.9.1 reads it nowhere (only the request schema of its removed SGLang multi-turn rollout, "
                   "unused, names it)")


@dataclass
class MultiTurnConfig:
    """verl's `rollout.multi_turn`: multi-turn rollouts with tool calls (`agent.loop`). Rows run
    the tool agent when their `agent_name` (or `rollout.agent.default_agent_loop`) says
    `tool_agent`."""

    enable: bool = opt(False, "multi-turn rollouts: the rows whose agent is tool_agent call the tools of "
                              "tool_config_path between turns (needs rollout.name=native)")
    max_assistant_turns: int | None = opt(None, "most model turns per rollout (null or 0: no limit, as in verl)", ge=0)
    max_user_turns: int | None = opt(None, "most user turns per rollout: each tool-response turn (a turn's calls "
                                           "answered together) and each interaction reply counts one; the model "
                                           "turn after the last ends the rollout (null or 0: no limit, as in verl)", ge=0)
    tool_config_path: str | None = opt(None, "verl's tool config (YAML: tools with class_name, config, tool_schema; "
                                             "null: no tools)", path=True)
    interaction_config_path: str | None = opt(None, "verl's interaction config (YAML: interactions with name, "
                                                    "class_name, config): a simulated user that answers a turn "
                                                    "without tool calls; rows pick one with "
                                                    "extra_info.interaction_kwargs.name", path=True)
    max_parallel_calls: int = opt(1, "tool calls run per turn (the first ones of a turn)", ge=1)
    max_tool_response_length: int = opt(256, "a tool response's length limit in characters", ge=1)
    tool_response_truncate_side: str = opt("middle", "where a longer tool response is cut (as verl 0.9.1): left "
                                                     "cuts its start (keeps the end), right cuts its end (keeps "
                                                     "the start), middle keeps both ends", choices=TRUNCATE_SIDES)
    use_inference_chat_template: bool = opt(False, "verl: the chat template of inference between turns",
                                            no_effect=f"{_UNREAD_IN_VERL}; meshppo keeps each turn's tokens as the "
                                                      "model generated them (what false meant there)")
    tokenization_sanity_check_mode: str = opt("strict", "verl: the check of the turns' tokenization",
                                              no_effect=f"{_UNREAD_IN_VERL}; meshppo checks nothing at the end of a "
                                                        "rollout: the messages it inserts are rendered alone and "
                                                        "appended after the model's turn, and after what the chat "
                                                        "template writes after that turn's end-of-turn token "
                                                        "(docs/VERL.md)")
    format: str = opt("hermes", "the tool-call format of the model's turns (verl 0.9.1's others, not supported: "
                                f"{', '.join(VERL_OTHER_FORMATS)})", choices=FORMATS)
    num_repeat_rollouts: int | None = opt(None, "verl: rollouts repeated per interaction",
                                          no_effect="verl reads it nowhere")
    function_tool_path: str | None = opt(None, "not supported: must be null (verl 0.9.1: tools made of the functions "
                                               "of a Python file; meshppo's tool agent takes the tool classes of "
                                               "tool_config_path)", unsupported=lambda v: v is not None)


# Options of meshppo's engine that the plain loop (rollout.name=hf) has no use for. Those that would
# change the work or the numbers are refused there at any value but their default; the engine's
# tuning knobs are only noted (a config tuned for the engine can switch to hf for a comparison).
ENGINE_ONLY_OPTIONS = ("tensor_model_parallel_size", "quantization", "kv_cache_dtype", "enable_rollout_routing_replay")
SERVER_ENGINES = ("vllm", "sglang", "trtllm")
"""verl's `rollout.name` values that meshppo answers with its own engine."""
NOT_VLLM_ENGINES = ("sglang", "trtllm")  # verl's engines that read none of vLLM's own options
# trainer.logger's sinks (trainer.tracking.Tracking), and verl 0.9.1's other backends (its Tracking.supported_backend)
LOGGERS = ("console", "jsonl", "file", "tensorboard", "wandb")
_LOGGERS_LISTED = ", ".join(LOGGERS[:-1]) + " or " + LOGGERS[-1]
VERL_ONLY_LOGGERS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio", "rl_insight")

ENGINE_TUNING_OPTIONS = ("dtype", "gpu_memory_utilization", "enforce_eager", "max_num_batched_tokens", "max_num_seqs",
                         "enable_chunked_prefill", "block_size", "cudagraph_capture_sizes", "free_cache_engine",
                         "free_engine_weights")


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _non_default(obj, keys) -> dict:
    out = {}
    for key in keys:
        if getattr(obj, key) != _default(type(obj).__dataclass_fields__[key]):
            out[key] = getattr(obj, key)
    return out


def _set_options(obj, base, prefix: str = "", skip=()) -> dict:
    """The leaf options of section `obj` whose values differ from those of `base` (the same section
    as the config would have it without the user's values: defaults, and what `resolve` inherits),
    by dotted key under `prefix`. Options with a `no_effect` (said on their own) or an `unsupported`
    (refused unless neutral) mark, and the relative keys (options or sections) in `skip`, are left out.
    An fsdp_config's offloads that its offload_policy turned off (`FSDPOptions.superseded`) are as set: true."""
    out, superseded = {}, getattr(obj, "superseded", ())
    for f in dataclasses.fields(obj):
        rel = f"{prefix}.{f.name}" if prefix else f.name
        if rel in skip or f.metadata.get("no_effect") or f.metadata.get("unsupported"):
            continue
        value, theirs = getattr(obj, f.name), getattr(base, f.name)
        if dataclasses.is_dataclass(value) and type(value) is type(theirs):
            out.update(_set_options(value, theirs, rel, skip))
        elif f.name in superseded:
            out[rel] = True
        elif value != theirs:
            out[rel] = value
    return out


def _inherited_base(cfg, name: str):
    """Section `name` of `cfg` (a dotted key: critic, actor_rollout_ref.ref) as the config would resolve
    it had the user set none of its options (its defaults and what it inherits from the other sections)."""
    base = copy.deepcopy(cfg)
    *parents, leaf = name.split(".")
    owner = functools.reduce(getattr, parents, base)
    setattr(owner, leaf, type(getattr(owner, leaf))())
    base.resolve()
    return getattr(owner, leaf)


# Options of a role's section that the section itself fills from another of its options (null
# inherits it, or verl's copy sets it): one the user did not set, when equal to one of its sources.
_DERIVED_OPTIONS = {"forward_micro_batch_size_per_gpu": ("ppo_micro_batch_size_per_gpu",),
                    "forward_max_token_len_per_gpu": ("ppo_max_token_len_per_gpu",),
                    "checkpoint.load_contents": ("checkpoint.save_contents",),
                    "ulysses_sequence_parallel_size": ("model.fsdp_config.ulysses_sequence_parallel_size",
                                                       "fsdp_config.ulysses_sequence_parallel_size"),
                    "model.fsdp_config.mixed_precision.param_dtype": ("model.fsdp_config.dtype",),
                    "fsdp_config.mixed_precision.param_dtype": ("fsdp_config.dtype",)}


def _user_options(cfg, name: str, skip=()) -> dict:
    """The options of section `name` (a role's, a dotted key) that the user set, by their full keys:
    not those at their defaults, nor those inherited from other options."""
    opts = _set_options(functools.reduce(getattr, name.split("."), cfg), _inherited_base(cfg, name), skip=skip)
    opts = {k: v for k, v in opts.items()
            if not any(source in opts and opts[source] == v for source in _DERIVED_OPTIONS.get(k, ()))}
    return {f"{name}.{k}": v for k, v in opts.items()}


def _listed(options: dict, cfg=None) -> str:
    """`key=value, ...` as the notes list options; given the config `cfg`, each by the names the user
    set it under (`as_set`)."""
    return ", ".join(f"{k}={shown(v)}" if cfg is None else as_set(cfg, k, v) for k, v in options.items())


# verl's other names of an option, which the config resolves to the first (`_alias`, `_resolve_grad_clip`,
# trainer.nccl_timeout's, `OptimConfig`'s warmup_style; critic.fsdp's options: `_spellings`), in the
# order verl reads them.
_SPELLINGS = {
    "trainer.nccl_timeout": ("trainer.nccl_timeout", "actor_rollout_ref.nccl_timeout"),
    "data.tokenizer": ("data.tokenizer", "actor_rollout_ref.model.tokenizer_path"),
    **{f"custom_reward_function.{k}": (f"custom_reward_function.{k}", f"reward.custom_reward_function.{k}")
       for k in ("path", "name", "reward_kwargs")},
    "reward_model.reward_manager": ("reward_model.reward_manager", "reward_manager.name", "reward.reward_manager.name"),
    "reward_model.enable": ("reward_model.enable", "reward.reward_model.enable"),
    "reward_model.model.path": ("reward_model.model.path", "reward.reward_model.model_path"),
    "reward_model.reward_kwargs": ("reward_model.reward_kwargs", "reward.reward_kwargs"),
    **{f"{role}.grad_clip": (f"{role}.optim.grad_clip", f"{role}.optim.clip_grad", f"{role}.grad_clip")
       for role in ("actor_rollout_ref.actor", "critic")},
    **{f"{role}.optim.lr_scheduler_type": (f"{role}.optim.warmup_style", f"{role}.optim.lr_scheduler_type")
       for role in ("actor_rollout_ref.actor", "critic")},
    # verl's deprecated global micro-batch sizes (`_per_gpu_micro_batch`: the per-GPU one is it over the ranks)
    # verl's copy of a role's Ulysses size in its fsdp_config (`_sp_copy`; 1 there leaves the role's: not set)
    **{f"{role}.ulysses_sequence_parallel_size": (f"{role}.ulysses_sequence_parallel_size",
                                                  *(f"{fsdp}.ulysses_sequence_parallel_size" for fsdp in sections))
       for role, sections in (("actor_rollout_ref.actor", ["actor_rollout_ref.actor.fsdp_config"]),
                              ("actor_rollout_ref.ref", ["actor_rollout_ref.ref.fsdp_config"]),
                              ("critic", ["critic.model.fsdp_config", "critic.fsdp"]),
                              ("reward_model", ["reward_model.model.fsdp_config"]))},
    **{f"{role}.{name}_per_gpu": (f"{role}.{name}_per_gpu", f"{role}.{name}") for role, name in (
        ("actor_rollout_ref.actor", "ppo_micro_batch_size"), ("actor_rollout_ref.rollout", "log_prob_micro_batch_size"),
        ("actor_rollout_ref.ref", "log_prob_micro_batch_size"), ("critic", "ppo_micro_batch_size"),
        ("critic", "forward_micro_batch_size"), ("reward_model", "micro_batch_size"))}}


def _spellings(key: str) -> tuple:
    """The names a config may set option `key` (dotted) by, `key` among them."""
    if key.startswith("critic.model.fsdp_config."):  # verl 0.9.1's critic.fsdp, merged into it
        return key, "critic.fsdp." + key.removeprefix("critic.model.fsdp_config.")
    for name, names in _SPELLINGS.items():
        if key == name or key.startswith(name + "."):  # (a key inside a mapping option: reward_kwargs.max_resp_len)
            return tuple(n + key[len(name):] for n in names)
    return (key,)


def _given_spellings(cfg, key: str) -> list[tuple[str, object]]:
    """(name, value written) of each name of option `key` (`_spellings`) that the user's config file or
    command line set (`configlib.given_option`), in verl's order; an fsdp_config's Ulysses size of 1,
    which leaves the role's own (`_sp_copy`), is not counted as setting it."""
    def leaves_it(name, value):
        return name != key and name.endswith(".ulysses_sequence_parallel_size") and value == 1

    return [(name, v) for name in _spellings(key) for found, v in [given_option(cfg, name)]
            if found and not leaves_it(name, v)]


def as_set(cfg, key: str, value) -> str:
    """`key=value` as a note or an error names option `key` of the config `cfg`, whose value is `value`:
    by the names the user's config file or command line set it under (verl's other names of it:
    `_spellings`), another name with the value written there (a global micro-batch size is not the
    per-GPU one); `key=value` where none was (a config not loaded by `load_config` records none:
    `configlib.given_option`)."""
    given = _given_spellings(cfg, key)
    if not given:
        return f"{key}={shown(value)}"
    return ", ".join(f"{name}={shown(value if name == key else v)}" for name, v in given)


def given_name(cfg, key: str) -> str:
    """The name the user's config file or command line set option `key` of the config `cfg` under
    (`as_set`; the first verl reads where several were set), `key` where none was."""
    return next((name for name, _ in _given_spellings(cfg, key)), key)


def _short_name(cfg, section_key: str, name: str, beside: str) -> str:
    """Option `name` of section `section_key` as a note names it after option `beside` of that section:
    by its name where the user set both under the same section's name (or neither), else by its full
    key as set (`given_name`: verl's other name of the section)."""
    given = given_name(cfg, f"{section_key}.{name}")
    return name if given.rsplit(".", 1)[0] == given_name(cfg, f"{section_key}.{beside}").rsplit(".", 1)[0] else given


def _per_gpu_size(cfg, key: str, size: int) -> str:
    """Per-GPU micro-batch size option `key`, of value `size`, as an error names it: `key (size)`, or the
    global size the user set (`as_set`) with the per-GPU size it gives."""
    name = given_name(cfg, key)
    return f"{key} ({size})" if name == key else f"{as_set(cfg, key, size)} ({size} per GPU)"


def said_key(cfg, key: str) -> str:
    """Option `key` of the config `cfg` as a note names it without its value: the names the user set it
    under (`as_set`), joined by "and"; `key` where none was."""
    return " and ".join(name for name, _ in _given_spellings(cfg, key)) or key


# verl's rollout.logprobs_mode values (vLLM's): log-probs or logits, before (raw) or after (processed)
# the sampling parameters' processing.
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")


@dataclass
class RolloutConfig:
    name: str = opt("native", "generation engine: native (meshppo's paged-KV engine) or hf (plain loop, reference); "
                              "verl's vllm, sglang and trtllm are accepted and run the native engine (a start-up "
                              "note says so): meshppo has no other engine", choices=("native", "hf", *SERVER_ENGINES))
    mode: str = opt("sync", "sync: colocated SPMD rollouts; verl's async (its agent-loop servers) is accepted and "
                            "runs the same single-turn rollouts in-process (a start-up note says so)",
                    choices=("sync", "async"))
    temperature: float = opt(1.0, "sampling temperature; 0: greedy decoding, scored at temperature 1", ge=0)
    top_k: int = opt(-1, "top-k sampling (-1 or 0: off)", ge=-1)
    top_p: float = opt(1.0, "nucleus sampling threshold", gt=0, le=1)
    do_sample: bool = opt(True, "verl's hf-rollout switch: with rollout.name=hf, false decodes greedily (scored at "
                                "temperature 1); the other engines sample at temperature (0: greedy), as verl's vLLM "
                                "and SGLang rollouts do (its agent loop, since its sync rollouts, which read it, were "
                                "retired)")
    n: int = opt(1, "responses per prompt", ge=1)
    seed: int = opt(42, "verl: the seed of its inference engine's sampling",
                    no_effect="meshppo's engine draws its samples from trainer.seed and the step")
    prompt_length: int | None = opt(None, "the engine's prompt budget: only sets the default of max_model_len "
                                          "(prompt_length + response_length); at least data.max_prompt_length, which "
                                          "filters or truncates the prompts; null: data.max_prompt_length", ge=1)
    response_length: int | None = opt(None, "defaults to data.max_response_length", ge=1)
    dtype: str = opt("bfloat16", "the engine's dtype: its weights, activations and KV cache (kv_cache_dtype=auto); "
                                 "CPU runs use float32", choices=DTYPES)
    gpu_memory_utilization: float = opt(0.5, "fraction of the GPU memory free when the KV cache is first allocated "
                                             "(the engine's weights in place) that the cache and the engine's "
                                             "activations take, the cache keeping that size for the run; vLLM's is "
                                             "a fraction of the whole GPU, its weights included (docs/VERL.md)",
                                        gt=0, le=1)
    ignore_eos: bool = opt(False, "keep generating after EOS (benchmarks), whatever the rollout.name (verl's "
                                  "SGLang and TensorRT-LLM servers do not read it: a start-up note says so)")
    enforce_eager: bool = opt(False, "disable CUDA graphs (decode and prefill steps)")
    free_cache_engine: bool = opt(True, "release the engine's KV cache after generation, so the training phases get "
                                        "its memory (the next generation re-allocates it)")
    free_engine_weights: bool = opt(True, "release the engine's weights after generation, so the training phases get "
                                          "their memory (the model's bytes in rollout.dtype over the TP size); the "
                                          "next reshard re-allocates and fills them. The CUDA graphs stay, replayed "
                                          "when the weights come back at the same address and recaptured otherwise "
                                          "(timing_s/graph_capture)")
    quantization: str | None = opt(None, "fp8: the engine's qkv, gate/up and down projections as e4m3 GEMMs (weights "
                                         "quantized after every reshard); faster, and its log-probs move away from "
                                         "the actor's (pair with algorithm.rollout_correction). null: all in dtype",
                                   choices=(None, *QUANTIZATIONS))
    kv_cache_dtype: str = opt("auto", "fp8: the engine's KV cache as e4m3 values with one float32 scale per token and "
                                      "KV head: 1.94x the tokens in the same pool (head dim 128), not a faster decode "
                                      "step on an H200; its log-probs move away from the actor's (pair with "
                                      "algorithm.rollout_correction). auto: the cache in dtype",
                              choices=KV_CACHE_DTYPES)
    tensor_model_parallel_size: int = opt(1, "TP degree of the generation engine", ge=1)
    moe_tensor_parallel_size: int = opt(1, "not supported: must be 1 (verl: the experts' own TP degree; meshppo's engine "
                                           "splits every expert along its intermediate size over "
                                           "tensor_model_parallel_size)", ge=1, unsupported=other_than(1))
    standalone_gpu_memory_utilization: float | None = opt(None, "verl: the gpu_memory_utilization of its fully-async "
                                                                "trainer's rollout replicas on GPUs of their own",
                                                          gt=0, le=1, no_effect="meshppo's engine runs on the training "
                                                                                "GPUs: gpu_memory_utilization sizes it")
    checkpoint_manager_class: str | None = opt(None, "not supported: must be null (verl: the import path of a user's "
                                                     "own CheckpointEngineManager class, which moves the weights to "
                                                     "the engine; meshppo's resharder does)",
                                               unsupported=lambda v: v is not None)
    max_num_batched_tokens: int = opt(8192, "prompt-token budget of one engine prefill step (chunked prefill); "
                                            "decode steps run up to max_num_seqs sequences whatever it is (vLLM "
                                            "counts their tokens in it too)", ge=1)
    max_num_seqs: int = opt(256, "sequences decoded at once; a prompt's rollout.n samples above it run as further "
                                  "groups of at most max_num_seqs, each prefilling the prompt again", ge=1)
    max_model_len: int | None = opt(None, "context limit of the engine: at least data.max_prompt_length + "
                                          "response_length (a shorter one is refused: it would cut the longest "
                                          "prompts' responses short); null: prompt_length + response_length", ge=2)
    enable_chunked_prefill: bool = opt(True, "split long prefills across engine steps (vLLM's option); false is "
                                             "refused unless max_num_batched_tokens >= max_model_len (as vLLM "
                                             "requires), and is not read "
                                             "under rollout.name sglang or trtllm, whose servers always chunk (a "
                                             "start-up note says so)")
    block_size: int = opt(16, "tokens per KV-cache block", ge=1)
    cudagraph_capture_sizes: list[int] | None = opt(
        None, "decode batch sizes captured as CUDA graphs (also the row buckets of graphed prefill sampling): a step "
              "runs as the graph of the smallest size that holds its sequences, padded, and eagerly above the "
              "largest; sizes past the first one at or above max_num_seqs are never used. null: 1, 2, 4, 8, then "
              "multiples of 8 up to the first at or above max_num_seqs", ge=1)
    log_prob_micro_batch_size_per_gpu: int | None = opt(None, "sequences per old-log-prob forward on one GPU; null: "
                                                              "the actor's ppo_micro_batch_size_per_gpu", ge=1)
    log_prob_micro_batch_size: int | None = _global_micro_batch("log_prob_micro_batch_size_per_gpu")
    log_prob_use_dynamic_bsz: bool | None = opt(None, "pack old-log-prob forwards by token count; null: the actor's "
                                                      "use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = opt(None, "token budget of one old-log-prob forward with dynamic "
                                                           "bsz; null: the actor's ppo_max_token_len_per_gpu", ge=1)
    calculate_log_probs: bool = opt(False, "also log the engine's own log-probs vs the actor's (metrics "
                                           "rollout/logprob_diff and verl's training/rollout_probs_diff_*, "
                                           "training/rollout_actor_probs_pearson_corr)")
    load_format: str = opt("dtensor", "accepted for verl compatibility (any of verl's values): the engine's weights "
                                     "always come from the resharder", choices=("dtensor", "auto", "dummy_dtensor",
                                                                              "dummy", "safetensors", "hf"))
    layered_summon: bool = opt(False, "accepted for verl compatibility",
                               no_effect="the resharder moves the weights bucket by bucket")
    data_parallel_size: int = opt(1, "not supported: must be 1 (the engine's data parallelism is the world size "
                                     "over tensor_model_parallel_size)", ge=1, unsupported=lambda v: v != 1)
    expert_parallel_size: int = opt(1, "not supported: must be 1 (no mixture-of-experts models)", ge=1,
                                    unsupported=lambda v: v != 1)
    pipeline_model_parallel_size: int = opt(1, "not supported: must be 1", ge=1, unsupported=lambda v: v != 1)
    val_kwargs: SamplingOverrides = section(SamplingOverrides, "sampling settings for validation")
    profiler: SharedProfilerConfig = section(SharedProfilerConfig, "profiling of generation (global_profiler); "
                                                                   "the actor's tool_config")
    logprobs_mode: str = opt("processed_logprobs", "the kind of the engine's log-probs (vLLM's modes): "
                                                   "processed_logprobs only, the log-softmax of the logits over the "
                                                   "temperature (as meshppo's engine returns them; vLLM's also "
                                                   "renormalised to top_k / top_p, meshppo's not: a start-up note "
                                                   "says so where they are read)", choices=LOGPROBS_MODES,
                             unsupported=other_than("processed_logprobs"))
    engine_kwargs: dict = opt(default_factory=lambda: {"vllm": {}, "sglang": {}, "trtllm": {}},
                              help="verl: more arguments of the vLLM, SGLang and TensorRT-LLM engines",
                              no_effect="meshppo generates with its own engine, which takes none of them")
    enable_prefix_caching: bool = opt(True, "verl: the engine's cache of prompt prefixes across requests",
                                      no_effect="meshppo's engine prefills each prompt once for its n samples, which "
                                                "share its KV blocks copy-on-write (rollout/block_manager.py); it "
                                                "keeps no cache across prompts (a multi-turn sample keeps its "
                                                "own K/V between its turns)")
    multi_stage_wake_up: bool = opt(False, "verl: bring the engine's weights back before its KV cache (lower peak "
                                           "memory)",
                                    no_effect="meshppo's engine always does: the weights come back at the reshard, "
                                              "the KV cache when generation starts, after the actor's training "
                                              "states are offloaded")
    disable_log_stats: bool = opt(True, "verl: turn off the engine's periodic statistics log",
                                  no_effect="meshppo's engine logs no such statistics (its timings are in the "
                                            "step's metrics)")
    skip_tokenizer_init: bool = opt(True, "verl: the engine loads no tokenizer (token ids in and out)",
                                    no_effect="meshppo's engine never loads one: it takes and returns token ids")
    scheduling_policy: str = opt("fcfs", "the engine's scheduling: fcfs only (meshppo's engine admits sequences "
                                         "first come, first served)", choices=("fcfs", "priority"),
                                 unsupported=other_than("fcfs"))
    over_sample_rate: float = opt(0.0, "not supported: must be 0 (verl: abort the last over_sample_rate of a "
                                       "step's requests)", ge=0, le=1, unsupported=bool)
    enable_rollout_routing_replay: bool = opt(False, "the engine records each token's experts in every sparse layer "
                                                     "(prompt and response) and the batch carries them: what "
                                                     "actor.router_replay.mode=R3 replays (alone, as in verl, they "
                                                     "are recorded and not used); a mixture-of-experts model and "
                                                     "rollout.name=native only")
    quantization_config_file: str | None = opt(None, "not supported: must be null (meshppo's quantization is fp8 "
                                                     "with scales computed at every reshard)",
                                               unsupported=lambda v: v is not None)
    skip_rollout: bool = opt(False, "not supported: must be false (verl: replay rollouts dumped in skip_dump_dir)",
                             unsupported=bool)
    skip_dump_dir: str = opt("/tmp/rollout_dump", "verl: the rollouts' dump of skip_rollout",
                             no_effect=read_only_with("skip_rollout"))
    repetition_penalty: float = opt(1.0, "verl: a repetition penalty of the rollouts' sampling", gt=0,
                                    no_effect="verl 0.9.1's agent loop asks its engines for 1.0 whatever it says (only "
                                              "its standalone generation script reads it); meshppo's engine applies "
                                              "no penalty either")
    enable_sleep_mode: bool = opt(True, "verl: the engine releases its memory between generations",
                                  no_effect="meshppo's engine does with free_cache_engine and free_engine_weights")
    sglang_engine_mode: str = opt("local", "verl: where the SGLang engine runs", no_effect="meshppo runs its own engine "
                                                                                          "in-process")
    layer_name_map: dict = opt(default_factory=dict, help="verl: the weight names' map of its Megatron-to-engine "
                                                          "weight transfer",
                               no_effect="meshppo's resharder maps its own model's names")
    limit_images: int | None = opt(None, "verl: the most images a prompt may hold",
                                   no_effect="meshppo's models take text only")
    server: dict = opt(default_factory=dict, help="verl: the rollout server's HTTP settings (timeouts, retries)",
                       no_effect="meshppo's engine runs in-process, behind no server")
    custom: dict | None = opt(None, "verl: settings for a user's own rollout class", no_effect="meshppo generates with "
                                                                                             "its own engine")
    mtp: MtpConfig = section(MtpConfig, "verl's copy of actor_rollout_ref.model.mtp (speculative decoding)")
    nnodes: int = opt(0, "0 only: the engine runs on the training ranks (verl: rollout replicas on nodes of their own, "
                         "its separate asynchronous trainer's)", ge=0, unsupported=bool)
    n_gpus_per_node: int | None = opt(None, "verl: GPUs a node of the rollout's own nodes; null (or "
                                            "trainer.n_gpus_per_node, verl's default): trainer.n_gpus_per_node",
                                      no_effect=read_only_with("rollout.nnodes > 0"))
    full_determinism: bool = opt(False, "deterministic generation (verl: a batch-invariant vLLM): meshppo's engine "
                                        "runs in the training processes, so true turns on their full determinism, "
                                        "one switch for the process, as each role's fsdp_config.full_determinism "
                                        "does")
    router_config_path: str | None = opt(None, "verl: the rollout servers' router config",
                                         no_effect="meshppo's engine runs in-process, behind no router")
    moe_load_balance_metrics_interval: int = opt(0, "not supported: must be 0 (verl: log the engine's expert load "
                                                    "balance every so many steps; meshppo's engine logs none)",
                                                 ge=0, unsupported=bool)
    qat: QATConfig | None = opt(None, "verl's copy of actor_rollout_ref.actor.fsdp_config.qat (its engine's "
                                      "quantization): null or not enabled")
    disaggregation: DisaggregationConfig = section(DisaggregationConfig, "verl 0.9.1's prefill / decode split")
    agent: AgentLoopConfig = section(AgentLoopConfig, "verl's agent loop")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "verl's multi-turn rollouts")
    checkpoint_engine: CheckpointEngineConfig = section(CheckpointEngineConfig, "verl's weight transfer to the engine")
    trace: TraceConfig = section(TraceConfig, "verl's rollout tracing")
    prometheus: PrometheusConfig = section(PrometheusConfig, "verl's rollout-server metrics")

    def __post_init__(self):
        if self.cudagraph_capture_sizes == []:  # (each size's range is checked as the config loads)
            raise ConfigError("actor_rollout_ref.rollout.cudagraph_capture_sizes=[] lists no decode batch size to "
                              "capture: list at least one, or leave it null for the engine's default sizes "
                              "(enforce_eager=true turns the CUDA graphs off)")

    @property
    def engine(self) -> str:
        """The engine that generates: native (also for verl's vllm, sglang and trtllm) or hf."""
        return "native" if self.name in SERVER_ENGINES else self.name

    @property
    def chunked_prefill(self) -> bool:
        """Whether the engine splits long prefills: enable_chunked_prefill is vLLM's option, which verl
        passes to vLLM only (its SGLang and TensorRT-LLM rollouts chunk as they do by default)."""
        return self.enable_chunked_prefill or self.name in NOT_VLLM_ENGINES

    def decoding_temperature(self, validate: bool = False) -> float:
        """The temperature the training (`validate`: validation) rollouts sample at; 0: greedy.
        verl reads `do_sample` and `val_kwargs.do_sample` only in its hf rollout; its vLLM and
        SGLang rollouts, which meshppo's engine stands in for, sample at the temperature."""
        s = self.val_kwargs if validate else self
        return 0.0 if self.engine == "hf" and not s.do_sample else s.temperature


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = opt(True, "actor and engine share the GPUs (the only mode)", unsupported=lambda v: not v)
    nccl_timeout: int | None = opt(None, "verl's name of trainer.nccl_timeout: in verl the timeout of the actor, "
                                         "rollout and reference workers' process group; meshppo's models share "
                                         "one set of process groups, so it is the run's one timeout. Setting both "
                                         "to different values is an error", ge=1)
    model: ModelConfig = section(ModelConfig, "policy model")
    actor: ActorConfig = section(ActorConfig, "actor training")
    ref: RefConfig = section(RefConfig, "reference model")
    rollout: RolloutConfig = section(RolloutConfig, "generation")


@dataclass
class CriticModelConfig:
    path: str | None = opt(None, "critic checkpoint; default: the actor's model path (value head starts at zero)",
                           path=True)
    tokenizer_path: str | None = opt(None, "critic tokenizer; must be the actor's (checked), null: the actor's",
                                     path=True)
    override_config: dict = _override_config(
        "the critic is", "max_position_embeddings and bos/eos/pad_token_id only its exported config.json (checkpoint "
                         "hf_model), initializer_range only dummy weights")
    enable_gradient_checkpointing: bool = opt(False, "recompute each block's activations in backward")
    enable_activation_offload: bool = opt(False, _ACTIVATION_OFFLOAD_HELP)
    use_remove_padding: bool = opt(True, "padding-free packed forwards")
    lora_rank: int = opt(0, "LoRA adapter rank on the critic; 0: the whole critic trains. With adapters only "
                            "they and the whole value head train and are checkpointed (the base is re-read from "
                            "path); verl's peft critic freezes the value head's weight (all-linear: an adapter on "
                            "it; a list of projections: not trained at all)",
                         ge=0)
    lora_alpha: float = opt(16.0, "critic LoRA scaling numerator: the adapter output is scaled by "
                                  "lora_alpha / lora_rank", gt=0)
    target_modules: str | list[str] = opt("all-linear", "critic projections that get adapters, as peft selects "
                                                         "them: all-linear (any case), a list (an entry selects the "
                                                         "module of that name or whose name ends with '.' + it: "
                                                         "q_proj, self_attn.q_proj) or a regular expression "
                                                         "(re.fullmatch on whole names); only the decoder layers' "
                                                         "projections, the same ones in every layer")
    fsdp_config: FSDPOptions = section(FSDPOptions, "critic FSDP2 settings")
    external_lib: str | None = opt(None, "not supported", unsupported=lambda v: v is not None)
    trust_remote_code: bool = opt(False, "not supported (models are built by meshppo)", unsupported=bool)
    use_shm: bool = opt(False, "verl: copy the checkpoint to /dev/shm and load it from there", no_effect=_SHM_WHY)
    tiled_mlp: TiledMLPConfig = section(TiledMLPConfig, "the tiled MLP of the critic")
    hf_config_path: str | None = _hf_config_path()
    custom_chat_template: str | None = opt(None, "verl: the critic tokenizer's chat template",
                                           no_effect="the critic reads the actor's token ids, rendered with the actor's "
                                                     "template")
    exclude_modules: str | list[str] | None = _exclude_modules()
    lora_adapter_path: str | None = opt(None, "not supported: must be null (verl: a peft adapter the critic starts "
                                              "from; meshppo's critic adapters start fresh, lora_rank)",
                                        unsupported=lambda v: v is not None)
    use_liger: bool = _use_liger()
    use_fused_kernels: bool = opt(False, "verl: fused log-prob kernels", no_effect="a critic has no LM head")
    fused_kernel_options: FusedKernelOptions = section(FusedKernelOptions, "verl's fused-kernel settings")
    mtp: MtpConfig = section(MtpConfig, "verl's multi-token prediction")
    megatron_lora: MegatronLoRAConfig = section(MegatronLoRAConfig, "verl 0.9.1's Megatron LoRA", key="lora")

    def __post_init__(self):
        self.override_config = _check_override_config("critic.model", self.override_config)
        if self.lora_rank:
            self.lora  # a bad target_modules / lora_alpha fails here, naming the key

    @property
    def lora(self) -> LoRAConfig | None:
        """The critic's `LoRAConfig`, None when lora_rank is 0."""
        return _lora_config("critic.model", self)


@dataclass
class CriticConfig:
    strategy: str = opt("fsdp2", "training backend", choices=("fsdp", "fsdp2"))
    optim: CriticOptimConfig = section(CriticOptimConfig, "critic optimizer")
    model: CriticModelConfig = section(CriticModelConfig, "critic model")
    fsdp: FSDPOptions | None = opt(None, "verl 0.9.1's name of critic.model.fsdp_config (its engine config): each "
                                         "option set here other than its default sets that one's, which must be at "
                                         "its default or the same; null: none")
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling of the critic (global_profiler)")
    ppo_mini_batch_size: int | None = opt(None, "prompts per critic optimizer step; default: the actor's", ge=1)
    ppo_micro_batch_size_per_gpu: int | None = opt(None, "sequences per critic forward/backward on one GPU; null: "
                                                         "the actor's ppo_micro_batch_size_per_gpu", ge=1)
    ppo_micro_batch_size: int | None = _global_micro_batch("ppo_micro_batch_size_per_gpu")
    forward_micro_batch_size_per_gpu: int | None = opt(None, "sequences per value forward on one GPU; null: "
                                                             "ppo_micro_batch_size_per_gpu", ge=1)
    forward_micro_batch_size: int | None = _global_micro_batch("forward_micro_batch_size_per_gpu")
    use_dynamic_bsz: bool | None = opt(None, "pack critic micro-batches by token count; null: the actor's")
    ppo_max_token_len_per_gpu: int = opt(32768, "token budget of one critic micro-batch", ge=1)
    forward_max_token_len_per_gpu: int | None = opt(None, "token budget of one value forward; null: "
                                                          "ppo_max_token_len_per_gpu", ge=1)
    ppo_epochs: int | None = opt(None, "critic passes per batch; default: the actor's", ge=1)
    shuffle: bool | None = opt(None, "shuffle sequences before mini-batches; null: the actor's")
    grad_clip: float | None = opt(None, _GRAD_CLIP_HELP, gt=0)
    cliprange_value: float = opt(0.5, "value clipping range", gt=0)
    loss_agg_mode: str | None = opt(None, "aggregation of the value loss; null: the actor's",
                                    choices=(*LOSS_AGG_MODES, None))
    loss_scale_factor: int | None = opt(None, "the value loss's seq-mean-token-sum-norm divisor T (loss_agg_mode); "
                                              "null: the actor's loss_scale_factor, as in verl (where both are null: "
                                              "the response length)", ge=1)
    ulysses_sequence_parallel_size: int = opt(1, _SP_HELP, ge=1)
    enable: bool | None = opt(None, "train a critic: must agree with algorithm.adv_estimator (meshppo trains one "
                                    "exactly for gae); null: as adv_estimator says")
    rollout_n: int | None = opt(None, "verl's copy of rollout.n: must equal it; null: rollout.n", ge=1)
    data_loader_seed: int = _data_loader_seed()
    checkpoint: CheckpointConfig = section(CheckpointConfig, "what the critic's checkpoints hold and a resume loads "
                                                             "(saved with the actor's, in the same step directory)")

    def __post_init__(self):
        _resolve_grad_clip("critic", self)
        _check_checkpoint("critic", self.checkpoint)


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment: verl's `reward_model.reward_kwargs.overlong_buffer_cfg` of
    reward_manager=dapo (`DAPORewardKwargs` says which keys are required)."""

    enable: bool | None = opt(None, "add the overlong penalty to the score")
    len: int | None = opt(None, "the buffer's length: the penalty starts at max_resp_len - len tokens", ge=1)
    penalty_factor: float | None = opt(None, "the penalty's size at max_resp_len tokens: it falls linearly from 0 at "
                                             "the buffer's start to -penalty_factor there, and on beyond", ge=0)
    log: bool | None = opt(None, "add the extras overlong_reward (the penalty) and overlong (1 where it is below 0)")


REWARD_KWARGS_KEY = "reward_model.reward_kwargs"


@dataclass
class DAPORewardKwargs:
    """`reward_model.reward_kwargs` of reward_manager=dapo: the arguments of verl's DAPORewardManager,
    checked as verl checks them and required where verl reads them."""

    max_resp_len: int | None = opt(None, "the response length the overlong buffer ends at (verl's DAPO recipes: "
                                         "data.max_response_length)", ge=1)
    overlong_buffer_cfg: OverlongBufferConfig | None = opt(None, "DAPO's overlong penalty; null: none")

    def __post_init__(self):
        kw = given_name(self, REWARD_KWARGS_KEY)
        b, key = self.overlong_buffer_cfg, f"{kw}.overlong_buffer_cfg"
        if b is None:
            return
        missing = [k for k in ("enable", "len", *(("penalty_factor", "log") if b.enable else ())) if getattr(b, k) is None]
        if missing:
            raise ConfigError(f"{key} needs {' and '.join(missing)}: verl's dapo manager reads "
                              f"{'them' if len(missing) > 1 else 'it'}{' when enable=true' if b.enable else ''}")
        if self.max_resp_len is None:
            raise ConfigError(f"{key} is set but {kw}.max_resp_len is not (verl's dapo manager asserts "
                              "it): give the response length the buffer ends at, usually data.max_response_length")
        if b.len > self.max_resp_len:
            raise ConfigError(f"{key}.len={b.len} is larger than {kw}.max_resp_len={self.max_resp_len} "
                              "(verl's dapo manager asserts max_resp_len >= len): the buffer would start before the "
                              "response does")


# verl's default of reward_model.model.input_tokenizer, an interpolation of the actor's model path
ACTOR_MODEL_PATH = "${actor_rollout_ref.model.path}"


@dataclass
class RewardModelModelConfig:
    path: str | None = opt(None, "reward model: a Hugging Face *ForSequenceClassification (num_labels 1) or meshppo "
                                 "value-model directory of a Gemma 2 / Gemma 3 / Llama / Mistral / OLMo-2 / Phi-3 / "
                                 "Qwen2 / Qwen3 model; "
                                 "its score at a sequence's last token is the reward", path=True)
    input_tokenizer: str | None = opt(ACTOR_MODEL_PATH,
                                      "the tokenizer the actor's responses are decoded with before the reward model "
                                      "reads them, as in verl: each prompt's chat messages plus the decoded response "
                                      "(EOS text removed) as the assistant turn, rendered with the reward model's own "
                                      "chat template and tokenizer (path's); the reward model may have its own "
                                      "vocabulary. null: the reward model reads the actor's token ids as they are "
                                      "(it must share the actor's tokenizer)", path=True)
    external_lib: str | None = opt(None, "not supported", unsupported=lambda v: v is not None)
    trust_remote_code: bool | None = opt(False, "not supported (models are built by meshppo); null: false",
                                         unsupported=bool)
    override_config: dict = _override_config(
        "the reward model is", "max_position_embeddings, initializer_range and bos/eos/pad_token_id have no effect "
                               "(said at start-up)")
    use_shm: bool = opt(False, "verl: copy the checkpoint to /dev/shm and load it from there",
                        no_effect="the weights are read once at start-up, memory-mapped where they are")
    use_remove_padding: bool = opt(True, "padding-free packed forwards (same scores either way)")
    use_fused_kernels: bool = opt(False, "verl: fused log-prob kernels", no_effect="a reward model has no LM head")
    fsdp_config: FrozenFSDPOptions = section(FrozenFSDPOptions, "reward model FSDP2 settings")

    def __post_init__(self):
        self.override_config = _check_override_config("reward_model.model", self.override_config)


@dataclass
class RewardModelConfig:
    """The reward model, at verl's older place (0.9.1 keeps these names, null, as deprecated ones:
    those it moved to `reward.*` are the same settings here, `PPOConfig.resolve`)."""

    enable: bool | None = opt(None, "score responses with a reward model instead of (or added to) the rule reward; "
                                    "null: reward.reward_model.enable (verl 0.9.1's name), else false")
    model: RewardModelModelConfig = section(RewardModelModelConfig, "the reward model")
    strategy: str = opt("fsdp", "fsdp and fsdp2 both mean meshppo's FSDP2", choices=("fsdp", "fsdp2"))
    micro_batch_size_per_gpu: int | None = opt(None, "sequences per reward-model forward; null (with micro_batch_size "
                                                     "null too): forwards packed by token count (use_dynamic_bsz), as "
                                                     "verl 0.9.1 has no reward-model micro-batch option", ge=1)
    micro_batch_size: int | None = _global_micro_batch("micro_batch_size_per_gpu")
    max_length: int | None = opt(None, "with input_tokenizer set: the longest input the reward model reads; a "
                                       "longer rendered chat is cut on the right, as earlier verl's FSDP reward model cut it at a set "
                                       "max_length; null: no limit (as verl 0.9.1's reward loop, which has no such "
                                       "cut; earlier verl read null as the actor's prompt + response length). Without input_tokenizer the prompt and response length "
                                       "bound the input: must be null", ge=1)
    use_dynamic_bsz: bool = opt(False, "pack reward-model forwards by token count (always so without a "
                                       "micro_batch_size_per_gpu)")
    forward_max_token_len_per_gpu: int = opt(32768, "token budget of one reward-model forward", ge=1)
    ulysses_sequence_parallel_size: int = opt(1, _SP_HELP, ge=1)
    enable_resource_pool: bool | None = opt(False, "not supported: the reward model runs on the training ranks, "
                                                   "between generation and the update (n_gpus_per_node / nnodes are "
                                                   "not read); null: false", unsupported=bool)
    n_gpus_per_node: int | None = opt(8, "verl: GPUs a node of the separate reward-model pool", ge=0,
                                      no_effect="read only with enable_resource_pool")
    nnodes: int | None = opt(0, "verl: nodes of the separate reward-model pool", ge=0,
                             no_effect="read only with enable_resource_pool")
    use_reward_loop: bool = opt(True, "verl: its reward-loop workers (true) or its legacy reward-model worker",
                                no_effect="meshppo scores in-process either way (max_length applies in both)")
    num_workers: int | None = opt(1, "verl: the reward-loop worker count (0.9.1: reward.num_workers)", ge=1,
                                  no_effect="meshppo scores on every training rank, without reward-loop workers")
    launch_reward_fn_async: bool = opt(False, "verl: compute the reward function in a background process",
                                       no_effect="the rewards are computed within the step, before the advantages "
                                                 "that read them")
    reward_loop_source: str | None = opt("register", "register only: reward_manager names the manager; null: "
                                                     "register", choices=("register", "importlib", None),
                                         unsupported=lambda v: v != "register")
    reward_loop_module_path: str | None = opt(None, "not supported (reward_loop_source=importlib)",
                                              unsupported=lambda v: v is not None)
    reward_loop_class_name: str | None = opt(None, "not supported (reward_loop_source=importlib)",
                                             unsupported=lambda v: v is not None)
    rollout: dict = opt(default_factory=dict, help="verl: the reward model's inference server (name, "
                                                   "tensor_model_parallel_size, gpu_memory_utilization, ...), "
                                                   "before 0.9.1 (whose trainer reads reward.reward_model.rollout "
                                                   "only): checked as that section is, the values that would change "
                                                   "the scores refused",
                        no_effect="meshppo runs the reward model as an FSDP2 forward on the training ranks")
    sandbox_fusion: SandboxFusionConfig = section(SandboxFusionConfig, "verl's remote code-execution service")
    reward_manager: str | None = opt(None, "how the rule reward calls the reward function, as verl's managers do: "
                                           "naive: once per response; dapo: naive plus DAPO's overlong penalty "
                                           "(reward_kwargs); batch: once per batch, with lists; prime: once per "
                                           "response in worker processes, 300 s per call, a failed call scoring 0; gdpo: naive's calls with "
                                           "trainer.experiment_name in extra_info (verl's gdpo recipe). "
                                           "verl's newer name: reward_manager.name; null: that, or naive",
                                     choices=(*REWARD_MANAGERS, None))
    reward_kwargs: dict | None = opt(None, "the reward manager's arguments, as verl passes them: dapo: max_resp_len "
                                           "and overlong_buffer_cfg {enable, len, penalty_factor, log}; batch: "
                                           "keywords added to every call (custom_reward_function.reward_kwargs win); "
                                           "naive, prime and gdpo take none. null: reward.reward_kwargs (verl 0.9.1's "
                                           "place), else none")
    combine: str = opt("replace", "with a rule reward too: replace it or add to it", choices=("replace", "add"))
    profiler: SharedProfilerConfig = section(SharedProfilerConfig, "profiling of the reward model "
                                                                   "(global_profiler); the actor's tool_config")

    def manager_kwargs(self) -> dict:
        """`reward_kwargs` as the manager takes them (`rewards.load_reward_manager`): dapo's typed,
        batch's as given. Raises ConfigError for a key the manager does not take."""
        kwargs, manager, key = self.reward_kwargs or {}, self.reward_manager, given_name(self, REWARD_KWARGS_KEY)
        if manager == "dapo":
            dapo = build_dataclass(DAPORewardKwargs, kwargs, key)
            return {f.name: getattr(dapo, f.name) for f in dataclasses.fields(dapo)}
        if manager == "batch":
            taken = sorted(set(kwargs) & set(BATCH_FN_ARGS))
            if taken:
                raise ConfigError(f"{key} sets {', '.join(taken)}: the batch manager passes "
                                  f"{', '.join(BATCH_FN_ARGS)} itself")
            return dict(kwargs)
        if kwargs:
            raise ConfigError(f"{key} is set ({', '.join(sorted(kwargs))}) but reward_manager={manager} "
                              "takes none (verl's would fail on them); they are dapo's (max_resp_len, "
                              "overlong_buffer_cfg) or batch's (keywords for the function)")
        return {}


@dataclass
class CustomRewardConfig:
    """The reward function, at verl's older place (0.9.1: `reward.custom_reward_function`, the same
    settings; `PPOConfig.resolve`)."""

    path: str | None = opt(None, "Python file (path or file:///abs/x.py) or module (pkg://package.module) with a "
                                 "reward function, called by keyword as verl calls it: fn(data_source=, solution_str=, "
                                 "ground_truth=, extra_info=); null: reward.custom_reward_function.path (verl 0.9.1's "
                                 "name)", path=True)
    name: str | None = opt(None, "function name in that file or module; null: reward.custom_reward_function.name, "
                                 "else compute_score")
    reward_kwargs: dict | None = opt(None, "keyword arguments added to every call of the function; they win over the "
                                           "call's own (as in verl); null: reward.custom_reward_function.reward_kwargs, "
                                           "else none")


@dataclass
class KLCtrlConfig:
    type: str = opt("fixed", "KL coefficient controller", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "initial / fixed KL coefficient for KL-in-reward", ge=0)
    horizon: int = opt(10000, "adaptive controller horizon (Ziegler et al.)", ge=1)
    target_kl: float = opt(0.1, "adaptive controller target KL", gt=0)


@dataclass
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction`: the engine's sampling policy pi_rollout differs
    from the trainer's pi_old by numerics. Decoupled mode (default) recomputes pi_old and can
    weight (`rollout_is`) and reject (`rollout_rs`) by pi_old / pi_rollout; bypass mode takes
    the engine's log-probs as pi_old, skips the recompute, and weights / rejects each
    micro-batch by pi_theta / pi_rollout. The parsed bounds are `is_bounds` and `rejection`."""

    rollout_is: str | None = opt(None, "importance weights pi_old / pi_rollout on the policy loss: token, sequence "
                                       "(one product per sequence), or null (off)",
                                 choices=(*ROLLOUT_IS_LEVELS, None))
    rollout_is_threshold: str | float = opt(2.0, "weights above it are truncated to it (TIS); 'lower_upper' zeroes "
                                                 "them outside (IcePop): write a decimal point in each bound, "
                                                 "0.5_2.0 (YAML reads 0.5_2 as the number 0.52)")
    rollout_is_batch_normalize: bool = opt(False, "divide the truncated weights by their mean over the batch (all "
                                                  "ranks), so they average 1: over the valid tokens (token) or "
                                                  "the sequences (sequence); bypass mode: over each micro-batch "
                                                  "of all ranks, as verl's actor. Logs "
                                                  "rollout_corr/rollout_is_batch_norm_factor (the mean)")
    rollout_rs: str | None = opt(None, "rejection sampling, comma-separated: token_k1/k2/k3, seq_sum_k1/k2/k3, "
                                       "seq_mean_k1/k2/k3, seq_max_k2/k3 (k1: log-ratio, k2: its square / 2, "
                                       "k3: KL estimate); null: off. Rejected tokens leave the response mask of "
                                       "the advantages, every loss term and the critic, as verl's (bypass mode: "
                                       "of the policy-gradient term only)")
    rollout_rs_threshold: str | float | None = opt(None, "bounds of rollout_rs (required with it), one shared or one "
                                                         "per option "
                                                         "(comma-separated): k1 'lower_upper' on the ratio "
                                                         "pi_old / pi_rollout itself (0.5_2.0, decimal points as "
                                                         "above) or C for [1/C, C]; k2 / k3 an upper bound. verl's "
                                                         "code tests -log(ratio), i.e. bounds 1 / ratio: the same "
                                                         "only for one number C or reciprocal bounds (0.5_2.0); "
                                                         "for verl's effect of a_b write 1/b_1/a")
    bypass_mode: bool = opt(False, "take the engine's log-probs as the old log-probs and skip the actor's "
                                   "recompute pass")
    loss_type: str = opt("ppo_clip", "policy loss in bypass mode, in place of actor.policy_loss.loss_mode (which "
                                     "must stay vanilla): ppo_clip (loss_mode vanilla: the ratio to pi_rollout, "
                                     "clipped) or reinforce (loss_mode gpg: -w * A * log pi)",
                         choices=BYPASS_LOSS_TYPES)

    def __post_init__(self):
        self.is_bounds = parse_rollout_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is None and self.rollout_rs_threshold is not None:
            raise ValueError(f"rollout_rs_threshold={shown(self.rollout_rs_threshold)} needs rollout_rs")
        self.rejection = () if self.rollout_rs is None else parse_rollout_rs(self.rollout_rs,
                                                                             self.rollout_rs_threshold)
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            raise ValueError(f"loss_type={self.loss_type} applies to bypass mode only: set bypass_mode=true")


FILTER_GROUP_SEQUENCE_METRICS = ("seq_reward", "seq_final_reward", "score", "reward")
"""`algorithm.filter_groups.metric` values that are not a reward function's extra key."""


@dataclass
class FilterGroupsConfig:
    enable: bool = opt(False, "DAPO's dynamic sampling: drop the prompts whose responses all have the same metric "
                              "(e.g. all right or all wrong: zero group advantage) and generate more rounds of "
                              "data.gen_batch_size prompts until data.train_batch_size prompts are kept")
    metric: str | None = opt("reward", "what must vary within a group: reward (verl 0.9.1's name and default: "
                                       "the summed reward before any KL, the score the advantages use), seq_reward "
                                       "(the same), seq_final_reward (the same: refused with KL in the reward), score "
                                       "(the reward function's own, before reward_manager=dapo's overlong penalty, "
                                       "as verl's DAPO trainer reads it), or a numeric extra key of the reward "
                                       "function's dict result (e.g. acc); null is refused with enable=true")
    max_num_gen_batches: int = opt(0, "generation rounds a step may take before it fails (the data are then too "
                                      "easy or too hard), as verl's DAPO recipe reads it (verl 0.9.1's default "
                                      "trainer ignores it, with a warning); 0 or less: no limit")
    max_inflight_gen_batches: int = opt(1, "1 only: meshppo generates one round at a time (verl 0.9.1: up to this many "
                                           "rounds of train_batch_size prompts in flight at once)", ge=1,
                                        unsupported=other_than(1))


@dataclass
class PFPPOConfig:
    reweight_method: str = opt("pow", "each response's weight from its score s: pow: |s|^weight_pow; max_min: 1 for "
                                      "the batch's highest and lowest scores, 0 for the others; max_random: 0.4 for "
                                      "the highest, 0.1 for the others (each + 1e-8)",
                               choices=("pow", "max_min", "max_random"))
    weight_pow: float = opt(2.0, "the power of the pow method, >= 0 (verl also takes a negative power, under "
                                 "which a score of 0 weighs |0|^p = inf and its step stops; meshppo refuses one)",
                            ge=0)


@dataclass
class AlgorithmConfig:
    gamma: float = opt(1.0, "discount factor", ge=0, le=1)
    lam: float = opt(1.0, "GAE lambda", ge=0, le=1)
    adv_estimator: str = opt("gae", "advantage estimator", choices=ADV_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool = opt(True, "divide GRPO advantages by the group std (false: Dr. GRPO)")
    use_kl_in_reward: bool = opt(False, "subtract kl_coef * KL(actor, ref) from the token rewards")
    kl_penalty: str = opt("kl", "KL estimator for KL-in-reward: " + _KL_ESTIMATORS_HELP, choices=KL_TYPES)
    kl_ctrl: KLCtrlConfig = section(KLCtrlConfig, "KL-in-reward controller")
    kl_guard: KLGuardConfig = section(KLGuardConfig, "KL to the reference watched every step (kl_guard/* metrics); "
                                                        "reactions beyond a warning are opt-in")
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, "the gap between the engine's "
                                                          "and the trainer's log-probs")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO's dynamic sampling (group filtering)")
    use_pf_ppo: bool = opt(False, "PF-PPO (policy filtration, as verl runs it with adv_estimator=gae): after the "
                                  "advantages, the step's batch is redrawn with replacement, as many responses as it "
                                  "has, each with probability proportional to its pf_ppo weight; the updates, "
                                  "metrics and dumps see the redrawn batch")
    pf_ppo: PFPPOConfig = section(PFPPOConfig, "PF-PPO's weights")
    gdpo_reward_keys: list[str] | None = opt(None, "gdpo: the keys of the reward function's dict result that hold "
                                                   "the reward components, each normalised within its group on its "
                                                   "own before their weighted sum is whitened (required with "
                                                   "adv_estimator=gdpo)")
    gdpo_reward_weights: list[float] | None = opt(None, "gdpo: the components' weights, one per gdpo_reward_keys; "
                                                        "null: 1 each")

    def __post_init__(self):
        if self.adv_estimator == "gdpo" and not self.gdpo_reward_keys:
            raise ValueError("adv_estimator=gdpo needs gdpo_reward_keys: the keys of the reward function's dict "
                             "result that hold the reward components (e.g. [format_reward, accuracy_reward])")
        if self.adv_estimator == "gdpo" and "score" in self.gdpo_reward_keys:
            # (rewards.registry.ResultCollector keeps a dict result's other numeric entries as its extras)
            raise ValueError("gdpo_reward_keys holds 'score': a dict result's 'score' is the reward itself, not one of "
                             "the extras the components are read from; return the component under its own key too "
                             "(e.g. 'accuracy') and list that")
        if self.gdpo_reward_weights is not None and len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys or ()):
            raise ValueError(f"gdpo_reward_weights has {len(self.gdpo_reward_weights)} weights for "
                             f"{len(self.gdpo_reward_keys or ())} gdpo_reward_keys: give one per key")


_NO_RAY_WHY = "meshppo runs without Ray (torchrun launches it)"
NCCL_TIMEOUT_S = 600
"""`trainer.nccl_timeout` when neither it nor `actor_rollout_ref.nccl_timeout` is set (verl's, torch's)."""


@dataclass
class TrainerConfig:
    project_name: str = opt("meshppo", "project name (wandb's project, the file logger's directory; with "
                                       "default_local_dir null, the run directory's parent)")
    experiment_name: str = opt("run", "experiment name (wandb's run name, the file logger's <experiment_name>.jsonl; "
                                      "with default_local_dir null, the run directory's name)")
    logger: list[str] = opt(default_factory=lambda: ["console", "jsonl"],
                            help="any of console (progress bar), jsonl (the run directory's metrics.jsonl: "
                                 "{\"step\": s, metrics...} lines), file (verl's: {\"step\": s, \"data\": {metrics}} "
                                 "lines in $VERL_FILE_LOGGER_PATH, else $VERL_FILE_LOGGER_ROOT (default: the working "
                                 "directory)/<project_name>/<experiment_name>.jsonl; lines of steps after a resumed "
                                 "checkpoint dropped, emptied on a fresh start), tensorboard, wandb")
    wandb_proxy: str | None = opt(None, "verl (read though not in its yaml: +trainer.wandb_proxy=URL): the proxy of "
                                        "wandb's https requests, wandb.Settings(https_proxy=URL) (an http:// or "
                                        "https:// URL); null or empty: wandb's own settings (HTTPS_PROXY). Read only "
                                        "with wandb in trainer.logger")
    total_epochs: int = opt(1, "passes over the training prompts", ge=1)
    use_legacy_worker_impl: str = opt("auto", "accepted for verl compatibility", choices=("auto", "enable", "disable"),
                                      no_effect="meshppo has one implementation, whose losses are normalised as "
                                                "verl's engine workers do (README)")
    use_v1: bool = opt(True, "verl: run its newer trainer (false: its deprecated RayPPOTrainer)",
                       no_effect="meshppo has one trainer")
    v1: TrainerV1Config = section(TrainerV1Config, "verl 0.9.1: its newer trainer's modes")
    checkpoint_callback_class: str | None = opt(None, "not supported: must be null (verl: a user class, by import "
                                                      "path, called around checkpoint saves)",
                                                unsupported=lambda v: v is not None)
    total_training_steps: int | None = opt(None, "stop after this many steps (overrides total_epochs: more steps "
                                                 "than total_epochs give go on into further epochs; verl stops at "
                                                 "whichever ends first); null: the training set's full "
                                                 "train_batch_size batches (after filtering) x total_epochs", ge=1)
    nnodes: int = opt(1, "nodes (checked against the launch)", ge=1)
    n_gpus_per_node: int = opt(1, "processes per node (checked against the launch)", ge=1)
    device: str = opt("auto", "cuda, cpu, or auto (cuda when available)", choices=("auto", "cuda", "cpu"))
    balance_batch: bool = opt(True, "split the step's sequences over the data-parallel ranks (the actor's Ulysses "
                                    "groups, if any) as verl 0.9.1 does: equally many each, balanced by Karmarkar-Karp "
                                    "on verl's work estimate 24576 s + s² (s: a sequence's tokens); each rank cuts its "
                                    "mini-batches from its share, so this decides which sequences train together. "
                                    "false: consecutive blocks")
    critic_warmup: int = opt(0, "K: steps 1 to K (exactly K steps) train only the critic, the actor first "
                                "updates at step K + 1 (as verl's yaml says; verl 0.9.1's code, critic_warmup <= "
                                "global_steps with steps from 1, skips K - 1 actor updates, none for K = 1)", ge=0)
    test_freq: int = opt(-1, "validate every this many steps and after the last step, as verl does (-1 or 0: "
                             "never, val_before_train aside)", ge=-1)
    val_before_train: bool = opt(True, "validate once before the first step of a fresh run; skipped on a resume "
                                       "(verl validates on every start)")
    val_only: bool = opt(False, "validate once and exit without training (needs data.val_files): the model of "
                                "actor_rollout_ref.model.path, or the checkpoint the run resumes (resume_mode); "
                                "verl acts on it only with val_before_train=true, meshppo always")
    save_freq: int = opt(-1, "checkpoint every this many steps and at the last step; -1 or 0: at the last step "
                             "only (verl saves no checkpoint then)", ge=-1)
    default_local_dir: str | None = opt(None, "run directory: checkpoints, metrics.jsonl, logs; null: "
                                              "runs/<project_name>/<experiment_name>, one per experiment (verl: "
                                              "checkpoints/<project_name>/<experiment_name>)", path=True)
    resume_mode: str = opt("auto", "auto (latest checkpoint if any), disable, or resume_path. disable starts the run "
                                   "directory over: it deletes default_local_dir/checkpoints and the earlier "
                                   "run's hf_actor/ and lora_adapter/ and empties metrics.jsonl (verl only ignores "
                                   "the old checkpoints)",
                           choices=("auto", "disable", "resume_path"))
    resume_from_path: str | None = opt(None, "checkpoint directory for resume_mode=resume_path", path=True)
    max_actor_ckpt_to_keep: int | None = opt(None, "keep at most this many checkpoints (null or 0: all, as in verl)",
                                             ge=0)
    max_critic_ckpt_to_keep: int | None = opt(None, "critic checkpoints to keep: meshppo saves the critic in the "
                                                    "actor's checkpoints and rotates them together, so null or 0 "
                                                    "(verl: keep every critic checkpoint; here the actor's count) or "
                                                    "max_actor_ckpt_to_keep (checked with a critic)", ge=0)
    remove_previous_ckpt_in_save: bool = opt(False, "verl's deprecated switch (not in its config; verl 0.9.1 still "
                                                    "reads it): true keeps only the newest checkpoint, setting "
                                                    "max_actor_ckpt_to_keep and, with a critic, "
                                                    "max_critic_ckpt_to_keep to 1 over any value they have")
    log_val_generations: int = opt(0, "validation samples (prompt, response, score) printed to the log and, as "
                                      "verl logs them, written as a val/generations table to wandb and a "
                                      "val/generations text to TensorBoard where those loggers are on; picked as "
                                      "verl picks its table's (sorted by prompt, shuffled with seed 42)", ge=0)
    rollout_data_dir: str | None = opt(None, "write each step's samples to DIR/{step}.jsonl (input, output, gts, "
                                       "score, reward, advantage, ...)", path=True)
    validation_data_dir: str | None = opt(None, "write each validation's samples to DIR/{step}.jsonl (input, output, "
                                          "gts, score, ...)", path=True)
    seed: int = opt(1, "the run's seed: the rollouts' sampling (validation's too), the LoRA adapters' and dummy "
                       "weights' initialisation, the updates' mini-batch shuffle (actor.shuffle) and clip_cov's draws, "
                       "and Python's, NumPy's and torch's global generators (the prompt order is data.seed's)", ge=0)
    export_hf_at_end: bool = opt(True, "also write the final actor as a Hugging Face directory (hf_actor/; a LoRA "
                                                "actor with its adapters merged, and the adapters as a peft "
                                                "directory lora_adapter/)")
    max_nonfinite_steps: int = opt(3, "stop after this many consecutive steps with a non-finite loss or grad norm",
                                    ge=1)
    preemption_grace_s: float = opt(120.0, "after SIGTERM/SIGUSR1, a step whose updates would end later than this "
                                    "is abandoned (redone on resume) so the checkpoint is written in time", ge=0)
    nccl_timeout: int | None = opt(None, "seconds a collective may wait for the other ranks before the run fails "
                                         "with a message naming the rank and the phase (the process groups' timeout; "
                                         "gloo too); null: actor_rollout_ref.nccl_timeout (verl's name), or "
                                         f"{NCCL_TIMEOUT_S} when that is null too", ge=1)
    esi_redundant_time: int = opt(0, "verl: seconds before the cloud instance's expiry at which it saves a checkpoint",
                                  ge=0, no_effect="meshppo reads no instance expiry: it saves on SIGTERM or SIGUSR1 "
                                                  "(preemption_grace_s)")
    default_hdfs_dir: str | None = opt(None, "not supported: must be null (verl: a copy of the checkpoints on HDFS)",
                                       unsupported=lambda v: v is not None)
    del_local_ckpt_after_load: bool = opt(False, "not supported: must be false (verl: delete the local checkpoint "
                                                 "once loaded)", unsupported=bool)
    ray_wait_register_center_timeout: int = opt(300, "verl: seconds to wait for Ray's register center",
                                                no_effect=_NO_RAY_WHY)


@dataclass
class PPOConfig:
    data: DataConfig = section(DataConfig, "prompt data")
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig, "policy, reference and generation")
    critic: CriticConfig = section(CriticConfig, "value model")
    reward_model: RewardModelConfig = section(RewardModelConfig, "model-based reward")
    custom_reward_function: CustomRewardConfig = section(CustomRewardConfig, "user reward function")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and KL")
    trainer: TrainerConfig = section(TrainerConfig, "the run")
    global_profiler: GlobalProfilerConfig = section(GlobalProfilerConfig, "profiling of chosen steps")
    reward_manager: RewardManagerConfig = section(RewardManagerConfig, "verl's newer section of the reward manager")
    reward: RewardConfig = section(RewardConfig, "verl 0.9.1's reward section: the newer names of the reward "
                                                 "function's, reward manager's and reward model's options")
    sandbox_fusion: SandboxFusionConfig = section(SandboxFusionConfig, "verl 0.9.1's deprecated place of "
                                                                       "reward.sandbox_fusion")
    distillation: DistillationConfig = section(DistillationConfig, "verl 0.9.1's on-policy distillation")
    skip: SkipConfig = section(SkipConfig, "verl 0.9.1's dumps and replays of stages")
    ray_kwargs: dict = opt(default_factory=lambda: {"ray_init": {"num_cpus": None, "runtime_env": {"py_executable": None}},
                                                    "timeline_json_file": None},
                           help="verl: the arguments of ray.init and Ray's timeline file", no_effect=_NO_RAY_WHY)
    transfer_queue: TransferQueueConfig = section(TransferQueueConfig, "verl's transfer queue")

    def __post_init__(self):
        self.resolve()

    def resolve(self) -> None:
        """Fill every inherited or defaulted value, once, right after loading: a null option
        that means "the same as X" becomes X's value, so nothing downstream falls back. Idempotent
        (a resolved config resolves to itself)."""
        d, arr, critic = self.data, self.actor_rollout_ref, self.critic
        actor, ref, rollout = arr.actor, arr.ref, arr.rollout

        def inherit(obj, name, value):
            if getattr(obj, name) is None:
                setattr(obj, name, value)

        # verl's actor_rollout_ref.nccl_timeout and meshppo's trainer.nccl_timeout: one timeout
        t, alias = self.trainer.nccl_timeout, arr.nccl_timeout
        if t is not None and alias is not None and t != alias:
            raise ConfigError(f"trainer.nccl_timeout={t} and actor_rollout_ref.nccl_timeout={alias}: both name the "
                              "timeout of the run's process groups (meshppo's models share them); set one of them, "
                              "or both to the same value")
        self.trainer.nccl_timeout = next((v for v in (t, alias) if v is not None), NCCL_TIMEOUT_S)
        arr.nccl_timeout = None
        for name in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
            if getattr(self.trainer, name) == 0:  # verl keeps every checkpoint for 0, as for null
                setattr(self.trainer, name, None)
        if self.trainer.remove_previous_ckpt_in_save:  # verl 0.9.1: the deprecated switch wins over both counts
            self.trainer.max_actor_ckpt_to_keep = 1
            if self.uses_critic:  # (without one, a critic count keeps its note: it has no effect)
                self.trainer.max_critic_ckpt_to_keep = 1

        if critic.fsdp is not None:  # verl 0.9.1's name of the critic's fsdp_config
            fc = critic.model.fsdp_config
            superseded = critic.fsdp.superseded + fc.superseded  # (each section's, cleared as it was built)
            _merge_section("critic.fsdp", critic.fsdp, "critic.model.fsdp_config", fc)
            fc.__post_init__()  # the section's own rules and checks, on the merged values
            fc.superseded = [k for k in ("param_offload", "optimizer_offload") if k in superseded + fc.superseded]
            critic.fsdp = None
        _alias("data.tokenizer", d, "tokenizer", ("actor_rollout_ref.model.tokenizer_path", arr.model, "tokenizer_path"))
        rm = self.reward_model
        if rm.model.input_tokenizer == ACTOR_MODEL_PATH:  # verl's interpolation, as a config file would resolve it
            rm.model.input_tokenizer = arr.model.path
        _resolve_reward_names(self)
        _full_shard_sizes(self)  # (of the models built: reward_model.enable resolved)
        rm.manager_kwargs()  # reward_kwargs checked against the manager they go to
        for key, role in (("actor_rollout_ref.rollout", rollout), ("reward_model", rm)):
            if role.profiler.tool_config is not None:
                _copy_of_section(f"{key}.profiler.tool_config", role.profiler.tool_config,
                                 "actor_rollout_ref.actor.profiler.tool_config", actor.profiler.tool_config)
            role.profiler.tool_config = actor.profiler.tool_config
        inherit(d, "tokenizer", arr.model.path)
        t = self.trainer
        inherit(t, "default_local_dir", os.path.join("runs", t.project_name, t.experiment_name))
        for key, obj in (("actor_rollout_ref.actor", actor), ("actor_rollout_ref.ref", ref), ("critic", critic)):
            _copy_of(f"{key}.rollout_n", obj, "rollout_n", "actor_rollout_ref.rollout.n", rollout.n)
        _copy_of("actor_rollout_ref.actor.use_remove_padding", actor, "use_remove_padding",
                 "actor_rollout_ref.model.use_remove_padding", arr.model.use_remove_padding)
        # Ulysses: verl's fsdp_config copies folded into the roles' sizes; the reference runs in the actor's groups
        ref_key = "actor_rollout_ref.ref" + (".fsdp_config" if ref.fsdp_config.ulysses_sequence_parallel_size != 1
                                             and ref.ulysses_sequence_parallel_size in (None, 1) else "")
        for key, obj, fsdp in (("actor_rollout_ref.actor", actor, actor.fsdp_config),
                               ("actor_rollout_ref.ref", ref, ref.fsdp_config),
                               ("critic", critic, critic.model.fsdp_config),
                               ("reward_model", self.reward_model, self.reward_model.model.fsdp_config)):
            _sp_copy(key, obj, fsdp)
        # (the size the user set, by the key they set it with: the reference's own or its fsdp_config copy)
        _copy_of(f"{ref_key}.ulysses_sequence_parallel_size", ref, "ulysses_sequence_parallel_size",
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size", actor.ulysses_sequence_parallel_size)
        # the deprecated global micro-batch sizes over each role's data-parallel size, as verl's workers
        # divide them (the actor's Ulysses size for the rollout's and the reference's log-probs, which
        # verl's actor worker computes; its reward-model worker divides by all ranks)
        actor_sp = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", actor.ulysses_sequence_parallel_size)
        critic_sp = ("critic.ulysses_sequence_parallel_size", critic.ulysses_sequence_parallel_size)
        for key, obj, name, (sp_key, sp) in (("actor_rollout_ref.actor", actor, "ppo_micro_batch_size", actor_sp),
                                             ("actor_rollout_ref.rollout", rollout, "log_prob_micro_batch_size",
                                              actor_sp),
                                             ("actor_rollout_ref.ref", ref, "log_prob_micro_batch_size", actor_sp),
                                             ("critic", critic, "ppo_micro_batch_size", critic_sp),
                                             ("critic", critic, "forward_micro_batch_size", critic_sp),
                                             ("reward_model", self.reward_model, "micro_batch_size", (None, 1))):
            _per_gpu_micro_batch(key, obj, name, self.trainer, sp_key, sp)
        if critic.enable is not None and critic.enable != self.uses_critic:
            raise ConfigError(f"critic.enable={shown(critic.enable)} with algorithm.adv_estimator="
                              f"{self.algorithm.adv_estimator}: meshppo trains a critic exactly when adv_estimator is "
                              "gae; leave critic.enable null")
        if rollout.prometheus.served_model_name == arr.model.path:
            rollout.prometheus.served_model_name = None  # verl's default names the model path
        inherit(d, "gen_batch_size", d.train_batch_size)
        inherit(rollout, "prompt_length", d.max_prompt_length)
        inherit(rollout, "response_length", d.max_response_length)
        inherit(rollout, "max_model_len", rollout.prompt_length + rollout.response_length)
        inherit(rollout, "log_prob_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu)
        # The old-log-prob and reference forwards pack by tokens as the actor does (verl's defaults).
        for obj in (rollout, ref):
            inherit(obj, "log_prob_use_dynamic_bsz", actor.use_dynamic_bsz)
            inherit(obj, "log_prob_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu)
        inherit(ref, "log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu)
        inherit(ref, "use_torch_compile", actor.use_torch_compile)
        # The critic inherits the actor's batch sizes, epochs, micro-batching, loss aggregation,
        # shuffle, model and tokenizer.
        inherit(critic, "ppo_mini_batch_size", actor.ppo_mini_batch_size)
        inherit(critic, "ppo_epochs", actor.ppo_epochs)
        inherit(critic, "ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu)
        inherit(critic, "forward_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu)
        inherit(critic, "use_dynamic_bsz", actor.use_dynamic_bsz)
        inherit(critic, "forward_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu)
        inherit(critic, "loss_agg_mode", actor.loss_agg_mode)
        inherit(critic, "loss_scale_factor", actor.loss_scale_factor)
        inherit(critic, "shuffle", actor.shuffle)
        inherit(critic.model, "path", arr.model.path)
        inherit(critic.model, "tokenizer_path", d.tokenizer)
        # verl 0.9.1 scores with its reward-loop servers and has no micro-batch option for the reward model
        # (its examples set none): without one, the reward model's forwards pack by tokens
        if self.reward_model.enable and self.reward_model.micro_batch_size_per_gpu is None:
            self.reward_model.use_dynamic_bsz = True
        # The roles' profilers: the global tool, save_path and tool settings; the rollout's
        # selection is the actor's (verl's interpolations).
        gp, rm_prof = self.global_profiler, self.reward_model.profiler
        tools = gp.global_tool_config
        for prof in (actor.profiler, ref.profiler, rollout.profiler, critic.profiler, rm_prof):
            inherit(prof, "tool", gp.tool)
            inherit(prof, "save_path", gp.save_path)
        for tc in (actor.profiler.tool_config, ref.profiler.tool_config, critic.profiler.tool_config):
            inherit(tc.nsys, "discrete", tools.nsys.discrete)
            inherit(tc.torch_memory, "trace_alloc_max_entries", tools.torch_memory.trace_alloc_max_entries)
            inherit(tc.torch_memory, "stack_depth", tools.torch_memory.stack_depth)
        for name, default in (("enable", False), ("all_ranks", False), ("ranks", [])):
            inherit(rollout.profiler, name, getattr(actor.profiler, name))
            inherit(rm_prof, name, default)
        _null_verl_copies(self)

    # --------------------------------------------------------------- derived views
    @property
    def uses_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def uses_ref(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def response_length(self) -> int:
        return self.actor_rollout_ref.rollout.response_length

    @property
    def prompt_length(self) -> int:
        return self.actor_rollout_ref.rollout.prompt_length


def built_fsdp_sections(cfg: PPOConfig) -> dict:
    """The `fsdp_config` of each model the run builds, by its section's key: the actor's; the
    reference's with a reference (not under LoRA: the actor with its adapters off is the reference);
    the critic's with a critic; the reward model's with reward_model.enable. The others' options are
    read by nothing (a start-up note names those set)."""
    arr = cfg.actor_rollout_ref
    return {key: fc for key, fc, built in (
        ("actor_rollout_ref.actor", arr.actor.fsdp_config, True),
        ("actor_rollout_ref.ref", arr.ref.fsdp_config, cfg.uses_ref and not arr.model.adapted),
        ("critic.model", cfg.critic.model.fsdp_config, cfg.uses_critic),
        ("reward_model.model", cfg.reward_model.model.fsdp_config, bool(cfg.reward_model.enable))) if built}


def _full_shard_sizes(cfg: PPOConfig) -> None:
    """Each model's `fsdp_size` above the ranks of the launch the config describes shards over them
    all, as verl's device mesh reads it: -1 here, with its start-up note (`sharding.mesh.full_shard_note`).
    The other models share the actor's mesh: beside an actor of shard groups smaller than the launch
    (HYBRID_SHARD) their size stays as set, and `validate` refuses it as it refuses the world size."""
    world = described_launch(cfg)[0]
    actor = cfg.actor_rollout_ref.actor.fsdp_config
    for key, fc in built_fsdp_sections(cfg).items():  # (the others' sizes are unread: said as set)
        if fc is not actor and actor.fsdp_size not in (-1, world):
            continue
        note = full_shard_note(given_name(cfg, f"{key}.fsdp_config.fsdp_size"), fc.fsdp_size, world)
        if note:
            fc.fsdp_size, fc.full_shard_note = -1, note


def _shared_mesh_notes(cfg: PPOConfig) -> list[str]:
    """Beside an actor of shard groups smaller than the launch (HYBRID_SHARD), the other models the run
    builds with `fsdp_size=-1` shard over the actor's groups (one training mesh), where verl's -1 shards
    each over every rank: their memory per GPU is that of the actor's groups."""
    world = described_launch(cfg)[0]
    arr = cfg.actor_rollout_ref
    size = arr.actor.fsdp_config.fsdp_size
    if size in (-1, world):
        return []
    keys = [given_name(cfg, f"{key}.fsdp_config.fsdp_size") for key, fc in built_fsdp_sections(cfg).items()
            if key != "actor_rollout_ref.actor" and fc.fsdp_size == -1]
    if not keys:
        return []
    they = "they shard" if len(keys) > 1 else "it shards"
    return [f"{', '.join(keys)}=-1: every model shares the actor's training mesh, so {they} over its shard groups "
            f"of {size} ranks (HYBRID_SHARD, actor_rollout_ref.actor.fsdp_config.fsdp_size={size}), where verl's -1 "
            f"shards a model over all {world} ranks (FULL_SHARD)"]


def _unit_option_notes(cfg: PPOConfig) -> list[str]:
    """The fsdp_config options that shape FSDP2's units (forward_prefetch, wrap_policy) of the models the run
    builds, where their shard groups are of one rank (one GPU, or the actor's fsdp_size=1: the one training
    mesh): `sharding.fsdp` builds no units there (`sharding.replicate`), so nothing reads them."""
    world = described_launch(cfg)[0]
    arr = cfg.actor_rollout_ref
    size = arr.actor.fsdp_config.fsdp_size
    if (world if size == -1 else size) != 1:
        return []
    unread = {f"{key}.fsdp_config.{k}": v for key, fc in built_fsdp_sections(cfg).items()
              for k, v in _non_default(fc, ("forward_prefetch", "wrap_policy")).items()}
    if not unread:
        return []
    why = ("trainer.nnodes x trainer.n_gpus_per_node = 1 rank" if world == 1
           else "actor_rollout_ref.actor.fsdp_config.fsdp_size=1")
    return [f"{_listed(unread, cfg)} has no effect: the shard groups are of one rank ({why}): no FSDP units are built, "
            "each rank holds every parameter whole"]


def _null_verl_copies(cfg: PPOConfig) -> None:
    """The options that verl's generated config interpolates from another one and meshppo does not
    read, null where they are that one's (said at start-up only where set otherwise): the roles'
    profiler finish-hook options (the global profiler's; the rollout's and reward model's: the
    actor's), the rollout's GPUs a node, its trace's project and experiment, and the distillation
    teachers' copies of the rollout's options."""
    arr, gp = cfg.actor_rollout_ref, cfg.global_profiler
    for name in FINISH_HOOK_OPTIONS:
        actor_value = getattr(arr.actor.profiler, name)
        for prof, source in ((arr.rollout.profiler, actor_value), (cfg.reward_model.profiler, actor_value),
                             (arr.actor.profiler, getattr(gp, name)), (arr.ref.profiler, getattr(gp, name)),
                             (cfg.critic.profiler, getattr(gp, name))):
            if getattr(prof, name) in (source, getattr(gp, name)):
                setattr(prof, name, None)
    rollout, trainer = arr.rollout, cfg.trainer
    for obj, name, source in ((rollout, "n_gpus_per_node", trainer.n_gpus_per_node),
                              (rollout.trace, "project_name", trainer.project_name),
                              (rollout.trace, "experiment_name", trainer.experiment_name)):
        if getattr(obj, name) == source:
            setattr(obj, name, None)
    teachers = _without_hydra_targets(cfg.distillation.teacher_models)
    for teacher in teachers.values():
        inference = teacher.get("inference") if isinstance(teacher, dict) else None
        for name in TEACHER_ROLLOUT_COPIES:
            if isinstance(inference, dict) and inference.get(name) == getattr(rollout, name):
                inference[name] = None
    cfg.distillation.teacher_models = teachers


def _without_hydra_targets(tree):
    """A mapping of verl's without its Hydra `_target_` class names (metadata, as `build_dataclass`
    takes them), at any depth."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without_hydra_targets(v) for k, v in tree.items()
            if not (k == "_target_" and isinstance(v, str) and v.startswith("verl."))}


def _copy_of(key: str, obj, name: str, source: str, value) -> None:
    """verl's copy `key` of option `source` (of value `value`): null or equal, then `value`."""
    mine = getattr(obj, name)
    if mine is not None and mine != value:
        raise ConfigError(f"{key}={shown(mine)} differs from {source}={shown(value)}: it is verl's copy of that "
                          "option; leave it null or set it the same")
    setattr(obj, name, value)


def _leaves(section_, other, prefix: str = ""):
    """`(key, value, default, owner, name)` of each leaf option of `section_`, by its dotted key
    under `prefix`, with `owner` the section of `other` (the same section: its class or a subclass)
    that holds the same option, as attribute `name`."""
    for f in dataclasses.fields(section_):
        key = f"{prefix}.{option_key(f)}" if prefix else option_key(f)
        value, theirs = getattr(section_, f.name), getattr(other, f.name)
        if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(theirs):
            yield from _leaves(value, theirs, key)
        else:
            yield key, value, _default(f), other, f.name


def _copy_of_section(key: str, copy_, source_key: str, source) -> None:
    """verl's copy `key` of section `source_key`, option by option: each one it sets other than its
    default must be the source's (verl 0.9.1's rollout profiler copies some of the actor's)."""
    for rel, mine, default, owner, name in _leaves(copy_, source):
        theirs = getattr(owner, name)
        if mine != default and mine != theirs:
            raise ConfigError(f"{key}.{rel}={shown(mine)} differs from {source_key}.{rel}={shown(theirs)}: it is "
                              "verl's copy of that option; leave it out or set it the same")


def _merge_section(key: str, newer, older_key: str, older) -> None:
    """Section `newer` (verl's newer name `key` of section `older_key`) into `older`, option by
    option: one set other than its default sets the older's, which must be at its default or the
    same (verl reads only the newer; meshppo does not guess which one was meant)."""
    for rel, value, default, owner, name in _leaves(newer, older):
        current = getattr(owner, name)
        if value == default or value == current:
            continue
        if current != _default(type(owner).__dataclass_fields__[name]):
            raise ConfigError(f"{key}.{rel}={shown(value)} and {older_key}.{rel}={shown(current)}: both name the "
                              "same setting; set one of them, or both the same")
        setattr(owner, name, value)


def _sp_copy(key: str, role, fsdp) -> None:
    """`fsdp_config.ulysses_sequence_parallel_size`, verl's copy of the role's `key` size (its engine
    workers read that one): 1 leaves the role's; another value must agree with a role's size set
    above 1, and sets it where that is 1 or null."""
    copy, mine = fsdp.ulysses_sequence_parallel_size, role.ulysses_sequence_parallel_size
    if copy == 1:
        return
    fsdp_key = "critic.model" if key == "critic" else "reward_model.model" if key == "reward_model" else key
    if mine not in (None, 1, copy):
        raise ConfigError(f"{given_name(role, f'{fsdp_key}.fsdp_config.ulysses_sequence_parallel_size')}={copy} differs from "
                          f"{key}.ulysses_sequence_parallel_size={mine}: both set the role's Ulysses group size; set "
                          "one of them, or both the same")
    role.ulysses_sequence_parallel_size = copy


def _alias(key: str, obj, name: str, *others, default=None) -> None:
    """Option `key` (attribute `name` of `obj`) and verl's other names of it (`others`: key,
    section, attribute each), null where not set: the value of those set, `default` where none is;
    names set to different values are an error naming them. The value ends at `key`, the other
    names null, so a resolved config resolves to itself."""
    names = {key: getattr(obj, name), **{k: getattr(o, n) for k, o, n in others}}
    given = {k: v for k, v in names.items() if v is not None}
    values = list(given.values())
    if any(v != values[0] for v in values):
        raise ConfigError(f"{' and '.join(f'{k}={shown(v)}' for k, v in given.items())}: "
                          f"{'both name' if len(given) == 2 else 'each names'} the same setting; set one of them, or "
                          f"{'both' if len(given) == 2 else 'all'} the same")
    setattr(obj, name, values[0] if values else copy.deepcopy(default))
    for _, o, n in others:
        setattr(o, n, None)


def _resolve_reward_names(cfg: PPOConfig) -> None:
    """verl 0.9.1's `reward` section and the older names it keeps as deprecated aliases (verl's
    `migrate_legacy_reward_impl` moves an older one's value to the newer): each one setting
    (`_alias`), held at the older name, which meshppo reads. The older names' nulls (0.9.1 writes
    them so) are verl's defaults; the older reward-model server's keys are checked as the newer
    section's (`_check_reward_model_rollout`)."""
    fn, rm, new = cfg.custom_reward_function, cfg.reward_model, cfg.reward
    new_fn, new_rm = new.custom_reward_function, new.reward_model
    for key, obj, name, others, default in (
            ("custom_reward_function.path", fn, "path", [("reward.custom_reward_function.path", new_fn, "path")], None),
            ("custom_reward_function.name", fn, "name", [("reward.custom_reward_function.name", new_fn, "name")],
             "compute_score"),
            ("custom_reward_function.reward_kwargs", fn, "reward_kwargs",
             [("reward.custom_reward_function.reward_kwargs", new_fn, "reward_kwargs")], {}),
            ("reward_model.reward_manager", rm, "reward_manager",
             [("reward_manager.name", cfg.reward_manager, "name"),
              ("reward.reward_manager.name", new.reward_manager, "name")], "naive"),
            ("reward_model.enable", rm, "enable", [("reward.reward_model.enable", new_rm, "enable")], False),
            ("reward_model.model.path", rm.model, "path", [("reward.reward_model.model_path", new_rm, "model_path")],
             None),
            ("reward_model.reward_kwargs", rm, "reward_kwargs", [("reward.reward_kwargs", new, "reward_kwargs")], {})):
        _alias(key, obj, name, *others, default=default)
    for section_, names in ((rm, ("num_workers", "enable_resource_pool", "n_gpus_per_node", "nnodes",
                                  "reward_loop_source")),
                            (rm.model, ("trust_remote_code",)),
                            *((s, ("max_concurrent", "memory_limit_mb"))
                              for s in (rm.sandbox_fusion, cfg.sandbox_fusion, new.sandbox_fusion)),
                            *((m, ("source",)) for m in (cfg.reward_manager, new.reward_manager))):
        for name in names:
            if getattr(section_, name) is None:
                setattr(section_, name, _default(type(section_).__dataclass_fields__[name]))
    _check_reward_model_rollout(rm)


def _check_reward_model_rollout(rm: RewardModelConfig) -> None:
    """The older `reward_model.rollout` (a mapping; verl 0.9.1 writes its keys null, which are left
    out, and its trainer reads `reward.reward_model.rollout` only) checked as that section is, by the
    older names: a value that would change the scores is refused; the rest change nothing (its note)."""
    rm.rollout = {k: v for k, v in rm.rollout.items() if v is not None}  # null: not given
    if rm.rollout:
        build_dataclass(RewardModelRolloutConfig, rm.rollout, "reward_model.rollout")


def _validate_sequence_parallel(cfg: PPOConfig, world_size: int, per_node: int) -> None:
    """Each used role's Ulysses size against the launch, and its packed layout (the model's heads
    are checked when it is built: `setup.build_models`); the packed layout of prefix sharing."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.ulysses_sequence_parallel_size, "actor_rollout_ref.model",
              arr.model.use_remove_padding)]
    if cfg.uses_critic:
        roles.append(("critic", cfg.critic.ulysses_sequence_parallel_size, "critic.model",
                      cfg.critic.model.use_remove_padding))
    if cfg.reward_model.enable:
        roles.append(("reward_model", cfg.reward_model.ulysses_sequence_parallel_size, "reward_model.model",
                      cfg.reward_model.model.use_remove_padding))
    for key, size, model_key, packed in roles:
        try:
            check_sequence_parallel(given_name(cfg, f"{key}.ulysses_sequence_parallel_size"), size, world_size, per_node)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if size > 1 and not packed:
            raise ConfigError(f"{as_set(cfg, f'{key}.ulysses_sequence_parallel_size', size)} with "
                              f"{model_key}.use_remove_padding=false: "
                              "sequence parallelism shards the packed (padding-free) layout; set it to true")
    if arr.actor.use_prefix_grouper and not arr.model.use_remove_padding:
        raise ConfigError("actor_rollout_ref.actor.use_prefix_grouper=true with "
                          "actor_rollout_ref.model.use_remove_padding=false: meshppo shares a prompt among its "
                          "responses in the packed (padding-free) layout; set use_remove_padding=true (earlier "
                          "verl's prefix grouper needed it false, meshppo's needs it true)")


def _validate_reward_model(cfg: PPOConfig) -> None:
    rm = cfg.reward_model
    if not rm.enable:
        return
    if not rm.model.path:
        raise ConfigError(f"{as_set(cfg, 'reward_model.enable', True)} needs reward_model.model.path (verl 0.9.1's "
                          "name: reward.reward_model.model_path)")
    if rm.max_length is not None and rm.model.input_tokenizer is None:
        raise ConfigError(f"reward_model.max_length={rm.max_length} with reward_model.model.input_tokenizer=null: the "
                          "reward model reads the actor's prompt and response tokens as they are, which the prompt "
                          "and response lengths bound; max_length cuts the reward model's own rendering of the chat "
                          "(input_tokenizer set)")


def config_notes(cfg, prefix: str = "", unbuilt: tuple = (), top=None) -> list[str]:
    """One line for each setting whose effect differs from how it reads (printed at start-up).
    `unbuilt`: the sections of the models the run does not build, whose options are named as unread
    (`_unused_section_notes`), not by what they would do; `top`: the whole config, `cfg` its section
    at `prefix` (the options are named as the user set them: `as_set`)."""
    notes, top = [], cfg if top is None else top
    if not prefix:
        notes += _run_notes(cfg)
        built = built_fsdp_sections(cfg)
        unbuilt = tuple(f"{key}." for key in ("actor_rollout_ref.ref", "critic", "reward_model")
                        if not any(k.startswith(key) for k in built))
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{option_key(f)}"
        why = f.metadata.get("no_effect")
        if why and value != _default(f):
            notes.append(f"{as_set(top, key, value)} has no effect: {why}")
        acts = not f"{key}.".startswith(unbuilt)
        if isinstance(value, FSDPOptions) and value.full_shard_note:
            notes.append(value.full_shard_note)
        if getattr(value, "grad_clip_note", None) and acts:  # the actor's and the critic's (`_resolve_grad_clip`)
            notes.append(value.grad_clip_note)
        if isinstance(value, FSDPOptions) and value.superseded and acts:
            frozen = key.startswith(("actor_rollout_ref.ref.", "reward_model."))  # (no gradients, no optimizer)
            notes.append(f"{as_set(top, f'{key}.offload_policy', True)} supersedes "
                         f"{' and '.join(_short_name(top, key, k, 'offload_policy') + '=true' for k in value.superseded)} "
                         f"(as in verl): {'its parameters stay' if frozen else 'parameters, gradients and optimizer states stay'} "
                         "on CPU for the whole run (FSDP2 CPUOffloadPolicy) and are not moved between phases")
        if dataclasses.is_dataclass(value):
            notes.extend(config_notes(value, f"{key}.", unbuilt, top))
    return notes


def full_determinism_sections(cfg: PPOConfig) -> dict:
    """The sections with a `full_determinism` switch that this run reads, by their key: the
    `fsdp_config` of each role it builds (not the reference's under LoRA: the actor with its adapters
    off is the reference), the rollout's and verl's reward-model server's (with a reward model, as verl
    reads it). Any one true makes the process deterministic."""
    sections = {f"{key}.fsdp_config": fc for key, fc in built_fsdp_sections(cfg).items()}
    sections["actor_rollout_ref.rollout"] = cfg.actor_rollout_ref.rollout
    if cfg.reward_model.enable:
        sections["reward.reward_model.rollout"] = cfg.reward.reward_model.rollout
    return sections


def validation_runs(cfg: PPOConfig) -> bool:
    """Whether the run validates: it has data.val_files and validation is scheduled (before training,
    every trainer.test_freq steps, or trainer.val_only)."""
    t = cfg.trainer
    return bool(cfg.data.val_files) and (t.val_before_train or t.test_freq > 0 or t.val_only)


def _run_notes(cfg: PPOConfig) -> list[str]:
    """The notes that depend on several sections or on the machine."""
    notes = []
    if cfg.trainer.wandb_proxy and "wandb" not in cfg.trainer.logger:
        notes.append(f"trainer.wandb_proxy={cfg.trainer.wandb_proxy} has no effect: it is wandb's proxy, and "
                     f"trainer.logger=[{', '.join(cfg.trainer.logger)}] has no wandb")
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    if rollout.name in SERVER_ENGINES:
        notes.append(f"actor_rollout_ref.rollout.name={rollout.name}: meshppo generates with its own engine (native); "
                     f"{rollout.name} is not used, and the rollout options it shares with verl tune meshppo's engine")
    if rollout.chunked_prefill != rollout.enable_chunked_prefill:
        notes.append(f"actor_rollout_ref.rollout.enable_chunked_prefill=false has no effect with rollout.name="
                     f"{rollout.name}: it is vLLM's option, which verl passes to vLLM only; meshppo's engine splits "
                     "long prefills")
    if rollout.ignore_eos and rollout.name in NOT_VLLM_ENGINES:
        notes.append(f"actor_rollout_ref.rollout.ignore_eos=true with rollout.name={rollout.name}: meshppo's engine "
                     f"generates past EOS, as verl's vLLM server does; verl's {rollout.name} server does not pass the "
                     "option on, and stops at EOS")
    validates = validation_runs(cfg)  # (else the options only validation reads have their own note)
    if rollout.engine != "hf":
        for key, opts, default, validate in (("rollout.do_sample", rollout, True, False),
                                             ("rollout.val_kwargs.do_sample", rollout.val_kwargs, False, True)):
            if validate and not validates:
                continue
            t = rollout.decoding_temperature(validate)
            if opts.do_sample != default and opts.do_sample != (t > 0):  # it asks for what the temperature does not
                what = f"samples at temperature {t:g}" if t > 0 else "decodes greedily (temperature 0)"
                notes.append(f"actor_rollout_ref.{key}={shown(opts.do_sample)} has no effect with rollout.name="
                             f"{rollout.name}: as in verl, whose vLLM and SGLang rollouts (its agent loop) do not read "
                             f"it (its hf rollout does), the {'validation' if validate else 'training'} rollout {what}; "
                             f"actor_rollout_ref.{key.replace('do_sample', 'temperature')} decides")
    rc = cfg.algorithm.rollout_correction
    engine_log_probs = rollout.calculate_log_probs or rc.bypass_mode or rc.rollout_is is not None or bool(rc.rejection)
    if engine_log_probs and rollout.decoding_temperature() > 0 and (rollout.top_k > 0 or rollout.top_p < 1):
        notes.append(f"actor_rollout_ref.rollout.logprobs_mode={rollout.logprobs_mode} with top_k={rollout.top_k}, "
                     f"top_p={rollout.top_p:g}: meshppo's engine log-probs are those of the whole softmax(logits / "
                     "temperature); vLLM's are renormalised to the top-k / top-p tokens")
    # top_k / top_p truncate a sampled distribution (the validation's: only where it runs)
    for validate, key in ((False, "actor_rollout_ref.rollout"), (True, "actor_rollout_ref.rollout.val_kwargs")):
        opts = rollout.val_kwargs if validate else rollout
        unused = {f"{key}.{k}": v for k, v, acts in (("top_k", opts.top_k, opts.top_k > 0),
                                                     ("top_p", opts.top_p, opts.top_p < 1)) if acts}
        if unused and rollout.decoding_temperature(validate) == 0 and (validates or not validate):
            why = (f"{key}.temperature=0" if opts.temperature == 0 else f"{key}.do_sample=false with rollout.name=hf")
            notes.append(f"{_listed(unused)} has no effect: the {'validation' if validate else 'training'} rollouts "
                         f"decode greedily ({why})")
    if rollout.mode == "async":
        notes.append("actor_rollout_ref.rollout.mode=async: meshppo's engine runs in-process on every rank; the "
                     "single-turn rollouts are the same as with sync (verl's agent-loop servers are not used)")
    if rollout.engine != "native":
        tuned = list(_non_default(rollout, ENGINE_TUNING_OPTIONS))
        # resolved from the data section unless set: only a value of their own is the user's
        tuned += [k for k, inherited in (("prompt_length", cfg.data.max_prompt_length),
                                         ("max_model_len", rollout.prompt_length + rollout.response_length))
                  if getattr(rollout, k) != inherited]
        if tuned:
            notes.append(f"{', '.join(f'actor_rollout_ref.rollout.{k}' for k in tuned)} tune meshppo's engine; "
                         f"rollout.name={rollout.name} does not use them")
        if arr.actor.fsdp_config.param_offload:
            notes.append("actor_rollout_ref.actor.fsdp_config.param_offload=true frees nothing with "
                         f"rollout.name={rollout.name}: the actor generates, so its parameters stay on the device "
                         "(optimizer_offload still moves the optimizer states out during generation)")
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        notes.append(f"algorithm.rollout_correction.rollout_is={rc.rollout_is} with bypass_mode=true and loss_type="
                     "ppo_clip: the weights are computed for their rollout_corr/* metrics only (as in verl): the "
                     "PPO ratio pi_theta / pi_rollout already is the importance weight (loss_type=reinforce applies "
                     "them)")
    if arr.actor.calculate_sum_pi_squared and rc.bypass_mode:
        notes.append("actor_rollout_ref.actor.calculate_sum_pi_squared=true has no effect with "
                     "algorithm.rollout_correction.bypass_mode=true: bypass mode runs no old-log-prob pass to compute "
                     "the sums in (as in verl), so no variance_proxy/* metrics either")
    notes += _adapter_notes(arr.model)
    adv = cfg.algorithm.adv_estimator
    if adv in SINGLETON_ESTIMATORS and rollout.n == 1:
        notes.append(f"algorithm.adv_estimator={adv} with actor_rollout_ref.rollout.n=1: every group holds one "
                     "response, whose advantage is its score as it is (as in verl: a group of one has mean 0"
                     + (" and std 1" if adv.startswith("grpo") else "") + "), with no baseline; set rollout.n >= 2 "
                     "for the group baseline")
    if cfg.trainer.resume_from_path and cfg.trainer.resume_mode == "auto":
        notes.append(f"trainer.resume_from_path={cfg.trainer.resume_from_path} is not read with trainer.resume_mode="
                     "auto (as in verl): the run resumes the newest checkpoint in trainer.default_local_dir, if any; "
                     "set trainer.resume_mode=resume_path to resume from it")
    if cfg.trainer.remove_previous_ckpt_in_save:
        counts = ["trainer.max_actor_ckpt_to_keep"] + (["trainer.max_critic_ckpt_to_keep"] if cfg.uses_critic else [])
        notes.append(f"trainer.remove_previous_ckpt_in_save=true keeps only the newest checkpoint, over any "
                     f"{' or '.join(counts)} (as verl 0.9.1 does, which deprecates the switch): set "
                     f"{' and '.join(f'{key}=1' for key in counts)} instead")
    keep, actor_keep = cfg.trainer.max_critic_ckpt_to_keep, cfg.trainer.max_actor_ckpt_to_keep
    if keep is not None and not cfg.uses_critic:
        notes.append(f"trainer.max_critic_ckpt_to_keep={keep} has no effect: algorithm.adv_estimator="
                     f"{cfg.algorithm.adv_estimator} trains no critic")
    elif keep is None and actor_keep is not None and cfg.uses_critic:
        notes.append(f"trainer.max_critic_ckpt_to_keep=null: the critic is saved in the actor's checkpoints, so the "
                     f"last {actor_keep} are kept (trainer.max_actor_ckpt_to_keep; verl would keep every critic "
                     "checkpoint)")
    if cfg.data.max_response_length != rollout.response_length:
        notes.append(f"data.max_response_length={cfg.data.max_response_length} is not used: "
                     f"actor_rollout_ref.rollout.response_length={rollout.response_length} sets the responses' length")
    fn = cfg.custom_reward_function
    if fn.path is None and fn.name != "compute_score":  # (resolved: null is verl's default, compute_score)
        notes.append(f"{as_set(cfg, 'custom_reward_function.name', fn.name)} has no effect: "
                     f"{said_key(cfg, 'custom_reward_function.path')} is null (the "
                     "built-in scorers score each row by its data_source)")
    notes += _reward_manager_notes(cfg)
    for key, model in model_sections(cfg).items():
        if key not in models_run(cfg):  # (_unused_section_notes names its overrides)
            continue
        overrides = model.override_config
        inert, acting = check_overrides(overrides)[1], acting_overrides(key, overrides)
        for name in overrides:
            if name not in acting:
                notes.append(f"{key}.override_config.{name}={shown(overrides[name])} has no effect: "
                             f"{inert.get(name, _RM_UNREAD_WHY)}")
    sections = full_determinism_sections(cfg)
    on = [k for k, fc in sections.items() if fc.full_determinism]
    off = [k for k, fc in sections.items() if k.endswith(".fsdp_config") and not fc.full_determinism]
    if on and off:  # (the servers' switches, verl's rollout's and reward model's, are named only where set)
        notes.append(f"{', '.join(given_name(cfg, f'{k}.full_determinism') for k in on)}=true makes every role "
                     "deterministic: the "
                     f"roles share their processes (also {', '.join(off)})")
    if not cfg.reward_model.enable and cfg.reward.reward_model.rollout.full_determinism:
        notes.append("reward.reward_model.rollout.full_determinism=true has no effect: reward_model.enable is false "
                     "(it makes the reward model's scores deterministic)")
    notes += _shared_mesh_notes(cfg) + _unit_option_notes(cfg)
    # of the frozen models the run builds (the others' options are named with their section's, or with LoRA's)
    frozen = [key for key, fc in built_fsdp_sections(cfg).items()
              if key in ("actor_rollout_ref.ref", "reward_model.model") and fc.optimizer_offload]
    if frozen:
        notes.append(f"{', '.join(f'{k}.fsdp_config.optimizer_offload' for k in frozen)}: a frozen model has no "
                     "optimizer states, there is nothing to offload")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        notes.append("algorithm.rollout_correction.rollout_is_batch_normalize=true has no effect: rollout_is is null "
                     "(no importance weights to normalise)")
    alg = cfg.algorithm
    if not alg.use_kl_in_reward:
        unused = {f"algorithm.kl_ctrl.{k}": v for k, v in
                  _non_default(alg.kl_ctrl, [f.name for f in dataclasses.fields(alg.kl_ctrl)]).items()}
        unused.update({f"algorithm.{k}": v for k, v in _non_default(alg, ("kl_penalty",)).items()})
        if unused:
            notes.append(f"{', '.join(f'{k}={shown(v)}' for k, v in unused.items())} has no effect: "
                         "algorithm.use_kl_in_reward=false (it sets the KL penalty in the reward)")
    if not arr.actor.use_kl_loss:
        unused = _non_default(arr.actor, ("kl_loss_coef", "kl_loss_type"))
        if unused:
            notes.append(f"{', '.join(f'actor_rollout_ref.actor.{k}={shown(v)}' for k, v in unused.items())} has no "
                         "effect: actor_rollout_ref.actor.use_kl_loss=false (it sets the KL loss)")
    adv = alg.adv_estimator
    discount = {k: v for k, v in _non_default(alg, ("gamma", "lam")).items()
                if not (adv == "gae" or (k == "gamma" and adv == "reinforce_plus_plus"))}
    if discount:
        notes.append(f"{', '.join(f'algorithm.{k}={shown(v)}' for k, v in discount.items())} has no effect with "
                     f"algorithm.adv_estimator={adv} (gamma discounts gae's and reinforce_plus_plus's returns, lam is "
                     "gae's)")
    switched = (("algorithm.filter_groups.enable", alg.filter_groups.enable, "algorithm.filter_groups",
                 alg.filter_groups, ("metric", "max_num_gen_batches")),
                ("algorithm.use_pf_ppo", alg.use_pf_ppo, "algorithm.pf_ppo", alg.pf_ppo,
                 [f.name for f in dataclasses.fields(alg.pf_ppo)]),
                ("algorithm.rollout_correction.rollout_is", alg.rollout_correction.rollout_is is not None,
                 "algorithm.rollout_correction", alg.rollout_correction, ("rollout_is_threshold",)))
    for switch, on, key, section_, names in switched:
        unused = _non_default(section_, names)
        if not on and unused:
            notes.append(f"{', '.join(f'{key}.{k}={shown(v)}' for k, v in unused.items())} has no effect: "
                         f"{switch} is {'null' if switch.endswith('rollout_is') else 'false'}")
    if alg.use_pf_ppo and alg.pf_ppo.reweight_method != "pow" and _non_default(alg.pf_ppo, ("weight_pow",)):
        notes.append(f"algorithm.pf_ppo.weight_pow={shown(alg.pf_ppo.weight_pow)} has no effect: "
                     f"algorithm.pf_ppo.reweight_method={alg.pf_ppo.reweight_method} (it is the pow method's power)")
    if alg.filter_groups.enable and arr.rollout.n == 1:
        notes.append("algorithm.filter_groups.enable=true has no effect with actor_rollout_ref.rollout.n=1: each "
                     "prompt's group is its one response, and a group of one is always kept (as in verl)")
    notes += _unused_section_notes(cfg)
    if alg.use_kl_in_reward and arr.actor.use_kl_loss:
        notes.append("algorithm.use_kl_in_reward=true and actor_rollout_ref.actor.use_kl_loss=true: the KL to the "
                     "reference is penalised twice, in the reward and in the loss")
    if alg.use_kl_in_reward and alg.kl_ctrl.type == "fixed":
        unused = _non_default(alg.kl_ctrl, ("horizon", "target_kl"))
        if unused:
            notes.append(f"{_listed({f'algorithm.kl_ctrl.{k}': v for k, v in unused.items()})} has no effect: "
                         "algorithm.kl_ctrl.type=fixed (they steer the adaptive controller)")
    if adv not in GRPO_ESTIMATORS and not alg.norm_adv_by_std_in_grpo:
        why = ("gdpo always divides each reward component by its group std, as verl's" if adv == "gdpo" else
               f"only {', '.join(GRPO_ESTIMATORS[:-1])} and {GRPO_ESTIMATORS[-1]} divide by the group std")
        notes.append(f"algorithm.norm_adv_by_std_in_grpo=false has no effect with algorithm.adv_estimator={adv} ({why})")
    notes += _gdpo_notes(alg)
    actor = arr.actor
    critic_own = cfg.uses_critic and cfg.critic.loss_scale_factor != actor.loss_scale_factor  # not the inherited
    # the actor's is also the critic's where it inherits it: read where the critic's aggregation divides by it
    critic_reads_actors = (cfg.uses_critic and not critic_own
                           and cfg.critic.loss_agg_mode == "seq-mean-token-sum-norm")
    for key, role, read in (("actor_rollout_ref.actor", actor, not critic_reads_actors),
                            ("critic", cfg.critic, critic_own)):
        if read and role.loss_scale_factor is not None and role.loss_agg_mode != "seq-mean-token-sum-norm":
            notes.append(f"{key}.loss_scale_factor={role.loss_scale_factor} has no effect: {key}.loss_agg_mode="
                         f"{role.loss_agg_mode} (it is seq-mean-token-sum-norm's divisor)")
    models = [("actor_rollout_ref.model", arr.model, arr.model.lora_adapter_path is None)]
    models += [("critic.model", cfg.critic.model, cfg.uses_critic)]  # (else the critic's note says them)
    for key, model, read in models:
        unused = _non_default(model, ("lora_alpha", "target_modules", "exclude_modules"))
        if read and not model.lora_rank and unused:
            notes.append(f"{_listed({f'{key}.{k}': v for k, v in unused.items()})} has no effect: {key}.lora_rank=0 "
                         "(no LoRA adapters)")
    for key, optim in (("actor_rollout_ref.actor.optim", arr.actor.optim), ("critic.optim", cfg.critic.optim)):
        unused = _non_default(optim, ("min_lr_ratio", "num_cycles", "zero_indexed_step"))
        if optim.lr_scheduler_type == "constant" and unused and (key != "critic.optim" or cfg.uses_critic):
            notes.append(f"{', '.join(f'{key}.{k}={shown(v)}' for k, v in unused.items())} has no effect: "
                         f"{as_set(cfg, f'{key}.lr_scheduler_type', 'constant')} (they shape the cosine schedule)")
        if optim.lr_warmup_steps > 0 and optim.lr_warmup_steps_ratio and (key != "critic.optim" or cfg.uses_critic):
            notes.append(f"{key}.lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio:g} has no effect: "
                         f"{key}.lr_warmup_steps={optim.lr_warmup_steps} sets the warm-up (a count above 0 wins over "
                         "the ratio, as in verl)")
    notes += _token_budget_notes(cfg)
    if cfg.trainer.test_freq > 0 and not cfg.data.val_files:
        notes.append(f"trainer.test_freq={cfg.trainer.test_freq}: data.val_files is empty, so no validation runs "
                     "(verl refuses a run without validation data)")
    if not cfg.data.shuffle and cfg.data.seed != _default(DataConfig.__dataclass_fields__["seed"]):
        notes.append(f"{_listed({'data.seed': cfg.data.seed})} has no effect: "
                     "data.shuffle=false (the prompts go in file order; train_max_samples and val_max_samples take "
                     "the first rows)")
    if cfg.data.filter_overlong_prompts and cfg.data.truncation != "error":
        notes.append(f"data.truncation={cfg.data.truncation} has no effect: data.filter_overlong_prompts=true drops the "
                     "prompts longer than data.max_prompt_length (truncation cuts those not filtered)")
    t = cfg.trainer
    if not validation_runs(cfg):  # the options only validation reads
        unused = {"data.val_files": cfg.data.val_files} if cfg.data.val_files else {}
        unused |= {f"data.{k}": v for k, v in _non_default(cfg.data, ("val_batch_size", "val_max_samples")).items()}
        unused |= {f"trainer.{k}": v for k, v in _non_default(t, ("log_val_generations", "validation_data_dir")).items()}
        unused |= {f"actor_rollout_ref.rollout.val_kwargs.{k}": v for k, v in _set_options(rollout.val_kwargs,
                                                                             SamplingOverrides()).items()}
        why = ("data.val_files is empty" if not cfg.data.val_files else
               f"trainer.val_before_train=false and trainer.test_freq={t.test_freq}")
        if unused:
            notes.append(f"{_listed(unused)} has no effect: {why}, so no validation runs")
    guard = alg.kl_guard
    if not cfg.uses_ref and _non_default(guard, [f.name for f in dataclasses.fields(guard)]):
        notes.append("algorithm.kl_guard watches the KL to the reference, and this run has none "
                     "(actor_rollout_ref.actor.use_kl_loss=false, algorithm.use_kl_in_reward=false): it never acts")
    elif not guard.enable:
        unused = _non_default(guard, [f.name for f in dataclasses.fields(guard) if f.name != "enable"])
        if unused:
            notes.append(f"{_listed({f'algorithm.kl_guard.{k}': v for k, v in unused.items()})} has no effect: "
                         "algorithm.kl_guard.enable is false")
    else:
        for action, names in (("raise_coef", ("coef_multiplier", "max_kl_coef")), ("lower_lr", ("lr_multiplier",))):
            unused = _non_default(guard, names)
            if unused and action not in (guard.warn_action, guard.explode_action):
                notes.append(f"{_listed({f'algorithm.kl_guard.{k}': v for k, v in unused.items()})} has no effect: "
                             f"neither algorithm.kl_guard.warn_action nor explode_action is {action} (which reads it)")
        notes += _raise_coef_notes(cfg)
    ref = list(_non_default(arr.ref, ("fsdp_config",)))
    if arr.ref.use_torch_compile != arr.actor.use_torch_compile:  # null inherits the actor's
        ref.insert(0, "use_torch_compile")
    if arr.model.adapted and ref and cfg.uses_ref:  # (without a reference, _unused_section_notes)
        notes.append(f"{', '.join(f'actor_rollout_ref.ref.{k}' for k in ref)} unused: with LoRA the reference is the "
                     "actor with its adapters off, not a model of its own")
    for key, tiled in (("actor_rollout_ref.model", arr.model.tiled_mlp), ("critic.model", cfg.critic.model.tiled_mlp)):
        # (without a critic, _unused_section_notes names its tiled_mlp)
        if key in models_run(cfg) and not tiled.enabled and tiled.num_shards != TiledMLPConfig.num_shards:
            notes.append(f"{key}.tiled_mlp.num_shards={tiled.num_shards} has no effect: read only with "
                         f"{key}.tiled_mlp.enabled=true")
    return notes + _policy_loss_notes(cfg) + profiling_notes(cfg)


GRPO_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk")
"""The estimators that read algorithm.norm_adv_by_std_in_grpo."""


def _unused_section_notes(cfg: PPOConfig) -> list[str]:
    """The options the user set of a section its switch leaves unread: the critic's without a critic,
    the reward model's without one, the reference's without one, multi-turn's with it off."""
    notes = []
    if not cfg.uses_critic:
        # enable agrees with the estimator, strategy's values both mean FSDP2, profiling_notes says
        # profiler.enable (the model's override_config and tiled_mlp are named here, not in their own notes)
        unused = _user_options(cfg, "critic", {"enable", "strategy", "profiler.enable"})
        if unused:
            notes.append(f"{_listed(unused, cfg)} has no effect: algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                         "trains no critic")
    rm = cfg.reward_model
    if not rm.enable:
        # reward_manager and reward_kwargs call the rule reward (override_config is named here, not in its notes)
        unused = _user_options(cfg, "reward_model", {"enable", "reward_manager", "reward_kwargs", "strategy",
                                                     "profiler.enable"})
        if unused:
            notes.append(f"{_listed(unused, cfg)} has no effect: {said_key(cfg, 'reward_model.enable')} is false")
    if not cfg.uses_ref:
        # strategy's values both mean FSDP2, profiling_notes says profiler.enable
        unused = _user_options(cfg, "actor_rollout_ref.ref", {"strategy", "profiler.enable"})
        if unused:
            notes.append(f"{_listed(unused, cfg)} has no effect: the run has no reference "
                         "(actor_rollout_ref.actor.use_kl_loss=false, algorithm.use_kl_in_reward=false)")
    mt, key = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not mt.enable:  # (its tool_config_path too, with the data.tool_config_path that must name the same file)
        unused = _set_options(mt, MultiTurnConfig(), skip={"enable"})
        if unused:
            notes.append(f"{_listed({f'{key}.{k}': v for k, v in unused.items()})} has no effect: {key}.enable is "
                         "false")
    return notes


# The actor options that only some policy losses read, and which of them each loss reads.
_CLIP = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
_LOSS_OPTIONS = {"vanilla": (*_CLIP, "clip_ratio_c"), "dppo_tv": (*_CLIP, "clip_ratio_c"),
                 "dppo_kl": (*_CLIP, "clip_ratio_c"), "gspo": _CLIP, "sapo": ("tau_pos", "tau_neg"), "gpg": (),
                 "clip_cov": (*_CLIP, "policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb",
                              "policy_loss.clip_cov_ub"),
                 "kl_cov": ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"), "geo_mean": _CLIP,
                 "dro": ("policy_loss.dro_beta",), "cispo": _CLIP}
# The losses that weigh every sequence the same whatever loss_agg_mode (as verl).
_SEQUENCE_LOSSES = ("sapo", "geo_mean")


def _policy_loss_notes(cfg: PPOConfig) -> list[str]:
    """The actor's loss options that the policy loss of the run does not read, where set."""
    actor, rc = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    mode = BYPASS_LOSS_TYPES[rc.loss_type] if rc.bypass_mode else actor.policy_loss.loss_mode
    chosen = (f"algorithm.rollout_correction.loss_type={rc.loss_type}" if rc.bypass_mode
              else f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}")
    unread = []
    for key in sorted({k for keys in _LOSS_OPTIONS.values() for k in keys} - set(_LOSS_OPTIONS[mode])):
        section, _, name = key.rpartition(".")
        if _non_default(getattr(actor, section) if section else actor, [name]):
            unread.append(f"actor_rollout_ref.actor.{key}")
    notes = [f"{', '.join(unread)} not read by {chosen}"] if unread else []
    if ("clip_ratio" in _LOSS_OPTIONS[mode] and None not in (actor.clip_ratio_low, actor.clip_ratio_high)
            and _non_default(actor, ["clip_ratio"])):
        notes.append(f"actor_rollout_ref.actor.clip_ratio={shown(actor.clip_ratio)} has no effect: clip_ratio_low and "
                     "clip_ratio_high are both set (clip_ratio is their default)")
    if mode in _SEQUENCE_LOSSES and actor.loss_agg_mode != "seq-mean-token-mean":
        # (a critic that inherits the mode aggregates its value loss by it too; null inherits it)
        critic = ", and the critic's value loss (critic.loss_agg_mode inherits it)" if (
            cfg.uses_critic and cfg.critic.loss_agg_mode == actor.loss_agg_mode) else ""
        notes.append(f"{chosen} weighs every sequence the same (as verl): actor_rollout_ref.actor.loss_agg_mode="
                     f"{actor.loss_agg_mode} aggregates the entropy and KL-loss terms only{critic}")
    return notes


def _gdpo_notes(alg: AlgorithmConfig) -> list[str]:
    """gdpo's keys without gdpo, and the KL in the reward with gdpo (which reads the components only)."""
    if alg.adv_estimator != "gdpo":
        unused = _non_default(alg, ("gdpo_reward_keys", "gdpo_reward_weights"))
        return [f"{_listed({f'algorithm.{k}': v for k, v in unused.items()})} has no effect: "
                f"algorithm.adv_estimator={alg.adv_estimator} (they are gdpo's)"] if unused else []
    if alg.use_kl_in_reward:
        return ["algorithm.use_kl_in_reward=true does not reach the advantages: algorithm.adv_estimator=gdpo "
                "normalises the reward components (gdpo_reward_keys), not the token rewards (as in verl)"]
    return []


def _raise_coef_notes(cfg: PPOConfig) -> list[str]:
    """A KL guard's raise_coef that can change no coefficient: each enabled one is 0 (multiplying keeps
    it 0) or already at or above max_kl_coef (raising never lowers it) and stays there (a fixed one;
    the adaptive in-reward controller may later lower it below the cap)."""
    guard, alg, actor = cfg.algorithm.kl_guard, cfg.algorithm, cfg.actor_rollout_ref.actor
    actions = [f"algorithm.kl_guard.{name}=raise_coef" for name in ("warn_action", "explode_action")
               if getattr(guard, name) == "raise_coef"]
    coefs = []  # (key, value, whether it can move on its own)
    if actor.use_kl_loss:
        coefs.append(("actor_rollout_ref.actor.kl_loss_coef", actor.kl_loss_coef, False))
    if alg.use_kl_in_reward:
        coefs.append(("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef, alg.kl_ctrl.type == "adaptive"))
    stuck = [(key, value) for key, value, moves in coefs
             if value == 0 or (value >= guard.max_kl_coef and not moves)]
    if not actions or not coefs or len(stuck) < len(coefs):
        return []
    cap = f"algorithm.kl_guard.max_kl_coef={shown(guard.max_kl_coef)}"
    why = ", ".join(f"{key}={shown(value)} "
                    + ("stays 0 when multiplied" if value == 0 else f"is already at {cap} or above")
                    for key, value in stuck)
    return [f"{' and '.join(actions)} can change no KL coefficient: {why} (raise_coef multiplies a coefficient up "
            "to max_kl_coef and never lowers it)"]


def _token_budget_notes(cfg: PPOConfig) -> list[str]:
    """The token budgets set where their pass batches by sequence counts, of the roles the run has (the
    others' are named with their section's unread options). The actor's is also the log-prob passes' where
    they inherit it: read if any of them packs by tokens."""
    arr, critic, rm = cfg.actor_rollout_ref, cfg.critic, cfg.reward_model
    actor = arr.actor
    a, r, f = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    forwards = [(r, arr.rollout)] + ([(f, arr.ref)] if cfg.uses_ref else [])
    unread = []  # (the switch that leaves them unread, {key: value})
    if (actor.ppo_max_token_len_per_gpu != _default(ActorConfig.__dataclass_fields__["ppo_max_token_len_per_gpu"])
            and not actor.use_dynamic_bsz and not any(role.log_prob_use_dynamic_bsz for _, role in forwards)):
        unread.append((f"{a}.use_dynamic_bsz=false, and no log-prob pass packs by tokens",
                       {f"{a}.ppo_max_token_len_per_gpu": actor.ppo_max_token_len_per_gpu}))
    for key, role in forwards:  # (null inherits the actor's: one of another value was set)
        if role.log_prob_max_token_len_per_gpu != actor.ppo_max_token_len_per_gpu and not role.log_prob_use_dynamic_bsz:
            unread.append((f"{key}.log_prob_use_dynamic_bsz=false",
                           {f"{key}.log_prob_max_token_len_per_gpu": role.log_prob_max_token_len_per_gpu}))
    if cfg.uses_critic and not critic.use_dynamic_bsz:
        budgets = {k: v for k, v, own in (
            ("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu,
             critic.ppo_max_token_len_per_gpu != _default(CriticConfig.__dataclass_fields__["ppo_max_token_len_per_gpu"])),
            ("critic.forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu,
             critic.forward_max_token_len_per_gpu != critic.ppo_max_token_len_per_gpu)) if own}
        if budgets:
            unread.append(("critic.use_dynamic_bsz=false", budgets))
    budget = rm.forward_max_token_len_per_gpu
    if rm.enable and not rm.use_dynamic_bsz and budget != _default(
            RewardModelConfig.__dataclass_fields__["forward_max_token_len_per_gpu"]):
        unread.append(("reward_model.use_dynamic_bsz=false", {"reward_model.forward_max_token_len_per_gpu": budget}))
    notes = [f"{_listed(budgets)} has no effect: {switch} (a token budget is read by dynamic micro-batches only)"
             for switch, budgets in unread]
    return notes + _micro_batch_size_notes(cfg, forwards)


def _micro_batch_size_notes(cfg: PPOConfig, forwards: list) -> list[str]:
    """The micro-batch sizes set where their pass packs by tokens (`_token_budget_notes`' mirror), of the
    roles the run has. A size the next pass inherits (the actor's: the old-log-prob pass's and the
    critic's; the old-log-prob pass's: the reference's) is read where that pass batches by sequences."""
    arr, critic, rm = cfg.actor_rollout_ref, cfg.critic, cfg.reward_model
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    a = "actor_rollout_ref.actor"
    by_count = [(role.log_prob_micro_batch_size_per_gpu, not role.log_prob_use_dynamic_bsz) for _, role in forwards]
    if cfg.uses_critic:
        by_count.append((critic.ppo_micro_batch_size_per_gpu, not critic.use_dynamic_bsz))
    unread = []  # (the switch that leaves them unread, {key: value})
    size = actor.ppo_micro_batch_size_per_gpu
    if size is not None and actor.use_dynamic_bsz and not any(s == size and counts for s, counts in by_count):
        unread.append((f"{a}.use_dynamic_bsz=true", {f"{a}.ppo_micro_batch_size_per_gpu": size}))
    sources = {"actor_rollout_ref.rollout": size, "actor_rollout_ref.ref": rollout.log_prob_micro_batch_size_per_gpu}
    for key, role in forwards:  # (null inherits the one before: one of another value was set)
        own = role.log_prob_micro_batch_size_per_gpu
        read_on = cfg.uses_ref and key.endswith("rollout") and ref.log_prob_micro_batch_size_per_gpu == own and \
            not ref.log_prob_use_dynamic_bsz  # the reference inherits it
        if own is not None and own != sources[key] and role.log_prob_use_dynamic_bsz and not read_on:
            unread.append((f"{key}.log_prob_use_dynamic_bsz=true", {f"{key}.log_prob_micro_batch_size_per_gpu": own}))
    if cfg.uses_critic and critic.use_dynamic_bsz:
        sizes = {k: v for k, v, own in (
            ("critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu,
             critic.ppo_micro_batch_size_per_gpu not in (None, size)),
            ("critic.forward_micro_batch_size_per_gpu", critic.forward_micro_batch_size_per_gpu,
             critic.forward_micro_batch_size_per_gpu not in (None, critic.ppo_micro_batch_size_per_gpu))) if own}
        if sizes:
            unread.append(("critic.use_dynamic_bsz=true", sizes))
    if rm.enable and rm.use_dynamic_bsz and rm.micro_batch_size_per_gpu is not None:
        unread.append(("reward_model.use_dynamic_bsz=true",
                       {"reward_model.micro_batch_size_per_gpu": rm.micro_batch_size_per_gpu}))
    return [f"{_listed(sizes, cfg)} has no effect: {switch} (its micro-batches are packed by token budget)"
            for switch, sizes in unread]


def _reward_manager_notes(cfg: PPOConfig) -> list[str]:
    """The reward manager's settings that do not act, or act otherwise than they may read; a reward
    function the reward model replaces (verl 0.9.1 scores with the function then)."""
    rm, fn = cfg.reward_model, cfg.custom_reward_function
    if rm.enable and rm.combine == "replace" and fn.path is not None:
        return [f"{as_set(cfg, 'custom_reward_function.path', fn.path)} is not used: the reward model replaces the rule reward "
                "(reward_model.combine=replace, as verl's legacy reward-model worker does); verl 0.9.1's reward loop "
                "scores with the function alone when both are set, letting it call the reward model's inference "
                "server, which meshppo does not run; reward_model.combine=add adds the model's score to the "
                "function's"]
    if rm.enable and rm.combine == "replace" and rm.reward_manager != "naive":
        return [f"{as_set(cfg, 'reward_model.reward_manager', rm.reward_manager)} is not used: the reward model replaces the rule "
                "reward (reward_model.combine=replace; in verl the manager passes the model's scores on)"]
    if rm.reward_manager != "dapo":
        return []
    kw = rm.manager_kwargs()
    max_len, b, key = kw["max_resp_len"], kw["overlong_buffer_cfg"], given_name(cfg, REWARD_KWARGS_KEY)
    if b is None and max_len is not None:
        return [f"{key}.max_resp_len has no effect without {key}.overlong_buffer_cfg"]
    limit = cfg.response_length
    if b is not None and b.enable and max_len != limit:
        reach = (f"beyond the longest response ({limit} tokens)" if max_len > limit
                 else f"and keeps falling up to the longest response ({limit} tokens)")
        return [f"{key}.max_resp_len={max_len} is not actor_rollout_ref.rollout.response_length={limit}: as in verl, "
                f"the overlong penalty starts at {max_len} - {b.len} = {max_len - b.len} tokens and reaches "
                f"-{b.penalty_factor:g} at {max_len} tokens, {reach}"]
    return []


OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""The estimators that read the old log-probs, the sums of squared probabilities and the rollout
importance weights (verl's optimal token baseline)."""

GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo", "grpo_passk", "rloo", "rloo_vectorized",
                    "reinforce_plus_plus_baseline", "opo", "gpg")
# group estimators that verl runs at rollout.n=1 (a group of one: GRPO's mean 0 and std 1, RLOO's raw score)
SINGLETON_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo", "rloo")  # (verl's rloo_vectorized gives a group of one 0)


def described_launch(cfg: PPOConfig) -> tuple[int, int]:
    """(ranks, ranks per node) of the launch the config describes: `trainer.nnodes` x `trainer.n_gpus_per_node`."""
    t = cfg.trainer
    return t.nnodes * t.n_gpus_per_node, t.n_gpus_per_node


def _same_file(a: str, b: str | None) -> bool:
    """Whether the paths `a` and `b` name the same file, however spelled (`./x.yaml`, `x.yaml`, through a
    link): the same file when both exist, else the same resolved path."""
    if b is None:
        return False
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _mini_batch_share(what: str, seqs: int, world_size: int, sp: int, change: str) -> tuple[int, str]:
    """A mini-batch's `seqs` sequences (`what`) over the data-parallel groups: the ranks, or their
    Ulysses groups of `sp` ranks, which pool their rows (`trainer.roles.plan_update`), so it must
    split over world / sp of them, as verl's engine divides the mini-batch by its data-parallel size.
    Returns (sequences per group, what a group is); refused naming the option to `change`."""
    dp = world_size // sp  # (sp divides the world: _validate_sequence_parallel)
    if seqs % dp:
        over = f"{world_size} ranks" if sp == 1 else f"{dp} data-parallel groups ({world_size} ranks in Ulysses " \
                                                     f"groups of {sp})"
        raise ConfigError(f"{what} = {seqs} sequences must split evenly over {over}: change {change}")
    return seqs // dp, "rank" if sp == 1 else f"group of {sp} ranks (Ulysses)"


def _refuse_rollbacks_without_a_checkpoint(cfg: PPOConfig) -> None:
    """A ConfigError for a kl_guard action `rollback` that no checkpoint the run keeps can ever serve.

    A rollback at step K needs a checkpoint of step K-1-L or an earlier one (`KLGuard.rollback_bound`:
    the streak's first step minus 2), where L, the streak's shortest length, is 1 for explode_action (a
    non-finite KL fires it at once) and `patience` for warn_action. The checkpoints kept at step K
    are the newest `keep` of every `save_freq`-th step before K, the oldest of them no older than step
    K - keep x save_freq: one qualifies at some step if and only if keep x save_freq > L."""
    guard, t = cfg.algorithm.kl_guard, cfg.trainer
    for name, shortest in (("warn_action", guard.patience), ("explode_action", 1)):
        if getattr(guard, name) != "rollback":
            continue
        key = f"algorithm.kl_guard.{name}=rollback"
        if t.save_freq <= 0:
            raise ConfigError(f"{key} loads a checkpoint from before the KL streak began, but trainer.save_freq="
                              f"{t.save_freq} writes one only at the last step: set trainer.save_freq > 0")
        keep = t.max_actor_ckpt_to_keep
        if keep is not None and keep * t.save_freq <= shortest:
            streak = "a non-finite KL fires it at once" if name == "explode_action" else \
                f"the streak is algorithm.kl_guard.patience={guard.patience} steps at least"
            switch = " (trainer.remove_previous_ckpt_in_save=true)" if t.remove_previous_ckpt_in_save else ""
            raise ConfigError(
                f"{key} can never roll back: at step K it needs the checkpoint of step K-{shortest + 1} or an "
                f"earlier one ({streak}; the weights of the streak's steps are judged too high), but "
                f"trainer.max_actor_ckpt_to_keep={keep}{switch} with trainer.save_freq={t.save_freq} keeps none "
                f"older than step K-{keep * t.save_freq}: raise trainer.max_actor_ckpt_to_keep or trainer.save_freq "
                f"until max_actor_ckpt_to_keep x save_freq > {shortest}")


def _check_routing_replay(cfg: PPOConfig) -> None:
    """Routing replay's keys together (`actor.router_replay.mode`): R3's replayed experts come from the engine's
    record, which multi-turn rollouts do not assemble (tool responses join their samples between turns); R2's from
    the actor's old-log-prob pass, which bypass mode skips. Whether the model has experts is checked where its config
    is read (`setup.check_routing_replay`)."""
    arr = cfg.actor_rollout_ref
    if arr.actor.router_replay.mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError("actor_rollout_ref.actor.router_replay.mode=R2 with algorithm.rollout_correction.bypass_mode="
                          "true: R2 replays the routing the actor's old-log-prob pass records, and bypass mode runs "
                          "no such pass (the engine's log-probs are the old ones); use R3 (the engine's routing), or "
                          "bypass_mode=false")
    if arr.actor.router_replay.mode != "R3":
        return
    if not arr.rollout.enable_rollout_routing_replay:
        raise ConfigError("actor_rollout_ref.actor.router_replay.mode=R3 needs actor_rollout_ref.rollout."
                          "enable_rollout_routing_replay=true: R3 replays the experts the rollout engine records")
    if arr.rollout.multi_turn.enable:
        raise ConfigError("actor_rollout_ref.actor.router_replay.mode=R3 with actor_rollout_ref.rollout.multi_turn."
                          "enable=true is not supported: a multi-turn sample's routing is not assembled over its turns")


def validate(cfg: PPOConfig, world_size: int | None = None, local_world_size: int | None = None) -> None:
    """Cross-field checks against the launch the config describes (`described_launch`). Given the
    real launch's sizes, first checks that they are the described ones. Raises ConfigError saying
    what to change."""
    t = cfg.trainer
    described, per_node = described_launch(cfg)
    shape = f"trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes} x {t.n_gpus_per_node}"
    if world_size is not None and world_size != described:
        raise ConfigError(f"this launch has {world_size} process{'es' if world_size != 1 else ''} but the config "
                          f"describes {shape} = {described}: "
                          + ("launch that many (launch/run_single_node.sh starts n_gpus_per_node ranks) or change "
                             "trainer.nnodes / trainer.n_gpus_per_node" if t.nnodes == 1 else
                             f"launch trainer.nnodes={t.nnodes} nodes of n_gpus_per_node ranks each "
                             "(launch/slurm/multi_node.sbatch, or torchrun --nnodes on each node), or change "
                             "trainer.nnodes / trainer.n_gpus_per_node"))
    if local_world_size is not None and local_world_size != per_node:
        raise ConfigError(f"this launch has {local_world_size} process{'es' if local_world_size != 1 else ''} per "
                          "node but the config describes "
                          f"trainer.n_gpus_per_node = {per_node}")
    world_size = described
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    n = rollout.n
    bs = cfg.data.train_batch_size
    if not arr.model.path:
        raise ConfigError("actor_rollout_ref.model.path is required (a Hugging Face model directory)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one .jsonl or .parquet file")
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        blank = next((i for i, path in enumerate(files) if not path.strip()), None)
        if blank is not None:  # e.g. `data.train_files=$TRAIN` with TRAIN unset
            raise ConfigError(f"{key}[{blank}] is empty ({files!r}): give a file path (an unset shell variable?)")
    _validate_sequence_parallel(cfg, world_size, per_node)
    adv = cfg.algorithm.adv_estimator
    if adv in GROUP_ESTIMATORS and adv not in SINGLETON_ESTIMATORS and n < 2:
        raise ConfigError(f"algorithm.adv_estimator={adv} needs groups: set actor_rollout_ref.rollout.n >= 2")
    if adv == "gdpo" and cfg.reward_model.enable and cfg.reward_model.combine == "replace":
        raise ConfigError(f"algorithm.adv_estimator=gdpo with {as_set(cfg, 'reward_model.enable', True)} and "
                          "reward_model.combine=replace: "
                          "the reward model's score replaces the reward function's, so no function runs and there are "
                          "no components under algorithm.gdpo_reward_keys; set reward_model.combine=add (the function "
                          "runs and gives them) or use another estimator")
    greedy = ("actor_rollout_ref.rollout.temperature=0" if rollout.temperature == 0
              else "actor_rollout_ref.rollout.do_sample=false with rollout.name=hf")
    if adv in GROUP_ESTIMATORS and n >= 2 and rollout.decoding_temperature() == 0:
        setting = greedy
        raise ConfigError(f"{setting} decodes greedily: the {n} responses to a prompt are identical, so every "
                          f"{adv} advantage is zero and nothing is learned; sample (temperature > 0) or use "
                          "rollout.n=1 with algorithm.adv_estimator=gae or reinforce_plus_plus")
    if adv in OTB_ESTIMATORS and not actor.calculate_sum_pi_squared:
        raise ConfigError(f"algorithm.adv_estimator={adv} needs each token's sum of squared probabilities: set "
                          "actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    if adv in OTB_ESTIMATORS and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(f"algorithm.adv_estimator={adv} with algorithm.rollout_correction.bypass_mode=true: bypass "
                          "mode skips the actor's old-log-prob pass, which alone computes the sums of squared "
                          "probabilities (verl's trainer stops there too); use the decoupled mode (bypass_mode=false)")
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        if fg.metric is None:
            raise ConfigError("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric: "
                              f"{', '.join(FILTER_GROUP_SEQUENCE_METRICS)}, or a numeric extra key of the reward "
                              "function's result (e.g. acc)")
        if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
            raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: "
                              "the KL penalty needs the reference pass over every generated round; filter on "
                              "seq_reward (the score) instead")
        if n >= 2 and rollout.decoding_temperature() == 0:
            raise ConfigError(f"algorithm.filter_groups.enable=true with {greedy}, which decodes greedily: the {n} "
                              "responses to a prompt are identical, so no group's metric varies and every prompt is "
                              "dropped: the generation rounds would never fill a step (and fail after "
                              "algorithm.filter_groups.max_num_gen_batches rounds where it is > 0); sample "
                              "(temperature > 0) or turn filter_groups off")
        if adv == "remax":
            raise ConfigError("algorithm.filter_groups with algorithm.adv_estimator=remax is not supported: filter "
                              "a group estimator's groups (grpo, rloo, ...)")
        rows = cfg.data.gen_batch_size * n
        if rows % world_size:  # each round's rows are scored where they are, every rank a share of them
            raise ConfigError(f"data.gen_batch_size x rollout.n ({rows}) must be a multiple of the world size "
                              f"({world_size}) with algorithm.filter_groups: each generation round is scored on "
                              "every rank, in equal shares")
    elif cfg.data.gen_batch_size != bs:
        raise ConfigError(f"data.gen_batch_size={cfg.data.gen_batch_size} differs from data.train_batch_size={bs}, "
                          "but algorithm.filter_groups.enable=false: only dynamic sampling generates in rounds of "
                          "gen_batch_size; leave it null")
    if adv == "remax" and rollout.decoding_temperature() == 0:
        setting = greedy
        raise ConfigError(f"{setting} decodes greedily: every response is remax's greedy baseline itself, so "
                          "every advantage is zero and nothing is learned; sample (temperature > 0)")
    try:
        ParallelDims(world_size=world_size, fsdp_size=actor.fsdp_config.fsdp_size,
                     tp=rollout.tensor_model_parallel_size, local_world_size=per_node)
    except ValueError as e:
        raise ConfigError(f"{e} (the config describes {shape} ranks)") from None
    def shards(size: int) -> int:  # -1: over all ranks
        return world_size if size == -1 else size

    for key, fc in built_fsdp_sections(cfg).items():  # (the others' options are unread, each said at start-up)
        if fc.fsdp_size != -1 and shards(fc.fsdp_size) != shards(actor.fsdp_config.fsdp_size):
            raise ConfigError(f"{as_set(cfg, f'{key}.fsdp_config.fsdp_size', fc.fsdp_size)}: every model shares the actor's training "
                              f"mesh, shard groups of {shards(actor.fsdp_config.fsdp_size)} ranks "
                              f"(actor_rollout_ref.actor.fsdp_config.fsdp_size={actor.fsdp_config.fsdp_size}); use "
                              f"-1 or {shards(actor.fsdp_config.fsdp_size)}")
    if bs % actor.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size ({bs}) must be a multiple of "
                          f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size})")
    per_group, who = _mini_batch_share("ppo_mini_batch_size x rollout.n", actor.ppo_mini_batch_size * n, world_size,
                                       actor.ulysses_sequence_parallel_size, "actor_rollout_ref.actor.ppo_mini_batch_size")
    if not actor.use_dynamic_bsz:
        micro = actor.ppo_micro_batch_size_per_gpu
        if micro is None:
            raise ConfigError("set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or use_dynamic_bsz=true")
        if per_group % micro:
            raise ConfigError(f"sequences per {who} per mini-batch ({per_group}) must be a multiple of "
                              f"{_per_gpu_size(cfg, 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu', micro)}")
    # the log-prob forwards, as the actor's update (and verl): a size, or dynamic batching; else a
    # rank's whole share would be one micro-batch (null sizes inherit the actor's, null with its
    # use_dynamic_bsz=true; the reward model's: _validate_reward_model)
    forwards = [("actor_rollout_ref.rollout", rollout, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")]
    if cfg.uses_ref:
        forwards.append(("actor_rollout_ref.ref", arr.ref, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"))
    for key, role, source in forwards:
        if not role.log_prob_use_dynamic_bsz and role.log_prob_micro_batch_size_per_gpu is None:
            raise ConfigError(f"set {key}.log_prob_micro_batch_size_per_gpu or log_prob_use_dynamic_bsz=true (null "
                              f"inherits {source}, null here)")
    # every admitted prompt gets its full response budget: a shorter context would cut responses short
    max_prompt = cfg.data.max_prompt_length
    if rollout.prompt_length < max_prompt:
        raise ConfigError(f"actor_rollout_ref.rollout.prompt_length={rollout.prompt_length} is below "
                          f"data.max_prompt_length={max_prompt}: the data admits prompts whose responses the engine "
                          "would cut short; raise it or leave it null (it defaults to data.max_prompt_length)")
    if rollout.max_model_len < max_prompt + rollout.response_length:
        raise ConfigError(f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} is below "
                          f"data.max_prompt_length + rollout.response_length = {max_prompt} + "
                          f"{rollout.response_length}: the longest prompts' responses would be cut short; raise it "
                          "or leave it null")
    if (bs * n) % world_size:
        raise ConfigError(f"data.train_batch_size x rollout.n ({bs * n}) must be a multiple of the world size "
                          f"({world_size})")
    for key, value in (("temperature", rollout.temperature), ("val_kwargs.temperature", rollout.val_kwargs.temperature)):
        if 0 < value < MIN_TEMPERATURE:
            raise ConfigError(f"actor_rollout_ref.rollout.{key}={value:g}: {TEMPERATURE_BOUND}")
    if rollout.engine == "native":
        if not rollout.chunked_prefill and rollout.max_num_batched_tokens < rollout.max_model_len:
            raise ConfigError(f"actor_rollout_ref.rollout.enable_chunked_prefill=false with max_num_batched_tokens="
                              f"{rollout.max_num_batched_tokens} < max_model_len={rollout.max_model_len}: without "
                              "chunked prefill a whole prompt must fit in one step (as vLLM requires); raise "
                              "max_num_batched_tokens or enable chunked prefill")
    if cfg.trainer.val_only and not cfg.data.val_files:
        raise ConfigError("trainer.val_only=true validates and exits, but data.val_files is empty: give the "
                          "validation files")
    if cfg.trainer.val_only and cfg.trainer.resume_mode == "disable":
        raise ConfigError("trainer.val_only=true with trainer.resume_mode=disable would delete the run directory's "
                          "checkpoints, exports and metrics for a validation that trains nothing in their place: "
                          "validate the model of actor_rollout_ref.model.path in another trainer.default_local_dir, "
                          "or a checkpoint with resume_mode auto or resume_path")
    rc, loss_mode = cfg.algorithm.rollout_correction, actor.policy_loss.loss_mode
    if loss_mode == "vanilla" and (not rc.bypass_mode or BYPASS_LOSS_TYPES[rc.loss_type] == "vanilla") \
            and not actor.clip_ratio_c > 1:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c={shown(actor.clip_ratio_c)} with policy_loss."
                          "loss_mode=vanilla: the dual clip's bound on a negative advantage's ratio must be > 1 "
                          "(as verl asserts); 1 or less is a truncation bound only for loss_mode dppo_tv / dppo_kl")
    if rc.bypass_mode and loss_mode != "vanilla":
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} with "
                          "algorithm.rollout_correction.bypass_mode=true: bypass mode trains with its own loss, "
                          "algorithm.rollout_correction.loss_type's (ppo_clip: vanilla, reinforce: gpg), which verl "
                          f"would put in place of {loss_mode} silently; set loss_mode=vanilla, or bypass_mode=false "
                          f"to train with {loss_mode}")
    if cfg.trainer.critic_warmup and not cfg.uses_critic:
        raise ConfigError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} trains only the critic for that many "
                          f"steps, but algorithm.adv_estimator={adv} has no critic: those steps would train nothing; "
                          "set it to 0 or use adv_estimator=gae")
    kc = cfg.algorithm.kl_ctrl
    if cfg.algorithm.use_kl_in_reward and kc.type == "adaptive" and 5 * kc.horizon <= bs * n:
        raise ConfigError(f"algorithm.kl_ctrl.horizon={kc.horizon} with {bs * n} responses a step "
                          "(data.train_batch_size x rollout.n): the adaptive controller multiplies the KL coefficient "
                          f"by 1 + e x {bs * n} / horizon with e in [-0.2, 0.2], which reaches 0 or below; use a "
                          f"horizon above {bs * n // 5}")
    if rollout.engine != "native":
        for key, value in _non_default(rollout, ENGINE_ONLY_OPTIONS).items():
            raise ConfigError(f"actor_rollout_ref.rollout.{key}={shown(value)} needs rollout.name=native: "
                              f"rollout.name={rollout.name} generates with the training model, there is no engine")
    try:
        check_chat_template_kwargs(cfg.data.apply_chat_template_kwargs, "data.apply_chat_template_kwargs")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.data.tool_config_path is not None and not _same_file(cfg.data.tool_config_path,
                                                                rollout.multi_turn.tool_config_path):
        raise ConfigError(f"data.tool_config_path={shown(cfg.data.tool_config_path)} differs from actor_rollout_ref."
                          f"rollout.multi_turn.tool_config_path={shown(rollout.multi_turn.tool_config_path)}: meshppo "
                          "renders (and filters) the tool agent's prompts with the rollout's tools; set it null or to "
                          "the same file")
    _check_routing_replay(cfg)
    if rollout.multi_turn.enable and rollout.engine != "native":
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.enable=true needs rollout.name=native: the turns "
                          f"continue each sample in meshppo's engine, and rollout.name={rollout.name} has none")
    if rollout.kv_cache_dtype == "fp8" and rollout.dtype == "float16":
        raise ConfigError("actor_rollout_ref.rollout.kv_cache_dtype=fp8 needs rollout.dtype bfloat16 or float32, "
                          "not float16 (the attention would round probability x scale products to subnormals)")
    if cfg.uses_critic:
        critic = cfg.critic
        cmini = critic.ppo_mini_batch_size
        if bs % cmini:
            raise ConfigError(f"data.train_batch_size ({bs}) must be a multiple of critic.ppo_mini_batch_size ({cmini})")
        per_group, who = _mini_batch_share("critic.ppo_mini_batch_size x rollout.n", cmini * n, world_size,
                                           critic.ulysses_sequence_parallel_size, "critic.ppo_mini_batch_size")
        if not critic.use_dynamic_bsz:
            cmicro = critic.ppo_micro_batch_size_per_gpu
            if cmicro is None:
                raise ConfigError("set critic.ppo_micro_batch_size_per_gpu or critic.use_dynamic_bsz=true")
            if per_group % cmicro:
                raise ConfigError(f"critic sequences per {who} per mini-batch ({per_group}) must be a multiple of "
                                  f"{_per_gpu_size(cfg, 'critic.ppo_micro_batch_size_per_gpu', cmicro)}")
        keep, actor_keep = cfg.trainer.max_critic_ckpt_to_keep, cfg.trainer.max_actor_ckpt_to_keep
        if keep is not None and keep != actor_keep:
            raise ConfigError(f"trainer.max_critic_ckpt_to_keep={keep} differs from trainer.max_actor_ckpt_to_keep="
                              f"{'null' if actor_keep is None else actor_keep}: meshppo saves the critic "
                              "in the actor's checkpoints and rotates them together; set it to null"
                              + ("" if actor_keep is None else f" or {actor_keep}"))
    tok = cfg.data.tokenizer
    if not _same_file(tok, cfg.critic.model.tokenizer_path):  # (however spelled: a trailing /, a relative path)
        raise ConfigError(f"critic.model.tokenizer_path ({cfg.critic.model.tokenizer_path}) must be the actor's "
                          f"tokenizer ({tok}) or null: the critic scores the actor's tokens")
    adapter = arr.model.lora_adapter_path
    if adapter is not None:  # its config, then its tensors' names (the header: no tensor is read)
        arr.model.lora
        try:
            read_peft_adapter_shapes(adapter)
        except (OSError, ValueError) as e:
            raise ConfigError(f"actor_rollout_ref.model.lora_adapter_path: {e}") from None
    d = cfg.data
    for key in ("train_max_samples", "val_max_samples"):
        if getattr(d, key) > 0 and d.shuffle and d.seed is None:
            raise ConfigError(f"data.{key}={getattr(d, key)} with data.shuffle=true and data.seed=null: verl draws "
                              "that subset unseeded (a different one every run, and here on every rank); set data.seed")
    crf = cfg.custom_reward_function
    if crf.reward_kwargs and not crf.path:
        raise ConfigError("custom_reward_function.reward_kwargs is set but custom_reward_function.path is not: the "
                          "built-in scorers take no extra arguments")
    if cfg.reward_model.reward_manager == "batch" and not crf.path:
        raise ConfigError(f"{as_set(cfg, 'reward_model.reward_manager', 'batch')} calls custom_reward_function once "
                          "per batch, with lists "
                          "(as verl's batch manager does; the built-in scorers take one response): set "
                          "custom_reward_function.path")
    _validate_reward_model(cfg)
    if cfg.algorithm.use_pf_ppo and cfg.algorithm.adv_estimator != "gae":
        raise ConfigError(f"algorithm.use_pf_ppo=true with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: "
                          "verl redraws the batch for gae only (with another estimator it does nothing); use gae")
    guard = cfg.algorithm.kl_guard
    if guard.enable and "rollback" in (guard.warn_action, guard.explode_action):
        roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.checkpoint)]
        roles += [("critic", cfg.critic.checkpoint)] if cfg.uses_critic else []
        for key, c in roles:
            # both: a rollback that kept the live optimizer would go on with the moments (and step counts)
            # of the branch it abandons
            for item in ("model", "optimizer"):
                lists = [name for name in ("save_contents", "load_contents") if item not in getattr(c, name)]
                if lists:
                    raise ConfigError(f"algorithm.kl_guard's rollback reloads the models and their optimizers of an "
                                      f"earlier checkpoint, but {' and '.join(f'{key}.checkpoint.{n}' for n in lists)} "
                                      f"lack {item!r}: add it, or choose another kl_guard action")
        _refuse_rollbacks_without_a_checkpoint(cfg)
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    if cfg.trainer.resume_from_path and cfg.trainer.resume_mode == "disable":  # which deletes the run's checkpoints
        raise ConfigError("trainer.resume_from_path is set but trainer.resume_mode=disable does not read it (and "
                          "starts the run directory over): set trainer.resume_mode=resume_path to resume from it, or "
                          "drop it")
    profile_plan(cfg)  # npu, or enabled roles that disagree: ConfigError
    check_profiler_ranks(cfg, world_size)
    for name in cfg.trainer.logger:
        if name in LOGGERS:
            continue
        if name == "tracking":
            raise ConfigError("trainer.logger: tracking is verl's deprecated name of wandb: use wandb")
        if name in VERL_ONLY_LOGGERS:
            raise ConfigError(f"trainer.logger: verl's {name} logger is not supported; use {_LOGGERS_LISTED}")
        raise ConfigError(f"trainer.logger: unknown logger {name!r}; use {_LOGGERS_LISTED}")
