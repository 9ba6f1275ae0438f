"""A Qwen3-MoE engine on a CUDA GPU: in bf16 its decode steps are captured in CUDA graphs (models.moe's grouped GEMM
counts the experts' tokens on the device) and generate what the eager engine generates; in float32 the experts loop
on the host, so the engine runs eagerly, with the training model's greedy tokens. (bf16 log-probs against the
trainer's: tests/gpu/test_engine_gpu.py, test_engine_bf16_tracks_training_forward.) Skipped without CUDA."""

import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rollout import SamplingParams  # noqa: E402
from tests.unit.test_engine import (check_against_training_forward, greedy_reference, make_engine,  # noqa: E402
                                    prompts_of, tiny_args, tiny_model)

DEV = "cuda"


def _moe_model(dtype=torch.float32):
    """A sparse layer (8 experts of 128, top-2) and a dense one, hidden 256."""
    args = tiny_args("qwen3_moe", hidden_size=256, intermediate_size=512, head_dim=64, num_experts=8,
                     moe_intermediate_size=128, max_position_embeddings=512, eos_token_id=None)
    return tiny_model(args).to(DEV, dtype)


def test_bf16_moe_engine_graphs_generate_what_the_eager_engine_does():
    """bf16 (the grouped GEMM): decode steps at several batch sizes are captured and replayed, their greedy tokens the
    eager engine's, their log-probs within bf16's rounding of each other (the graphs pad a step's rows to the captured
    size, which may change cuBLAS's choice of kernel for the dense projections; a sequence's rows in the experts'
    grouped GEMM are its own whatever the padding rows)."""
    model = _moe_model()
    prompts = prompts_of([5, 40, 3, 17, 90, 1], seed=4)
    cfg = dict(device=DEV, dtype=torch.bfloat16, block_size=16, num_kv_blocks=64)
    graph, eager = make_engine(model, **cfg), make_engine(model, enforce_eager=True, **cfg)
    assert graph.model.graph_capturable
    params = SamplingParams(temperature=0, max_tokens=24)
    a, b = graph.generate(prompts, params), eager.generate(prompts, params)
    assert graph.runner.graphs and not eager.runner.graphs
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 5e-2
    assert len({t for o in a for t in o.token_ids}) > 5  # not one constant token


def test_float32_moe_engine_runs_eagerly_with_the_models_greedy_tokens(caplog):
    """float32: the experts loop over the experts with tokens, which the host counts, so no graph is captured (said
    in the log) and every step runs eagerly; greedy tokens are a no-cache loop's over the training model, the
    log-probs its forward's."""
    model = _moe_model()
    with caplog.at_level(logging.WARNING, logger="rollout.runner"):
        engine = make_engine(model, device=DEV, block_size=16, num_kv_blocks=14, max_num_batched_tokens=48)
    assert not engine.model.graph_capturable and engine.runner.capture_sizes == []
    assert "no CUDA graphs" in caplog.text and "float32" in caplog.text
    prompts = prompts_of([1, 7, 33, 70, 4, 22], seed=3)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert engine.runner.use_triton and not engine.runner.graphs
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_reference(model, p, 24)
        check_against_training_forward(model, o, SamplingParams(temperature=0), atol=1e-4)


def test_bf16_moe_engine_records_the_same_experts_in_its_graphs_as_eagerly():
    """Routing replay's record (EngineConfig.return_routed_experts) inside the captured steps: the graphed engine
    (decode graphs at padded batch sizes, padded prefill graphs) returns the experts the eager engine returns for
    the same greedy tokens, at every prompt and response position, in both engines' shapes; bf16 may split a
    near-tie between two experts where the graphs' padding changes a dense projection's kernel, so at most 0.5% of
    the ids may differ (a record missing from the graphs leaves the decode positions' places unwritten: most
    differ)."""
    model = _moe_model()
    prompts = prompts_of([5, 40, 3, 17, 90, 1], seed=4)
    cfg = dict(device=DEV, dtype=torch.bfloat16, block_size=16, num_kv_blocks=64, return_routed_experts=True,
               free_cache_engine=False)  # the pool (and with it the graphs) kept between the two calls
    graph, eager = make_engine(model, **cfg), make_engine(model, enforce_eager=True, **cfg)
    params = SamplingParams(temperature=0, max_tokens=24)
    graph.generate(prompts, params)  # every prefill bucket used once: the second call replays its graphs
    a, b = graph.generate(prompts, params), eager.generate(prompts, params)
    assert graph.runner.graphs and graph.runner.prefill_graphs and not eager.runner.graphs
    same = total = 0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        n = len(x.prompt_token_ids) + len(x.token_ids) - 1
        assert x.routed_experts.shape == y.routed_experts.shape == (n, 1, 2)
        same += (x.routed_experts == y.routed_experts).sum().item()
        total += y.routed_experts.numel()
    assert same >= 0.995 * total, (same, total)
