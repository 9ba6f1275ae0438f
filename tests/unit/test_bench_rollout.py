"""The byte count and the EOS stop set of bench/rollout.py (its GPU figures rest on them)."""

import torch

from bench.rollout import eos_ids, step_bytes
from models import Transformer
from rollout import EngineConfig, LLMEngine
from tests.unit.test_engine import tiny_args


def test_step_bytes_reads_the_looked_up_embedding_rows_not_the_table():
    for kind in ("llama", "qwen2"):  # untied: the table is not read; tied: read whole as the LM head
        args = tiny_args(kind)
        engine = LLMEngine(args, EngineConfig(dtype=torch.float32, num_kv_blocks=8), device="cpu")
        with torch.device("meta"):
            params = sum(p.numel() for p in Transformer(args).parameters())
        table = args.vocab_size * args.hidden_size
        batch, context = 3, 10
        weights = params - (table if kind == "llama" else 0) + batch * args.hidden_size
        kv = batch * context * args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim
        nbytes, logits = step_bytes(engine, batch, context)
        assert nbytes == 4 * (weights + kv), kind
        assert logits == 4 * 2 * batch * args.vocab_size


def test_eos_ids_spread_over_the_vocabulary():
    v = 151936
    ids = eos_ids(v, 256)
    assert len(ids) == len(set(ids)) == 594 and ids[0] == 0 and ids[-1] < v  # V / 256 = 593.5 ids
    bounds = ids + [v]
    assert {b - a for a, b in zip(bounds, bounds[1:])} == {v // 594, v // 594 + 1}  # even spacing
