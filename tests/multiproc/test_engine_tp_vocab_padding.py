"""A vocabulary that the TP size does not divide (a Llama with an added pad token: 32001) at TP 2: the
engine pads its last vocabulary shard, and the padding is never drawn nor counted (gloo, CPU, float32)."""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.multiproc.test_engine_tp_replicated import assert_generates_as_tp1

VOCAB = 97  # shards of 49 ids: rank 1 holds ids 49..96 and one padded row


def _poison_padding(engine) -> None:
    """NaN in the padded rows of the LM head: a padded logit that reached the race, the top-k / top-p threshold
    or the log-normaliser would turn them into NaN or pick the padding."""
    m = engine.model
    with torch.no_grad():
        m.head_w[m.vocab_real:] = float("nan")


def _padded_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine
    from tests.unit.test_engine import prompts_of, tiny_args, tiny_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for kind in ("qwen2", "llama"):  # a tied head (the embedding's padding) and a head of its own
        model = tiny_model(tiny_args(kind, vocab_size=VOCAB, eos_token_id=None))
        engine = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24,
                                                    max_num_batched_tokens=16), tp_mesh=mesh["tp"], device="cpu")
        engine.load_weights(model.named_parameters())
        m = engine.model
        assert (m.vocab_start, m.vocab_local, m.vocab_real) == ((0, 49, 49) if rank == 0 else (49, 49, 48))
        slot = engine.param_slots()["embed_tokens.weight"]
        assert torch.equal(slot.view, model.embed_tokens.weight.detach()[m.vocab_start:m.vocab_start + m.vocab_real])
        _poison_padding(engine)
        assert_generates_as_tp1(engine, model, prompts_of([3, 17, 9, 30, 1], seed=2))


def test_vocab_97_at_tp2_equals_tp1():
    run_distributed(_padded_body, 2)


def _reshard_body(rank, world):
    import torch.distributed as dist

    from tests.multiproc.test_engine_tp_replicated import reshard_equals_direct, resharder_and_engines
    from tests.unit.test_engine import tiny_args, tiny_model

    resharder, engine, direct = resharder_and_engines(tiny_model(tiny_args("llama", vocab_size=VOCAB)), world, -1, 2)
    for reshard in (resharder.reshard, resharder.reshard_naive):
        stats = reshard_equals_direct(reshard, engine, direct, "vocab 97")
    # the embedding and the LM head (97 rows over 2 FSDP chunks of 49) are gathered whole, and counted
    assert stats.num_fallback == 2
    dist.barrier()


def test_resharder_fills_the_real_rows_of_a_padded_vocabulary():
    run_distributed(_reshard_body, 2)


def _padded_triton_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from rollout import EngineConfig, LLMEngine, SamplingParams
    from tests.unit.test_engine import make_engine, prompts_of, tiny_args, tiny_model

    model = tiny_model(tiny_args("llama", vocab_size=VOCAB, eos_token_id=None))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    engine = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=24,
                                                max_num_batched_tokens=16), tp_mesh=mesh["tp"], device="cpu")
    engine.load_weights(model.named_parameters())
    _poison_padding(engine)
    engine.runner.use_triton = True  # the sampling kernel reads the real columns of the padded logits' rows
    assert engine.runner.ops.__name__ == "TritonOps"
    tp1 = make_engine(model, num_kv_blocks=24, max_num_batched_tokens=16)
    prompts = prompts_of([3, 17, 9], seed=2)
    for sp in (SamplingParams(n=2, temperature=0.9, max_tokens=3, seed=5),
               SamplingParams(n=2, temperature=1.1, top_k=20, top_p=0.8, max_tokens=3, seed=7)):
        want, got = tp1.generate(prompts, sp), engine.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert max(abs(a - b) for w, g in zip(want, got) for a, b in zip(w.logprobs, g.logprobs)) < 1e-4


def test_vocab_97_at_tp2_triton_kernels_equal_tp1():
    """The Triton sampling kernel over the real columns of rank 1's padded shard (on CPU under the interpreter)."""
    import pytest

    pytest.importorskip("triton")
    run_distributed(_padded_triton_body, 2, triton_interpret=True)
