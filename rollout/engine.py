"""`LLMEngine`: meshppo's generation engine (tensor-parallel, paged KV cache, continuous batching).

    engine = LLMEngine(model_args, EngineConfig(), tp_mesh=mesh["tp"])
    for name, slot in engine.param_slots().items(): slot.view.copy_(my_shard_of(name))   # the resharder
    outs = engine.generate(prompt_token_ids, SamplingParams(n=4, temperature=1.0, max_tokens=256))

Every rank of a TP group runs the same program: same prompts, same parameters, same
scheduling decisions (the KV pool size is agreed on with a MIN all-reduce), and the
sampled tokens are identical on all ranks because the ranks combine the same partials.

The loop of `generate` overlaps the host with the GPU: decode step t+1 is scheduled and
launched before step t's tokens are read back (the model takes its input tokens from the
device), so the scheduler's Python runs while the GPU computes. Prefill steps are launched
the same way, although they read token values on the host: a fresh prompt's are known, and a
preempted sequence (recomputed from its prompt and its generated tokens) was last sampled in
the step before the one whose scheduling preempted it, and that step's results are processed
as soon as the preempting step is launched. `ModelRunner` refuses a prefill of an unknown token.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from models.args import ModelArgs
from rollout.block_manager import BlockManager, cdiv
from rollout.config import Continuation, EngineConfig, RequestOutput, SamplingParams, check_tp_divisibility
from rollout.model import EngineModel, ParamSlot
from rollout.parallel import TPGroup
from rollout.runner import ModelRunner
from rollout.scheduler import Scheduler
from rollout.sequence import Sequence

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU (allocated lazily by the OS)


class CacheTooSmallError(RuntimeError):
    """The KV pool cannot hold one sequence of `max_model_len` tokens. Its text names the engine's
    fields; `worded(memory, length)` names the caller's options for them (a CLI's flags, a config's keys)."""

    def __init__(self, blocks: int, gib: float, where: str, max_model_len: int, need: int, on_cuda: bool):
        self.blocks, self.gib, self.where, self.max_model_len, self.need, self.on_cuda = (
            blocks, gib, where, max_model_len, need, on_cuda)
        super().__init__(self.worded("gpu_memory_utilization", "max_model_len"))

    def worded(self, memory: str, length: str) -> str:
        fix = (f"free memory or raise {memory}" if self.on_cuda else
               f"on CPU the pool is {CPU_KV_CACHE_BYTES / 2**30:g} GiB: lower {length}")
        return (f"the KV pool would hold {self.blocks} blocks ({self.gib:.2f} GiB){self.where} but one sequence of "
                f"{length}={self.max_model_len} needs {self.need}: {fix}")
WATERMARK_FRACTION = 0.01  # blocks kept free at admission, as in vLLM


def blocks_with_watermark(usable: int) -> int:
    """The smallest pool whose blocks above the admission watermark number at least `usable`."""
    n = usable + int(WATERMARK_FRACTION * usable)
    while n - int(WATERMARK_FRACTION * n) < usable:
        n += 1
    return n


def _resolve_device(device, tp_mesh) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    on_cuda = tp_mesh.device_type == "cuda" if tp_mesh is not None else torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")


def check_allocator(device: torch.device, enforce_eager: bool) -> None:
    """CUDA graphs here launch Triton kernels on tensors allocated during the capture, which
    PyTorch's cudaMallocAsync backend makes unreadable to Triton: refuse it up front."""
    if device.type == "cuda" and not enforce_eager and torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF selects backend:cudaMallocAsync, under which the engine's CUDA "
                         "graphs cannot be captured (Triton cannot read tensors allocated inside the capture): use "
                         "the default allocator (backend:native), or run without graphs (EngineConfig.enforce_eager"
                         "=True; in the trainer actor_rollout_ref.rollout.enforce_eager=true)")


class LLMEngine:
    """Generation engine for one TP rank; see the module docstring and `rollout/__init__.py`."""

    def __init__(self, model_args: ModelArgs, config: EngineConfig, tp_mesh=None, device=None):
        self.args, self.config = model_args, config
        self.tp = TPGroup.from_mesh(tp_mesh)
        check_tp_divisibility(model_args, self.tp.size)
        self.device = _resolve_device(device, tp_mesh)
        check_allocator(self.device, config.enforce_eager)
        self.max_model_len = config.max_model_len or model_args.max_position_embeddings
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}): a whole prompt has to fit in one step")
        for key, value, needs in (("quantization", config.quantization, "e4m3 GEMMs"),
                                  ("kv_cache_dtype", config.kv_cache_dtype, "e4m3 conversions in its kernels")):
            if value == "fp8" and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
                raise ValueError(f"EngineConfig.{key}='fp8' needs {needs} (compute capability 8.9 or later); "
                                 f"{torch.cuda.get_device_name(self.device)} has "
                                 f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")
        self.model = EngineModel(model_args, self.tp, config.dtype, self.device, self.max_model_len,
                                 quantization=config.quantization)
        # The largest all-reduce is a prefill step's [tokens, hidden]; the buffer stops at 64 MiB.
        esize = torch.empty((), dtype=config.dtype).element_size()
        self.tp_all_reduce = self.tp.setup_all_reduce(
            config.tp_all_reduce, self.device, config.dtype,
            max_numel=min(config.max_num_batched_tokens * model_args.hidden_size, (64 << 20) // esize))
        self.runner = ModelRunner(self.model, config, self.device, self.max_model_len)
        self._kv_blocks: int | None = None  # sized at the first init_cache(), then kept
        self.last_stats: dict = {}
        # generate(keep_kv=True): the samples whose K/V stays in the pool for the next call to continue,
        # by (prompt index, sample index), with the block manager that accounts for their blocks
        self._kept: dict[tuple[int, int], Sequence] = {}
        self._kept_blocks: BlockManager | None = None

    @classmethod
    def from_pretrained(cls, path, config: EngineConfig, tp_mesh=None, device=None) -> "LLMEngine":
        """An engine with the weights of a Hugging Face checkpoint directory (each rank reads only its shards' bytes)."""
        from models.checkpoint import iter_hf_tensors, load_model_args

        engine = cls(load_model_args(path), config, tp_mesh=tp_mesh, device=device)
        loaded = engine.load_weights(iter_hf_tensors(path))
        missing = sorted(set(engine.param_slots()) - loaded)
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks tensors: {missing[:8]}")
        return engine

    # ------------------------------------------------------------------ weights
    def param_slots(self) -> dict[str, ParamSlot]:
        """Training parameter name -> view of this rank's TP shard inside the engine's weights.

        The caller is about to write the weights (the resharder asks at every reshard): weights
        released by `free_weights()` are re-allocated first. The views are the same tensor objects
        for the engine's whole life.
        """
        self.init_weights_storage()
        self.drop_kept()  # K/V computed with the weights about to be replaced
        return self.model.param_slots()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy FULL tensors (training names) into the slots, taking this rank's shard. Returns the names loaded.

        `lm_head.weight` is skipped for tied embeddings (Hugging Face checkpoints may carry it).
        """
        slots = self.param_slots()
        loaded = set()
        for name, tensor in named_tensors:
            if name not in slots:
                if name == "lm_head.weight" and self.args.tie_word_embeddings:
                    continue
                raise ValueError(f"load_weights: the engine has no parameter {name!r}")
            full = self.model.full_shapes[name]
            if tuple(tensor.shape) != full:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {full}")
            slots[name].view.copy_(slots[name].shard_of(tensor))
            loaded.add(name)
        return loaded

    def free_weights(self) -> None:
        """Release the weights' memory until the next weight load.

        Between PPO phases, with `free_cache()`: the actor trains in the memory the engine held.
        The weights' tensor objects (`param_slots()` views) stay valid; `param_slots()` or
        `init_weights_storage()` re-allocates the memory, which the next reshard or `load_weights`
        fills. The captured CUDA graphs stay, with what `free_graphs()` would give back: on an
        H200, 0.2 GB reserved for one batch size of 256 rows at qwen2.5-0.5b or 1.5b, and as much
        for all the sizes and padded prefills an EOS workload at 0.5b visits (BENCHMARKS.md,
        "Twenty-fourth pass"). The next `generate()` replays the graphs when the weights and the KV
        pool are back at the addresses they were captured over (the caching allocator hands the
        same block back unless something else holds it), and recaptures them otherwise
        (`last_stats["graph_capture_s"]`). Keeping them saves more than the capture's time: on an
        H200 a decode graph recaptured after the actor's update replayed 9 % slower than the one
        captured before it ("Twenty-third pass").
        """
        if self.model.allocated:
            self.model.release()

    def free_graphs(self) -> None:
        """Destroy the captured CUDA graphs and give back their memory pool and the padded prefill's
        buffers; the next `generate()` captures what it needs again."""
        self.runner.drop_graphs()

    def init_weights_storage(self) -> None:
        """Re-allocate weights released by `free_weights()` (uninitialised; no-op when allocated)."""
        self.model.restore()

    # ------------------------------------------------------------------ KV cache
    def _activation_reserve_bytes(self) -> int:
        """Rough peak of activations outside the pool: a full prefill step and a decode step's logits,
        and the prefill graphs' private pool of the same size (next to the allocator's cache)."""
        m, c = self.model, self.config
        elem = torch.empty((), dtype=m.dtype).element_size()
        per_token = (4 * m.hidden + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.mlp_activation_width) * elem
        rows = max(c.max_num_seqs, max(self.runner.capture_sizes, default=1))
        logits = rows * m.args.vocab_size * (elem + 4 + 8)  # logits, float32 scaled copy, sort indices
        tokens = c.max_num_batched_tokens + self.runner.prefill_graph_tokens
        return tokens * per_token + 2 * logits + (256 << 20)

    def _num_kv_blocks(self) -> int:
        c, runner = self.config, self.runner
        per_block = runner.kv_bytes_per_block()
        if c.num_kv_blocks is not None:
            n = c.num_kv_blocks
        else:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * c.gpu_memory_utilization) - self._activation_reserve_bytes()
            else:
                budget = CPU_KV_CACHE_BYTES
            # more could never be used: max_num_seqs full-length sequences above the watermark
            cap = blocks_with_watermark(c.max_num_seqs * cdiv(self.max_model_len, c.block_size))
            n = min(max(budget // per_block, 0), cap)
        # Every rank must schedule identically: agree on the smallest pool (before any rank may refuse it,
        # so that a rank with less free memory than its peers does not leave them in the all-reduce).
        mine, n = n, self.tp.all_reduce_min(n, self.device if self.device.type == "cuda" else "cpu")
        # one full-length sequence must be admitted: the scheduler keeps the watermark free at admission
        need = blocks_with_watermark(cdiv(self.max_model_len, c.block_size))
        if c.num_kv_blocks is None and n < need:
            where = f" (the least of the TP group's ranks; this rank's would hold {mine})" if mine != n else ""
            raise CacheTooSmallError(n, n * per_block / 2**30, where, self.max_model_len, need,
                                     self.device.type == "cuda")
        return n

    def init_cache(self) -> None:
        """Allocate the KV pool (no-op if it exists).

        The pool is sized from free memory the first time only; re-allocations keep that size,
        so that the captured CUDA graphs (whose kernels address the pool per layer) stay valid
        whenever the allocator hands back the same memory.
        """
        if self.runner.kv_cache is None:
            if self._kv_blocks is None:
                self._kv_blocks = self._num_kv_blocks()
            self.runner.allocate_cache(self._kv_blocks)

    def free_cache(self) -> None:
        """Release the KV pool (generate() re-allocates it), and with it any kept samples' K/V."""
        self.drop_kept()
        self.runner.free_cache()

    def drop_kept(self) -> None:
        """Forget the K/V that `generate(keep_kv=True)` kept (the blocks return to the next call's pool)."""
        self._kept, self._kept_blocks = {}, None

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    # ------------------------------------------------------------------ generation
    def _check_prompt(self, p: list[int], what: str) -> None:
        if len(p) == 0:
            raise ValueError(f"{what} is empty")
        if len(p) >= self.max_model_len:
            raise ValueError(f"{what} has {len(p)} tokens; max_model_len {self.max_model_len} leaves no room "
                             f"for a response")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= self.args.vocab_size:
            raise ValueError(f"{what} has token id {lo if lo < 0 else hi} outside the vocabulary "
                             f"[0, {self.args.vocab_size})")

    def _validate(self, prompts: list[list[int]], params: SamplingParams, sample_keys, max_tokens) -> None:
        for i, p in enumerate(prompts):
            self._check_prompt(p, f"prompt {i}")
        if sample_keys is not None:
            if params.n != 1:
                raise ValueError(f"sample_keys continue one sample per prompt: n must be 1, got {params.n}")
            if len(sample_keys) != len(prompts):
                raise ValueError(f"{len(sample_keys)} sample_keys for {len(prompts)} prompts")
            if len(set(sample_keys)) != len(sample_keys):
                raise ValueError("sample_keys repeat a (prompt index, sample index) pair")
        if max_tokens is not None:
            if len(max_tokens) != len(prompts):
                raise ValueError(f"{len(max_tokens)} max_tokens for {len(prompts)} prompts")
            if min(max_tokens, default=1) < 1:
                raise ValueError(f"max_tokens must be at least 1 for every prompt, got {min(max_tokens)}")

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams,
                 prompt_index_offset: int = 0, *, sample_keys: list[tuple[int, int]] | None = None,
                 max_tokens: list[int] | None = None, keep_kv: bool = False,
                 on_finish: Callable[[list[RequestOutput], bool], list[Continuation]] | None = None,
                 ) -> list[RequestOutput]:
        """Sample `n` responses per prompt. Outputs are prompt-major: prompt i's are `[i n, (i + 1) n)`.

        `prompt_index_offset`: these prompts are a slice, starting at that index, of a larger batch
        split over engines (the trainer's rollout-DP replicas). Prompt i is then prompt
        `prompt_index_offset + i` for the sampling noise, a hash of (seed, prompt index, sample
        index, position), and in its outputs' `prompt_index`: every slice of one seed draws
        distinct noise, the same as the whole batch in one call would.

        `sample_keys` (with `n = 1`): prompt i continues the sample `sample_keys[i]` = (prompt
        index, sample index), which replaces the offset's pair for its noise and outputs. The
        position in the hash is the token's index in the whole sequence, so a sample continued
        after tokens appended to it (a multi-turn rollout's tool response) draws fresh noise and,
        where nothing was appended, the same tokens as one uninterrupted call. `max_tokens`: each
        prompt's own limit of new tokens, replacing `sampling_params.max_tokens`.

        `keep_kv`: the samples' K/V stays in the pool after they finish (while blocks last:
        admission and decode growth take the oldest finished samples' blocks back before they
        preempt), and a later request with the same (prompt index, sample index) that extends a
        kept sample's tokens prefills only what is new: a multi-turn rollout does not recompute its
        context every turn. Kept K/V lasts to the next call (which keeps its own only with
        `keep_kv` again), which is why `free_cache_engine` does not free the pool after a
        `keep_kv` call; it is dropped by `free_cache()`, `drop_kept()` and a weight write
        (`param_slots()`).

        `on_finish(outputs, idle)`: requests join the call while it runs (a multi-turn rollout's
        next turns, each sample's as soon as its tool answered). It is called after every step
        with the outputs of the requests that ended in it (in the step's order; often none), and
        with `idle` True when nothing is left to run; it returns `Continuation`s, which the call
        schedules with its other requests (a key that is still running is an error). The call
        ends when an idle `on_finish` returns none. It then returns every request's output in the
        order they ended, where without `on_finish` the order is prompt-major.
        """
        if not self.model.allocated:
            raise RuntimeError("the engine's weights are released (free_weights()): load them first "
                               "(load_weights() or a reshard into param_slots())")
        params = sampling_params
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        self._validate(prompts, params, sample_keys, max_tokens)
        if not prompts:
            return []
        t0 = time.perf_counter()
        quantize_s = 0.0
        if self.model.fp8_layers and self.model.fp8_stale:
            self.model.quantize_fp8()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            quantize_s = time.perf_counter() - t0
        capture_s0, captures0 = self.runner.capture_s, self.runner.num_captures
        self.init_cache()
        c = self.config
        kept, bm = self._kept, self._kept_blocks
        self.drop_kept()
        if bm is None:
            bm = BlockManager(self.runner.num_blocks, c.block_size, int(WATERMARK_FRACTION * self.runner.num_blocks))
        record = self.runner.record_routing
        sched = Scheduler(bm, c.max_num_seqs, c.max_num_batched_tokens, c.enable_chunked_prefill, keep_kv=keep_kv,
                          record_routing=record)
        stops = params.stop_set(self.args.eos_token_id)
        n = params.n
        keys = sample_keys or [(prompt_index_offset + i, 0) for i in range(len(prompts))]
        limits = max_tokens or [params.max_tokens] * len(prompts)
        reused, added = 0, 0
        live: set[tuple[int, int]] = set()  # with on_finish: the keys queued or running

        def add(p: list[int], key: tuple[int, int], limit: int, samples: int, continued: bool) -> None:
            nonlocal reused, added
            seq = Sequence(seq_id=added, prompt_index=key[0], sample_index=key[1], token_ids=list(p),
                           num_prompt_tokens=len(p), max_len=min(len(p) + limit, self.max_model_len),
                           seed=params.seed, num_samples=samples, stop_token_ids=stops)
            added += samples
            prev = kept.pop(key, None) if continued else None
            # (a kept sample whose blocks went back under pressure has none left: it is recomputed)
            if prev is not None and prev.block_table and len(prev.token_ids) <= len(p) \
                    and p[:len(prev.token_ids)] == prev.token_ids:
                # its K/V holds every position but the last (whose token was sampled, never fed back)
                seq.block_table, prev.block_table = prev.block_table, []
                seq.num_computed_tokens = len(prev.token_ids) - 1
                reused += seq.num_computed_tokens
            elif prev is not None:
                bm.free(prev)
            live.update((key[0], key[1] + k) for k in range(samples))
            sched.add(seq)

        for i, p in enumerate(prompts):
            # A prompt's samples fork from one prefill and so are admitted together: more than max_num_seqs
            # of them go in as several such groups (the prompt prefilled once a group), as vLLM runs them. The
            # noise is keyed by each sample's index, so they are the samples one group would draw.
            for first in range(0, n, c.max_num_seqs):
                add(p, (keys[i][0], keys[i][1] + first), limits[i], min(c.max_num_seqs, n - first),
                    sample_keys is not None)
        for prev in kept.values():  # kept, but not continued: done
            bm.free(prev)
        kept = {}  # with on_finish and keep_kv: this call's ended samples, for their continuations
        self.runner.begin_generate(params.temperature, params.top_k, params.top_p)

        def join(requests: list[Continuation]) -> None:
            """`on_finish`'s continuations, checked, into the queue."""
            for r in requests:
                key = tuple(r.key)
                what = f"on_finish's continuation of sample {key}"
                if key in live:
                    raise ValueError(f"{what}: that sample is still running")
                if r.max_tokens < 1:
                    raise ValueError(f"{what}: max_tokens must be at least 1, got {r.max_tokens}")
                p = list(map(int, r.token_ids))
                self._check_prompt(p, what)
                add(p, key, r.max_tokens, 1, True)

        samples: dict[tuple[int, int], Sequence] = {}
        ended: list[RequestOutput] = []  # with on_finish: every output, in the order they ended
        steps = {"prefill": 0, "decode": 0, "prefill_decoding": 0}
        decode_sizes: list[int] = []  # sequences decoded per step that decodes: how full continuous batching kept the batch
        pending = None
        while True:
            launched = None
            if sched.has_unfinished():
                batch = sched.schedule()
                if record:  # read before this step, which may reuse their blocks
                    self._take_routing(sched.preempted_routing)
                steps["prefill" if batch.is_prefill else "decode"] += 1
                if batch.num_decode_rows:
                    decode_sizes.append(batch.num_decode_rows)
                    steps["prefill_decoding"] += batch.is_prefill
                launched = self.runner.execute(batch)
            if pending is not None:
                done = self._process(sched, pending, samples, ended=on_finish is not None)
            if record:  # read after the step that ran their last token, before the next may reuse their blocks
                self._take_routing(sched.released_routing)
            if pending is not None and on_finish is not None:
                outs = [_output(s) for s in done]
                for s in done:
                    live.discard((s.prompt_index, s.sample_index))
                    if keep_kv:
                        kept[s.prompt_index, s.sample_index] = s
                ended += outs
                join(on_finish(outs, False))
            pending = launched
            if pending is None and not sched.has_unfinished():
                more = on_finish([], True) if on_finish is not None else []
                if not more:
                    break
                join(more)

        if on_finish is not None:
            outputs = ended
        else:
            outputs = [_output(samples[keys[i][0], keys[i][1] + k]) for i in range(len(prompts)) for k in range(n)]
        if keep_kv:
            self._kept = {(s.prompt_index, s.sample_index): s for s in sched.kept if s.block_table}
            self._kept_blocks = bm
        self.last_stats = {"prefill_steps": steps["prefill"], "decode_steps": steps["decode"],
                           "reused_kv_tokens": reused,
                           "prefill_steps_decoding": steps["prefill_decoding"],
                           "decode_batch_sizes": decode_sizes,
                           "preemptions": sched.num_preemptions, "kv_blocks": self.runner.num_blocks,
                           "wall_s": time.perf_counter() - t0,
                           "graph_capture_s": self.runner.capture_s - capture_s0,
                           "graphs_captured": self.runner.num_captures - captures0,
                           "quantize_s": quantize_s}
        if c.free_cache_engine and not keep_kv:  # kept K/V holds the pool until the next call
            self.free_cache()
        return outputs

    def _take_routing(self, dropped: list) -> None:
        """Copy the recorded experts of the sequences in `dropped` (the scheduler's `(sequence, blocks, tokens)`
        of those that gave their blocks back) out of the pool, in stream order; empties the list."""
        for seq, blocks, num_tokens in dropped:
            seq.routed_experts = self.runner.routed_experts_of(blocks, num_tokens)
        dropped.clear()

    @staticmethod
    def _process(sched: Scheduler, step, samples: dict, ended: bool = False) -> list[Sequence]:
        """Record a launched step's results; with `ended`, the sequences that ended in it."""
        tokens, logprobs = step.result()
        if step.batch.is_prefill:
            # Every sample is first sampled in a prefill step (its prompt's last chunk, or its
            # recompute after a preemption): recorded there, not again at every decode step.
            for s in step.batch.sample_seqs:
                samples[(s.prompt_index, s.sample_index)] = s
        running = [s for s in step.batch.sample_seqs if s.finish_reason is None] if ended else []
        sched.postprocess(step.batch, tokens, logprobs)
        return [s for s in running if s.finish_reason is not None]


def _output(s: Sequence) -> RequestOutput:
    # (a sample that stopped after a later step had already run it recorded a token past its end: cut)
    routed = None if s.routed_experts is None else s.routed_experts[:len(s.token_ids) - 1].cpu()
    return RequestOutput(prompt_index=s.prompt_index, sample_index=s.sample_index,
                         prompt_token_ids=s.token_ids[:s.num_prompt_tokens], token_ids=s.output_token_ids,
                         logprobs=s.logprobs, finish_reason=s.finish_reason, routed_experts=routed)
