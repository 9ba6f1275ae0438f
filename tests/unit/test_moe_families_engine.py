"""Mixtral, OLMoE and Granite-MoE (`model_type` mixtral, olmoe, granitemoe, granitemoeshared) in the engine, on CPU:
greedy tokens and log-probs against transformers' MixtralForCausalLM / OlmoeForCausalLM / GraniteMoeForCausalLM /
GraniteMoeSharedForCausalLM (float64; Mixtral with a sliding window shorter than the longer prompts and without one,
OLMoE with attention biases and renormalised top-k weights and as OLMoE-1B-7B, Granite-MoE with its scalars and
without, Granite-MoE-Shared with its ungated shared expert and without one), the checkpoint read through the engine's
own loader (Mixtral's block_sparse_moe / w1 w3 w2 names, Granite-MoE's input_linear / output_linear / router.layer and
shared_mlp)."""

import pytest
import torch

from tests.unit.hf_family import check_engine_greedy, one_thread
from tests.unit.test_moe_families import CASES, VOCAB, _saved

transformers = pytest.importorskip("transformers")

_one_thread = one_thread


@pytest.mark.parametrize("model_type, shape", CASES)
def test_engine_greedy_tokens_and_log_probs_are_transformers(tmp_path, model_type, shape):
    """The engine on a Mixtral, OLMoE or Granite-MoE(-Shared) checkpoint (chunked prefill and preemption forced): greedy
    tokens are those of a no-cache loop over the training model and of transformers' logits, and each token's log-prob
    is log_softmax of transformers' logits (float64, returned in float32: within 1e-6)."""
    from rollout import LLMEngine
    from rollout.engine import EngineConfig

    hf, path = _saved(tmp_path, model_type, **shape)
    engine, prompts, params, outs = check_engine_greedy(hf, path, VOCAB)
    assert engine.model.args.model_type == model_type and engine.model.args.moe_layers == [0, 1, 2]
    # the engine's own reader of the directory (rollout.engine: models.checkpoint.iter_hf_tensors) gives the same
    # tokens as the training model's weights loaded into it
    again = LLMEngine.from_pretrained(str(path), EngineConfig(dtype=torch.float64, block_size=4, num_kv_blocks=64),
                                      device="cpu")
    assert [o.token_ids for o in again.generate(prompts, params)] == [o.token_ids for o in outs]
