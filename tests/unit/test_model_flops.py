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
        model(ids, labels=ids, label_index=index)
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
