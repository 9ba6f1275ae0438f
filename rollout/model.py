"""The engine's tensor-parallel copy of the `models.Transformer` weights and its forward.

All weights of one rank live in one flat buffer (`storage`), so that they can be released
and re-allocated between PPO phases as one block, and a CUDA graph captured over them
stays valid as long as that one pointer does. Releasing shrinks the buffer's storage to
zero bytes and re-allocating grows it back (`untyped_storage().resize_`): every tensor
object - `storage`, the per-layer views, the `ParamSlot` views the resharder writes - keeps
its identity and follows the new memory. Inside it:

* column-parallel (output rows sharded, TP shard j = rows [j n/t, (j+1) n/t)): the fused
  `qkv` ([q | k | v] of this rank's heads) and `gate_up` ([gate | up]) projections and
  their biases; the vocab-parallel embedding and LM head (rows = vocabulary ids, `ceil(V/t)` a rank:
  where t does not divide V, the last rank's rows end in padding, `rollout.parallel.vocab_shard`);
* row-parallel (input columns sharded): `o_proj` and `down_proj`, followed by one
  all-reduce on the TP group (the only collectives of a layer);
* replicated: the norms (Qwen3's per-head q/k norms too), a MoE layer's router (and a Qwen2-MoE's shared expert's
  gate), and `down_proj`'s bias (added once, after the all-reduce). OLMo-2's q/k norms span the whole q and k projections: every rank
  holds them whole and norms its own heads' columns with their part of the weight, by the root mean square of the
  whole projection (each rank's sums of squares, all-reduced: `_full_qk_norm`).

OLMo-2's blocks are post-norm (`ModelArgs.post_norm`): no input norm, each branch's output normed and
added to the residual stream (`ops.post_norm_add`), which the next projection reads as it is. Gemma 2's and Gemma 3's
(`ModelArgs.sandwich_norm`) norm each branch's input and output: the input norm and `pre_ff_norm` read the
residual stream, the output norms are added to it as OLMo-2's are; every norm of a Gemma scales by `1 + weight`
(`unit_offset`), its embedding by sqrt(hidden), and a Gemma 3's sliding_attention layers rotate by their own RoPE
tables. Gemma 2's soft caps are arguments of steps that exist anyway: the attention's (`softcap`, in the reference
paths and the Triton kernels) and the logits' (the sampler's, `rollout.sampler.Sampler`, before its temperature:
`EngineModel.logits` returns them uncapped).

Granite's scalars are arguments of the steps that exist anyway: the attention's scale (`ModelArgs.attention_scale`),
the residual_multiplier a scale of each branch output that `ops.rms_norm` adds to the residual stream, the
logits_scaling the sampler's temperature (`rollout.sampler.Sampler`); its embedding_multiplier multiplies the
embedding lookup's rows.

A mixture-of-experts layer (`ModelArgs.moe_layers`) holds, in place of the MLP's projections, its router
whole (`[E, H]`, replicated) and this rank's slice of every expert's intermediate size: `experts_gate_up`
`[E, 2 Im/t, H]` (of each expert, gate rows `[j Im/t, (j+1) Im/t)` then the same up rows: the trainer's fused
`experts.gate_up_proj [E, 2 Im, H]` has two parts along dim 1, `models.parallel_plan.tp_shard_parts`) and
`experts_down [E, H, Im/t]` (those columns). Its forward is `models.moe`'s, the trainer's own (`_feed_forward`), and
its weighted sum of the experts is all-reduced once, as `down_proj`'s output is. A Qwen2-MoE's sparse layer
(`ModelArgs.shared_expert_intermediate_size`) also holds its shared expert as a dense layer holds its MLP, this rank's
`shared_gate_up [2 Is/t, H]` rows and `shared_down [H, Is/t]` columns, and the expert's gate `shared_gate [1, H]`
whole: each rank adds `sigmoid(h · gate)` times its part of the shared expert's output to its part of the routed sum,
and the one all-reduce sums both. A Granite-MoE-Shared's is the same without the gate (`ModelArgs.shared_expert_gated`):
its part of the shared expert's output is added as it is. A Granite-MoE's router is `models.moe`'s too (its softmax
over the top-k logits).

`param_slots()` exposes, for every parameter of the training model (its names), the view of
this buffer that holds this rank's shard of it; `models.parallel_plan.tp_shard_dim` decides
the shard dimension (`tp_shard_parts` how many parts it fuses), `tp_shard_range` which rows or columns of it (of
each part) a rank holds, and construction checks that the fused layout agrees with both.

A TP size larger than the model's KV heads (a multiple of their count, as vLLM runs them:
Qwen2.5-1.5B's 2 KV heads at TP 4) replicates them: each rank holds its `Hq/t` query heads and a
copy of the one KV head they attend to, head `j // (t/Hkv)` on rank `j`, so the KV pool holds
one head a rank and each rank's attention groups its queries over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.args import ModelArgs
from models.moe import experts_forward, route_model, routing_dtype, use_grouped_mm
from models.parallel_plan import tp_narrow, tp_shard_dim, tp_shard_parts
from models.transformer import Transformer, rope_cos_sin, rope_inv_freq, scale_embeddings
from rollout.attention import AttentionMetadata
from rollout.ops import FP8, FP8_MAX, quantize_fp8, split_k_products
from rollout.config import check_quantization, check_tp_divisibility
from rollout.parallel import TPGroup, vocab_shard

_ALIGN = 128  # elements; keeps every weight 256-byte aligned in bf16 for vectorised loads


@dataclass
class ParamSlot:
    """A view into the engine's weights holding this rank's TP shard of one training parameter.

    `shard_dim` is `tp_shard_dim(name)`: the view is rows/columns `[start, start + n)` of the full
    parameter along it (`tp_shard_range`), or the whole parameter when it is None; of each of its `parts`
    (`tp_shard_parts`: a MoE layer's fused expert gate/up rows), the view then holding `parts * n`.
    """

    view: torch.Tensor
    shard_dim: int | None
    start: int = 0  # the first row / column of the full parameter (of each part), along shard_dim, the view holds
    parts: int = 1

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """The part of the full parameter `full` that this slot holds (`models.parallel_plan.tp_narrow`)."""
        if self.shard_dim is None:
            return full
        return tp_narrow(full, self.shard_dim, self.parts, self.start, self.view.shape[self.shard_dim] // self.parts)


@dataclass
class LayerWeights:
    in_norm: torch.Tensor | None  # [H]; None: a post-norm block (OLMo-2), which has none
    qkv_w: torch.Tensor  # [(Hq/t + 2 kv) D, H], kv = this rank's KV heads (Hkv/t, or 1 replicated)
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [H, Hq D / t]
    post_norm: torch.Tensor  # [H]: post_attention_layernorm (before the MLP; OLMo-2: after the attention)
    gate_up_w: torch.Tensor | None  # [2 I / t, H]; None on a MoE layer (its experts are below)
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor | None  # [H, I / t]
    down_b: torch.Tensor | None  # [H], replicated
    q_norm: torch.Tensor | None = None  # [D], replicated: Qwen3's per-head query norm (OLMo-2: this rank's
    # heads' part [Hq D / t] of the whole-projection norm)
    k_norm: torch.Tensor | None = None  # [D], its key norm (OLMo-2: this rank's KV heads' part [kv D])
    post_ff_norm: torch.Tensor | None = None  # [H]: OLMo-2's post_feedforward_layernorm (after the MLP)
    o_b: torch.Tensor | None = None  # [H], replicated: o_proj's bias (OLMo-2's with attention_bias), added once
    pre_ff_norm: torch.Tensor | None = None  # [H]: Gemma 3's pre_feedforward_layernorm (before the MLP)
    router: torch.Tensor | None = None  # [E, H], replicated: a MoE layer's router (`mlp.gate.weight`)
    experts_gate_up: torch.Tensor | None = None  # [E, 2 Im / t, H]: each expert's gate rows, then its up rows
    experts_down: torch.Tensor | None = None  # [E, H, Im / t]  (Im = moe_intermediate_size)
    shared_gate_up: torch.Tensor | None = None  # [2 Is / t, H]: a Qwen2-MoE's shared expert [gate | up] rows
    shared_down: torch.Tensor | None = None  # [H, Is / t]  (Is = shared_expert_intermediate_size)
    shared_gate: torch.Tensor | None = None  # [1, H], replicated: the shared expert's gate (Qwen2-MoE's; None: ungated)


FP8_PROJECTIONS = ("qkv_w", "gate_up_w", "down_w")  # the projections fp8 rollout runs in e4m3


@dataclass
class Fp8Layer:
    """One layer's e4m3 projections for fp8 rollout: qkv and gate_up with the preceding RMSNorm's weight
    folded in (`W diag(norm)`), down_proj as it is; each with one float32 scale (`scales [3]`)."""

    qkv: torch.Tensor  # [(Hq/t + 2 kv) D, H], kv = this rank's KV heads (Hkv/t, or 1 replicated)
    gate_up: torch.Tensor  # [2 I / t, H]
    down: torch.Tensor  # [H, I / t]
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # float32 scalars, 16-byte aligned: qkv, gate_up, down


# When a projection runs as two split-K products (`split_k_splits`): at most this many rows, and at most
# this many output elements, scaled by the depth of K relative to N (up to twice as many for a K of
# 2 N or more). Chosen from chains of projection + RMSNorm in a CUDA graph on an H200 at qwen2.5-0.5b's,
# 1.5b's and 7b's o_proj and down_proj, 2 to 2,048 rows (docs/results/splitk_rows_h200.json;
# BENCHMARKS.md, "Fifteenth pass").
SPLIT_K_MAX_ROWS = 512
SPLIT_K_MAX_OUTPUT = 400_000


def split_k_splits(rows: int, n: int, k: int, dtype: torch.dtype) -> int:
    """How many consecutive K ranges a projection `[rows, K] -> [rows, N]` is computed in, as float32
    products that the next kernel sums (1: one product, `F.linear`).

    At decode batch sizes cuBLAS covers a small output with a few tiles of a 132-SM GPU, each
    running the whole depth of K, and for a long K adds its own split-K and a separate reduce
    kernel. Two products from one batched GEMM give twice the tiles, and their sum costs the
    kernel that reads the projection anyway (the RMSNorm after `o_proj` and `down_proj`; the
    decode attention after `qkv`, which adds qkv's bias to the sum). That pays while the output
    is small for the depth of K; a one-row step has the GEMV. Only in
    bf16 / fp16 (a float32 engine keeps `F.linear`'s exact agreement with the reference) and
    when each half of K is whole 16-byte vectors.
    """
    if dtype not in (torch.bfloat16, torch.float16) or not 2 <= rows <= SPLIT_K_MAX_ROWS or k % 16:
        return 1
    return 2 if rows * n <= SPLIT_K_MAX_OUTPUT * min(2.0, k / n) else 1


VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")
KV_PROJECTIONS = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                  "self_attn.v_proj.bias")


def kv_heads_of_rank(args: ModelArgs, rank: int, tp: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) that TP rank `rank` of `tp` holds: its `Hkv/t` of them, or, at a TP
    size larger than their count, a copy of the one its query heads attend to (held by `t/Hkv` consecutive ranks)."""
    kv = args.num_key_value_heads
    if kv % tp == 0:
        return rank * (kv // tp), kv // tp
    return rank // (tp // kv), 1


def tp_shard_range(args: ModelArgs, name: str, full_len: int, rank: int, tp: int) -> tuple[int, int] | None:
    """`(start, length)`: the rows / columns `[start, start + length)` along `tp_shard_dim(name)` of the parameter
    `name` (`full_len` of them), of each of its `tp_shard_parts(name)` parts (a MoE layer's expert gate/up rows:
    the same range of its gate and its up rows), that TP rank `rank` of `tp` holds (`models.parallel_plan.tp_narrow`
    takes them); None for a parameter every rank holds whole."""
    if tp_shard_dim(name) is None:
        return None
    if name.endswith(KV_PROJECTIONS):
        first, count = kv_heads_of_rank(args, rank, tp)
        return first * args.head_dim, count * args.head_dim
    if name in VOCAB_PARALLEL:  # the real rows of a shard padded past the vocabulary
        start, _, real = vocab_shard(full_len, rank, tp)
        return start, real
    n = full_len // tp_shard_parts(name) // tp
    return rank * n, n


class EngineModel:
    """Weights (one flat buffer) + the forward of the paged-KV engine for one TP rank."""

    def __init__(self, args: ModelArgs, tp: TPGroup, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 quantization: str | None = None):
        check_tp_divisibility(args, tp.size)
        self.args, self.tp, self.dtype, self.device = args, tp, dtype, device
        self.quantization = quantization
        t = tp.size
        self.hidden = args.hidden_size
        self.head_dim = args.head_dim
        self.num_heads = args.num_attention_heads // t
        self.num_kv_heads = kv_heads_of_rank(args, tp.rank, t)[1]
        self.inter = args.intermediate_size // t
        self.moe_inter = args.moe_intermediate_size // t  # each expert's intermediate rows on this rank
        self.shared_inter = args.shared_expert_intermediate_size // t  # the shared expert's (Qwen2-MoE's)
        # this rank's vocabulary shard: `vocab_local` rows of the embedding and the LM head, of which the ids
        # `vocab_start + vocab_real` and up are padding (the last rank where t does not divide the vocabulary)
        self.vocab_start, self.vocab_local, self.vocab_real = vocab_shard(args.vocab_size, tp.rank, t)
        # head_dim ** -0.5 (Granite: its attention_multiplier; Gemma 3: query_pre_attn_scalar^-0.5)
        self.scale = args.attention_scale
        self.windows = args.layer_windows  # each layer's sliding window (None: the whole context)
        self.softcap = args.attn_logit_softcapping  # the attention scores' soft cap (Gemma 2's; None: none)
        self.offset = args.unit_offset_norm  # every norm scales by 1 + weight (Gemma 3)
        self.act = args.mlp_activation
        self._plan_layout()
        # RoPE tables [max_model_len, D/2] in the model dtype, computed as the training model
        # computes them (float32 angles, then cast), on the engine's device.
        # Gemma 3's sliding_attention layers rotate by their own (`ModelArgs.local_rope_layers`): `layer_rope`.
        pos = torch.arange(max_model_len, device=device)
        cos, sin = rope_cos_sin(rope_inv_freq(args, device=device), pos, dtype)
        self.cos = cos[:, :self.head_dim // 2].contiguous()
        self.sin = sin[:, :self.head_dim // 2].contiguous()
        self.layer_rope = [(self.cos, self.sin)] * args.num_hidden_layers
        if args.local_rope_layers:
            cos, sin = rope_cos_sin(rope_inv_freq(args.local_rope_args(), device=device), pos, dtype)
            local = (cos[:, :self.head_dim // 2].contiguous(), sin[:, :self.head_dim // 2].contiguous())
            for i in args.local_rope_layers:
                self.layer_rope[i] = local
        if quantization == "fp8":
            # The normed activations |x / rms(x)| <= sqrt(H): one fixed scale maps them into e4m3's range
            # (the norm's weight is folded into the next projection), so no pass over them measures it.
            self.fp8_in_scale = torch.full((self.hidden,), FP8_MAX / self.hidden ** 0.5, device=device)
            self.fp8_act_scale = torch.tensor(self.hidden ** 0.5 / FP8_MAX, device=device)
            self.fp8_one = torch.ones((), device=device)
        elif quantization is not None:
            raise ValueError(f"quantization must be None or 'fp8' (EngineConfig.quantization), got {quantization!r}")
        check_quantization(args, quantization)
        self.allocate()

    # ------------------------------------------------------------------ layout
    def _plan_layout(self) -> None:
        """Engine buffers (name -> local shape) and the training-name -> buffer mapping."""
        a, t = self.args, self.tp.size
        h, d = self.hidden, self.head_dim
        q, kv, inter = self.num_heads * d, self.num_kv_heads * d, self.inter
        buffers: dict[str, tuple[int, ...]] = {"embed": (self.vocab_local, h), "norm": (h,)}
        if not a.tie_word_embeddings:
            buffers["lm_head"] = (self.vocab_local, h)
        # training name -> (buffer, first row, rows or None for the whole buffer)
        vocab_rows = None if self.vocab_real == self.vocab_local else self.vocab_real  # the padding has no slot
        plan: dict[str, tuple[str, int, int | None]] = {
            "embed_tokens.weight": ("embed", 0, vocab_rows), "norm.weight": ("norm", 0, None)}
        if not a.tie_word_embeddings:
            plan["lm_head.weight"] = ("lm_head", 0, vocab_rows)
        moe_layers = set(a.moe_layers)
        for i in range(a.num_hidden_layers):
            p, b = f"layers.{i}.", f"layers.{i}."
            if not a.post_norm:
                buffers[b + "in_norm"] = (h,)
                plan[p + "input_layernorm.weight"] = (b + "in_norm", 0, None)
            if a.post_norm or a.sandwich_norm:
                buffers[b + "post_ff_norm"] = (h,)
                plan[p + "post_feedforward_layernorm.weight"] = (b + "post_ff_norm", 0, None)
            if a.sandwich_norm:
                buffers[b + "pre_ff_norm"] = (h,)
                plan[p + "pre_feedforward_layernorm.weight"] = (b + "pre_ff_norm", 0, None)
            buffers[b + "post_norm"] = (h,)
            buffers[b + "qkv_w"] = (q + 2 * kv, h)
            buffers[b + "o_w"] = (h, q)
            plan[p + "post_attention_layernorm.weight"] = (b + "post_norm", 0, None)
            plan[p + "self_attn.o_proj.weight"] = (b + "o_w", 0, None)
            for kind in ("weight",) + (("bias",) if a.attention_bias else ()):
                buf = b + ("qkv_w" if kind == "weight" else "qkv_b")
                plan[p + f"self_attn.q_proj.{kind}"] = (buf, 0, q)
                plan[p + f"self_attn.k_proj.{kind}"] = (buf, q, kv)
                plan[p + f"self_attn.v_proj.{kind}"] = (buf, q + kv, kv)
            if a.attention_bias:
                buffers[b + "qkv_b"] = (q + 2 * kv,)
            if a.o_proj_bias:
                buffers[b + "o_b"] = (h,)
                plan[p + "self_attn.o_proj.bias"] = (b + "o_b", 0, None)
            if a.qk_norm or a.full_qk_norm:
                widths = (a.num_attention_heads * d, a.num_key_value_heads * d) if a.full_qk_norm else (d, d)
                for part, width in zip(("q_norm", "k_norm"), widths):
                    buffers[b + part] = (width,)
                    plan[p + f"self_attn.{part}.weight"] = (b + part, 0, None)
            if i in moe_layers:  # the router whole, this rank's rows (gate's, then up's) and columns of every expert
                e, mi = a.num_experts, self.moe_inter
                buffers[b + "router"] = (e, h)
                buffers[b + "experts_gate_up"] = (e, 2 * mi, h)
                buffers[b + "experts_down"] = (e, h, mi)
                plan[p + "mlp.gate.weight"] = (b + "router", 0, None)
                plan[p + "mlp.experts.gate_up_proj"] = (b + "experts_gate_up", 0, None)
                plan[p + "mlp.experts.down_proj"] = (b + "experts_down", 0, None)
                if self.shared_inter:  # the shared expert as a dense MLP is held, its gate (Qwen2-MoE's) whole
                    si = self.shared_inter
                    buffers[b + "shared_gate_up"] = (2 * si, h)
                    buffers[b + "shared_down"] = (h, si)
                    plan[p + "mlp.shared_expert.gate_proj.weight"] = (b + "shared_gate_up", 0, si)
                    plan[p + "mlp.shared_expert.up_proj.weight"] = (b + "shared_gate_up", si, si)
                    plan[p + "mlp.shared_expert.down_proj.weight"] = (b + "shared_down", 0, None)
                    if self.args.shared_expert_gated:
                        buffers[b + "shared_gate"] = (1, h)
                        plan[p + "mlp.shared_expert_gate.weight"] = (b + "shared_gate", 0, None)
                continue
            buffers[b + "gate_up_w"] = (2 * inter, h)
            buffers[b + "down_w"] = (h, inter)
            plan[p + "mlp.down_proj.weight"] = (b + "down_w", 0, None)
            for kind in ("weight",) + (("bias",) if a.mlp_bias else ()):
                buf = b + ("gate_up_w" if kind == "weight" else "gate_up_b")
                plan[p + f"mlp.gate_proj.{kind}"] = (buf, 0, inter)
                plan[p + f"mlp.up_proj.{kind}"] = (buf, inter, inter)
            if a.mlp_bias:
                buffers[b + "gate_up_b"] = (2 * inter,)
                buffers[b + "down_b"] = (h,)
                plan[p + "mlp.down_proj.bias"] = (b + "down_b", 0, None)
        self._buffers, self._plan = buffers, plan

        # The training model is the source of truth for names and full shapes.
        with torch.device("meta"):
            ref = Transformer(a)
        self.full_shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
        if set(self.full_shapes) != set(plan):
            raise AssertionError(f"engine layout and models.Transformer disagree: "
                                 f"{sorted(set(self.full_shapes) ^ set(plan))[:6]}")
        self._starts: dict[str, int] = {}
        for name, full in self.full_shapes.items():
            buf, _, rows = plan[name]
            local = (rows,) + buffers[buf][1:] if rows is not None else buffers[buf]
            dim = tp_shard_dim(name)
            shard = tp_shard_range(a, name, full[dim], self.tp.rank, t) if dim is not None else (0, None)
            self._starts[name] = shard[0]
            expect = tuple(tp_shard_parts(name) * shard[1] if i == dim else s for i, s in enumerate(full))
            if tuple(local) != expect:
                raise AssertionError(f"{name}: engine shard {tuple(local)} != {expect} (tp_shard_dim={dim})")
            if dim == 1 and rows is not None:
                raise AssertionError(f"{name}: a fused buffer cannot hold a dim-1 shard")

    # ------------------------------------------------------------------ storage
    def _flat(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One uninitialised flat buffer holding `shapes` (name -> shape) one after another, each start
        `_ALIGN`-aligned, and the view of each."""
        offsets, total = {}, 0
        for name, shape in shapes.items():
            offsets[name] = total
            total += -(-torch.Size(shape).numel() // _ALIGN) * _ALIGN
        flat = torch.empty(total, dtype=dtype, device=self.device)
        return flat, {name: flat[offsets[name]:offsets[name] + torch.Size(shape).numel()].view(shape)
                      for name, shape in shapes.items()}

    def allocate(self) -> None:
        """Allocate the flat weight buffer, uninitialised, and build every view of it (once).

        fp8: the model-dtype qkv, gate/up and down weights live in a buffer of their own (`proj_storage`),
        given back once `quantize_fp8` has read them and re-allocated by the next `restore()` (which
        `param_slots()` and the resharder's writes come after); their e4m3 copies in `fp8_storage`."""
        fp8 = self.quantization == "fp8"
        proj = {n: s for n, s in self._buffers.items() if fp8 and n.rsplit(".", 1)[-1] in FP8_PROJECTIONS}
        self.storage, self.buffers = self._flat({n: s for n, s in self._buffers.items() if n not in proj}, self.dtype)
        self._storage_nbytes = self.storage.untyped_storage().nbytes()
        self.fp8_layers: list[Fp8Layer] = []
        if fp8:
            self.proj_storage, views = self._flat(proj, self.dtype)
            self._proj_nbytes = self.proj_storage.untyped_storage().nbytes()
            self.buffers.update(views)
            self.fp8_storage, q = self._flat(proj, FP8)
            self._fp8_nbytes = self.fp8_storage.untyped_storage().nbytes()
            # each scale 16 bytes from the next: cuBLASLt rejects a scale pointer that is not 16-byte aligned
            self.fp8_scales = torch.ones(self.args.num_hidden_layers, 3, 4, device=self.device)
            # the scale views made once: a forward indexes no tensor per layer
            self.fp8_layers = [Fp8Layer(*(q[f"layers.{i}.{p}"] for p in FP8_PROJECTIONS),
                                        tuple(self.fp8_scales[i, j, 0] for j in range(3)))
                               for i in range(self.args.num_hidden_layers)]
        self._slots = {}
        for name, (buf, row0, rows) in self._plan.items():
            view = self.buffers[buf] if rows is None else self.buffers[buf][row0:row0 + rows]
            self._slots[name] = ParamSlot(view, tp_shard_dim(name), self._starts[name], tp_shard_parts(name))
        B = self.buffers
        self.embed_w = B["embed"]
        self.norm_w = B["norm"]
        self.head_w = B["embed"] if self.args.tie_word_embeddings else B["lm_head"]
        self.layers = [
            LayerWeights(B.get(f"layers.{i}.in_norm"), B[f"layers.{i}.qkv_w"], B.get(f"layers.{i}.qkv_b"),
                         B[f"layers.{i}.o_w"], B[f"layers.{i}.post_norm"], B.get(f"layers.{i}.gate_up_w"),
                         B.get(f"layers.{i}.gate_up_b"), B.get(f"layers.{i}.down_w"), B.get(f"layers.{i}.down_b"),
                         *self._qk_norms(B.get(f"layers.{i}.q_norm"), B.get(f"layers.{i}.k_norm")),
                         B.get(f"layers.{i}.post_ff_norm"), B.get(f"layers.{i}.o_b"), B.get(f"layers.{i}.pre_ff_norm"),
                         B.get(f"layers.{i}.router"), B.get(f"layers.{i}.experts_gate_up"),
                         B.get(f"layers.{i}.experts_down"), B.get(f"layers.{i}.shared_gate_up"),
                         B.get(f"layers.{i}.shared_down"), B.get(f"layers.{i}.shared_gate"))
            for i in range(self.args.num_hidden_layers)]
        self.fp8_stale = True

    def _qk_norms(self, q_norm, k_norm):
        """A layer's q/k norm weights as its forward reads them: Qwen3's per-head ones whole, OLMo-2's
        whole-projection ones as the views of this rank's heads' columns (its KV heads' as `kv_heads_of_rank`)."""
        if q_norm is None or not self.args.full_qk_norm:
            return q_norm, k_norm
        d, t = self.head_dim, self.tp.size
        first_kv = kv_heads_of_rank(self.args, self.tp.rank, t)[0]
        q = self.num_heads * d
        return (q_norm[self.tp.rank * q:(self.tp.rank + 1) * q],
                k_norm[first_kv * d:(first_kv + self.num_kv_heads) * d])

    def release(self) -> None:
        """Give the weights' memory back (the views stay, over zero bytes, until `restore()`)."""
        for flat in (self.storage,) + ((self.proj_storage, self.fp8_storage) if self.fp8_layers else ()):
            flat.untyped_storage().resize_(0)

    def restore(self) -> None:
        """Re-allocate released weight memory, uninitialised, under the same tensor objects (fp8: the
        model-dtype projections filled with NaN, so that one left unwritten fails `quantize_fp8`)."""
        if not self.allocated:
            self.storage.untyped_storage().resize_(self._storage_nbytes)
            if self.fp8_layers:
                self.fp8_storage.untyped_storage().resize_(self._fp8_nbytes)
        if self.fp8_layers and self.proj_storage.untyped_storage().nbytes() == 0:
            self.proj_storage.untyped_storage().resize_(self._proj_nbytes)
            self.proj_storage.fill_(float("nan"))
        self.fp8_stale = True

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Fill the e4m3 projections from the current weights (after every weight write: `fp8_stale`).

        One scale per full tensor, agreed over the TP group (the largest |value| of any shard), so that every
        TP shard holds exactly the values TP 1 would."""
        def folded(src, norm):
            return src.float() if norm is None else src.float() * norm.float()

        sources = [((w.qkv_w, w.in_norm), (w.gate_up_w, w.post_norm), (w.down_w, None)) for w in self.layers]
        amax = torch.stack([torch.stack([folded(*s).abs().amax() for s in layer]) for layer in sources])
        if not self.tp.all_reduce_min(int(bool(torch.isfinite(amax).all())), self.device):
            raise RuntimeError("quantize_fp8: a qkv, gate/up or down weight is not finite on some TP rank - "
                               "param_slots() re-allocates them, and every slot must be written after it")
        self.tp.all_reduce_max_(amax)
        for layer, q, layer_amax in zip(sources, self.fp8_layers, amax):
            for j, (source, dst) in enumerate(zip(layer, (q.qkv, q.gate_up, q.down))):
                values, scale = quantize_fp8(folded(*source), layer_amax[j])
                dst.copy_(values)
                q.scales[j].copy_(scale)
        self.proj_storage.untyped_storage().resize_(0)  # read: the e4m3 copies serve until the next write
        self.fp8_stale = False

    @property
    def mlp_activation_width(self) -> int:
        """Elements of a token's MLP branch alive at once on this rank (the engine's activation reserve): a dense
        layer's gate, up and their product (`3 I/t`); a MoE layer's, for each of its top-k experts, those, the copy of
        its input row and its weighted output that `models.moe.experts_forward` sorts by expert (`k (3 Im/t + 2 H)`),
        and a shared expert's gate, up, product, output and gated output (`3 Is/t + 2 H`)."""
        a = self.args
        dense = 3 * self.inter if len(a.moe_layers) < a.num_hidden_layers else 0
        shared = 3 * self.shared_inter + 2 * self.hidden if self.shared_inter else 0
        moe = a.num_experts_per_tok * (3 * self.moe_inter + 2 * self.hidden) + shared if a.moe_layers else 0
        return max(dense, moe)

    @property
    def graph_capturable(self) -> bool:
        """Whether a forward reads nothing back to the host, so that a CUDA graph can capture it: not where a MoE
        layer's experts loop over the experts that have tokens, which the host counts (`models.moe`: on CUDA they
        take the grouped GEMM, which counts on the device, in bf16 with aligned sizes only, `use_grouped_mm`)."""
        w = next((layer for layer in self.layers if layer.router is not None), None)
        return w is None or use_grouped_mm(w.experts_gate_up.new_empty(0, self.hidden), w.experts_gate_up)

    @property
    def allocated(self) -> bool:
        return self.storage.untyped_storage().nbytes() > 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in the model dtype (what the resharder writes)."""
        n = sum(torch.Size(s).numel() for s in self._buffers.values())
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def fp8_weight_bytes(self) -> int:
        """Bytes of the e4m3 projections (0 without fp8): held next to the model-dtype weights."""
        return sum(t.numel() for q in self.fp8_layers for t in (q.qkv, q.gate_up, q.down))

    def param_slots(self) -> dict[str, ParamSlot]:
        """The slots; the caller is about to write them, so the e4m3 projections are requantized before the next forward."""
        self.fp8_stale = True
        return dict(self._slots)

    # ------------------------------------------------------------------ forward
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up its rows, zeros the rest, all-reduce; times
        `ModelArgs.embedding_scale` (Granite's embedding_multiplier, Gemma 3's sqrt(hidden)), rounded as the
        training model rounds it (`models.transformer.scale_embeddings`)."""
        if self.tp.size == 1:
            x = F.embedding(ids, self.embed_w)
        else:
            local = ids.long() - self.vocab_start
            mine = (local >= 0) & (local < self.vocab_local)
            x = F.embedding(torch.where(mine, local, 0), self.embed_w) * mine[:, None].to(self.dtype)
            x = self.tp.all_reduce(x)
        return scale_embeddings(x, self.args)

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ops, splits: int) -> torch.Tensor:
        """`o_proj` / `down_proj`: `[T, H]`, or (TP 1, `splits` > 1) their split-K products `[S, T, H]`
        for the next `rms_norm` to sum."""
        if self.tp.size == 1:
            return ops.linear(x, w, b) if splits == 1 else split_k_products(x, w, splits)
        y = self.tp.all_reduce(ops.linear(x, w))
        return y if b is None else y + b

    def routing_dtype(self) -> torch.dtype:
        """The integer dtype that holds an expert id (`EngineConfig.return_routed_experts`): uint8 up to 256
        experts, else int16 (`models.moe.routing_dtype`, the trainer's record's)."""
        return routing_dtype(self.args.num_experts)

    def _feed_forward(self, h: torch.Tensor, w: LayerWeights, ops, splits: int,
                      record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """A layer's MLP branch of its normed input `h [T, H]`, all-reduced: the gated MLP (`down_proj` as its split-K
        products when `splits` > 1, `_row_parallel`) or, on a MoE layer, its experts as the training model runs them
        (`models.moe`: the replicated router picks each token's experts, each rank computes them over its rows of every
        expert's intermediate size, and their weighted sum is all-reduced once, as `down_proj`'s output is; a shared
        expert's part of this rank, times its replicated gate's sigmoid, is added before that all-reduce, in
        transformers' order: `routed + sigmoid(gate) * shared`).
        `record = (buffer [rows, k], rows of h [T])`: a MoE layer writes its tokens' experts there (a scatter on the
        device: no host read, the same in a CUDA graph)."""
        if w.router is None:
            return self._row_parallel(ops.gated_linear(h, w.gate_up_w, w.gate_up_b, act=self.act), w.down_w, w.down_b,
                                      ops, splits)
        weights, experts = route_model(h, w.router, self.args)
        if record is not None:
            record[0][record[1]] = experts.to(record[0].dtype)
        out = experts_forward(h, weights, experts, w.experts_gate_up, w.experts_down, self.act)
        if w.shared_gate_up is not None:
            shared = ops.linear(ops.gated_linear(h, w.shared_gate_up, act=self.act), w.shared_down)
            out = out + (torch.sigmoid(F.linear(h, w.shared_gate)) * shared if w.shared_gate is not None else shared)
        return self.tp.all_reduce(out)

    def _down_fp8(self, h: torch.Tensor, w: LayerWeights, q: Fp8Layer, ops) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp8 `down_proj` of the gate/up output `h`: (x, x_scale) for the next `rms_norm` - at TP 1 without a bias
        the product rows in the model dtype and their scales (applied there), else the projection itself."""
        d, d_scale = ops.silu_and_mul_fp8(h)
        y = ops.scaled_linear(d, q.down, self.fp8_one, q.scales[2], None, self.dtype)
        if self.tp.size == 1 and w.down_b is None:
            return y, d_scale
        y = (y * d_scale[:, None]).to(self.dtype)
        if self.tp.size > 1:
            y = self.tp.all_reduce(y)
        return (y if w.down_b is None else y + w.down_b), None

    def _splits(self, rows: int, meta: AttentionMetadata) -> tuple[int, int, int]:
        """Split-K products of (qkv, o_proj, down_proj) in a step of `rows` rows, the same in every layer
        (`split_k_splits`): qkv's only in a decode step whose attention kernel reads each row once (one
        split a sequence) and without per-head q/k norms (they read the summed rows); o_proj's and
        down_proj's at TP 1 (elsewhere they are all-reduced), without a bias (the RMSNorm adds none:
        down_proj's, a Granite's o_proj with attention_bias). down_proj's is that of the dense layers; a MoE layer's
        experts ignore it (`_feed_forward`)."""
        w, dtype, h, fp8 = self.layers[0], self.dtype, self.hidden, bool(self.fp8_layers)
        dense = next((layer for layer in self.layers if layer.down_w is not None), None)
        qkv = split_k_splits(rows, w.qkv_w.shape[0], h, dtype) if meta.is_decode and meta.num_splits == 1 else 1
        if fp8 or self.args.qk_norm or self.args.full_qk_norm:
            qkv = 1  # e4m3 GEMMs (only o_proj stays in the model dtype), or the q/k norms read the sums
        if self.args.post_norm or self.args.sandwich_norm:
            return qkv, 1, 1  # each branch's norm reads its projection, not a residual sum
        if self.tp.size > 1:
            return qkv, 1, 1
        down = (split_k_splits(rows, h, dense.down_w.shape[1], dtype)
                if dense is not None and dense.down_b is None and not fp8 else 1)
        o = split_k_splits(rows, h, w.o_w.shape[1], dtype) if w.o_b is None else 1
        return qkv, o, down

    def forward(self, input_ids, positions, token_slots, meta: AttentionMetadata, kv_cache, block_tables,
                ops, kv_scales=None, routed_experts=None) -> torch.Tensor:
        """Tokens `[T]` at `positions [T]` of the sequences in rows `token_slots [T]` -> final-normed hidden `[T, H]`
        (in a decode step, one token a sequence: `meta.context_lens - 1` and `meta.slots`).

        Writes the tokens' K/V into `kv_cache [L, 2, blocks, block_size, Hkv/t, D]`: in the model dtype, or
        (`kv_scales [L, 2, blocks, block_size, Hkv/t]` given) as e4m3 values with those float32 scales; and with
        `routed_experts [blocks * block_size, len(moe_layers), k]` (laid out as the pool's token places), each
        sparse layer's experts of each token at its place (`_routing_records`).
        """
        if self.fp8_layers and self.fp8_stale:
            raise RuntimeError("the weights changed since quantize_fp8(): the e4m3 projections are stale")
        eps = self.args.rms_norm_eps
        if self.args.sandwich_norm:
            return self._sandwich_forward(input_ids, positions, token_slots, meta, kv_cache, block_tables, ops,
                                          kv_scales)
        branch = self.args.residual_multiplier  # each branch output's scale before its residual add (Granite's)
        records = self._routing_records(positions, token_slots, block_tables, kv_cache, routed_experts)
        x = self.embed(input_ids)
        qkv_splits, o_splits, down_splits = self._splits(x.shape[0], meta)
        residual = x_scale = None
        for i, w in enumerate(self.layers):
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            if w.in_norm is None:  # a post-norm block: the residual stream is the projection's input
                qkv = ops.linear(x, w.qkv_w, w.qkv_b)
            elif self.fp8_layers:  # e4m3 qkv from the e4m3 norm (its weight is folded into qkv)
                q8 = self.fp8_layers[i]
                h, residual = ops.rms_norm(x, self.fp8_in_scale, eps, residual, x_scale, out_dtype=FP8,
                                           scale=1.0 if residual is None else branch)
                qkv = ops.scaled_linear(h, q8.qkv, self.fp8_act_scale, q8.scales[0], w.qkv_b, self.dtype)
            else:
                h, residual = ops.rms_norm(x, w.in_norm, eps, residual, scale=1.0 if residual is None else branch)
                qkv = (ops.linear(h, w.qkv_w, w.qkv_b) if qkv_splits == 1
                       else split_k_products(h, w.qkv_w, qkv_splits))  # summed, with the bias, in the attention
            if w.q_norm is not None and self.args.full_qk_norm:  # OLMo-2: the whole q and k projections
                qkv = self._full_qk_norm(qkv, w, ops, eps)
            elif w.q_norm is not None:  # Qwen3: each head's q and k RMS-normalised before RoPE
                qkv = ops.qk_norm(qkv, w.q_norm, w.k_norm, self.num_heads, self.num_kv_heads, self.head_dim, eps)
            if meta.is_decode:  # RoPE and the K/V write are part of the attention (one token a sequence)
                o = ops.decode_attention(qkv, positions, self.cos, self.sin, k_cache, v_cache, block_tables, meta,
                                         self.scale, self.num_heads, self.num_kv_heads, self.head_dim, w.qkv_b,
                                         k_scale, v_scale, window=self.windows[i], softcap=self.softcap)
            else:
                q = ops.rope_and_cache(qkv, positions, token_slots, self.cos, self.sin, k_cache, v_cache,
                                       block_tables, self.num_heads, self.num_kv_heads, self.head_dim, k_scale, v_scale)
                o = ops.prefill_attention(q, k_cache, v_cache, block_tables, meta, self.scale, k_scale, v_scale,
                                          window=self.windows[i], softcap=self.softcap)
            if w.in_norm is None:  # post-norm: x + norm(attention), then that + norm(MLP)
                x = ops.post_norm_add(self._row_parallel(o, w.o_w, w.o_b, ops, 1), w.post_norm, eps, x)
                x = ops.post_norm_add(self._feed_forward(x, w, ops, 1, records.get(i)), w.post_ff_norm, eps, x)
                continue
            x = self._row_parallel(o, w.o_w, w.o_b, ops, o_splits)
            if self.fp8_layers:
                h, residual = ops.rms_norm(x, self.fp8_in_scale, eps, residual, out_dtype=FP8, scale=branch)
                h = ops.scaled_linear(h, q8.gate_up, self.fp8_act_scale, q8.scales[1], w.gate_up_b, self.dtype)
                x, x_scale = self._down_fp8(h, w, q8, ops)
            else:
                h, residual = ops.rms_norm(x, w.post_norm, eps, residual, scale=branch)
                x = self._feed_forward(h, w, ops, down_splits, records.get(i))
        h, _ = ops.rms_norm(x, self.norm_w, eps, residual, x_scale, scale=1.0 if residual is None else branch)
        return h

    def _routing_records(self, positions, token_slots, block_tables, kv_cache, routed_experts) -> dict:
        """Sparse layer index -> `(its [places, k] slice of routed_experts, each token's place)`, where a token's
        place is where its K/V goes (block `block_tables[slot, position // block_size]`, offset `position %
        block_size`): a shared prompt's experts are recorded once in its shared blocks, a copied block carries
        them, and padding rows (the dummy slot) write the scratch block. Empty without `routed_experts`."""
        if routed_experts is None:
            return {}
        bs = kv_cache.shape[3]
        pos = positions.long()
        places = block_tables[token_slots.long(), pos // bs].long() * bs + pos % bs
        return {layer: (routed_experts[:, j], places) for j, layer in enumerate(self.args.moe_layers)}

    def _attention(self, i: int, qkv, positions, token_slots, meta: AttentionMetadata, kv_cache, block_tables, ops,
                   kv_scales, qkv_b=None):
        """Layer `i`'s attention of its projections `qkv` (q / k normed): RoPE by the layer's tables, the K/V
        write, attention through its window; `[T, Hq/t D]`."""
        k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
        k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
        cos, sin = self.layer_rope[i]
        if meta.is_decode:  # RoPE and the K/V write are part of the attention (one token a sequence)
            return ops.decode_attention(qkv, positions, cos, sin, k_cache, v_cache, block_tables, meta, self.scale,
                                        self.num_heads, self.num_kv_heads, self.head_dim, qkv_b, k_scale, v_scale,
                                        window=self.windows[i], softcap=self.softcap)
        q = ops.rope_and_cache(qkv, positions, token_slots, cos, sin, k_cache, v_cache, block_tables,
                               self.num_heads, self.num_kv_heads, self.head_dim, k_scale, v_scale)
        return ops.prefill_attention(q, k_cache, v_cache, block_tables, meta, self.scale, k_scale, v_scale,
                                     window=self.windows[i], softcap=self.softcap)

    def _sandwich_forward(self, input_ids, positions, token_slots, meta: AttentionMetadata, kv_cache, block_tables,
                          ops, kv_scales) -> torch.Tensor:
        """`forward` of a Gemma (`ModelArgs.sandwich_norm`): each branch's input normed from the residual stream
        and its output normed and added to it (`ops.post_norm_add`); every norm by 1 + weight (Gemma 3's per-head
        q / k norms too; Gemma 2 has none)."""
        eps = self.args.rms_norm_eps
        x = self.embed(input_ids)
        for i, w in enumerate(self.layers):
            h, _ = ops.rms_norm(x, w.in_norm, eps, unit_offset=True)
            qkv = ops.linear(h, w.qkv_w, w.qkv_b)
            if w.q_norm is not None:
                qkv = ops.qk_norm(qkv, w.q_norm, w.k_norm, self.num_heads, self.num_kv_heads, self.head_dim, eps,
                                  unit_offset=True)
            o = self._attention(i, qkv, positions, token_slots, meta, kv_cache, block_tables, ops, kv_scales)
            x = ops.post_norm_add(self._row_parallel(o, w.o_w, w.o_b, ops, 1), w.post_norm, eps, x, unit_offset=True)
            h, _ = ops.rms_norm(x, w.pre_ff_norm, eps, unit_offset=True)
            x = ops.post_norm_add(self._feed_forward(h, w, ops, 1), w.post_ff_norm, eps, x, unit_offset=True)
        h, _ = ops.rms_norm(x, self.norm_w, eps, unit_offset=True)
        return h

    def _full_qk_norm(self, qkv: torch.Tensor, w: LayerWeights, ops, eps: float) -> torch.Tensor:
        """OLMo-2's q and k of `qkv` RMS-normalised over the whole projections, in place: the root mean square
        of each from the sums of squares of every rank's columns (one all-reduce of `[T, 2]` at TP > 1). Where
        ranks hold copies of one KV head, each head is counted as often as every other, so the mean over all
        ranks' columns is still the projection's."""
        q_width, k_width = w.q_norm.shape[0], w.k_norm.shape[0]
        sums = ops.qk_square_sums(qkv, q_width, k_width)
        if self.tp.size > 1:
            sums = self.tp.all_reduce(sums)
        t = self.tp.size
        return ops.full_qk_norm(qkv, w.q_norm, w.k_norm, sums, (q_width * t, k_width * t), eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, `[R, vocab_local]` in the model dtype, not soft-capped: the
        sampler caps them by final_logit_softcapping (Gemma 2's) where it reads them (`rollout.sampler.Sampler`,
        which the runner builds with the cap), so that without top-k / top-p the cap's three elementwise passes over
        `[R, V]` cost no memory traffic of their own; the columns from `vocab_real` on are padding, never written by
        a weight load, which the sampler leaves out."""
        return F.linear(h, self.head_w)
