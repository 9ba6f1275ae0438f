"""The tiled MLP under FSDP2 (gloo, CPU, 2 ranks, float32): the Function reads the weights that
the block's pre-forward hook all-gathered (and, after the first block was resharded, that its
pre-backward hook gathered again), and its weight gradients reach the reduce-scatter: every
sharded gradient equals the untiled model's, with block checkpointing too, for the actor and a
value head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import ModelArgs, cu_seqlens_from_lengths
from models.tiled_mlp import apply_tiled_mlp
from sharding import FSDPConfig, ParallelDims, build_fsdp_model
from tests.dist_utils import run_distributed

ARGS = ModelArgs(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True, mlp_bias=True)
FP32 = FSDPConfig(mixed_precision={"param_dtype": "fp32"})
# float32 with the weight gradients summed in another order: ~1e-7 of the largest entry
REL = 1e-5


def _grads(mesh, rank, tiles, head, checkpointing):
    model = build_fsdp_model(ARGS, mesh, FP32, head=head, seed=0, enable_gradient_checkpointing=checkpointing)
    with torch.no_grad():  # biases start at zero: give them values, each rank its FSDP chunk of one draw
        g = torch.Generator().manual_seed(7)
        for n, p in model.named_parameters():
            chunks = (torch.randn(p.shape, generator=g) * 0.1).chunk(mesh.size())
            if n.endswith("bias") and rank < len(chunks):  # a 1-row tensor has one chunk
                p.to_local().copy_(chunks[rank])
    apply_tiled_mlp(model, tiles)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own packed micro-batch
    lengths = [5, 9, 4] if rank == 0 else [11, 6]
    ids = torch.randint(0, ARGS.vocab_size, (1, sum(lengths)), generator=gen)
    cu = cu_seqlens_from_lengths(lengths)
    if head == "value":
        loss = model(ids, cu_seqlens=cu).pow(2).mean()
    else:
        logits = model(ids, cu_seqlens=cu)
        loss = F.cross_entropy(logits.reshape(-1, ARGS.vocab_size)[:-1], ids.reshape(-1)[1:])
    loss.backward()
    return loss.detach(), {n: p.grad.to_local() for n, p in model.named_parameters()}


def _body(rank, world):
    mesh = ParallelDims(world).build_meshes("cpu").train
    for head in ("lm", "value"):
        for checkpointing in (False, True):
            loss_ref, ref = _grads(mesh, rank, None, head, checkpointing)
            loss, got = _grads(mesh, rank, 3, head, checkpointing)
            assert abs(loss - loss_ref) <= REL * abs(loss_ref), (head, checkpointing)
            assert got.keys() == ref.keys() and any(".mlp.up_proj.bias" in n for n in ref)
            for n in ref:
                if not ref[n].numel():  # a shard this rank does not hold (the value head's [1, H])
                    continue
                scale = ref[n].abs().max().item()
                assert scale > 0 or ".mlp." not in n, n  # the MLP's gradients are non-trivial
                err = (got[n] - ref[n]).abs().max().item() / max(scale, 1e-12)
                assert err < REL, (head, checkpointing, n, err)


def test_fsdp_grads_with_tiles_are_the_untiled_ones():
    run_distributed(_body, 2)
