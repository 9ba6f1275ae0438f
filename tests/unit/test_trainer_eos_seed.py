"""How the trainer drives the rollout engine: the EOS ids it stops at and the seeds it samples with.

EOS: the trainer stops at every EOS id of the checkpoint (config.json + generation_config.json,
as the CLI and Hugging Face do) and the tokenizer's, on the engine and the HF rollout paths.
Seeds: every (step, replica, global prompt index, sample index) of training, and every
validation chunk, gets its own noise stream (replica r at step t used to replay replica 0's
noise at step t + r, and validation chunk c's prompt i chunk 0's prompt i).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from rollout import EngineConfig, LLMEngine, RequestOutput
from rollout.sequence import derive_seed, sequence_key
from tests.unit import test_engine
from tests.unit.test_engine import VOCAB, make_engine, prompts_of, tiny_args, tiny_model
from trainer.ppo_trainer import PPOTrainer
from trainer.rollout_phase import EngineRollout, NoCacheRollout
from trainer.tracking import PeakMemory, Timer

CPU = torch.device("cpu")
CONFIG_EOS, TOKENIZER_EOS = 3, 4


_one_thread = test_engine._one_thread  # autouse fixture: tiny engines run faster on one thread


class _Actor:
    """The FSDP actor as the rollout phase sees it (the HF path samples with `model`)."""

    def __init__(self, model=None):
        self.model, self.device = model, CPU

    def offload(self, params=True):
        pass

    def load(self, params=True):
        pass


class _Resharder:
    def reshard(self):
        pass


class _RecordingEngine:
    """Records what the rollout phase passes to `LLMEngine.generate`."""

    def __init__(self):
        self.calls = []
        self.last_stats = {"graph_capture_s": 0.0}
        self.cache_inits = 0

    def init_cache(self):  # the rollout phase sizes the engine's KV pool before generating
        self.cache_inits += 1

    def generate(self, prompts, sp, prompt_index_offset=0):
        self.calls.append((sp, prompt_index_offset, len(prompts)))
        return [RequestOutput(prompt_index=prompt_index_offset + i, sample_index=k, prompt_token_ids=list(p),
                              token_ids=[1], logprobs=[0.0], finish_reason="length")
                for i, p in enumerate(prompts) for k in range(sp.n)]


def _engine_rollout(engine, replica=0, replicas=1):
    return EngineRollout(_Actor(), engine, _Resharder(), replica, replicas, PeakMemory(CPU), Timer(CPU),
                         free_cache=False, free_weights=False)


def _sample(rollout, prompts, *, seed, eos_ids=(), temperature=1.0, max_tokens=8, n=1):
    return rollout.generate(prompts, max_tokens=max_tokens, eos_ids=list(eos_ids), ignore_eos=False, seed=seed, n=n,
                            temperature=temperature, top_p=1.0, top_k=-1)


def _trainer_for_eos(model_dir: Path, override_config: dict | None = None):
    from models.tokenizer import load_tokenizer

    model = NS(path=str(model_dir), override_config=override_config or {})
    return NS(tokenizer=load_tokenizer(str(model_dir)), cfg=NS(actor_rollout_ref=NS(model=model)))


# ---------------------------------------------------------------------------------------------- EOS
def _save(model, path: Path, eos_token: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"eos_token": eos_token} if eos_token else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", **extra).save_pretrained(path)


@pytest.fixture(scope="module")
def two_eos(tmp_path_factory):
    """A checkpoint whose config.json says EOS 3, whose generation_config.json lists [3, second] and
    whose tokenizer's EOS is 4; `second` is the j-th greedy token of `prompt` (none before it stops)."""
    model = tiny_model(tiny_args("qwen2", eos_token_id=CONFIG_EOS))
    d = tmp_path_factory.mktemp("two_eos") / "ckpt"
    _save(model, d, eos_token=f"w{TOKENIZER_EOS}")
    assert json.loads((d / "config.json").read_text())["eos_token_id"] == CONFIG_EOS
    engine = LLMEngine.from_pretrained(d, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=64))
    for prompt in prompts_of([5, 6, 7, 8], seed=3):
        free = engine.generate([prompt], _greedy_params(ignore_eos=True))[0].token_ids
        for j in range(1, len(free)):
            if free[j] not in (CONFIG_EOS, TOKENIZER_EOS) and not {CONFIG_EOS, TOKENIZER_EOS, free[j]} & set(free[:j]):
                (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [CONFIG_EOS, free[j]]}))
                return NS(dir=d, model=model, engine=engine, prompt=prompt, free=free, j=j, second=free[j])
    pytest.fail("no prompt with a usable second EOS")


def _greedy_params(**kw):
    from rollout import SamplingParams

    return SamplingParams(temperature=0, max_tokens=8, **kw)


def test_trainer_eos_ids_are_every_checkpoint_eos_and_the_tokenizers(two_eos):
    ids = PPOTrainer._eos_ids(_trainer_for_eos(two_eos.dir))
    assert ids == sorted({CONFIG_EOS, TOKENIZER_EOS, two_eos.second})


def test_the_cli_stops_at_the_trainers_eos_ids(two_eos, tmp_path, monkeypatch):
    """`python -m rollout.generate` stops where the trainer does: the tokenizer's EOS too (vLLM
    stops at it; the CLI read config.json and generation_config.json only, so a fine-tune that
    changed the tokenizer's EOS alone generated past it)."""
    import rollout
    import rollout.generate as cli

    seen = []
    real = rollout.SamplingParams
    monkeypatch.setattr(rollout, "SamplingParams", lambda **kw: seen.append(kw["eos_token_id"]) or real(**kw))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": two_eos.prompt}) + "\n")
    assert cli.main(["--model", str(two_eos.dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                     "--max-new-tokens", "1", "--dtype", "float32"]) == 0
    assert seen == [PPOTrainer._eos_ids(_trainer_for_eos(two_eos.dir))] and TOKENIZER_EOS in seen[0]


def test_an_unreadable_generation_config_is_a_user_error_naming_the_model(two_eos, tmp_path):
    """It raised the CLI's error class out of the trainer, with a traceback."""
    import shutil

    from trainer.errors import UserError

    d = tmp_path / "ckpt"
    shutil.copytree(two_eos.dir, d)
    (d / "generation_config.json").write_text("{bad")
    with pytest.raises(UserError, match=r"actor_rollout_ref.model.path: .*generation_config.json: not valid JSON"):
        PPOTrainer._eos_ids(_trainer_for_eos(d))


def test_trainer_generation_stops_at_the_second_eos(two_eos):
    ids = PPOTrainer._eos_ids(_trainer_for_eos(two_eos.dir))
    want = two_eos.free[:two_eos.j + 1]  # ends with the second EOS, which the response keeps (as the engine does)
    out = _sample(_engine_rollout(two_eos.engine), [two_eos.prompt], seed=0, eos_ids=ids, temperature=0)
    assert out.token_ids == [want] and out.finish_reasons == ["stop"] and len(out.logprobs[0]) == len(want)
    # The HF rollout (rollout.name=hf) gets the same list and stops at the same token.
    hf = NoCacheRollout(_Actor(two_eos.model), 0, 1, PeakMemory(CPU))
    out = _sample(hf, [two_eos.prompt], seed=0, eos_ids=ids, temperature=0)
    assert out.token_ids == [want] and out.finish_reasons == ["stop"]
    # The tokenizer's EOS alone (the old list) ran past it.
    out = _sample(_engine_rollout(two_eos.engine), [two_eos.prompt], seed=0, eos_ids=[TOKENIZER_EOS],
                  temperature=0)
    assert out.token_ids == [two_eos.free] and out.finish_reasons == ["length"]


def test_no_eos_anywhere_leaves_the_engine_its_model_default(tmp_path):
    d = tmp_path / "ckpt"
    _save(tiny_model(tiny_args("llama", eos_token_id=None)), d, eos_token=None)
    ids = PPOTrainer._eos_ids(_trainer_for_eos(d))
    assert ids == []
    engine = _RecordingEngine()
    _sample(_engine_rollout(engine), [[1, 2]], seed=0, eos_ids=ids)
    assert engine.calls[0][0].eos_token_id is None  # not [], which would disable EOS stopping
    assert engine.cache_inits == 1  # the pool sized before the call, where a too-small one is shared


# ---------------------------------------------------------------------------------------------- seeds
class _Captured(Exception):
    pass


def _step_seed(base: int, step: int) -> int:
    """The seed `PPOTrainer.step` passes for its rollout (run up to `_generate_all`)."""
    def generate_all(items, validate, seed):
        assert not validate
        raise _Captured(seed)

    fake = NS(global_step=step, ctx=NS(rank=0), loader=NS(next_batch=lambda: []), timer=Timer(CPU),
              _generate_all=generate_all, cfg=NS(trainer=NS(seed=base), algorithm=NS(filter_groups=NS(enable=False))))
    with pytest.raises(_Captured) as e:
        PPOTrainer.step(fake)
    return e.value.args[0]


def _validation_seeds(base: int, num_prompts: int, chunk: int) -> list[tuple[int, int]]:
    """(seed, chunk size) of every generate call of `PPOTrainer.validate`."""
    calls = []

    def generate_all(items, validate, seed):
        assert validate
        calls.append((seed, len(items)))
        return NS(responses=[], data_sources=[], ground_truths=[], extra_infos=[], prompts=[], uids=[], num_turns=None)

    tok = NS(clean_up_tokenization_spaces=True, batch_decode=lambda seqs, skip_special_tokens: ["" for _ in seqs])
    fake = NS(val_ds=[{} for _ in range(num_prompts)], timer=Timer(CPU), _generate_all=generate_all, tokenizer=tok,
              _score_spread=lambda ro, texts, with_extras=False: (torch.zeros(len(texts)), {}, {}), ctx=NS(is_main=True),
              global_step=0, log=print,
              cfg=NS(data=NS(val_batch_size=chunk),
                     trainer=NS(seed=base, validation_data_dir=None, log_val_generations=0)))
    PPOTrainer.validate(fake)
    return calls


def _engine_keys(seed: int, num_prompts: int, n: int, replicas: int) -> list[int]:
    """The sampler keys of every sample of one generation, over every replica: what each
    replica's `EngineRollout` passes to the engine, keyed as the engine keys its sequences."""
    keys = []
    for r in range(replicas):
        engine = _RecordingEngine()
        _sample(_engine_rollout(engine, r, replicas), [[1]] * num_prompts, seed=seed, n=n)
        for sp, offset, count in engine.calls:
            keys += [sequence_key(sp.seed, offset + i, k) for i in range(count) for k in range(sp.n)]
    return keys


@pytest.mark.parametrize("base", [0, 1, 7])
def test_training_noise_streams_are_distinct_over_steps_replicas_prompts_and_samples(base):
    prompts, n = 6, 3
    seeds = [_step_seed(base, t) for t in range(10)]
    for replicas in (1, 2, 3, 6):
        keys = [k for s in seeds for k in _engine_keys(s, prompts, n, replicas)]
        assert len(keys) == len(set(keys)) == 10 * prompts * n
        # A sample's stream is that of its global prompt index: the split over replicas does not change it.
        assert keys == [k for s in seeds for k in _engine_keys(s, prompts, n, 1)]
    # Validation chunks: distinct from each other and from the training steps'.
    val = [(s, k) for s, count in _validation_seeds(base, 7, 3) for k in _engine_keys(s, count, n, 2)]
    assert [s for s, _ in _validation_seeds(base, 7, 3)] == [derive_seed(base, 0), derive_seed(base, 3),
                                                            derive_seed(base, 6)]
    val_keys = [k for _, k in val]
    assert len(val_keys) == len(set(val_keys)) == 7 * n and not set(val_keys) & set(keys)


def test_hf_rollout_seeds_are_distinct_over_steps_and_replicas(monkeypatch):
    import trainer.hf_rollout

    seen = []
    monkeypatch.setattr(trainer.hf_rollout, "generate_no_cache",
                        lambda model, prompts, **kw: seen.append(kw["seed"]) or [])
    for t in range(10):
        for r in range(4):
            _sample(NoCacheRollout(_Actor(), r, 4, PeakMemory(CPU)), [[1]] * 8, seed=_step_seed(0, t))
    assert len(seen) == len(set(seen)) == 40


def test_replica_1_at_step_7_no_longer_replays_replica_0_at_step_8():
    """The repro (runs/dev/review_rollout/r6_seed_overlap.py) through the rollout phase: at a high
    temperature the tokens are the noise's, so a shared stream shows as equal responses."""
    engine = make_engine(tiny_model(tiny_args("qwen2")))
    pa, pb, px, py = prompts_of([6, 6, 5, 7], seed=9)
    s7, s8 = _step_seed(0, 7), _step_seed(0, 8)
    hot = dict(temperature=1e4, max_tokens=16)
    a = _sample(_engine_rollout(engine, 1, 2), [px, pa], seed=s7, **hot).token_ids[0]  # replica 1's prompt 0
    b = _sample(_engine_rollout(engine, 0, 2), [pb, py], seed=s8, **hot).token_ids[0]  # replica 0's prompt 0
    assert len(a) == len(b) == 16
    assert sum(x == y for x, y in zip(a, b)) <= 6  # was 16 / 16; independent streams agree on ~1 / 96
    # Replica 1's sample is the one a single replica draws for the same prompt of the batch.
    one = _sample(_engine_rollout(engine, 0, 1), [px, pa], seed=s7, **hot)
    assert one.token_ids[1] == a  # (samples prompt-major: prompt 1's is the second)


def test_a_multi_turn_replica_without_prompts_returns_nothing():
    """With fewer prompts than replicas a replica's share is empty: the single-turn branch returned [], the
    multi-turn one read its never-used engine's capture time and raised KeyError (and on a used engine
    re-counted the previous call's)."""
    from agent.loop import ToolAgent
    from tests.unit.test_engine import make_engine
    from trainer.rollout_phase import AgentRows

    loop = ToolAgent(None, [], response_length=8, max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                     max_tool_response_length=256, tool_response_truncate_side="middle", format="hermes")
    agent = AgentRows(loop, ["single_turn_agent"], [{}], [[{"role": "user", "content": "x"}]], [None])
    rollout = _engine_rollout(make_engine(tiny_model(tiny_args("qwen2"))), replica=0, replicas=2)
    outs = rollout.generate(prompts_of([5]), max_tokens=8, eos_ids=[], ignore_eos=False, seed=0, n=2,
                            temperature=1.0, top_p=1.0, top_k=-1, agent=agent)
    assert len(outs) == 0 and len(outs.token_ids) == len(outs.masks) == 0


def test_eos_ids_read_the_checkpoint_with_the_actors_override_config(two_eos, tmp_path):
    """A config.json whose rope type meshppo refuses (dynamic) is read with the actor's
    `override_config`, which replaces it (`rope_scaling: null`), as the models are built: reading
    the EOS ids without it stopped the run at start-up."""
    import shutil

    from trainer.errors import UserError

    d = tmp_path / "ckpt"
    shutil.copytree(two_eos.dir, d)
    config = json.loads((d / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    config.pop("rope_parameters", None)  # (transformers v5 would read the type from here)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="dynamic"):
        PPOTrainer._eos_ids(_trainer_for_eos(d))
    ids = PPOTrainer._eos_ids(_trainer_for_eos(d, {"rope_scaling": None}))
    assert ids == PPOTrainer._eos_ids(_trainer_for_eos(two_eos.dir))
