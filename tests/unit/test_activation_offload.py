"""`sharding.ac.ActivationOffloader`: what moves to host memory, when it comes back, and that
the gradients do not change. On CPU the copies are host copies in the order the GPU runs them
(the GPU test `test_activation_checkpointing_and_offload_lower_the_peak` checks the streams)."""

import pytest
import torch
import torch.nn as nn

from models import ModelArgs, Transformer
from sharding.ac import ActivationOffloader, activation_offloader, apply_ac

ARGS = ModelArgs(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, tie_word_embeddings=True)
B, S = 2, 24


def _ids(seed=0):
    return torch.randint(0, ARGS.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def _model(min_bytes=0, **ac):
    model = apply_ac(Transformer.build(ARGS, seed=0), **ac)
    off = activation_offloader(model)
    if off is not None:
        off.min_bytes = min_bytes
    return model, off


def _grads(model, ids, retain_graph=False, backwards=1):
    loss = model(ids).float().pow(2).mean()
    for _ in range(backwards):
        loss.backward(retain_graph=retain_graph)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_blocks_give_bitwise_the_same_gradients(checkpointing):
    ref = _grads(Transformer.build(ARGS, seed=0), _ids())
    model, off = _model(enable_gradient_checkpointing=checkpointing, enable_activation_offload=True)
    grads = _grads(model, _ids())
    assert off.stats.tensors > 0
    for n, g in ref.items():
        assert torch.equal(grads[n], g), n


def test_with_checkpointing_exactly_the_block_inputs_move():
    model, off = _model(enable_gradient_checkpointing=True, enable_activation_offload=True)
    _grads(model, _ids())
    x = B * S * ARGS.hidden_size * 4  # a block's input, float32; the rotary tables that every block gets stay
    last = ARGS.num_hidden_layers - 1
    assert off.stats.bytes_by_block == {i: x for i in range(last)}  # the last block keeps its own


def test_parameters_small_tensors_and_the_last_block_stay():
    model, off = _model(enable_activation_offload=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved, kept = [], []
    pack = off.pack

    def spy(t):
        out = pack(t)
        (kept if getattr(out, "t", None) is t else moved).append((off._block, t))
        return out

    off.pack = spy
    ref = _grads(Transformer.build(ARGS, seed=0), _ids())
    grads = _grads(model, _ids())
    assert moved and all(b < ARGS.num_hidden_layers - 1 for b, _ in moved)
    assert not any(t.untyped_storage().data_ptr() in params for _, t in moved)
    assert any(isinstance(t, nn.Parameter) for _, t in kept)  # the projections save their weights
    assert all(torch.equal(grads[n], g) for n, g in ref.items())
    # Above every saved tensor's size, nothing moves and nothing changes.
    model, off = _model(min_bytes=1 << 30, enable_activation_offload=True)
    grads = _grads(model, _ids())
    assert off.stats.tensors == 0 and off.stats.kept > 0
    assert all(torch.equal(grads[n], g) for n, g in ref.items())


def test_block_i_minus_1_comes_back_when_block_i_asks_first():
    """Backward runs from the last block to the first: the first tensor that block i unpacks
    starts the copies of block i-1, so that they travel during block i's backward."""
    model, off = _model(enable_activation_offload=True)
    log = []
    fetch, unpack = off._fetch, off.unpack
    off._fetch = lambda key: (log.append(("fetch", key[1])), fetch(key))[1]

    def spy(packed):
        if ("unpack", packed.key[1]) not in log:
            log.append(("unpack", packed.key[1]))
        return unpack(packed)

    off.unpack = spy
    _grads(model, _ids())
    n = ARGS.num_hidden_layers
    # The last block keeps its tensors on the device (it has nothing to fetch); its first unpack
    # brings back block n-2's.
    assert [b for kind, b in log if kind == "unpack"] == list(range(n - 1, -1, -1)), log
    for b in range(n - 1):
        assert log.index(("unpack", b + 1)) < log.index(("fetch", b)) < log.index(("unpack", b)), log


def test_kept_graphs_and_interleaved_passes():
    ref = _grads(Transformer.build(ARGS, seed=0), _ids(), retain_graph=True, backwards=2)
    model, _ = _model(enable_activation_offload=True)
    grads = _grads(model, _ids(), retain_graph=True, backwards=2)  # the second backward fetches again
    assert all(torch.equal(grads[n], g) for n, g in ref.items())

    # Two forwards, then their backwards in reverse order (a pass whose tensors were dropped from
    # the prefetch lists still comes back, tensor by tensor).
    plain = Transformer.build(ARGS, seed=0)
    losses = [plain(_ids(s)).float().pow(2).mean() for s in range(3)]
    for loss in reversed(losses):
        loss.backward()
    ref = {n: p.grad.clone() for n, p in plain.named_parameters()}
    model, _ = _model(enable_activation_offload=True)
    losses = [model(_ids(s)).float().pow(2).mean() for s in range(3)]
    for loss in reversed(losses):
        loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0, msg=n)


def test_no_grad_forward_saves_nothing():
    model, off = _model(enable_activation_offload=True)
    with torch.no_grad():
        model(_ids())
    assert off.stats.tensors == 0 and off.stats.kept == 0
    assert activation_offloader(apply_ac(Transformer.build(ARGS, seed=0), enable_gradient_checkpointing=True)) is None


def test_an_address_seen_in_an_earlier_block_is_no_reason_to_stay():
    """A moved tensor's memory goes back to the allocator, which hands the same address to a
    later block's tensor: only the shared inputs of the current block call stay (an address
    remembered from an earlier block had kept most tensors of an offloaded 1.5b update on the GPU)."""
    off = ActivationOffloader(num_blocks=4, min_bytes=0)
    buf, rope = torch.randn(64, 8), torch.randn(64, 4)
    with off.block(0, [rope]):
        assert hasattr(off.pack(buf), "host")
    with off.block(1, [rope]):
        again = off.pack(buf.view(8, 64))  # the same address, a later block
        kept = off.pack(rope[:, :2])  # a view of a shared input
    assert hasattr(again, "host") and torch.equal(again.host, buf.view(8, 64))
    assert kept.t.untyped_storage().data_ptr() == rope.untyped_storage().data_ptr() and not hasattr(kept, "host")
    assert off.stats.bytes_by_block == {0: buf.nbytes, 1: buf.nbytes} and off.stats.kept == 1
