"""Configuration and result types of the generation engine.

`EngineConfig` sizes the engine (KV pool, batch limits, CUDA graphs); `SamplingParams`
describes one `generate()` call; `RequestOutput` is one generated sample.

Log-probabilities. Every sampled token comes with
`log_softmax(logits / temperature)[token]`: the log-probability under the
temperature-scaled distribution *before* top-k / top-p truncation (with `temperature == 0`,
greedy, the logits are divided by 1). It is computed from the same logits the token was
sampled from, so a trainer that recomputes `old_log_prob` with its own forward and the same
temperature gets the same number up to the forward's numerics (bf16 matmul order).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from models.args import ModelArgs
from rollout.parallel import ALL_REDUCE_IMPLS, vocab_shard

MIN_TEMPERATURE = 1e-6
TEMPERATURE_BOUND = (f"a positive temperature below {MIN_TEMPERATURE:g} is greedy decoding in all but name, and its "
                     "reciprocal scales the logits past float32 (it overflowed to inf and failed); use 0 for greedy "
                     "decoding")
"""The smallest positive sampling temperature, and why (the engine's and the trainer's check)."""


QUANTIZATIONS = ("fp8",)  # `EngineConfig.quantization` besides None (the engine, the trainer, the CLIs)
KV_CACHE_DTYPES = ("auto", "fp8")  # `EngineConfig.kv_cache_dtype` (vLLM's names)
KV_FP8_DTYPES = (torch.bfloat16, torch.float32)  # engine dtypes an e4m3 KV cache works with


# What the engine cannot run a model with, refused by the engine and, before any work, by the trainer's
# pre-flight (which reads the model's config.json, not the engine).
def check_tp_divisibility(args: ModelArgs, tp: int) -> None:
    """Refuse the TP sizes the engine cannot split `args` over (the ones vLLM refuses too): the dense MLPs' and the
    experts' intermediate sizes are split evenly (a model whose every layer is a MoE block has no dense MLP), and a
    Qwen2-MoE's shared expert's."""
    sizes = [("num_attention_heads", args.num_attention_heads)]
    if len(args.moe_layers) < args.num_hidden_layers:
        sizes.append(("intermediate_size", args.intermediate_size))
    if args.moe_layers:
        sizes.append(("moe_intermediate_size", args.moe_intermediate_size))
    if args.moe_layers and args.shared_expert_intermediate_size:
        sizes.append(("shared_expert_intermediate_size", args.shared_expert_intermediate_size))
    for what, value in sizes:
        if value % tp:
            raise ValueError(f"tensor parallelism {tp} needs {what} ({value}) divisible by {tp}")
    kv = args.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor parallelism {tp} needs num_key_value_heads ({kv}) divisible by {tp}, or {tp} "
                         f"divisible by it (each rank then holds a copy of one KV head)")
    width = vocab_shard(args.vocab_size, 0, tp)[1]
    if vocab_shard(args.vocab_size, tp - 1, tp)[2] == 0:
        raise ValueError(f"tensor parallelism {tp} needs vocab_size ({args.vocab_size}) above {(tp - 1) * width}: "
                         f"in shards of {width} ids the last rank would hold none")


def check_quantization(args: ModelArgs, quantization: str | None) -> None:
    """Refuse a quantization the engine cannot run `args` with: fp8 on a post-norm model (OLMo-2), one whose
    norms scale by 1 + weight (Gemma 3) or a mixture of experts (Qwen3-MoE)."""
    if quantization == "fp8" and args.moe_layers:
        raise ValueError(f"fp8 rollout is not supported for model_type {args.model_type}: its quantization covers "
                         "linear projections, and this model's experts are stacked [experts, out, in] tensors")
    if quantization == "fp8" and args.post_norm:
        raise ValueError(f"fp8 rollout is not supported for model_type {args.model_type}: it folds each block's input "
                         "norm into its projections, and this model's post-norm blocks have none")
    if quantization == "fp8" and args.sandwich_norm:
        raise ValueError(f"fp8 rollout is not supported for model_type {args.model_type}: it folds each block's input "
                         "norm's weight into its projections, and this model's norms scale by 1 + weight and norm "
                         "each branch's output too")


def default_cudagraph_capture_sizes(max_size: int = 512) -> list[int]:
    """The batch-size ladder 1, 2, 4, 8, 16, 24, 32, ..., max_size (multiples of 8 from 16)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    sizes += list(range(16, max_size + 1, 8))
    return sizes


@dataclass
class EngineConfig:
    """How the engine is sized. One line of documentation per field."""

    dtype: torch.dtype = torch.bfloat16
    """dtype of the engine's weights, activations and KV cache."""
    block_size: int = 16
    """tokens per KV-cache block (page)."""
    gpu_memory_utilization: float = 0.5
    """on CUDA: fraction of the memory free after the weights that the KV pool and activations may use."""
    num_kv_blocks: int | None = None
    """explicit KV pool size in blocks (tests, CPU); overrides the memory-based sizing."""
    max_num_seqs: int = 256
    """most sequences in one step (the decode batch size limit)."""
    max_num_batched_tokens: int = 8192
    """most tokens in one prefill step (the chunk budget)."""
    enable_chunked_prefill: bool = True
    """split prompts longer than the remaining budget over several prefill steps."""
    max_model_len: int | None = None
    """longest sequence (prompt + response); default: the model's max_position_embeddings."""
    enforce_eager: bool = False
    """never use CUDA graphs."""
    cudagraph_capture_sizes: list[int] | None = None
    """decode batch sizes captured as CUDA graphs; default 1, 2, 4, 8, 16, 24, ..., 512 (capped at max_num_seqs)."""
    prefill_graph_max_tokens: int = 2048
    """prefill steps of at most this many tokens (and `max_num_batched_tokens`) run as CUDA graphs,
    padded to a bucket and captured the second time a bucket is used; 0: prefill always eager.
    Small steps are where launches dominate (a larger step's kernels mostly outlast its launches),
    and a PPO step, which drops the graphs, would capture a large bucket again at every step
    that uses it twice (BENCHMARKS.md, "Eighth pass" and "Tenth pass")."""
    free_cache_engine: bool = True
    """release the KV pool at the end of every generate() call (it is re-allocated by the next one)."""
    quantization: str | None = None
    """`fp8`: the qkv, gate/up and down projections run as e4m3 GEMMs (weights quantized with one scale a
    tensor at the first generate() after every weight write, activations by the norms and the SiLU
    kernel; `o_proj`, attention, the LM head and sampling stay in `dtype`). Faster and less exact: the
    sampling log-probs move away from the actor's (see rollout correction). None: everything in `dtype`."""
    kv_cache_dtype: str = "auto"
    """`fp8`: the KV cache holds e4m3 values, each token's K and V of each KV head with one float32 scale
    (its largest |value| maps to 448), written by the RoPE / cache-write kernels and read by the
    attention kernels: 2 D / (D + 4) times the tokens in a pool of the same bytes (it did not shorten
    an H200's decode step: the attention kernel is held by too few warps a SM there, not by bandwidth). Less exact (each value within 2^-4
    of itself, relative). `auto`: the cache in `dtype`."""
    return_routed_experts: bool = False
    """mixture-of-experts models: record each token's experts in every sparse layer as the engine computes it (prompt
    tokens in prefill, responses in decode; into a device buffer laid out as the KV pool's pages, inside the CUDA
    graphs) and return them with each output (`RequestOutput.routed_experts`), for the trainer's routing replay (R3).
    Off: nothing is recorded and nothing is allocated."""
    tp_all_reduce: str = "auto"
    """TP > 1: the all-reduce of the layers' outputs. `symm_mem`: through a symmetric-memory
    buffer (CUDA, NVLink peers; no NCCL launch), `nccl`, or `auto` (the first where it can be
    set up)."""

    def __post_init__(self):
        if self.tp_all_reduce not in ALL_REDUCE_IMPLS:
            raise ValueError(f"EngineConfig.tp_all_reduce must be one of {ALL_REDUCE_IMPLS}, got {self.tp_all_reduce!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"EngineConfig.quantization must be None or one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.dtype not in KV_FP8_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype='fp8' needs dtype bfloat16 or float32, got {self.dtype}: the "
                             f"attention multiplies each probability by its value's scale, which float16 would round "
                             f"to subnormals")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"EngineConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"EngineConfig.block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"EngineConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"EngineConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"EngineConfig.prefill_graph_max_tokens must be >= 0, got {self.prefill_graph_max_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.cudagraph_capture_sizes is not None:
            sizes = sorted(set(int(s) for s in self.cudagraph_capture_sizes))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"EngineConfig.cudagraph_capture_sizes must be positive, got {self.cudagraph_capture_sizes}")
            self.cudagraph_capture_sizes = sizes

    def capture_sizes(self) -> list[int]:
        """The graph ladder actually used: configured (or default) sizes up to the first one >= max_num_seqs
        (the default ladder reaches it: past 512 it goes on to max_num_seqs rounded up to a multiple of 8)."""
        sizes = self.cudagraph_capture_sizes or default_cudagraph_capture_sizes(max(512, -(-self.max_num_seqs // 8) * 8))
        out = []
        for s in sizes:
            out.append(s)
            if s >= self.max_num_seqs:
                break
        return out


@dataclass
class SamplingParams:
    """Sampling for one generate() call (the same for every prompt of the call).

    `temperature == 0` is greedy. `top_k == -1` (or 0) and `top_p == 1` disable truncation.
    `eos_token_id=None` uses the model's `eos_token_id` (from its config); `ignore_eos`
    disables EOS stopping but keeps `stop_token_ids`. `seed` makes sampling reproducible: the
    noise of a token is a pure function of (seed, prompt index, sample index, position), so
    it does not depend on the batch, the schedule or preemption.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] | list[int] = ()
    eos_token_id: int | list[int] | None = None
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not self.temperature >= 0 or self.temperature == math.inf:  # NaN compares False
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"SamplingParams.temperature={self.temperature:g}: {TEMPERATURE_BOUND}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_truncation(self) -> bool:
        """True when top-k / top-p change the sampled distribution (never for greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def stop_set(self, model_eos: int | list[int] | None) -> frozenset[int]:
        """Token ids that end a sample: stop_token_ids, plus EOS unless ignore_eos."""
        stops = set(self.stop_token_ids)
        if not self.ignore_eos:
            eos = self.eos_token_id if self.eos_token_id is not None else model_eos
            if isinstance(eos, int):
                stops.add(eos)
            elif eos is not None:
                stops.update(int(e) for e in eos)
        return frozenset(stops)


@dataclass
class RequestOutput:
    """One sample: `token_ids` / `logprobs` of the response (same length), and why it ended. With
    `EngineConfig.return_routed_experts`, `routed_experts [len(prompt_token_ids) + len(token_ids) - 1,
    len(ModelArgs.moe_layers), num_experts_per_tok]` (uint8, or int16 past 256 experts; on the CPU): the experts each
    token the engine ran (every one but the last, which was sampled and never fed back) was routed to in each sparse
    layer, in the router's descending order."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token, included in token_ids) | "length"
    routed_experts: torch.Tensor | None = None


@dataclass(frozen=True)
class Continuation:
    """A request that `LLMEngine.generate(on_finish=...)` adds to the running call: the sample `key`
    (prompt index, sample index) continued from `token_ids` (its whole context so far) by up to
    `max_tokens` new tokens, under the call's sampling parameters."""

    token_ids: list[int]
    key: tuple[int, int]
    max_tokens: int

