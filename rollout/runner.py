"""Executes scheduled steps on the device: KV pool, per-sequence device tables, CUDA graphs.

Device-side state that outlives a step, indexed by a sequence's `slot`:

* `block_tables [max_num_seqs + 1, max_blocks_per_seq]` int32: each slot's pages. The
  scheduler's changes arrive as (slot, column, block) updates, so a decode step uploads
  only a few integers instead of whole tables.
* `last_tokens [max_num_seqs + 1]` int64: the last sampled token of each slot. A decode
  step reads its input tokens from here and writes the sampled ones back, on the device:
  the host never has to see a token before the next step can start, which lets the engine
  overlap its bookkeeping of step t with the GPU running step t+1. A prefill step's
  decoding rows (the scheduler's module docstring) read theirs from here too.

With `EngineConfig.return_routed_experts` (a mixture-of-experts model), `routed_experts` holds every
token's experts in each sparse layer at its place in the KV pool (rollout/README.md, "Routing record").

Slot `max_num_seqs` is a dummy that pads a decode batch up to its CUDA-graph size; its
pages all point at a scratch block (the last one of the pool), so padding rows write and
read only there.

A decode step is `[slots | positions | keys]` (3 x rows int32, in pinned memory) in, a
replay of the graph captured for the padded batch size (the inputs read from pinned memory,
embedding, layers, LM head, sampling, `last_tokens` update, tokens + log-probs written to
pinned memory) and an event: no host synchronisation inside the step, and no copy between
two replays (eager steps copy the same buffers up and down). Graphs are captured
lazily, the first time a batch size is used, and are kept while the weight and KV-pool
pointers they were captured with stay the same.

A prefill step of up to `EngineConfig.prefill_graph_max_tokens` tokens (with the Triton ops)
runs padded to a token bucket (`prefill_bucket`) through static buffers: its inputs are one
upload into a fixed layout, padding tokens write only the dummy slot's scratch block, padding
sequences have no queries, and padding tiles of the attention grid end at once. Its forward
(`[tokens bucket]`) and its sampling (`[rows bucket]`: LM head on the sampled rows, sampler,
`last_tokens` update) are two graphs, each captured the second time its bucket is used: the
first, eager use compiles the kernels, and a shape seen once (the single prefill of a PPO
rollout) never pays for a capture. All graphs share one memory pool: they run one after
another and their outputs land in static buffers. Eager, such a step costs ~200 kernel
launches of host time, 10-14 ms on the H200 host, however few tokens it has.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from models.transfer import host_to_device
from models.triton_support import triton_usable
from rollout.attention import PREFILL_TILE, AttentionMetadata, prefill_tiles
from rollout.block_manager import cdiv
from rollout.config import EngineConfig
from rollout.model import EngineModel
from rollout.ops import FP8, get_ops
from rollout.sampler import Sampler
from rollout.sequence import ScheduledBatch


# Above this many tokens, prefill buckets are multiples of it. A continuous-batching refill is
# typically one prompt riding with the decoding rows (128 + 255 = 383 tokens): 128-token steps pad
# it to 384, where 512-token steps padded it to 512 (BENCHMARKS.md, "Seventeenth pass").
PREFILL_BUCKET_STEP = 128

log = logging.getLogger(__name__)


def prefill_bucket(tokens: int, cap: int) -> int:
    """The padded size of a prefill step of `tokens` (<= cap) tokens: the next power of two from
    PREFILL_TILE up to PREFILL_BUCKET_STEP, then the next multiple of it, at most `cap`."""
    if tokens <= PREFILL_BUCKET_STEP:
        b = max(PREFILL_TILE, 1 << (tokens - 1).bit_length())
    else:
        b = cdiv(tokens, PREFILL_BUCKET_STEP) * PREFILL_BUCKET_STEP
    return min(b, cap)


class StepOutput:
    """The sampled tokens of a launched step, readable once its event has completed."""

    def __init__(self, batch: ScheduledBatch, tokens: torch.Tensor, logprobs: torch.Tensor, event, n: int):
        self.batch, self._tokens, self._logprobs, self._event, self.n = batch, tokens, logprobs, event, n

    def result(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        return self._tokens[:self.n].tolist(), self._logprobs[:self.n].tolist()


class ModelRunner:
    def __init__(self, model: EngineModel, config: EngineConfig, device: torch.device, max_model_len: int):
        self.model, self.config, self.device = model, config, device
        self.use_triton = triton_usable(device)  # any head_dim: the kernels pad it (`head_lanes`)
        self.is_cuda = device.type == "cuda"
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.dummy_slot = config.max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, config.block_size)
        # Graphs need the Triton decode attention: the reference path sizes its context gather
        # from a host value, which a graph would freeze at its capture-time value; and a forward
        # that reads nothing back to the host (`EngineModel.graph_capturable`: a MoE model's
        # experts in bf16).
        graphs = self.is_cuda and self.use_triton and not config.enforce_eager
        if graphs and not model.graph_capturable:
            log.warning("engine: no CUDA graphs - this %s model's experts loop over the experts on the host in %s "
                        "(models.moe's grouped GEMM, which a graph can capture, takes bf16 with hidden and expert "
                        "sizes multiples of 8); every step runs eagerly", model.args.model_type,
                        str(model.dtype).removeprefix("torch."))
            graphs = False
        self.capture_sizes = config.capture_sizes() if graphs else []
        self.max_rows = max([config.max_num_seqs] + self.capture_sizes)

        self.block_tables = torch.zeros(self.max_num_seqs + 1, self.max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.last_tokens = torch.zeros(self.max_num_seqs + 1, dtype=torch.int64, device=device)
        self.sampler = Sampler(model.tp, model.args.vocab_size, device, model.args.logits_scaling,
                               model.args.final_logit_softcapping)
        self.dec_in = torch.zeros(3, self.max_rows, dtype=torch.int32, device=device)
        self.dec_tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
        self.dec_logprobs = torch.zeros(self.max_rows, dtype=torch.float32, device=device)
        # A step's inputs and results pass through one half of these pinned buffers, halves taken in
        # turn (`_flip`): the host fills the next step's half while the GPU may still read the other.
        # A captured decode step reads and writes its half itself, the one `_parity` names on the
        # device (`ops.step_inputs` / `step_outputs`): no copy between two replays.
        pin = self.is_cuda
        self._in_host = torch.zeros(2, 3, self.max_rows, dtype=torch.int32, pin_memory=pin)
        self._tok_host = torch.zeros(2, self.max_rows, dtype=torch.int64, pin_memory=pin)
        self._lp_host = torch.zeros(2, self.max_rows, dtype=torch.float32, pin_memory=pin)
        self._flip = 0
        self._parity = torch.zeros(1, dtype=torch.int32, device=device)

        self.kv_cache: torch.Tensor | None = None
        # (EngineConfig.return_routed_experts, a MoE model) `[(num_blocks + 1) * block_size, sparse layers, k]`:
        # each token's experts at its place in the pool (`EngineModel._routing_records`)
        self.record_routing = config.return_routed_experts and bool(model.args.moe_layers)
        self.routed_experts: torch.Tensor | None = None
        self.kv_fp8 = config.kv_cache_dtype == "fp8"
        self.kv_scales: torch.Tensor | None = None  # e4m3 cache: one float32 scale per token and KV head
        self.num_blocks = 0
        # (padded rows, the sampler's static truncation) -> graph; temperature and greedy are device values
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._graph_pool = None  # one memory pool for every graph: they never run concurrently
        self._graph_key = None
        self._capture_stream = None
        self._warmed: set[tuple] = set()  # graph keys run eagerly once: Triton compiled, cuBLAS initialised
        self.capture_s = 0.0  # host time spent capturing graphs (warm-up included), and how many
        self.num_captures = 0
        self.step_events: list | None = None  # set to [] to record (is_prefill, rows, start, end) CUDA events
        # Padded prefill (module docstring): ("prefill", tokens) / ("sample", rows, truncation) -> graph
        self.prefill_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._prefill_uses: dict[tuple, int] = {}
        self.prefill_graph_tokens = 0  # padded prefill for steps of at most this many tokens; 0: off
        self._release_prefill_buffers()
        if graphs and config.prefill_graph_max_tokens:
            self.setup_padded_prefill(min(config.max_num_batched_tokens, config.prefill_graph_max_tokens))

    @property
    def ops(self):
        return get_ops(self.use_triton)

    # ------------------------------------------------------------------ KV pool
    @property
    def kv_dtype(self) -> torch.dtype:
        return FP8 if self.kv_fp8 else self.model.dtype

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of the pool over all layers: K and V, and with an e4m3 cache their float32 scales."""
        m = self.model
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        per_head = m.head_dim * elem + (4 if self.kv_fp8 else 0)
        kv = m.args.num_hidden_layers * 2 * self.block_size * m.num_kv_heads * per_head
        return kv + self.block_size * self._routing_bytes_per_token()

    def _routing_bytes_per_token(self) -> int:
        """Bytes of one token's recorded experts (0 when not recording)."""
        if not self.record_routing:
            return 0
        args = self.model.args
        return len(args.moe_layers) * args.num_experts_per_tok * self.model.routing_dtype().itemsize

    def allocate_cache(self, num_blocks: int) -> None:
        """The pool `[layers, 2, num_blocks + 1, block_size, Hkv/t, D]` (block `num_blocks` is the scratch block),
        and with an e4m3 cache its scales `kv_scales [layers, 2, num_blocks + 1, block_size, Hkv/t]` (float32)."""
        m = self.model
        shape = (m.args.num_hidden_layers, 2, num_blocks + 1, self.block_size, m.num_kv_heads)
        self.kv_cache = torch.empty(*shape, m.head_dim, dtype=self.kv_dtype, device=self.device)
        self.kv_scales = torch.empty(shape, dtype=torch.float32, device=self.device) if self.kv_fp8 else None
        if self.record_routing:
            args = m.args
            self.routed_experts = torch.zeros((num_blocks + 1) * self.block_size, len(args.moe_layers),
                                              args.num_experts_per_tok, dtype=m.routing_dtype(), device=self.device)
        self.num_blocks = num_blocks
        self.block_tables[self.dummy_slot].fill_(num_blocks)

    def free_cache(self) -> None:
        self.kv_cache = self.kv_scales = self.routed_experts = None
        self.num_blocks = 0

    def drop_graphs(self) -> None:
        """Destroy the captured graphs; their private memory pool goes back to the caching allocator
        (to the device at the next `torch.cuda.empty_cache()`, or when an allocation needs it)."""
        had = bool(self.graphs or self.prefill_graphs)
        self.graphs = {}
        self.prefill_graphs = {}
        self._prefill_uses = {}
        self._release_prefill_buffers()  # re-allocated by the next padded prefill step
        self._graph_pool = None
        self._graph_key = None
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if had and clear is not None:
            # cuBLAS keeps the workspace it allocated inside the last capture, a live block that
            # would pin a segment of the pool; it allocates a new one at its next matmul.
            clear()

    def _check_graphs(self) -> None:
        """Drop graphs captured over other weight / KV-pool memory than the current one."""
        m = self.model
        key = (m.storage.data_ptr(), m.fp8_storage.data_ptr() if m.fp8_layers else 0, self.kv_cache.data_ptr(),
               self.kv_scales.data_ptr() if self.kv_fp8 else 0, self.num_blocks,
               self.routed_experts.data_ptr() if self.record_routing else 0)
        if key != self._graph_key:
            self.drop_graphs()
            self._graph_pool = torch.cuda.graph_pool_handle() if self.is_cuda else None
            self._graph_key = key

    # ------------------------------------------------------------------ splits
    def _decode_splits(self, rows: int) -> int:
        if not self.use_triton:
            return 1
        from rollout.triton_kernels import num_sms

        # Enough (sequence, KV head, split) programs for two waves; the chunk per split is
        # derived from each sequence's own length inside the kernel, so this is graph-safe.
        return max(1, min(16, cdiv(2 * num_sms(self.device), rows * self.model.num_kv_heads)))

    def _sample_splits(self, rows: int) -> int:
        if not self.use_triton:
            return 1
        from rollout.triton_kernels import num_sms

        # ~16 programs per SM: at 256 rows x 152k on an H200 the kernel took 175 us with 2 splits a
        # row, 153 with 8 (BENCHMARKS.md, "Sixth pass")
        return max(1, min(self.model.vocab_local // 4096 or 1, cdiv(16 * num_sms(self.device), rows)))

    # ------------------------------------------------------------------ steps
    def begin_generate(self, temperature: float, top_k: int, top_p: float) -> None:
        self.sampler.set_params(temperature, top_k, top_p)
        self._check_graphs()

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Launch one step (asynchronously on CUDA); the returned handle yields its sampled tokens."""
        start = end = None
        if self.step_events is not None and self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        self._apply_updates(batch)
        if batch.is_prefill:
            tokens, logprobs = self._run_prefill(batch)
        else:
            tokens, logprobs = self._run_decode(batch)
        n = len(batch.sample_seqs)
        f = self._flip
        self._flip ^= 1
        tok_h, lp_h = self._tok_host[f], self._lp_host[f]
        if tokens is not None:  # else a captured decode step wrote them there itself
            tok_h[:n].copy_(tokens[:n], non_blocking=self.is_cuda)
            lp_h[:n].copy_(logprobs[:n], non_blocking=self.is_cuda)
        event = None
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record()
        if end is not None:
            end.record()
            self.step_events.append((batch.is_prefill, len(batch.seqs), start, end))
        return StepOutput(batch, tok_h, lp_h, event, n)

    def _apply_updates(self, batch: ScheduledBatch) -> None:
        # Through pinned memory (`host_to_device`): from pageable memory the copy could wait for
        # the step before, which a decode step that starts new KV blocks would then not overlap.
        if batch.block_table_updates:
            u, = host_to_device([np.asarray(batch.block_table_updates, dtype=np.int64)], self.device)
            self.block_tables[u[:, 0], u[:, 1]] = u[:, 2].to(torch.int32)
        if batch.copies:
            c, = host_to_device([np.asarray(batch.copies, dtype=np.int64)], self.device)
            self.kv_cache[:, :, c[:, 1]] = self.kv_cache[:, :, c[:, 0]]
            if self.kv_scales is not None:
                self.kv_scales[:, :, c[:, 1]] = self.kv_scales[:, :, c[:, 0]]
            if self.routed_experts is not None:  # a copied block carries its tokens' experts
                pages = self.routed_experts.view(self.num_blocks + 1, self.block_size, *self.routed_experts.shape[1:])
                pages[c[:, 1]] = pages[c[:, 0]]

    def routed_experts_of(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """`[num_tokens, sparse layers, k]` on the device: the experts recorded for the first `num_tokens` tokens of a
        sequence in `blocks` (its block table), copied out in stream order, so a later step may reuse the blocks."""
        pages = self.routed_experts.view(self.num_blocks + 1, self.block_size, *self.routed_experts.shape[1:])
        index, = host_to_device([np.asarray(blocks[:cdiv(num_tokens, self.block_size)], dtype=np.int64)],
                                self.device)
        return pages[index].flatten(0, 1)[:num_tokens]

    # ------------------------------------------------------------------ decode
    def _graph_size(self, rows: int) -> int | None:
        for s in self.capture_sizes:
            if s >= rows:
                return s
        return None

    def _run_decode(self, batch: ScheduledBatch):
        b = len(batch.seqs)
        padded = self._graph_size(b)
        use_graph = padded is not None
        rows = padded if use_graph else b
        key = (rows, self.sampler.truncation)
        host = self._in_host[self._flip].numpy()
        host[0, :b] = batch.slots
        host[1, :b] = batch.starts
        host[2, :b] = np.asarray([s.key for s in batch.seqs], dtype=np.uint32).view(np.int32)
        host[0, b:rows] = self.dummy_slot
        host[1:, b:rows] = 0
        if use_graph:
            if key not in self.graphs:
                self._capture(key)
            self._parity.fill_(self._flip)  # a kernel, not a copy: the value is its argument
            self.graphs[key].replay()
            return None, None  # the results are in this step's pinned half already
        self.dec_in.copy_(self._in_host[self._flip], non_blocking=self.is_cuda)
        self._decode_body(rows, max(batch.starts) + 1)
        return self.dec_tokens, self.dec_logprobs

    def _graphed_decode(self, rows: int) -> None:
        """The captured decode step: its inputs from the pinned half `_parity` names, the step, its results
        into the same half of the result buffers."""
        self.ops.step_inputs(self._in_host, self._parity, self.dec_in, rows)
        self._decode_body(rows, 1)
        self.ops.step_outputs(self.dec_tokens, self.dec_logprobs, self._parity, self._tok_host, self._lp_host, rows)

    def _decode_body(self, rows: int, max_context_len: int) -> None:
        """One decode step over the first `rows` entries of `dec_in`; results in `dec_tokens` / `dec_logprobs`."""
        m, ops = self.model, self.ops
        slots, positions, keys = self.dec_in[0, :rows], self.dec_in[1, :rows], self.dec_in[2, :rows]
        context_lens = positions + 1
        meta = AttentionMetadata(is_decode=True, slots=slots, context_lens=context_lens,
                                 max_context_len=max_context_len, num_splits=self._decode_splits(rows))
        slots_l = slots.long()
        h = m.forward(self.last_tokens[slots_l], positions, slots, meta, self.kv_cache, self.block_tables, ops,
                      kv_scales=self.kv_scales, routed_experts=self.routed_experts)
        tokens, _ = self.sampler.sample(m.logits(h), keys, context_lens, ops, self._sample_splits(rows),
                                        out=(self.dec_tokens[:rows], self.dec_logprobs[:rows]))
        self.last_tokens[slots_l] = tokens

    def _capture(self, key: tuple) -> None:
        """Capture the decode step for `key = (rows, truncation)` (inputs: the dummy slot, harmless to real state).

        The eager warm-up (Triton compilation, cuBLAS set-up) runs only the first time a key is
        captured: a recapture after `drop_graphs()` finds both done.
        """
        t0 = time.perf_counter()
        rows = key[0]
        self.dec_in[0, :rows].fill_(self.dummy_slot)
        self.dec_in[1:, :rows].zero_()
        if key not in self._warmed:
            # On the capture stream: cuBLAS keeps a workspace (32 MiB on an H200) per stream it
            # has run on, until `drop_graphs()`; a new stream per warm-up held one per batch size
            # (1.13 GB over the 35-size ladder of 256 slots; 0.07 GB for graphs and all with one).
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._decode_body(rows, 1)
                # The I/O kernels too, into scratch: the pinned halves may hold a step in flight.
                self.ops.step_inputs(self._in_host, self._parity, torch.empty_like(self.dec_in), rows)
                self.ops.step_outputs(self.dec_tokens, self.dec_logprobs, self._parity,
                                      torch.empty_like(self._tok_host, device=self.device),
                                      torch.empty_like(self._lp_host, device=self.device), rows)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._warmed.add(key)
        self.graphs[key] = self._capture_graph(lambda: self._graphed_decode(rows), t0)

    def _side_stream(self) -> torch.cuda.Stream:
        """The one stream that warm-ups and captures run on (created at first use)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    def _capture_graph(self, body, started: float) -> torch.cuda.CUDAGraph:
        """A graph of `body()` in the runner's pool, ordered after the work already queued; counted
        in `capture_s` from `started` (a `perf_counter` time: a warm-up before it counts too)."""
        # Not `torch.cuda.graph(...)`: on entry it synchronises the device and empties the caching
        # allocator and the pinned host cache, so that after every recapture the trainer's next
        # allocations went back to cudaMalloc / cudaHostAlloc.
        # The capture needs a side stream, ordered after the work already queued.
        main = torch.cuda.current_stream(self.device)
        stream = self._side_stream()
        stream.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._graph_pool)
            try:
                body()
            finally:
                graph.capture_end()
        main.wait_stream(stream)
        self.capture_s += time.perf_counter() - started
        self.num_captures += 1
        return graph

    # ------------------------------------------------------------------ prefill
    def _prefill_arrays(self, batch: ScheduledBatch) -> dict[str, np.ndarray]:
        """The int32 inputs of a prefill step, by their names in the padded layout."""
        ids: list[int] = []
        cu = [0]
        ctx = []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.chunk_lens):
            ids.extend(seq.token_ids[start:start + n])
            cu.append(cu[-1] + n)
            ctx.append(start + n)
        tile_seq, tile_start = prefill_tiles(batch.chunk_lens)
        starts = np.asarray(batch.starts, dtype=np.int32)
        lens = np.asarray(batch.chunk_lens, dtype=np.int32)
        slots = np.asarray(batch.slots, dtype=np.int32)
        positions = np.repeat(starts - np.cumsum(np.concatenate([[0], lens[:-1]])), lens) + np.arange(len(ids))
        cu_np = np.asarray(cu, dtype=np.int32)
        rows_src = cu_np[1:][np.asarray(batch.sample_src, dtype=np.int64)] - 1
        keys = np.asarray([s.key for s in batch.sample_seqs], dtype=np.uint32).view(np.int32)
        ids = np.asarray(ids, dtype=np.int32)
        # Only decoding rows (the last ones) may carry PLACEHOLDER: their tokens are on the device.
        if (ids[:cu[len(batch.seqs) - batch.num_decode_rows]] < 0).any():
            raise RuntimeError("prefill of a token whose value is unknown: results were not processed first")
        arrays = dict(ids=ids, pos=positions, tslots=np.repeat(slots, lens), cu=cu_np, ctx=ctx, slots=slots,
                      tseq=tile_seq, tstart=tile_start, src=rows_src, rslots=batch.sample_slots, keys=keys,
                      spos=batch.sample_positions)
        return {k: np.asarray(v, dtype=np.int32) for k, v in arrays.items()}

    def _run_prefill(self, batch: ScheduledBatch):
        a = self._prefill_arrays(batch)
        if self.use_triton and len(a["ids"]) <= self.prefill_graph_tokens:
            return self._run_prefill_padded(a)
        # One upload, from pinned memory: it does not wait for the steps before (`host_to_device`).
        d = dict(zip(a, host_to_device(list(a.values()), self.device)))
        meta = AttentionMetadata(is_decode=False, slots=d["slots"], context_lens=d["ctx"],
                                 max_context_len=int(a["ctx"].max()), cu_q=d["cu"], tile_seq=d["tseq"],
                                 tile_start=d["tstart"], host_cu_q=a["cu"].tolist(), host_context_lens=a["ctx"].tolist())
        ids = self._known_ids(d["ids"], d["tslots"]) if batch.num_decode_rows else d["ids"]
        h = self.model.forward(ids, d["pos"], d["tslots"], meta, self.kv_cache, self.block_tables, self.ops,
                               kv_scales=self.kv_scales, routed_experts=self.routed_experts)
        if not batch.sample_seqs:
            return self.dec_tokens, self.dec_logprobs  # nothing sampled (only partial chunks)
        return self._sample_prefill(h[d["src"].long()], d)

    def _known_ids(self, ids: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """`ids` with each `PLACEHOLDER` (a decoding row's input token, sampled by a step whose
        results the host has not read yet) replaced by its slot's last sampled token."""
        return torch.where(ids >= 0, ids, self.last_tokens[token_slots.long()].to(ids.dtype))

    def _sample_prefill(self, h, d: dict, out=None):
        """Sample rows `h [R, H]` (LM head, sampler; into `out` when given) and set their slots' `last_tokens`."""
        r = h.shape[0]
        tokens, logprobs = self.sampler.sample(self.model.logits(h), d["keys"][:r], d["spos"][:r], self.ops,
                                               self._sample_splits(r), out=out)
        self.last_tokens[d["rslots"][:r].long()] = tokens
        return tokens, logprobs

    # ------------------------------------------------------------------ padded prefill
    def _prefill_tiles(self, tokens: int) -> int:
        """Attention tiles of the padded grid: chunks of T tokens over N <= min(max_num_seqs, T)
        sequences cut into at most T // PREFILL_TILE + N tiles."""
        return tokens // PREFILL_TILE + min(self.max_num_seqs, tokens)

    def setup_padded_prefill(self, max_tokens: int) -> None:
        """Padded prefill steps of up to `max_tokens` tokens (the module docstring), through static
        buffers allocated at the first such step and released with the graphs.

        Called at construction when prefill graphs are on; on CPU (no graphs) a test may call it to
        run the padded layout eagerly.
        """
        seqs = self.max_num_seqs + 1  # and a padding sequence with no tokens, which padding tiles point at
        tiles, rows = self._prefill_tiles(max_tokens), self.max_rows
        sizes = dict(ids=max_tokens, pos=max_tokens, tslots=max_tokens, cu=seqs + 1, ctx=seqs, slots=seqs,
                     tseq=tiles, tstart=tiles, src=rows, rslots=rows, keys=rows, spos=rows)
        self._pre_layout, o = {}, 0
        for name, n in sizes.items():
            self._pre_layout[name] = (o, n)
            o += n
        self._sample_ladder = self.config.capture_sizes()  # the decode ladder, graphs on or not
        self.prefill_graph_tokens = max_tokens

    def _release_prefill_buffers(self) -> None:
        self._pre_host = self._pre_dev = self._pre_h = self._pre_tokens = self._pre_logprobs = None
        self._pre_views = {}

    def _allocate_prefill_buffers(self) -> None:
        size = sum(n for _, n in self._pre_layout.values())
        rows = self._pre_layout["src"][1]
        self._pre_host = [torch.zeros(size, dtype=torch.int32, pin_memory=self.is_cuda) for _ in range(2)]
        self._pre_dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._pre_views = {name: self._pre_dev[o:o + n] for name, (o, n) in self._pre_layout.items()}
        self._pre_h = torch.empty(self.prefill_graph_tokens, self.model.hidden, dtype=self.model.dtype,
                                  device=self.device)
        self._pre_tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._pre_logprobs = torch.zeros(rows, dtype=torch.float32, device=self.device)

    def _run_prefill_padded(self, a: dict[str, np.ndarray]):
        if self._pre_dev is None:
            self._allocate_prefill_buffers()
        t, n, r = len(a["ids"]), len(a["slots"]), len(a["src"])
        tb = prefill_bucket(t, self.prefill_graph_tokens)
        pad = dict(ids=0, pos=0, tslots=self.dummy_slot, cu=t, ctx=0, slots=self.dummy_slot, tseq=n, tstart=0,
                   src=0, rslots=self.dummy_slot, keys=0, spos=0)
        # Every step rewrites the whole layout, padding included, in one upload, from the pinned
        # buffer of this step's parity (as decode steps do): the engine launches a step with at
        # most the previous one unprocessed, so the step before that, which read this buffer, is done.
        pinned = self._pre_host[self._flip]
        host = pinned.numpy()
        for name, (o, size) in self._pre_layout.items():
            v = a[name]
            host[o:o + len(v)] = v
            host[o + len(v):o + size] = pad[name]
        self._pre_dev.copy_(pinned, non_blocking=self.is_cuda)
        self._graphed(("prefill", tb), lambda: self._padded_forward(tb))
        if not r:
            return self.dec_tokens, self.dec_logprobs  # nothing sampled (only partial chunks)
        rb = next((s for s in self._sample_ladder if s >= r), self.max_num_seqs)  # a ladder may stop short
        self._graphed(("sample", rb, self.sampler.truncation), lambda: self._sample_prefill(
            self._pre_h[self._pre_views["src"][:rb].long()], self._pre_views,
            out=(self._pre_tokens[:rb], self._pre_logprobs[:rb])))
        return self._pre_tokens, self._pre_logprobs

    def _padded_forward(self, tokens: int) -> None:
        v, tiles = self._pre_views, self._prefill_tiles(tokens)
        meta = AttentionMetadata(is_decode=False, slots=v["slots"], context_lens=v["ctx"],
                                 max_context_len=self.max_model_len, cu_q=v["cu"], tile_seq=v["tseq"][:tiles],
                                 tile_start=v["tstart"][:tiles])
        ids = self._known_ids(v["ids"][:tokens], v["tslots"][:tokens])
        h = self.model.forward(ids, v["pos"][:tokens], v["tslots"][:tokens], meta, self.kv_cache,
                               self.block_tables, self.ops, kv_scales=self.kv_scales,
                               routed_experts=self.routed_experts)
        self._pre_h[:tokens].copy_(h)

    def _graphed(self, key: tuple, body) -> None:
        """Run a padded prefill part: replay its graph; capture it on the second use of `key` (the
        first, eager one compiled its kernels); else (first use, or no CUDA) run it eagerly."""
        uses = self._prefill_uses[key] = self._prefill_uses.get(key, 0) + 1
        graph = self.prefill_graphs.get(key)
        if graph is None and self.is_cuda and uses >= 2:
            graph = self.prefill_graphs[key] = self._capture_graph(body, time.perf_counter())
        if graph is None:
            body()
        else:
            graph.replay()
