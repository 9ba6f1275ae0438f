"""Bad input: each case fails with a message naming the problem, a non-zero exit code and
no traceback, and nothing already written is lost (table-driven, in-process, world size 1)."""

import json
import os
import shutil

import pytest

from tests.e2e.conftest import demo_args, read_metrics
from trainer import cli

BASE = ["trainer.n_gpus_per_node=1", "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "trainer.logger=[jsonl]"]


def _run(args, capsys):
    code = cli.main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _write(path, text):
    path.write_text(text)
    return str(path)


def _reward_file(tmp_path, body):
    return _write(tmp_path / "reward.py", f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                          f"    {body}\n")


RETURN_STR = 'return "good"'

CASES = {
    "missing model dir": (lambda a, t: [f"actor_rollout_ref.model.path={t}/nope", f"data.tokenizer={a}/tokenizer"],
                          1, "does not exist"),
    "model dir without weights": (lambda a, t: [f"actor_rollout_ref.model.path={_no_weights(a, t)}"], 1,
                                  "has no *.safetensors weights"),
    "chat prompts without chat template": (lambda a, t: [f"data.tokenizer={_no_template(a, t)}"], 1,
                                           "chat template"),
    "empty dataset": (lambda a, t: [f"data.train_files=[{_write(t / 'empty.jsonl', '')}]"], 1, "empty.jsonl"),
    "malformed row": (lambda a, t: [f"data.train_files=[{_write(t / 'bad.jsonl', _first_row(a) + '{oops' + chr(10))}]"],
                      1, "bad.jsonl"),
    "overlong prompt, truncation=error": (lambda a, t: ["data.max_prompt_length=4", "data.filter_overlong_prompts=false",
                                                         "data.truncation=error"], 1, "max_prompt_length"),
    "reward function raises": (lambda a, t: [f"custom_reward_function.path={_reward_file(t, 'raise KeyError(1)')}"],
                               1, "reward.py:2: KeyError: 1"),
    "reward function returns a string": (lambda a, t: ["custom_reward_function.path=" + _reward_file(t, RETURN_STR)],
                                         1, "good"),
    "reward module not importable": (lambda a, t: ["custom_reward_function.path=pkg://no_such_reward_module"], 1,
                                     "custom reward module no_such_reward_module (pkg://no_such_reward_module) cannot "
                                     "be imported"),
    "resume path missing": (lambda a, t: ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={t}/ckpt"],
                            1, "does not exist"),
    "impossible batch sizes": (lambda a, t: ["data.train_batch_size=12"], 2, "ppo_mini_batch_size"),
    "launch unlike the config": (lambda a, t: ["trainer.n_gpus_per_node=2"], 2,
                                 "this launch has 1 process but the config describes"),
    "negative learning rate": (lambda a, t: ["actor_rollout_ref.actor.optim.lr=-1e-4"], 2,
                               "actor_rollout_ref.actor.optim.lr: -0.0001 is out of range; allowed: >= 0"),
    "batch larger than the data": (lambda a, t: ["data.train_batch_size=128", "actor_rollout_ref.actor.ppo_mini_batch_size=128"],
                                   2, "larger than the training set"),
    # a model directory without tokenizer files once loaded an empty tokenizer and failed at the first rollout
    "model dir without a tokenizer": (lambda a, t: [f"actor_rollout_ref.model.path={_model_copy(a, t, 'tokenizer*')}"],
                                      1, "holds no tokenizer"),
    "malformed config.json": (lambda a, t: [f"actor_rollout_ref.model.path={_model_copy(a, t, write={'config.json': '{bad'})}",
                                            f"data.tokenizer={a}/tokenizer"], 1, "config.json"),
    "truncated weights": (lambda a, t: [f"actor_rollout_ref.model.path={_model_copy(a, t, truncate='model.safetensors')}",
                                        f"data.tokenizer={a}/tokenizer"], 1, "is not a readable safetensors file"),
    "run directory is a file": (lambda a, t: [f"trainer.default_local_dir={_write(t / 'afile', '')}"], 2,
                                "trainer.default_local_dir="),
    "samples directory under a file": (lambda a, t: [f"trainer.rollout_data_dir={_write(t / 'bfile', '')}/samples"], 2,
                                       "trainer.rollout_data_dir="),
    # refused at load, naming the row, not after the first generation (a row without a ground truth once scored 0.0)
    "row without a ground truth": (lambda a, t: [f"data.train_files=[{_edited_rows(a, t, reward_model=None)}]"], 1,
                                   "edited.jsonl:3: missing field 'reward_model.ground_truth'"),
    "data source without a scorer": (lambda a, t: [f"data.train_files=[{_edited_rows(a, t, data_source='x/y')}]"], 1,
                                     "edited.jsonl:3: no built-in reward for data_source 'x/y' (built-in: "
                                     "['meshppo/demo_add', 'openai/gsm8k'])"),
    # a causal LM has no score head: as a reward model it would score every response 0
    "reward model without a score head": (lambda a, t: ["reward_model.enable=true", f"reward_model.model.path={a}/sft_model",
                                                        "reward_model.micro_batch_size_per_gpu=8"],
                                          1, "has no score head (score.weight)"),
    # damaged or mismatched model, tokenizer and adapter files: each was a traceback, some after the data loaded
    "tokenizer with more ids than the model embeds": (lambda a, t: [f"data.tokenizer={_added_tokens(a, t)}"], 1,
                                                      "(vocab_size)"),
    "truncated tokenizer.json": (lambda a, t: [f"data.tokenizer={_tokenizer_copy(a, t, 'tokenizer.json')}"], 1,
                                 "tokenizer.json' (data.tokenizer) is not a readable JSON file"),
    "tokenizer_config.json not JSON": (lambda a, t: [f"data.tokenizer={_tokenizer_copy(a, t, 'tokenizer_config.json')}"],
                                       1, "tokenizer_config.json' (data.tokenizer) is not a readable JSON file"),
    "index without a weight_map": (lambda a, t: [f"actor_rollout_ref.model.path={_model_copy(a, t, write=_NO_MAP)}"], 1,
                                   'model.safetensors.index.json\' has no "weight_map"'),
    "config.json with a string size": (lambda a, t: [f"actor_rollout_ref.model.path={_edited_config(a, t, hidden_size='32')}"],
                                       1, "Field 'hidden_size' expected int, got str"),
    "config.json with 0 heads": (lambda a, t: [f"actor_rollout_ref.model.path={_edited_config(a, t, num_attention_heads=0)}"],
                                 1, "config.json': num_attention_heads=0 is not a positive integer"),
    "truncated reward model": (lambda a, t: ["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=8",
                                             f"reward_model.model.path={_model_copy(a, t, truncate='model.safetensors')}"],
                               1, "is not a readable safetensors file"),
    "corrupt lora adapter": (lambda a, t: [f"actor_rollout_ref.model.lora_adapter_path={_adapter(a, t, corrupt=True)}"],
                             2, "adapter_model.safetensors' is not a readable safetensors file"),
    "lora adapter of another model": (lambda a, t: [f"actor_rollout_ref.model.lora_adapter_path={_adapter(a, t)}"], 2,
                                      "q_proj.lora_A has shape (4, 7), the model needs (4, "),
}
# cases that keep an earlier run's checkpoints under trainer.resume_mode=disable (which would delete them)
KEEPS_CHECKPOINTS = [
    "index without a weight_map", "config.json with a string size", "config.json with 0 heads", "truncated reward model",
    "truncated tokenizer.json", "tokenizer_config.json not JSON",
    "tokenizer with more ids than the model embeds",
    "corrupt lora adapter", "lora adapter of another model",
]
_NO_MAP = {"model.safetensors.index.json": '{"metadata": {}}'}


def _added_tokens(assets, tmp):
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(f"{assets}/tokenizer")
    tok.add_tokens([f"<extra_{i}>" for i in range(8)])
    tok.save_pretrained(tmp / "added_tokens")
    return tmp / "added_tokens"


def _tokenizer_copy(assets, tmp, truncate):
    d = tmp / "tokenizer_copy"
    shutil.copytree(f"{assets}/tokenizer", d)
    text = (d / truncate).read_text()
    (d / truncate).write_text(text[:len(text) // 2])
    return d


def _edited_config(assets, tmp, **change):
    d = _model_copy(assets, tmp)
    config = json.loads((d / "config.json").read_text())
    config.update(change)
    (d / "config.json").write_text(json.dumps(config))
    return d


def _adapter(assets, tmp, corrupt=False):
    """A peft adapter (r 4, q_proj) for the model's layers: A 7 columns wide (no model's), or not safetensors."""
    import torch
    from safetensors.torch import save_file

    layers = json.loads(open(f"{assets}/sft_model/config.json").read())["num_hidden_layers"]
    d = tmp / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"]}))
    if corrupt:
        (d / "adapter_model.safetensors").write_bytes(b"not a header")
        return d
    prefix = "base_model.model.model.layers.{}.self_attn.q_proj"
    save_file({f"{prefix.format(i)}.lora_{ab}.weight": torch.zeros(4, 7) for i in range(layers) for ab in "AB"},
              str(d / "adapter_model.safetensors"))
    return d


def _first_row(assets):
    with open(f"{assets}/train.jsonl") as f:
        return f.readline()


def _edited_rows(assets, tmp, **change):
    """The training file with row 3's fields replaced by `change` (None: the field removed)."""
    with open(f"{assets}/train.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows[2].update(change)
    rows[2] = {k: v for k, v in rows[2].items() if v is not None}
    return _write(tmp / "edited.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _no_weights(assets, tmp):
    d = tmp / "no_weights"
    shutil.copytree(f"{assets}/sft_model", d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    return d


def _model_copy(assets, tmp, remove=None, write=None, truncate=None):
    d = tmp / "model_copy"
    shutil.copytree(f"{assets}/sft_model", d)
    for f in d.glob(remove) if remove else []:
        f.unlink()
    for name, text in (write or {}).items():
        (d / name).write_text(text)
    if truncate:
        data = (d / truncate).read_bytes()
        (d / truncate).write_bytes(data[:100])
    return d


def _no_template(assets, tmp):
    d = tmp / "tok_no_template"
    shutil.copytree(f"{assets}/tokenizer", d)
    for f in d.glob("chat_template*"):
        f.unlink()
    cfg_file = d / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, tiny_assets, tmp_path, capsys):
    make, code, message = CASES[case]
    extra = make(tiny_assets, tmp_path)
    earlier = tmp_path / "run" / "checkpoints" / "global_step_1" / "earlier.txt"
    if case in KEEPS_CHECKPOINTS:
        earlier.parent.mkdir(parents=True)
        earlier.write_text("an earlier run's")
        extra = [*extra, "trainer.resume_mode=disable"]
    got, err = _run(demo_args(tiny_assets, tmp_path / "run", *BASE, *extra), capsys)
    assert got == code, err
    assert message in err, err
    if case in KEEPS_CHECKPOINTS:
        assert earlier.read_text() == "an earlier run's"


def test_resume_from_a_different_model_is_refused(tiny_assets, tmp_path, capsys):
    run = tmp_path / "run"
    code, err = _run(demo_args(tiny_assets, run, *BASE, "trainer.export_hf_at_end=false"), capsys)
    assert code == 0, err
    state_file = run / "checkpoints" / "global_step_1" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["model"]["hidden_size"] += 32  # as if written by a wider model
    state_file.write_text(json.dumps(state))
    before = sorted(os.listdir(run / "checkpoints"))
    code, err = _run(demo_args(tiny_assets, run, *BASE, "trainer.total_training_steps=2"), capsys)
    assert code == 1 and "belongs to a different model" in err, err
    assert sorted(os.listdir(run / "checkpoints")) == before  # nothing written or removed


def test_greedy_rollouts_are_scored_at_temperature_one(tiny_assets, tmp_path, capsys):
    """rollout.temperature=0 (n=1, no groups) once divided by zero in the LM head; it means greedy
    decoding scored at temperature 1: the actor's log-probs of the greedy tokens are the engine's,
    which it reports of softmax(logits) (float32 on CPU: they agree to rounding; scored at another
    temperature they would be O(1) apart)."""
    run = tmp_path / "temperature_0"
    code, err = _run(demo_args(tiny_assets, run, *BASE, "algorithm.adv_estimator=reinforce_plus_plus",
                               "actor_rollout_ref.rollout.n=1", "trainer.total_training_steps=2",
                               "trainer.export_hf_at_end=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                               "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.calculate_log_probs=true"),
                     capsys)
    assert code == 0, err
    rows = read_metrics(run)
    assert len(rows) == 2 and all(abs(r["actor/pg_loss"]) < float("inf") for r in rows)
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows), [r["rollout/logprob_diff"] for r in rows]


def test_rows_without_a_ground_truth_train_with_a_custom_reward_function(tiny_assets, tmp_path, capsys):
    """Only the built-in scorers need `reward_model.ground_truth`: a custom function (a length or
    format reward) gets None for rows without one, as verl's managers pass it (such rows were refused
    at load); the built-in scorer still refuses them (the bad-input case above)."""
    with open(f"{tiny_assets}/train.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for i, row in enumerate(rows):  # absent, null, and a reward_model without the key
        row["reward_model"] = [None, {"ground_truth": None}, {"style": "rule"}][i % 3]
        row = {k: v for k, v in row.items() if v is not None}
        rows[i] = row
    data = _write(tmp_path / "no_truth.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    seen = tmp_path / "seen.txt"
    reward = _write(tmp_path / "length_reward.py",
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    f"    open({str(seen)!r}, 'a').write(repr(ground_truth) + '\\n')\n"
                    "    return len(solution_str) / 10\n")
    code, err = _run(demo_args(tiny_assets, tmp_path / "run", *BASE, f"data.train_files=[{data}]",
                               f"custom_reward_function.path={reward}", "trainer.export_hf_at_end=false"), capsys)
    assert code == 0, err
    assert set(seen.read_text().split()) == {"None"}
