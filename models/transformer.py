"""A decoder-only transformer for the Gemma 2, Gemma 3 (text), Granite, Granite-MoE (and -Shared), Llama, Mistral,
Mixtral, OLMo-2, OLMoE, Phi-3 (Phi-4), Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE families.

A plain `nn.Module`: parallelism (FSDP2, TP for the engine, activation checkpointing) is
applied from outside by `sharding/` and `rollout/`. Parameter names follow Hugging Face
without the leading `model.` (`layers.0.self_attn.q_proj.weight`), which keeps checkpoint
conversion a prefix change (and a split of rows where a checkpoint fuses projections: Phi3's
qkv_proj and gate_up_proj, `models.checkpoint.split_fused`). q/k/v and gate/up stay separate
parameters on purpose: each FSDP chunk range of one of them is then exactly one TP shard
(docs/ARCHITECTURE.md). A mixture-of-experts layer (`MoE`, `ModelArgs.moe_layers`: Mixtral's, OLMoE's,
Qwen2-MoE's, Qwen3-MoE's) holds its experts as transformers 5 does in memory, stacked: `mlp.experts.gate_up_proj
[E, 2I, H]` and `mlp.experts.down_proj [E, H, I]`, with its router `mlp.gate.weight [E, H]` (`models/moe.py` computes
them; checkpoints store one tensor per expert and projection, Mixtral's under its own names, Granite-MoE's stacked
under its own: `models.checkpoint`); a Qwen2-MoE's also its shared expert, an `MLP` at `mlp.shared_expert`, and that
expert's gate `mlp.shared_expert_gate.weight [1, H]`, under transformers' names (a Granite-MoE-Shared's the same
`MLP`, ungated: its checkpoints' `shared_mlp`).

Shapes: `B` batch, `S` sequence, `T` packed tokens, `H` hidden, `V` vocab.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import block_ops, moe
from models.args import ModelArgs
from models.attention import PrefixSharing, attention_packed, attention_padded, soft_cap
from models.lm_head import chunked_token_logprobs
from models.tiled_mlp import tiled_mlp


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. `unit_offset` (Gemma 3's, `ModelArgs.unit_offset_norm`): the weight is stored
    0-centred and the norm scales by `1 + weight`, in float32, rounded once to the input's dtype (transformers'
    Gemma3RMSNorm); else the normalised row is rounded first, then times the weight (Llama's)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def reset_parameters(self):
        (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if block_ops.use_fused_ops(x, self.weight):
            return block_ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if self.unit_offset:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                    * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in float32 and cast back before the weight, as Hugging Face does: this
        # ordering is what makes bf16 logits agree with checkpoints trained there.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RopeFrequencies(NamedTuple):
    """What a rope type needs to build cos and sin (`rope_cos_sin`)."""
    inv_freq: torch.Tensor  # [D/2], float32
    attention_factor: float  # multiplies cos and sin (YaRN's; 1 for the other types)


def rope_inv_freq(args: ModelArgs, device=None) -> RopeFrequencies:
    """The inverse frequencies and attention factor of `rope_theta` with `rope_scaling` none / linear /
    llama3 / yarn, as transformers computes them: the one place a rope type is read (the training
    model and the engine build their cos and sin from it)."""
    d = args.head_dim
    periods = args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    inv_freq = 1.0 / periods
    rs = args.rope_scaling or {}
    if args.rope_type == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif args.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    elif args.rope_type == "yarn":
        return _yarn(args, periods)
    return RopeFrequencies(inv_freq, 1.0)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times the original: 0.1·mscale·ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(args: ModelArgs, periods: torch.Tensor) -> RopeFrequencies:
    """YaRN of the unscaled `periods` (`rope_theta^(2i/D)`): frequencies that turn fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`), those that
    turn more than `beta_fast` times kept, with a linear ramp between; cos and sin are scaled by the
    attention factor."""
    rs, d = args.rope_scaling, args.head_dim
    factor = float(rs["factor"])
    # transformers fills the original context in from max_position_embeddings when config.json has none
    original = rs.get("original_max_position_embeddings") or args.max_position_embeddings
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero (as transformers)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=periods.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it is (extrapolated)
    inv_freq = 1.0 / (factor * periods) * (1 - kept) + 1.0 / periods * kept
    return RopeFrequencies(inv_freq, float(attention_factor))


def rope_cos_sin(rope: RopeFrequencies, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., D] for integer positions [...], computed in float32 (times the attention factor)
    then cast."""
    inv_freq, attention_factor = rope
    with torch.autocast(device_type=position_ids.device.type, enabled=False):
        freqs = position_ids.float()[..., None] * inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:  # (YaRN's; the other types' forwards run no extra kernel)
            cos, sin = cos * attention_factor, sin * attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D]; cos/sin [..., D] broadcast over heads (rotate-half convention)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`apply_rope` on q and k: one fused launch for both where `block_ops.use_fused_ops` allows."""
    if block_ops.use_fused_ops(q, k, cos, sin, same_dtype=True):
        return block_ops.rope(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=args.o_proj_bias)  # (OLMo-2's with attention_bias)
        self.qk_norm, self.full_qk_norm = args.qk_norm, args.full_qk_norm
        if self.qk_norm or self.full_qk_norm:  # Qwen3, Gemma 3: each head's query and key RMS-normalised before
            # RoPE; OLMo-2: the whole query and key projections, before the head split
            offset = args.unit_offset_norm
            self.q_norm = RMSNorm(self.n_heads * d if self.full_qk_norm else d, args.rms_norm_eps, offset)
            self.k_norm = RMSNorm(self.n_kv_heads * d if self.full_qk_norm else d, args.rms_norm_eps, offset)
        # head_dim ** -0.5 (Granite: its attention_multiplier; Gemma 3: query_pre_attn_scalar^-0.5)
        self.scale = args.attention_scale
        self.softcap = args.attn_logit_softcapping  # the scores' soft cap (Gemma 2's); None: none
        # Ulysses: packed input is this rank's token shard; attention runs split by heads over
        # the group (`sharding.ulysses.apply_sequence_parallel`)
        self.sequence_parallel = None
        # this layer's sliding window (`ModelArgs.layer_windows`, set by `Transformer`); None: the whole context
        self.window: int | None = None

    def forward(self, x, cos, sin, attention_mask=None, cu_seqlens=None, max_seqlen=None,
                shared: PrefixSharing | None = None):
        shape = x.shape[:-1]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(*shape, self.n_heads, self.head_dim)
        k = k.view(*shape, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_qk(q, k, cos, sin)
        if cu_seqlens is not None and self.sequence_parallel is not None:
            out = self.sequence_parallel.attention(attention_packed, q, k, v, cu_seqlens, max_seqlen, self.scale,
                                                   shared, self.window, self.softcap)
        elif cu_seqlens is not None:
            out = attention_packed(q, k, v, cu_seqlens, max_seqlen, self.scale, shared, self.window, self.softcap)
        else:
            out = attention_padded(q, k, v, attention_mask, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(*shape, -1))


class MLP(nn.Module):
    """The gated MLP (SwiGLU; Gemma 3's GeGLU) of `intermediate_size` (default: `args.intermediate_size`, a dense
    layer's; a Qwen2-MoE sparse layer's shared expert is one of `shared_expert_intermediate_size`)."""

    #: token tiles of the tiled MLP (`models.tiled_mlp`, verl's `model.tiled_mlp`); None: untiled
    num_shards: int | None = None

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        h, m = args.hidden_size, intermediate_size or args.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=args.mlp_bias)
        self.up_proj = nn.Linear(h, m, bias=args.mlp_bias)
        self.down_proj = nn.Linear(m, h, bias=args.mlp_bias)
        self.act = args.mlp_activation  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma 3's)

    def forward(self, x):
        if self.num_shards is not None:
            return tiled_mlp(self, x, self.num_shards)
        return self.swiglu_mlp(x)

    def swiglu_mlp(self, x):
        """The untiled MLP (the tiled one's LoRA path runs it on each tile)."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        down = self.down_proj
        if not block_ops.use_fused_ops(gate, up, same_dtype=True):
            return down(block_ops.activation(gate, self.act) * up)
        if type(down) is nn.Linear and block_ops.use_fused_ops(gate, down.weight, same_dtype=True):
            # a plain projection: its input, the largest activation, is not kept for backward
            return block_ops.swiglu_down(gate, up, down.weight, down.bias, self.act)
        return down(block_ops.swiglu(gate, up, self.act))


class Router(nn.Module):
    """A mixture-of-experts layer's router (transformers' Qwen3MoeTopKRouter / MixtralTopKRouter / OlmoeTopKRouter /
    GraniteMoeTopKRouter, `mlp.gate`; a Mixtral checkpoint's `block_sparse_moe.gate`, a Granite-MoE's
    `block_sparse_moe.router.layer`): `weight [E, H]`, the
    logits' projection. Not an `nn.Linear`, as transformers' is not: peft's all-linear leaves it alone."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))


class Experts(nn.Module):
    """A mixture-of-experts layer's experts (transformers' Qwen3MoeExperts / MixtralExperts / OlmoeExperts,
    `mlp.experts`), stacked:
    `gate_up_proj [E, 2I, H]` (each expert's gate rows, then its up rows) and `down_proj [E, H, I]`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class MoE(nn.Module):
    """The sparse MLP of a `ModelArgs.moe_layers` layer (transformers' Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock,
    OlmoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, GraniteMoeMoE): each token through its top `num_experts_per_tok`
    experts by the
    router, their outputs weighted by the router's probabilities (`models.moe.route_model`, in float32 where
    `ModelArgs.router_weights_float32`; `models.moe.experts_forward`). A Qwen2-MoE's (`SHARED_EXPERT_TYPES`) adds its
    shared expert, which every token runs through, unrouted: `routed + sigmoid(shared_expert_gate(x)) *
    shared_expert(x)`, in transformers' order of operations; a Granite-MoE-Shared's (its layer's `shared_mlp` in
    transformers) has no gate (`ModelArgs.shared_expert_gated`): `routed + shared_expert(x)`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        self.experts = Experts(args)
        if args.shared_expert_intermediate_size:
            self.shared_expert = MLP(args, args.shared_expert_intermediate_size)
            if args.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        self.args, self.act = args, args.mlp_activation

    def forward(self, x, replay: torch.Tensor | None = None, record: bool = False):
        """`replay [rows of x, k]`: each token's experts instead of the router's top-k (`models.moe.route`).
        `record`: returns `(output, experts [rows of x, k])`, the experts each token ran through (routing replay
        R2's record: the routing itself, not a second one)."""
        rows = x.reshape(-1, x.shape[-1])
        weights, experts = moe.route_model(rows, self.gate.weight, self.args, replay)
        out = moe.experts_forward(rows, weights, experts, self.experts.gate_up_proj, self.experts.down_proj,
                                  self.act)
        if self.args.shared_expert_intermediate_size:
            shared = self.shared_expert(rows)
            out = out + (torch.sigmoid(self.shared_expert_gate(rows)) * shared if self.args.shared_expert_gated
                         else shared)
        out = out.view(x.shape)
        return (out, experts) if record else out


class TransformerBlock(nn.Module):
    """Pre-norm (`x + attn(input_layernorm(x))`, then `h + mlp(post_attention_layernorm(h))`), or, where
    `ModelArgs.post_norm` (OLMo-2), post-norm on each branch without an input norm (`x +
    post_attention_layernorm(attn(x))`, then `h + post_feedforward_layernorm(mlp(h))`), or, where
    `ModelArgs.sandwich_norm` (Gemma 3), both (`x + post_attention_layernorm(attn(input_layernorm(x)))`, then
    `h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`), as transformers names the norms of each.
    Granite's branch outputs are multiplied by its residual_multiplier before each add. `sparse`: the MLP is a
    mixture of experts (`MoE`; the layer is one of `ModelArgs.moe_layers`).
    """

    def __init__(self, args: ModelArgs, sparse: bool = False):
        super().__init__()
        self.post_norm, self.sandwich_norm = args.post_norm, args.sandwich_norm
        self.residual_scale = args.residual_multiplier
        h, eps, offset = args.hidden_size, args.rms_norm_eps, args.unit_offset_norm
        if not self.post_norm:
            self.input_layernorm = RMSNorm(h, eps, offset)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        if self.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.mlp = MoE(args) if sparse else MLP(args)
        if self.post_norm or self.sandwich_norm:
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)

    def forward(self, x, cos, sin, attention_mask=None, cu_seqlens=None, max_seqlen=None,
                shared: PrefixSharing | None = None, routed_experts: torch.Tensor | None = None,
                record_routing: bool = False):
        """`routed_experts [tokens, k]` (a sparse layer's, in `x`'s row order): the experts its MoE replays.
        `record_routing` (a sparse layer): returns `(x, experts [tokens, k])`, the experts its MoE ran each token
        through."""
        if self.sandwich_norm:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attention_mask,
                                                                 cu_seqlens, max_seqlen, shared))
            branch, experts = self._mlp(self.pre_feedforward_layernorm(x), routed_experts, record_routing)
            x = x + self.post_feedforward_layernorm(branch)
        elif self.post_norm:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attention_mask, cu_seqlens, max_seqlen,
                                                                 shared))
            branch, experts = self._mlp(x, routed_experts, record_routing)
            x = x + self.post_feedforward_layernorm(branch)
        else:
            x = x + self._scaled(self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, cu_seqlens,
                                                max_seqlen, shared))
            branch, experts = self._mlp(self.post_attention_layernorm(x), routed_experts, record_routing)
            x = x + self._scaled(branch)
        return (x, experts) if record_routing else x

    def _mlp(self, x, routed_experts, record: bool):
        """The MLP branch and, where `record`, the experts its MoE ran each token through (else None); a MoE
        replays `routed_experts` where given."""
        if record:
            return self.mlp(x, routed_experts, record=True)
        return (self.mlp(x) if routed_experts is None else self.mlp(x, routed_experts)), None

    def _scaled(self, branch):
        """A branch's output times the residual scale (Granite's residual_multiplier; no op at 1)."""
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale


def scale_embeddings(x: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The embeddings `x` times `ModelArgs.embedding_scale` (Granite's embedding_multiplier, Gemma 3's
    sqrt(hidden_size); no op at 1), rounded as each transformers class rounds it: Gemma 3's scale is rounded to
    `x`'s dtype first (`ModelArgs.embedding_scale_rounded`), Granite's is a Python float, which the product takes
    unrounded. The training model's and the engine's embedding."""
    scale = args.embedding_scale
    if scale == 1.0:
        return x
    if args.embedding_scale_rounded:  # (rounded on the host: a device tensor would be a copy inside a CUDA graph)
        scale = torch.tensor(scale, dtype=x.dtype).item()
    return x * scale


def cu_seqlens_from_lengths(lengths: list[int] | torch.Tensor, device=None) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def position_ids_from_lengths(lengths: list[int], device=None) -> torch.Tensor:
    """0, 1, ..., n - 1 for each packed sequence of length n, concatenated: three ops for any
    number of sequences (one `arange` per sequence was 512 host ops per micro-batch of bench/learn)."""
    n = torch.as_tensor(lengths, dtype=torch.long)  # built on the host: no device sync for the total
    starts = torch.cumsum(n, 0) - n
    return (torch.arange(int(n.sum())) - torch.repeat_interleave(starts, n)).to(device)


class LMHead(nn.Linear):
    """The output projection. Called with `labels` it returns per-token log-probs (and
    entropy, and sum p^2) without materialising full logits; being a module call keeps FSDP's
    all-gather hooks in charge of the weight."""

    def forward(self, h, labels=None, temperature: float = 1.0, with_entropy: bool = False,
                chunk_size: int = 2048, with_sum_pi_squared: bool = False, softcap: float | None = None):
        if labels is None:
            return super().forward(h)
        return chunked_token_logprobs(h, self.weight, labels, temperature, chunk_size, with_entropy,
                                      with_sum_pi_squared, softcap)


class Transformer(nn.Module):
    """Decoder-only LM (`head="lm"`, logits) or value model (`head="value"`, one scalar per token).

    Forward layouts:
      padded: `input_ids [B, S]`, optional `attention_mask [B, S]` (left or right padding) and
              `position_ids [B, S]` (default: count of real tokens before each position)
      packed: `input_ids [T]` or `[1, T]`, `cu_seqlens [N+1]` (int32), `position_ids` like the
              input (default: restart at 0 in each sequence); `shared` (`PrefixSharing`) when
              some segments attend to a prefix laid out elsewhere in the row (responses after
              one copy of their prompt: `trainer.forward`, which then gives the positions)
    Returns logits `[..., V]` (lm; Granite's divided by its logits_scaling, which the log-probs' temperature is
    multiplied by; a Gemma 2's soft-capped by its final_logit_softcapping, as are the logits the log-probs are
    taken of, before their temperature) or values `[...]` (value). With `labels` (same shape as
    the input: the token each position should predict) an LM returns `(logprobs, entropy)`
    per position instead, computed chunk by chunk (`models/lm_head.py`); `entropy` is None
    unless `with_entropy`; `with_sum_pi_squared` adds a third output, sum_v p_v^2 per position
    (forward-only). `routed_experts [*input_ids.shape, len(ModelArgs.moe_layers), num_experts_per_tok]` (integer):
    each token's experts in each sparse layer, which its MoE replays instead of routing (routing replay,
    `models.moe.route`). `record_routing`: the output becomes `(output, record)`, `record` the experts each token
    ran through in each sparse layer, shaped as `routed_experts` (`models.moe.routing_dtype`): what its routers
    chose (routing replay R2 records the old-log-prob pass's), or the replayed ones.
    `label_index` (flat positions, int64, repeats allowed) restricts that to the
    given positions, and `labels` then holds one token per entry of `label_index` (a position
    shared by several sequences predicts a different token for each): the outputs are
    `[len(label_index)]`.
    """

    def __init__(self, args: ModelArgs, head: str = "lm"):
        super().__init__()
        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        self.args, self.head = args, head
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        sparse = set(args.moe_layers)
        self.layers = nn.ModuleList(TransformerBlock(args, i in sparse) for i in range(args.num_hidden_layers))
        for layer, window in zip(self.layers, args.layer_windows):
            layer.self_attn.window = window
        self.local_rope_layers = frozenset(args.local_rope_layers)  # (Gemma 3's sliding_attention layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.unit_offset_norm)
        if head == "value":
            self.score = nn.Linear(args.hidden_size, 1, bias=True)
        elif not args.tie_word_embeddings:
            self.lm_head = LMHead(args.hidden_size, args.vocab_size, bias=False)
        inv_freq, self.rope_attention_factor = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if self.local_rope_layers:
            inv_freq, self.local_rope_attention_factor = rope_inv_freq(args.local_rope_args())
            self.register_buffer("local_inv_freq", inv_freq, persistent=False)

    # ------------------------------------------------------------- construction
    @classmethod
    def build(cls, args: ModelArgs, head: str = "lm", device="cpu", dtype=torch.float32, seed: int | None = None):
        """Build on the meta device, then materialise on `device` with random init."""
        with torch.device("meta"):
            model = cls(args, head=head)
        model.to_empty(device=device)
        model.init_weights(seed)
        return model.to(dtype)

    def init_tensors(self, generator: torch.Generator | None = None):
        """Yield `(name, full initial tensor)` on CPU, drawn in module order from `generator`:
        normal(0, initializer_range) for linear and embedding weights, routers and experts (as transformers'
        Qwen3Moe draws them), zero biases, unit norms.
        The one definition of the initialisation: sharded builds (`sharding/`) draw the same
        numbers without ever materialising the model on one device."""
        std = self.args.initializer_range
        for mod_name, m in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            if isinstance(m, nn.Linear):
                yield prefix + "weight", nn.init.normal_(torch.empty(m.weight.shape), 0.0, std, generator=generator)
                if m.bias is not None:
                    yield prefix + "bias", torch.zeros(m.bias.shape)
            elif isinstance(m, (nn.Embedding, Router, Experts)):
                for name, p in m.named_parameters(recurse=False):
                    yield prefix + name, nn.init.normal_(torch.empty(p.shape), 0.0, std, generator=generator)
            elif isinstance(m, RMSNorm):  # the identity: ones, or zeros scaling by 1 + weight
                yield prefix + "weight", (torch.zeros if m.unit_offset else torch.ones)(m.weight.shape)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Random initialisation (`init_tensors`), seeded when `seed` is given."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        params = dict(self.named_parameters())
        for name, t in self.init_tensors(g):
            params[name].copy_(t)
        self.reset_buffers()

    def reset_buffers(self):
        """Recompute non-persistent buffers (they are garbage after `to_empty`)."""
        device = self.embed_tokens.weight.device
        self.inv_freq, self.rope_attention_factor = rope_inv_freq(self.args, device=device)
        if self.local_rope_layers:
            self.local_inv_freq, self.local_rope_attention_factor = rope_inv_freq(self.args.local_rope_args(), device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu", head: str = "lm"):
        from models.checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, head=head)

    def save_pretrained(self, path, state_dict=None, max_shard_size: int = 5 * 2**30):
        from models.checkpoint import save_pretrained

        save_pretrained(self, path, state_dict=state_dict, max_shard_size=max_shard_size)

    # ------------------------------------------------------------- forward
    def hidden_states(self, input_ids, position_ids=None, attention_mask=None, cu_seqlens=None, max_seqlen=None,
                      shared: PrefixSharing | None = None, routed_experts: torch.Tensor | None = None,
                      record_routing: bool = False):
        """Final-normed hidden states `[..., H]`, and with `record_routing` the record of the experts each token ran
        through (`(hidden states, record)`; see the class docstring for layouts, `routed_experts` and the record)."""
        replay = self._replay_of_layers(input_ids, routed_experts)
        if record_routing and not self.args.moe_layers:
            raise ValueError(f"record_routing on a {self.args.model_type} without sparse layers: no experts to record")
        shape, record = input_ids.shape, []
        packed = cu_seqlens is not None
        if packed:
            squeeze = input_ids.dim() == 2
            input_ids = input_ids.reshape(-1)
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1])
            if position_ids is None:
                position_ids = position_ids_from_lengths(lengths.tolist(), device=input_ids.device)
                if position_ids.numel() < input_ids.numel():
                    position_ids = F.pad(position_ids, (0, input_ids.numel() - position_ids.numel()))
            position_ids = position_ids.reshape(-1)
            if max_seqlen is None:
                max_seqlen = int(lengths.max()) if lengths.numel() else 0
        elif position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        x = self.embed_tokens(input_ids)
        x = scale_embeddings(x, self.args)
        cos, sin = rope_cos_sin(RopeFrequencies(self.inv_freq, self.rope_attention_factor), position_ids, x.dtype)
        local = (rope_cos_sin(RopeFrequencies(self.local_inv_freq, self.local_rope_attention_factor), position_ids,
                              x.dtype) if self.local_rope_layers else None)
        sparse = frozenset(self.args.moe_layers) if record_routing else frozenset()
        for i, layer in enumerate(self.layers):
            rope = local if i in self.local_rope_layers else (cos, sin)
            if i in sparse:
                x, experts = layer(x, *rope, attention_mask, cu_seqlens, max_seqlen, shared, replay.get(i), True)
                record.append(experts.to(moe.routing_dtype(self.args.num_experts)))
            else:
                x = layer(x, *rope, attention_mask, cu_seqlens, max_seqlen, shared, replay.get(i))
        x = self.norm(x)
        if packed and squeeze:
            x = x.unsqueeze(0)
        return (x, torch.stack(record, 1).view(*shape, len(record), -1)) if record_routing else x

    def _replay_of_layers(self, input_ids, routed_experts) -> dict[int, torch.Tensor]:
        """Layer index -> its `[tokens, k]` slice of `routed_experts [*input_ids.shape, len(moe_layers), k]`
        (empty without one)."""
        if routed_experts is None:
            return {}
        layers, k = len(self.args.moe_layers), self.args.num_experts_per_tok
        if not layers or tuple(routed_experts.shape) != (*input_ids.shape, layers, k):
            raise ValueError(f"routed_experts of shape {tuple(routed_experts.shape)} for input_ids of shape "
                             f"{tuple(input_ids.shape)}: expected [*input_ids.shape, {layers} sparse layers, {k}]")
        flat = routed_experts.reshape(-1, layers, k)
        return {layer: flat[:, j] for j, layer in enumerate(self.args.moe_layers)}

    def forward(self, input_ids, position_ids=None, attention_mask=None, cu_seqlens=None, max_seqlen=None,
                labels=None, temperature: float = 1.0, with_entropy: bool = False, chunk_size: int = 2048,
                label_index=None, with_sum_pi_squared: bool = False, shared: PrefixSharing | None = None,
                routed_experts: torch.Tensor | None = None, record_routing: bool = False):
        out = self.hidden_states(input_ids, position_ids, attention_mask, cu_seqlens, max_seqlen, shared,
                                 routed_experts, record_routing)
        if not record_routing:
            return self._head(out, labels, temperature, with_entropy, chunk_size, label_index, with_sum_pi_squared)
        h, record = out
        return self._head(h, labels, temperature, with_entropy, chunk_size, label_index, with_sum_pi_squared), record

    def _head(self, h, labels, temperature: float, with_entropy: bool, chunk_size: int, label_index,
              with_sum_pi_squared: bool):
        """`forward`'s outputs of the final hidden states `h` (logits, values, or log-probs and the rest)."""
        if labels is not None and label_index is not None:
            # Only these (flat) positions are scored: the LM head, the model's widest matmul,
            # then skips prompt tokens and padding.
            if labels.numel() != label_index.numel():
                raise ValueError(f"with label_index, labels holds one token per entry: {labels.numel()} labels "
                                 f"for {label_index.numel()} positions")
            h = h.reshape(-1, h.shape[-1])[label_index]
            labels = labels.reshape(-1)
        if self.head == "value":
            # FSDP2 hooks each unit's output for backward, and a view would bypass the hook: the
            # head (its own unit) sees 2-D rows (a linear over 3-D input returns a view), and the
            # sum over the size-1 dim gives the model's output as a new tensor, not a view.
            return self.score(h.flatten(0, -2)).view(*h.shape[:-1], 1).sum(-1)
        cap = self.args.final_logit_softcapping
        if labels is None:
            logits = F.linear(h, self.embed_tokens.weight) if self.args.tie_word_embeddings else self.lm_head(h)
            logits = soft_cap(logits, cap)
            return logits if self.args.logits_scaling == 1.0 else logits / self.args.logits_scaling
        # Granite's logits are divided by logits_scaling: the log-probs' temperature times it (T = 0, greedy's
        # tokens scored at T = 1, as chunked_token_logprobs reads it)
        if self.args.logits_scaling != 1.0 and temperature >= 0:
            temperature = (temperature or 1.0) * self.args.logits_scaling
        if not self.args.tie_word_embeddings:
            return self.lm_head(h, labels, temperature, with_entropy, chunk_size, with_sum_pi_squared, cap)
        return chunked_token_logprobs(h, self.embed_tokens.weight, labels, temperature, chunk_size, with_entropy,
                                      with_sum_pi_squared, cap)
