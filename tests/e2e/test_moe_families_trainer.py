"""A Mixtral, an OLMoE, a Qwen2-MoE, a Granite-MoE and a Granite-MoE-Shared in the trainer (CPU, fp32, weights at std
0.3 for decisive logits and routing): the demo's model built as each (4 experts, each token through 2, every layer
sparse; Mixtral's, OLMoE's and Granite-MoE's experts of intermediate_size, the Qwen2-MoE's beside its shared expert,
the Granite-MoE-Shared's beside its ungated one) trains two steps in one process; the engine's rollout log-probs are
the trainer's (the weights reach the engine through the resharder; Mixtral's checkpoint, written by prepare_demo under
its block_sparse_moe / w1 w3 w2 names, Granite-MoE's under its input_linear / output_linear / router.layer and
shared_mlp names, read by both), its losses finite."""

import pytest

from tests.e2e.test_qwen3_moe_trainer import check_trains_two_steps, moe_assets


@pytest.mark.parametrize("model_type, architecture", [("mixtral", "MixtralForCausalLM"),
                                                      ("olmoe", "OlmoeForCausalLM"),
                                                      ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                                      ("granitemoe", "GraniteMoeForCausalLM"),
                                                      ("granitemoeshared", "GraniteMoeSharedForCausalLM")])
def test_a_mixture_of_experts_trains_two_steps_with_the_engines_log_probs_the_trainers(tmp_path, model_type,
                                                                                       architecture):
    check_trains_two_steps(moe_assets(tmp_path / "assets", model_type), tmp_path, architecture,
                           "trainer.n_gpus_per_node=1")
