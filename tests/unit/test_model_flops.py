"""`ModelArgs.flops` (the MFU numerator) against PyTorch's own FLOP counter on a real forward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models import ModelArgs, Transformer


@pytest.mark.parametrize("tied", [True, False])
def test_flops_match_the_flop_counter_on_a_forward_with_the_head_on_response_positions(tied):
    args = ModelArgs(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, model_type="qwen2",
                     attention_bias=True, tie_word_embeddings=tied)
    model = Transformer.build(args, seed=0)
    batch, seq, response = 3, 40, 24
    ids = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    # the LM head only on the response positions of each row, as the trainer evaluates it
    index = torch.cat([torch.arange(r * seq + seq - response, (r + 1) * seq) for r in range(batch)])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, labels=ids.reshape(-1)[index], label_index=index)
    counts = counter.get_flop_counts()["Global"]
    # The linear layers (blocks and LM head); the CPU attention kernel is not one the counter knows.
    counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0)
    # Biases and norm weights are in N_body but run no matmul: 0.13 % at this shape.
    predicted = args.flops(batch * seq, batch * response, 0)
    assert abs(predicted - counted) / counted < 5e-3, (predicted, counted)
    # The input embedding is a lookup: counting it (or the head on every position) over-counts.
    assert args.flops(batch * seq, batch * seq, 0) > 1.05 * counted
    # Attention, by hand: QKᵀ and AV are 2·head_dim multiply-adds per head, layer and (query, key) pair.
    assert args.flops(0, 0, 1) == 2 * 2 * 2 * 8 * 32
    assert args.flops(7, 5, 3, backward=True) == 3 * args.flops(7, 5, 3)


@pytest.mark.parametrize("targets", [None, "all-linear", ["q_proj", "down_proj"], ["v_proj"], ["o_proj"],
                                     ["gate_proj", "up_proj", "down_proj"], ["up_proj"], ["down_proj"]])
def test_training_flops_match_the_flop_counter_full_and_lora(targets):
    """Forward + backward, counted by PyTorch: a full model runs `6·` everything; a LoRA model runs
    no weight gradient for its frozen base and head (`4·`), `6·r·(in + out)` per adapted projection,
    and in layer 0 no input gradient upstream of its first adapter: q / k / v's never (their input
    is the frozen embedding's), o_proj's without a q / k / v adapter, the MLP's without an attention
    adapter, down_proj's with down_proj the only target. The full-model formula over-counts a LoRA
    run by ~1.45x at this shape."""
    from models.lora import LoRAConfig, inject_lora

    args = ModelArgs(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, model_type="qwen2",
                     attention_bias=True, tie_word_embeddings=False)
    model = Transformer.build(args, seed=0)
    lora = None
    if targets is not None:
        lora = LoRAConfig(rank=8, target_modules=targets)
        inject_lora(model, lora, generator=torch.Generator().manual_seed(0))
    batch, seq, response = 3, 40, 24
    ids = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    index = torch.cat([torch.arange(r * seq + seq - response, (r + 1) * seq) for r in range(batch)])
    with FlopCounterMode(display=False) as counter:
        logp, _ = model(ids, labels=ids.reshape(-1)[index], label_index=index)
        logp.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    # the head's backward recomputes its logits (2·h·V a position): recomputation, not counted
    counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0) - 2 * 256 * 1000 * batch * response
    predicted = args.flops(batch * seq, batch * response, 0, backward=True, lora=lora)
    assert abs(predicted - counted) / counted < 5e-3, (predicted, counted)
    if targets == "all-linear":
        assert args.flops(batch * seq, batch * response, 0, backward=True) > 1.4 * counted
    # Attention (the counter does not know the CPU kernel), by hand: 4·heads·head_dim a pair and layer
    # forward, 8· more backward, which layer 0 runs only with a q / k / v adapter.
    if lora is not None:
        layer0_backward = any(m in lora.targets for m in ("q_proj", "k_proj", "v_proj"))
        assert args.flops(0, 0, 1, backward=True, lora=lora) == 4 * 8 * 32 * 2 + 8 * 8 * 32 * (1 + layer0_backward)


def test_peak_bf16_flops_by_device_name():
    # names as torch.cuda.get_device_name reports them; the PCIe / NVL boards have their own datasheet peaks
    from models import peak_bf16_flops
    cases = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA GH200 480GB": 989e12,
             "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12, "NVIDIA H200 NVL": 835e12,
             "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA H20": None,
             "NVIDIA GeForce RTX 4090": None}
    for name, peak in cases.items():
        assert peak_bf16_flops(name) == peak, name
