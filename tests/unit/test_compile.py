"""`sharding.compile.apply_compile`: compiled blocks compute what eager blocks compute."""

import dataclasses

import pytest
import torch

from models import ModelArgs, Transformer, cu_seqlens_from_lengths
from sharding.ac import activation_offloader, apply_ac
from sharding.compile import apply_compile

ARGS = ModelArgs(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True)


def _loss_and_grads(model, ids, labels, cu, index):
    logp, ent = model(ids, labels=labels.reshape(-1)[index], cu_seqlens=cu, with_entropy=True, label_index=index)
    ((logp * torch.linspace(-1, 1, logp.numel())).sum() + ent.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# a mixture of experts (Qwen3-MoE's sparse layer 0, dense layer 1): its routing and expert loop in the compiled block
MOE_ARGS = dataclasses.replace(ARGS, model_type="qwen3_moe", attention_bias=False, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, mlp_only_layers=(1,))
# OLMoE's (every layer sparse, experts of intermediate_size, q / k normed over the whole projections, biases) and
# Mixtral's (its routing weights kept in float32: `ModelArgs.router_weights_float32`)
OLMOE_ARGS = dataclasses.replace(MOE_ARGS, model_type="olmoe", attention_bias=True, intermediate_size=16,
                                 mlp_only_layers=())
MIXTRAL_ARGS = dataclasses.replace(OLMOE_ARGS, model_type="mixtral", attention_bias=False, norm_topk_prob=True)
# Qwen2-MoE's (its sparse layer's shared expert and that expert's sigmoid gate, under activation checkpointing)
QWEN2_MOE_ARGS = dataclasses.replace(MOE_ARGS, model_type="qwen2_moe", attention_bias=True,
                                     shared_expert_intermediate_size=24)
# Granite-MoE-Shared's (every layer sparse, its router's softmax over the top-k logits, its ungated shared expert,
# Granite's scalars)
GRANITE_MOE_ARGS = dataclasses.replace(OLMOE_ARGS, model_type="granitemoeshared", attention_bias=False,
                                       norm_topk_prob=True, shared_expert_intermediate_size=24,
                                       embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                       logits_scaling=2.0)


@pytest.mark.parametrize("checkpointing, offload, args", [(False, False, ARGS), (True, False, ARGS),
                                                          (True, True, ARGS), (True, False, MOE_ARGS),
                                                          (False, False, OLMOE_ARGS), (True, False, MIXTRAL_ARGS),
                                                          (True, False, QWEN2_MOE_ARGS),
                                                          (True, False, GRANITE_MOE_ARGS)])
def test_compiled_blocks_match_eager_values_and_grads(checkpointing, offload, args):
    torch.manual_seed(0)
    eager = Transformer.build(args, seed=0)
    compiled = Transformer.build(args, seed=0)
    names = [n for n, _ in compiled.named_parameters()]
    # torchtitan's order: AC, then compile (which traces the offloader's hooks' context too)
    apply_ac(compiled, enable_gradient_checkpointing=checkpointing, enable_activation_offload=offload)
    offloader = activation_offloader(compiled)
    if offloader is not None:
        offloader.min_bytes = 0  # move this tiny model's tensors too
    apply_compile(compiled, backend="aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == names  # checkpoints and the resharder key on these
    for lengths in ([5, 9, 3], [7, 11]):  # a second shape: dynamic, no stale graph
        ids = torch.randint(0, args.vocab_size, (1, sum(lengths)))
        labels = torch.roll(ids, -1, dims=1)
        cu = cu_seqlens_from_lengths(lengths)
        index = torch.arange(2, sum(lengths), 2)
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
        ref, ref_grads = _loss_and_grads(eager, ids, labels, cu, index)
        out, grads = _loss_and_grads(compiled, ids, labels, cu, index)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert offloader is None or offloader.stats.tensors > 0
        for n in names:
            torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_compiling_twice_is_an_error():
    m = Transformer.build(ARGS, seed=0)
    apply_compile(m, backend="aot_eager")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_compile(m, backend="aot_eager")


def test_compiled_lora_blocks_take_no_host_scalars():
    """The LoRA scaling and the norm epsilons are constants of the compiled graph: were a Python
    float a graph input, Dynamo would pass it as a 0-d float64 CPU tensor, and Inductor put a CPU
    kernel inside a GPU block (the LoRA update failed so on an H200)."""
    from models.lora import LoRAConfig, inject_lora

    m = inject_lora(Transformer.build(ARGS, seed=0), LoRAConfig(rank=4, alpha=8), torch.Generator().manual_seed(1))
    graph_inputs = []

    def backend(gm, example_inputs):
        graph_inputs.extend(x for x in example_inputs if isinstance(x, torch.Tensor))
        return gm.forward

    apply_compile(m, backend=backend)
    ids = torch.randint(0, ARGS.vocab_size, (1, 12))
    m(ids, labels=torch.roll(ids, -1, dims=1))
    assert graph_inputs, "the blocks were not compiled"
    scalars = [x for x in graph_inputs if x.dim() == 0]
    assert not scalars, f"0-d host tensors among the compiled blocks' inputs: {scalars}"
    assert not any(x.dtype == torch.float64 for x in graph_inputs)


def _graphs_compiled(num_layers: int, offload: bool) -> int:
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = Transformer.build(dataclasses.replace(ARGS, num_hidden_layers=num_layers), seed=0)
    apply_ac(m, enable_activation_offload=offload)
    offloader = activation_offloader(m)
    if offloader is not None:
        offloader.min_bytes = 0
    apply_compile(m, backend=backend)
    for lengths in ([5, 9, 3], [7, 11]):
        ids = torch.randint(0, ARGS.vocab_size, (1, sum(lengths)))
        logp, _ = m(ids, labels=torch.roll(ids, -1, dims=1), cu_seqlens=cu_seqlens_from_lengths(lengths),
                    with_entropy=True)
        logp.sum().backward()
        assert offloader is None or set(offloader.stats.bytes_by_block) == set(range(num_layers - 1))
    return len(graphs)


def test_offloaded_blocks_compile_once_whatever_the_depth():
    """The offloader's bookkeeping runs outside the compiled blocks: were it traced, Dynamo would
    guard on its per-block state and compile again for each block index (on an H200 the 28
    blocks of qwen2.5-1.5b hit the recompile limit of 8). With checkpointing, the CPU attention's
    data-dependent mask keeps the checkpointed block out of the graph; the GPU test covers it."""
    plain = _graphs_compiled(10, offload=False)
    assert plain > 0, "the blocks were not compiled"
    assert _graphs_compiled(2, offload=True) == _graphs_compiled(10, offload=True) == plain
