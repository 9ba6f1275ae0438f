"""Tensor parallelism: TP=2 over two gloo processes equals TP=1 (float32, CPU)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def check_tp2_equals_tp1(rank: int, device: torch.device, logprob_tol: float, tp2_triton: bool = False):
    """TP=2 over the two ranks of the default group against TP=1 on each rank, float32 engines on
    `device`: same tokens (greedy, top-k, top-p sampling), log-probs within `logprob_tol`. The
    GPU check (tests/gpu/multi_gpu_checks.py) runs it over NCCL. `tp2_triton`: the TP=2 engine
    runs the Triton kernels (on CPU under the interpreter, about 1.3 s a step), the TP=1 one the
    PyTorch ops, over fewer prompts and new tokens (the same kinds of step: chunked prefill, decode at several
    rows and at one; the one row is the prompt of 3 tokens, whose decode steps are the GEMVs' at one row, not the
    chunked one, whose 1-token second chunk was one more one-row step through them, the slowest kernel under the
    interpreter); the pool's preemptions are then left to the PyTorch run."""
    from torch.distributed.device_mesh import init_device_mesh

    from models import ModelArgs, Transformer, tp_shard_dim
    from rollout import EngineConfig, LLMEngine, SamplingParams

    results = []
    for kind in ("qwen2", "qwen3", "llama"):
        if kind == "qwen2":
            args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
        elif kind == "qwen3":  # per-head q/k norms, replicated over TP
            args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                             model_type="qwen3", tie_word_embeddings=True)
        else:
            args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             model_type="llama", mlp_bias=True, tie_word_embeddings=False)
        model = Transformer.build(args, seed=0)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.15 * torch.randn(p.shape, generator=g))
        params = dict(model.named_parameters())
        mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("tp",))
        config = EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
        tp2 = LLMEngine(args, config, tp_mesh=mesh["tp"], device=device)
        tp2.load_weights(model.named_parameters())
        tp1 = LLMEngine(args, config, device=device)  # TP=1 needs no process group
        tp1.load_weights(model.named_parameters())
        if tp2_triton:
            tp2.runner.use_triton, tp1.runner.use_triton = True, False

        # Each slot holds this rank's shard j = rows/cols [j n/t, (j+1) n/t) along tp_shard_dim.
        for name, slot in tp2.param_slots().items():
            full = params[name].detach()
            dim = tp_shard_dim(name)
            assert slot.shard_dim == dim
            expect = full if dim is None else full.chunk(2, dim=dim)[rank]
            assert torch.equal(slot.view.cpu(), expect), name

        g = torch.Generator().manual_seed(2)
        # the Triton run over three of the prompts (a chunked one, 17 tokens over two steps, and two short ones):
        # the same kinds of step as the five's, in half of them
        lengths = (3, 17, 1) if tp2_triton else (3, 17, 9, 30, 1)
        prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
        new = (lambda n: 3) if tp2_triton else (lambda n: n)
        cases = {"qwen2": (SamplingParams(temperature=0, max_tokens=new(10)),
                           SamplingParams(n=2, temperature=0.9, top_k=5, max_tokens=new(8), seed=6)),
                 "qwen3": (SamplingParams(n=2, temperature=0.9, top_p=0.9, max_tokens=new(10), seed=9),),
                 "llama": (SamplingParams(n=2, temperature=0.9, max_tokens=new(10), seed=5),
                           SamplingParams(n=2, temperature=1.1, top_p=0.8, top_k=20, max_tokens=new(8), seed=7))}
        one = SamplingParams(temperature=0.9, max_tokens=new(6), seed=8)  # one sequence: decode steps of one row
        preemptions = 0
        one_row = prompts[:1] if tp2_triton else prompts[1:2]
        for sp, batch in [(sp, prompts) for sp in cases[kind]] + [(one, one_row)]:
            a, b = tp1.generate(batch, sp), tp2.generate(batch, sp)
            preemptions += tp2.last_stats["preemptions"]
            assert [o.token_ids for o in a] == [o.token_ids for o in b], (kind, sp)
            diff = max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))
            assert diff < logprob_tol, (kind, sp, diff)
            results.append(b)
        assert preemptions > 0 or tp2_triton  # the tight pool made both ranks preempt identically

    # Both ranks return the same outputs.
    mine = [[o.token_ids for o in outs] for outs in results]
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    assert gathered[0] == gathered[1]


def _tp_body(rank, world_size):
    check_tp2_equals_tp1(rank, torch.device("cpu"), 1e-5)


def test_tp2_equals_tp1():
    run_distributed(_tp_body, 2)


def _tp_triton_body(rank, world_size):
    check_tp2_equals_tp1(rank, torch.device("cpu"), 1e-4, tp2_triton=True)


def test_tp2_triton_kernels_equal_tp1_torch_ops():
    """The engine's Triton kernels at TP 2 (vocabulary-sharded sampling partials, row-parallel
    GEMVs and the gated GEMV at one row, all-reduces between them) against the PyTorch ops at TP 1."""
    pytest.importorskip("triton")
    run_distributed(_tp_triton_body, 2, triton_interpret=True)


def _tp_split_k_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import rollout.model as engine_model
    from rollout import EngineConfig, LLMEngine, SamplingParams
    from rollout.ops import split_k_products
    from tests.unit.test_engine import prompts_of, tiny_args, tiny_model

    model = tiny_model(tiny_args("qwen2", eos_token_id=None)).to(torch.bfloat16)  # qkv bias, tied head
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    prompts = prompts_of([3, 9, 5, 12, 7, 4], seed=4)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=3)
    calls = []
    engine_model.split_k_products = lambda x, w, s: calls.append(w.shape[0]) or split_k_products(x, w, s)
    original = engine_model.split_k_splits
    try:
        outs = []
        for rule in (original, lambda rows, n, k, dtype: 1):
            engine_model.split_k_splits = rule
            engine = LLMEngine(model.args, EngineConfig(dtype=torch.bfloat16, block_size=4, num_kv_blocks=64),
                               tp_mesh=mesh["tp"], device="cpu")
            engine.load_weights(model.named_parameters())
            outs.append(engine.generate(prompts, params))
    finally:
        engine_model.split_k_products = split_k_products
        engine_model.split_k_splits = original
    # At TP 2 only qkv (column-parallel: this rank's 64 of its 128 outputs) splits; o_proj and
    # down_proj are all-reduced as one product each.
    assert calls and set(calls) == {64}, set(calls)
    split, plain = outs
    assert [o.token_ids for o in split] == [o.token_ids for o in plain]
    diff = max(abs(a - b) for s, p in zip(split, plain) for a, b in zip(s.logprobs, p.logprobs))
    assert diff < 0.05, diff


def test_tp2_bf16_split_k_qkv_decodes_as_without():
    """bf16 at TP 2: the decode qkv's split-K products, summed with this rank's bias shard in the
    attention, give the tokens of one product."""
    run_distributed(_tp_split_k_body, 2)


def _tp_fp8_body(rank, world_size):
    """fp8 at TP 2: each rank's e4m3 shards and scales are exactly TP 1's (one scale per full tensor, agreed over
    the group), and the engine computes what a fake-quantized training forward does with down_proj's input
    scaled per rank (`tests.unit.test_fp8_rollout`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine, SamplingParams
    from tests.unit.test_engine import make_engine, prompts_of, tiny_args, tiny_model
    from tests.unit.test_fp8_rollout import _fake_quant_reference, _logprob_errors

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for kind in ("qwen2", "llama"):
        model = tiny_model(tiny_args(kind))
        tp1 = make_engine(model, quantization="fp8")
        tp2 = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=256,
                                                 quantization="fp8"), tp_mesh=mesh["tp"], device="cpu")
        tp2.load_weights(model.named_parameters())
        params = SamplingParams(temperature=1.0, max_tokens=4, seed=3, ignore_eos=True)
        prompts = prompts_of([3 + i % 12 for i in range(16)])
        tp1.generate(prompts[:1], params)  # quantizes
        outs = tp2.generate(prompts, params)
        for q1, q2 in zip(tp1.model.fp8_layers, tp2.model.fp8_layers):
            assert torch.equal(torch.stack(q1.scales), torch.stack(q2.scales))
            for full, shard, dim in ((q1.qkv, q2.qkv, 0), (q1.gate_up, q2.gate_up, 0), (q1.down, q2.down, 1)):
                if dim == 0:  # [q | k | v] and [gate | up]: each part split over the ranks
                    parts = (tp1.model.num_heads * tp1.model.head_dim, tp1.model.num_kv_heads * tp1.model.head_dim,
                             tp1.model.num_kv_heads * tp1.model.head_dim) if full is q1.qkv else (tp1.model.inter,) * 2
                    expect = torch.cat([p.chunk(2, 0)[rank] for p in full.float().split(parts)])
                else:
                    expect = full.float().chunk(2, 1)[rank]
                assert torch.equal(shard.float(), expect), kind
        assert _logprob_errors(_fake_quant_reference(model, tp=2), outs).median().item() < 1e-4, kind


def test_tp2_fp8_shards_are_tp1_and_match_a_fake_quantized_forward():
    run_distributed(_tp_fp8_body, 2)


def _tp_kv_fp8_body(rank, world_size):
    """An e4m3 KV cache at TP 2 (each rank holds its KV heads' values and scales) against the float64 training
    forward whose attention sees K/V rounded as the cache holds them (`tests.unit.test_fp8_kv_cache`); forks
    copy blocks with their scales on both ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine, SamplingParams
    from tests.unit.test_engine import prompts_of, tiny_args, tiny_model
    from tests.unit.test_fp8_kv_cache import _kv_rounded_reference
    from tests.unit.test_fp8_rollout import _logprob_errors

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for kind in ("qwen2", "llama"):
        model = tiny_model(tiny_args(kind))
        tp2 = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=256,
                                                 kv_cache_dtype="fp8", free_cache_engine=False),
                        tp_mesh=mesh["tp"], device="cpu")
        tp2.load_weights(model.named_parameters())
        outs = tp2.generate(prompts_of([3 + i % 12 for i in range(8)]),
                            SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=3, ignore_eos=True))
        assert tp2.runner.kv_scales.shape[-1] == model.args.num_key_value_heads // 2
        monkeypatch = pytest.MonkeyPatch()
        try:
            with torch.no_grad():
                ref = _kv_rounded_reference(model, monkeypatch)
            assert _logprob_errors(ref, outs).median().item() < 1e-4, kind
        finally:
            monkeypatch.undo()
        assert _logprob_errors(model, outs).mean().item() > 1e-3, kind


def test_tp2_kv_fp8_matches_a_forward_over_rounded_kv():
    run_distributed(_tp_kv_fp8_body, 2)


def _pool_body(rank, world_size):
    import rollout.engine as engine_mod
    from models import ModelArgs
    from rollout import EngineConfig, LLMEngine
    from torch.distributed.device_mesh import init_device_mesh

    if rank == 1:
        engine_mod.CPU_KV_CACHE_BYTES = 1 << 12  # less free memory on this rank than on its TP peer
    args = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    engine = LLMEngine(args, EngineConfig(dtype=torch.float32, block_size=4), tp_mesh=mesh["tp"], device="cpu")
    with pytest.raises(engine_mod.CacheTooSmallError, match="KV pool would hold 4 blocks") as err:
        engine.init_cache()
    assert ("this rank's would hold" in str(err.value)) == (rank == 0), str(err.value)


def test_a_kv_pool_too_small_on_one_rank_is_refused_on_every_rank():
    """The pool's size comes from each GPU's free memory: a rank whose pool cannot hold one sequence refused it
    before the TP group's agreement on the smallest pool, and left its peers waiting in that all-reduce. Now
    the group agrees first and every rank raises."""
    run_distributed(_pool_body, 2, timeout=120.0)


def _stages_body(rank, world_size):
    from rollout.parallel import TPGroup

    tp = TPGroup(dist.group.WORLD)
    ran = []

    def allocate():
        ran.append("allocate")

    def rendezvous():  # fails on rank 1 alone
        ran.append("rendezvous")
        if rank == 1:
            raise OSError("no peer access")

    def probe():  # a collective: a rank sent here alone would wait for its peer
        ran.append("probe")
        dist.all_reduce(torch.ones(1), group=tp.group)

    failure = tp.agreed_stages((allocate, rendezvous, probe), torch.device("cpu"))
    assert ran == ["allocate", "rendezvous"], ran
    assert failure == ("rendezvous", "OSError: no peer access" if rank == 1 else "on the TP group's rank 1"), failure
    assert tp.agreed_stages((allocate, probe), torch.device("cpu")) is None and ran[-2:] == ["allocate", "probe"]


def test_symmetric_memory_setup_stages_are_agreed():
    """The symmetric-memory all-reduce's setup (allocate, rendezvous, probe): a rank whose stage failed fell back to
    NCCL alone and left its peers in the next stage's collective (or decoding with another all-reduce). Each
    stage's outcome is now agreed before the next: every rank stops at the failed one, and names it."""
    run_distributed(_stages_body, 2, timeout=60.0)
