"""The rollout phase's outputs cross the ranks and sit in every rank's batch compactly: each replica sends
its responses' ids and log-probs as int32 / float32 arrays (no per-token Python object pickled, no prompt,
which every rank has), and the step's `RolloutBatch` keeps its token ids and log-probs as arrays (4 bytes
a token each; as lists of Python ints and floats they cost 36 and 32 bytes a token, on every rank)."""

import pickle
import tracemalloc
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

import trainer.ppo_trainer as pt
from rollout.config import RequestOutput
from trainer.config import PPOConfig
from trainer.configlib import load_config
from trainer.rollout_phase import Samples, _Rollout
from trainer.tracking import PeakMemory

CPU = torch.device("cpu")


class FakeRollout(_Rollout):
    """A replica whose engine answers prompt i's sample k with `length` ids above 256 (each a Python int of
    its own, as the engine's are) and float32 log-probs; the outputs carry their prompts, as the engine's do."""

    def __init__(self, replica=0, replicas=1, length=50):
        super().__init__(SimpleNamespace(), replica, replicas, PeakMemory(CPU))
        self.length = length

    def generate(self, prompts, *, n, **_):
        lo, mine = self._slice(prompts)
        outs = [RequestOutput(prompt_index=lo + i, sample_index=k, prompt_token_ids=list(p),
                              token_ids=[1000 + 7 * (lo + i) + k + j for j in range(self.length)],
                              logprobs=[-0.25 * ((j + k) % 5) for j in range(self.length)], finish_reason="length")
                for i, p in enumerate(mine) for k in range(n)]
        return self._share(outs)


def _gathered_payload(monkeypatch, prompt_length):
    """What replica 0 of 2 hands `all_gather_object` for 4 prompts x 2 samples of 50 tokens, and what it gets
    back (replica 1's share: the same objects, standing in for its own)."""
    sent = []

    def all_gather_object(out, obj):
        sent.append(pickle.dumps(obj))
        out[:] = [obj, (1, obj[1], None)]

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    prompts = [[300 + i] * prompt_length for i in range(8)]
    got = FakeRollout(0, 2).generate(prompts, n=2)
    return sent[0], got


def test_a_replica_sends_its_responses_as_arrays_without_the_prompts(monkeypatch):
    short, got = _gathered_payload(monkeypatch, 10)
    long, _ = _gathered_payload(monkeypatch, 1000)
    tokens = 4 * 2 * 50
    assert len(long) == len(short)  # no prompt id travels
    assert len(long) < 8 * tokens + 1500, len(long)  # 4 bytes an id and a log-prob (was ~5,000 bytes a token here)
    assert isinstance(got, Samples) and len(got) == 16  # both replicas' samples, prompt-major
    assert got.token_ids[1] == [1000 + 1 + j for j in range(50)] and got.finish_reasons == ["length"] * 16
    assert got.logprobs[3] == [-0.25 * ((j + 1) % 5) for j in range(50)]  # (multiples of 1/4: exact in float32)


def test_the_steps_batch_keeps_its_tokens_in_a_few_bytes_each():
    """`PPOTrainer._generate_all` of 32 prompts x 4 samples, prompts and responses of 200 tokens: the batch it
    returns holds each prompt id (copied into each of its prompt's rows) in 4 bytes, each response id and
    log-prob in 4 each, plus a few Python objects a row; bound at twice that (the lists held 36 bytes a
    response id, 32 a log-prob and 8 a prompt id: 6.3 x the bound)."""
    trainer = object.__new__(pt.PPOTrainer)
    trainer.cfg, trainer.device, trainer.agent_loop, trainer.eos_ids = load_config(PPOConfig, None, []), CPU, None, []
    trainer.rollout = FakeRollout(length=200)
    items = [{"input_ids": list(range(300 + i, 500 + i)), "extra_info": {}, "data_source": "d", "ground_truth": "1",
              "raw_prompt": "p"} for i in range(32)]
    sampling = dict(n=4, temperature=1.0, top_p=1.0, top_k=-1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        batch = trainer._generate_all(items, validate=False, seed=0, sampling=sampling)
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    rows = 32 * 4
    assert len(batch) == rows and batch.prompts[5] == items[1]["input_ids"] and batch.uids[5] == 1
    assert batch.responses[5] == [1000 + 7 + 1 + j for j in range(200)]
    assert np.allclose(batch.padded(batch.engine_log_probs).numpy()[5], [-0.25 * ((j + 1) % 5) for j in range(200)])
    compact = rows * (4 * 200 + 8 * 200)
    assert retained < 2 * compact, f"{retained / rows:.0f} bytes a row, compact {compact / rows:.0f}"
