"""Does the policy improve? A learning benchmark on one GPU: multi-digit addition, a 73M-parameter
Qwen2-shaped model warmed up from scratch, then GRPO, PPO (critic + GAE) and RLOO through the
trainer's own step.

    python bench/learn.py --warmup-only                      # build (or reuse) the warm-up checkpoint
    python bench/learn.py --runs grpo:0,grpo:1,grpo:2        # RL runs: ALGORITHM:SEED (grpo, ppo, rloo)
    python bench/learn.py --runs ppo:0,rloo:0                # more runs into the same --out
    python bench/learn.py --runs grpo:0,ppo:0 --budget-minutes 8.5   # only the runs that fit (device calls)
    python bench/learn.py --summarize                        # summary.json + PNG curves of every run in --out
                                                             # (with bench/learn_trl.py's trl.json: the comparison)
    python bench/learn.py --tiny ...                         # a tiny model and task: checks the wiring on a CPU
    python bench/learn.py --runs grpo:0 --trainer-override actor_rollout_ref.actor.use_torch_compile=true
                                                             # any trainer option (kept in the run's record)
    python bench/learn.py --task worked --runs grpo:0,grpo:1,grpo:2   # the worked task (its own warm-up
    python bench/learn.py --task worked --summarize          # and --out, runs/learn/out_worked)

The task (`data.arith`, `--task sum`, the default): `a+b=` with 3-digit operands written with 3
digits (`007+358=`), answered by the sum written with 4 (`0365`) and scored by exact match
(`rewards/arith.py`). The supervised warm-up imitates a demonstrator who, on 70 % of the
problems, forgets every carry between columns; after it the model's greedy answer to a problem
with such a carry (70 % of them) is the slip, while about 30 % of its samples are right: greedy
validation accuracy starts near 0.3 with room to reach 1.

`--task worked`: the same problems at 4 digits (`WORKED`'s defaults), answered with the work
column by column, units first, then the sum, 41 characters (42 tokens with EOS):

    4728+1196=  ->  8+6+0=14 2+9+1=12 7+1+1=09 4+1+0=05=05924

and scored on the sum after the last `=` alone. The demonstrator who forgets writes every carry
into a column as 0 (`...7+1+0=08 4+1+0=05=05814`); 83 % of 4-digit problems have a carry to
forget, so greedy accuracy starts near 0.17. Why a second task: the sum's answers are 5 tokens,
so an RL step is mostly per-step fixed cost on either framework and a fast rollout engine has
nothing to win; answers of 42 tokens make generation (42 decoding steps a rollout) the part of a
step that grows, and the wall-clock comparison with TRL (`generate`) measures it.

The warm-up draws fresh problems every step (never a validation one), runs once per settings and
is saved as a Hugging Face directory `WORK/warmup-<hash>/` (config, safetensors, tokenizer, the
prompt files, `warmup.json`), the hash covering every setting it depends on (the task too, except
the first task, `sum`, whose checkpoints keep the names they had): later calls, other runs and
TRL (`bench/learn_trl.py`) load the same one. `--max-response-length` defaults to the task's
answer + EOS + 3 tokens (8 for the 3-digit sum, 45 worked at 4 digits); shorter is an error.

Each RL run (`OUT/<algorithm>_<seed>.json`) evaluates on 512 held-out problems every
`--eval-every` steps: greedy accuracy (`val-core/meshppo/add_carry/acc/greedy`; `add_carry_worked`
for the worked task) and the mean accuracy of `--eval-n` samples per prompt at the training
temperature (verl's `val-core/meshppo/add_carry/acc/mean@N`), with the step's KL to the reference
(`actor/ref_kl`, k3), training reward and response length; `train_wall_s` counts the training
steps only (evaluation and set-up excluded). A run stops after `--steps` steps or
`--max-minutes` of training, whichever comes first. Every run uses the same prompts per step,
samples per prompt, mini-batches, learning rate and KL loss coefficient, so runs and TRL compare
at equal samples; give `bench/learn_trl.py` the same `--eval-every` (the default is the same),
and `--summarize` reads the wall-clock to a level on both sides at the sample counts where both
evaluated (`compare`), so neither is seen reaching it sooner for being evaluated more often.

The trainer runs as `train_ppo.py` would with the overrides of `overrides_for`, which include
verl's rollout-correction bypass mode (the engine's sampling log-probs serve as the old
log-probs; no recompute pass) and a reference kept gathered between forwards; a
`--trainer-override` comes after them (`algorithm.rollout_correction.bypass_mode=false` puts the
recompute pass back).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import git_commit, hardware  # noqa: E402
from data.arith import (TASKS, data_source, has_forgotten_carry, make_rows, operands, problem,  # noqa: E402
                        response, response_chars)

ALGORITHMS = {"grpo": "grpo", "ppo": "gae", "rloo": "rloo"}  # run name -> algorithm.adv_estimator
TARGET_GAIN = 0.3
ROOM = 3  # response tokens allowed past the answer + EOS (a model may ramble), unless --max-response-length


def greedy_key(task: str = "sum") -> str:
    """The record key of greedy validation accuracy (verl's name) for `task`'s data source."""
    return f"val-core/{data_source(task)}/acc/greedy"


def mean_at(n: int, task: str = "sum") -> str:
    """The record key of verl's mean@N validation accuracy for `task`'s data source."""
    return f"val-core/{data_source(task)}/acc/mean@{n}"


GREEDY = greedy_key("sum")


def task_of(rec: dict) -> str:
    """A run record's task (records written before `task` existed are the `sum` task's)."""
    return rec.get("settings", {}).get("task", "sum")


@dataclass
class Settings:
    """Everything a run depends on. The `WARMUP_FIELDS` name the warm-up checkpoint (`warmup_hash`).
    The defaults are the `sum` task's; `--task worked` on the command line also sets `WORKED`'s."""

    task: str = "sum"               # answer format (data.arith.TASKS): "sum" (0365) or "worked" (work, then sum)
    digits: int = 3                 # operands in [0, 10**digits)
    n_train: int = 20000            # RL training prompts (the warm-up draws its own problems)
    n_val: int = 512                # held-out prompts (never drawn by the warm-up)
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 2
    intermediate: int = 2048
    init_std: float = 0.02
    slip: float = 0.7               # share of demonstrations that forget every carry
    warmup_steps: int = 3000
    warmup_batch: int = 256
    warmup_lr: float = 5e-4
    seed: int = 0                   # data, initialisation and warm-up batches
    prompts: int = 64               # RL prompts per step (data.train_batch_size)
    n: int = 8                      # samples per prompt
    mini_batch: int = 32            # prompts per optimizer step
    epochs: int = 1
    lr: float = 2e-5
    critic_lr: float = 1e-4
    kl_coef: float = 0.01           # k3 (low_var_kl) KL loss coefficient; TRL's beta
    clip_ratio: float = 0.2
    grad_clip: float = 1.0
    temperature: float = 1.0
    max_response_length: int = 0    # 0: derived, the task's answer + EOS + ROOM (8 for the 3-digit sum)
    steps: int = 300
    max_minutes: float = 2.0        # training wall-clock per run, evaluation excluded
    eval_every: int = 10            # steps between evaluations: meshppo's runs and TRL's alike
    eval_n: int = 8

    WARMUP_FIELDS = ("digits", "n_train", "n_val", "hidden", "layers", "heads", "kv_heads", "intermediate",
                     "init_std", "slip", "warmup_steps", "warmup_batch", "warmup_lr", "seed", "task")

    def __post_init__(self):
        def bad(option: str, why: str):
            raise ValueError(f"bad setting --{option.replace('_', '-')}={getattr(self, option)!r}: {why}")

        if self.task not in TASKS:
            bad("task", f"one of {', '.join(TASKS)}")
        if self.digits < 1:
            bad("digits", "must be >= 1")
        need = self.answer_tokens
        if self.max_response_length == 0:
            self.max_response_length = need + ROOM
        checks = {"slip": (0 <= self.slip <= 1, "must be in [0, 1]"),
                  "n": (self.n >= 2, "must be >= 2 (group baselines need 2 samples per prompt)"),
                  "prompts": (self.prompts % self.mini_batch == 0,
                              f"must be a multiple of --mini-batch ({self.mini_batch})"),
                  "eval_n": (self.eval_n >= 1, "must be >= 1"),
                  "n_train": (self.n_train + self.n_val <= 10 ** (2 * self.digits),
                              f"with --n-val {self.n_val}, more than the 100**{self.digits} distinct problems"),
                  "eval_every": (self.eval_every >= 1, "must be >= 1"), "steps": (self.steps >= 1, "must be >= 1")}
        checks["max_response_length"] = (
            need <= self.max_response_length <= self.context - self.prompt_tokens,
            f"the {self.task} task's answers at --digits {self.digits} take {need} tokens (EOS included) and the "
            f"warm-up model's context is {self.context} positions, {self.prompt_tokens} of them the prompt: "
            f"give {need} to {self.context - self.prompt_tokens}, or leave it out for {need + ROOM}")
        for option, (ok, why) in checks.items():
            if not ok:
                bad(option, why)

    @property
    def answer_tokens(self) -> int:
        """Tokens of every answer of the task, EOS included (5 for the 3-digit sum, 42 worked at 4 digits)."""
        return response_chars(self.digits, self.task) + 1

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every chat-formatted prompt: `<|user|>`, `a+b=` (2 * digits + 2), `<|assistant|>`."""
        return 2 * self.digits + 4

    @property
    def context(self) -> int:
        """The warm-up model's `max_position_embeddings` (the engine's longest sequence): the least
        multiple of 64 that holds a prompt, its answer + EOS and ROOM (64 for every task of <= 4 digits)."""
        return 64 * math.ceil((self.prompt_tokens + self.answer_tokens + ROOM) / 64)

    def warmup_hash(self) -> str:
        fields = {k: getattr(self, k) for k in self.WARMUP_FIELDS}
        if fields["task"] == "sum":  # the first task: its checkpoints were named before `task` existed
            del fields["task"]
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


# A model and batch small enough for a CPU (the tests, a first check of the wiring), either task.
TINY = dict(digits=2, n_train=2000, n_val=64, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
            init_std=0.1, warmup_steps=200, warmup_batch=64, warmup_lr=3e-3, prompts=8, n=4, mini_batch=4,
            lr=1e-4, critic_lr=1e-3, steps=2, eval_every=1, eval_n=2)

# What `--task worked` sets on the GPU unless an option says otherwise (the rest as for `sum`).
# 4 digits: answers of 41 characters + EOS (a response length of 45 with ROOM) after 12-token
# prompts, 54-token warm-up sequences where the sum's are 15. A problem is carry-free with
# probability 0.55**3 = 0.17: the greedy accuracy the warm-up leaves (no `slip` above 0.5 moves
# it, see data/arith.py), below the sum task's 0.30, so more headroom; `slip` stays 0.7, so a
# carry problem is sampled right about 30 % of the time, as in the sum task. The warm-up: 1,000
# steps of 192 sequences, 10.4M tokens where the sum's 3,000 of 256 are 11.5M, so at most the
# sum's 241 s on an H200 if the time grew with tokens (it grows less: a step of these short
# sequences is mostly fixed cost). The format is learnt fast: a 0.8M-parameter model on a CPU
# is at the loss floor of the slip's coin after 500 steps of 64 and after 1,500 of them starts
# where RL should (greedy 0.16, right on every carry-free problem, the slip on every carry
# problem, a right sample on one with probability 0.35).
WORKED = dict(digits=4, warmup_steps=1000, warmup_batch=192)


# --------------------------------------------------------------------------- the warm-up
@dataclass
class Warmup:
    """A warm-up checkpoint directory: the model (Hugging Face), its tokenizer, the prompt files."""

    dir: Path

    @property
    def train_file(self) -> str:
        return str(self.dir / "train.jsonl")

    @property
    def val_file(self) -> str:
        return str(self.dir / "val.jsonl")

    @property
    def stats(self) -> dict:
        return json.loads((self.dir / "warmup.json").read_text())

    @property
    def summary(self) -> dict:
        """What a run record keeps of it: the diagnostics, hash and weights checksum, not the loss curve."""
        return {"dir": str(self.dir), **{k: v for k, v in self.stats.items() if k not in ("loss_history", "settings")}}


def model_args(s: Settings, tokenizer):
    from models import ModelArgs

    return ModelArgs(vocab_size=(len(tokenizer) + 7) // 8 * 8, hidden_size=s.hidden, intermediate_size=s.intermediate,
                     num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                     max_position_embeddings=s.context, model_type="qwen2", attention_bias=True,
                     tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, bos_token_id=1, initializer_range=s.init_std)


class Encoder:
    """Token ids of the task's prompts and answers, in batches. A prompt is rendered as the
    trainer's dataset renders a chat prompt (the chat template with the generation prompt, then
    tokenized without special tokens). The template is rendered once with a NUL character as the
    user message, and each problem is substituted for it, since a warm-up step encodes hundreds
    of problems."""

    def __init__(self, tokenizer, digits: int, task: str = "sum"):
        self.tokenizer, self.digits, self.task = tokenizer, digits, task
        self.template = tokenizer.apply_chat_template([{"role": "user", "content": "\0"}], add_generation_prompt=True,
                                                      tokenize=False)

    def prompts(self, pairs: list[tuple[int, int]]) -> list[list[int]]:
        texts = [self.template.replace("\0", problem(a, b, self.digits)) for a, b in pairs]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def responses(self, pairs: list[tuple[int, int]], forget: list[bool]) -> list[list[int]]:
        """The demonstrator's answer in the task's format + EOS for each pair: right, or with
        every carry forgotten where `forget` says so (`data.arith.response`)."""
        texts = [response(a, b, self.digits, self.task, f) for (a, b), f in zip(pairs, forget, strict=True)]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [x + [self.tokenizer.eos_token_id] for x in ids]


@torch.no_grad()
def teacher_forced(model, prompts: list[list[int]], answers: list[list[int]], device, batch: int = 512):
    """Per answer: whether greedy decoding reproduces it exactly (every answer token, EOS
    included, is the argmax after the right prefix) and its log-probability under the model."""
    from trainer.forward import build_micro_batch

    greedy, logp = [], []
    for s in range(0, len(prompts), batch):
        mb = build_micro_batch(prompts[s:s + batch], answers[s:s + batch], device, packed=False)
        logits = model(mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask).float()
        logits = logits.reshape(-1, logits.shape[-1])[mb.src_index]
        labels = mb.src_labels
        token_lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
        wrong = (logits.argmax(-1) != labels).long()
        zeros = torch.zeros(mb.batch_size, device=device)
        greedy += (zeros.index_add(0, mb.dst_row, wrong.float()) == 0).tolist()
        logp += zeros.index_add(0, mb.dst_row, token_lp).tolist()
    return greedy, logp


def warmup_diagnostics(model, tokenizer, val_rows: list[dict], digits: int, device, task: str = "sum") -> dict:
    """What RL starts from, on the validation prompts: greedy accuracy, the probability of a right
    sample (the limit of mean@N), and the share of carry problems whose greedy answer is the slip.
    In the worked format "right" is the whole right derivation (a right sum after other work
    also scores: the reward's accuracy can only be higher), "the slip" the demonstrator's."""
    pairs = [operands(r) for r in val_rows]
    enc = Encoder(tokenizer, digits, task)
    prompts = enc.prompts(pairs)
    right_greedy, right_lp = teacher_forced(model, prompts, enc.responses(pairs, [False] * len(pairs)), device)
    slip_greedy, _ = teacher_forced(model, prompts, enc.responses(pairs, [True] * len(pairs)), device)
    carry = [has_forgotten_carry(a, b, digits if task == "worked" else None) for a, b in pairs]
    n_carry = max(sum(carry), 1)
    return {"greedy_acc": sum(right_greedy) / len(pairs),
            "p_right_sample": sum(math.exp(x) for x in right_lp) / len(pairs),
            "p_right_sample_carry": sum(math.exp(x) for x, c in zip(right_lp, carry) if c) / n_carry,
            "greedy_slip_on_carry": sum(g for g, c in zip(slip_greedy, carry) if c) / n_carry,
            "greedy_acc_no_carry": sum(g for g, c in zip(right_greedy, carry) if not c) / max(len(pairs) - n_carry, 1),
            "carry_share": sum(carry) / len(pairs)}


def build_warmup(s: Settings, work: Path, device, log=print) -> Warmup:
    """The warm-up checkpoint for `s` under `work`, trained now unless a complete one is there."""
    out = Warmup(work / f"warmup-{s.warmup_hash()}")
    if (out.dir / "warmup.json").is_file():
        log(f"warm-up: reusing {out.dir}")
        return out
    from data.dataset import write_jsonl
    from data.demo import build_demo_tokenizer
    from models import Transformer

    t0 = time.time()
    tmp = out.dir.with_name(out.dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_demo_tokenizer(tmp)
    train_rows = make_rows(s.n_train, s.digits, seed=s.seed, split="train", task=s.task)
    val_rows = make_rows(s.n_val, s.digits, seed=s.seed + 1, split="val",
                         exclude={operands(r) for r in train_rows}, task=s.task)
    write_jsonl(train_rows, tmp / "train.jsonl")
    write_jsonl(val_rows, tmp / "val.jsonl")
    model = Transformer.build(model_args(s, tokenizer), device=device, seed=s.seed)
    # Deterministic kernels: a device call that finds no checkpoint (a fresh machine) rebuilds the
    # same weights, so runs made in different calls still start from one checkpoint (the record's
    # `weights_sha1` shows it). fp32 weights, TF32 matmuls: no mixed-precision path to get right.
    # The math SDPA backend: its backward is matmuls, deterministic (these sequences are 15 tokens,
    # 54 in the 4-digit worked task).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with sdpa_kernel(SDPBackend.MATH):
            history = supervised_warmup(model, tokenizer, s, {operands(r) for r in val_rows}, device, log)
    finally:
        torch.use_deterministic_algorithms(False)
    stats = warmup_diagnostics(model, tokenizer, val_rows, s.digits, device, s.task)
    model.save_pretrained(tmp)
    stats.update(settings={k: getattr(s, k) for k in s.WARMUP_FIELDS}, task=s.task, hash=s.warmup_hash(),
                 weights_sha1=hashlib.sha1((tmp / "model.safetensors").read_bytes()).hexdigest()[:12],
                 params=model.args.num_params(), seconds=time.time() - t0, loss_history=history,
                 device=str(device), commit=git_commit())
    (tmp / "warmup.json").write_text(json.dumps(stats, indent=1))
    shutil.rmtree(out.dir, ignore_errors=True)
    os.replace(tmp, out.dir)
    log(f"warm-up: {s.warmup_steps} steps in {stats['seconds']:.0f}s; validation greedy accuracy "
        f"{stats['greedy_acc']:.3f}, right-sample probability {stats['p_right_sample']:.3f} "
        f"({stats['p_right_sample_carry']:.3f} on carry problems, whose greedy answer is the slip "
        f"{stats['greedy_slip_on_carry']:.1%} of the time) -> {out.dir}")
    return out


def supervised_warmup(model, tokenizer, s: Settings, held_out: set, device, log=print) -> list:
    """`warmup_steps` AdamW steps of teacher-forced cross-entropy on `answer + EOS` after fresh
    chat-formatted problems (none in `held_out`), where the answer, in the task's format, forgets
    every carry (`data.arith.response(..., forget=True)`) with probability `slip`, else is right.
    Linear warm-up over 5 % of the steps, cosine decay to a tenth. Returns `[step, loss]` every
    100 steps."""
    import torch.nn.functional as F

    from trainer.forward import build_micro_batch

    rng = random.Random(s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.warmup_lr, weight_decay=0.0, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    ramp = max(s.warmup_steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / ramp) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(k, s.warmup_steps) / s.warmup_steps))))
    top = 10 ** s.digits
    history = []
    enc = Encoder(tokenizer, s.digits, s.task)
    for step in range(1, s.warmup_steps + 1):
        pairs = []
        while len(pairs) < s.warmup_batch:
            pair = (rng.randrange(top), rng.randrange(top))
            if pair not in held_out:
                pairs.append(pair)
        prompts = enc.prompts(pairs)
        answers = enc.responses(pairs, [rng.random() < s.slip for _ in pairs])
        mb = build_micro_batch(prompts, answers, device, packed=False)
        logits = model(mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1])[mb.src_index].float(),
                               mb.src_labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == s.warmup_steps:
            history.append([step, loss.item()])
            if step % 500 == 0:
                log(f"warm-up step {step}: loss {history[-1][1]:.4f}")
    return history


def warmup_problem(stats: dict) -> str | None:
    """Why RL from this warm-up would not measure learning (None: it is the intended start): the
    model must add (greedy right on problems without a carry), imitate the slip greedily on carry
    problems (the headroom) and still sample the right answer to them now and then."""
    if stats["greedy_acc_no_carry"] < 0.8:
        return f"greedy accuracy on problems without a carry is {stats['greedy_acc_no_carry']:.2f} (< 0.8): it cannot add"
    if stats["greedy_slip_on_carry"] < 0.5:
        return (f"its greedy answer to carry problems is the slip only {stats['greedy_slip_on_carry']:.0%} of the time "
                "(< 50 %): no headroom to measure")
    if stats["p_right_sample_carry"] < 0.05:
        return (f"it samples the right answer to a carry problem with probability {stats['p_right_sample_carry']:.3f} "
                "(< 0.05): exact-match RL would rarely see a reward")
    return None


# --------------------------------------------------------------------------- the trainer
class MeshppoRun:
    """The one place this benchmark drives the trainer (ppo/): a `PPOTrainer` built from dotted
    overrides, as `train_ppo.py` builds it, stepped with `step()`; evaluation through its own
    `validate()` with `rollout.val_kwargs` set per call, reading the samples it dumps to
    `trainer.validation_data_dir`. The trainer's `train()` loop is not used: the benchmark needs
    evaluation at its own points and a wall-clock budget."""

    def __init__(self, overrides: list[str]):
        from trainer.config import PPOConfig
        from trainer.configlib import load_config
        from trainer.launch import init_distributed
        from trainer.ppo_trainer import PPOTrainer

        cfg = load_config(PPOConfig, None, overrides)
        self.trainer = PPOTrainer(cfg, init_distributed(cfg.trainer.device))
        self.dump_dir = cfg.trainer.validation_data_dir

    def step(self) -> dict:
        return self.trainer.step()

    def samples(self, n: int, temperature: float) -> list[dict]:
        """One validation pass: `n` samples per prompt at `temperature` (0: greedy), as rows
        with `input`, `output` and `score`, prompt-major."""
        rollout = self.trainer.cfg.actor_rollout_ref.rollout
        rollout.val_kwargs = dataclasses.replace(rollout.val_kwargs, n=n, do_sample=temperature > 0,
                                                 temperature=temperature)
        self.trainer.validate()
        path = os.path.join(self.dump_dir, f"{self.trainer.global_step}.jsonl")
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        os.remove(path)
        return rows

    def close(self):
        del self.trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def overrides_for(algorithm: str, seed: int, s: Settings, warm: Warmup, run_dir: Path, device: str) -> list[str]:
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    budget = 65536  # tokens per micro-batch: a whole mini-batch of these short sequences in one
    ov = [f"data.train_files=[{warm.train_file}]", f"data.val_files=[{warm.val_file}]",
          f"data.max_prompt_length={2 * s.digits + 4}", f"data.max_response_length={s.max_response_length}",
          f"data.train_batch_size={s.prompts}", "data.shuffle=true", f"data.seed={seed}",
          f"actor_rollout_ref.model.path={warm.dir}",
          f"{actor}.ppo_mini_batch_size={s.mini_batch}", f"{actor}.ppo_epochs={s.epochs}",
          f"{actor}.use_dynamic_bsz=true", f"{actor}.ppo_max_token_len_per_gpu={budget}",
          f"{actor}.use_kl_loss=true", f"{actor}.kl_loss_type=low_var_kl", f"{actor}.kl_loss_coef={s.kl_coef}",
          f"{actor}.loss_agg_mode=token-mean", f"{actor}.entropy_coeff=0", f"{actor}.clip_ratio={s.clip_ratio}",
          f"{actor}.grad_clip={s.grad_clip}", f"{actor}.optim.lr={s.lr}", f"{actor}.optim.weight_decay=0.0",
          f"{rollout}.n={s.n}", f"{rollout}.temperature={s.temperature}",
          f"{rollout}.log_prob_use_dynamic_bsz=true", f"{rollout}.log_prob_max_token_len_per_gpu={budget}",
          "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
          f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
          f"{rollout}.gpu_memory_utilization=0.3",
          # one engine wave for a step's 512 samples and 1024 of the 4096 validation samples; a few
          # decode graphs (captured at every trainer build) instead of the 130-size default ladder
          f"{rollout}.max_num_seqs=1024", f"{rollout}.max_num_batched_tokens=16384",
          f"{rollout}.cudagraph_capture_sizes=[8,32,128,256,512,1024]",
          # The engine's log-probs are the old log-probs (verl's bypass mode): no recompute pass.
          "algorithm.rollout_correction.bypass_mode=true",
          # A 73M reference on one GPU: keep it gathered between forwards (no per-step gather).
          "actor_rollout_ref.ref.fsdp_config.reshard_after_forward=false",
          f"algorithm.adv_estimator={ALGORITHMS[algorithm]}", "algorithm.norm_adv_by_std_in_grpo=true",
          "algorithm.kl_guard.enable=false",
          f"custom_reward_function.path={ROOT / 'rewards' / 'arith.py'}",
          f"trainer.default_local_dir={run_dir}", f"trainer.validation_data_dir={run_dir / 'val'}",
          f"trainer.total_training_steps={s.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
          "trainer.save_freq=-1", "trainer.export_hf_at_end=false", "trainer.logger=[jsonl]",
          "trainer.resume_mode=disable", f"trainer.seed={seed}", "trainer.n_gpus_per_node=1",
          f"trainer.device={device}"]
    if algorithm == "ppo":
        ov += [f"critic.optim.lr={s.critic_lr}", "critic.optim.weight_decay=0.0", "critic.use_dynamic_bsz=true",
               f"critic.ppo_max_token_len_per_gpu={budget}", f"critic.forward_max_token_len_per_gpu={budget}",
               f"critic.grad_clip={s.grad_clip}"]
    if device == "cpu":  # the demo's CPU settings: fp32 throughout
        for part in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"):
            ov += [f"{part}.fsdp_config.model_dtype=fp32", f"{part}.fsdp_config.mixed_precision.param_dtype=fp32",
                   f"{part}.fsdp_config.mixed_precision.reduce_dtype=fp32"]
    return ov


# --------------------------------------------------------------------------- metrics
def val_metrics(greedy_rows: list[dict], sampled_rows: list[dict], n: int, task: str = "sum") -> dict:
    """Greedy accuracy and verl's mean@N (per prompt, the mean score of its N samples; then the
    mean over prompts) from validation rows (`input`, `output`, `score`; N rows per prompt, in
    any order), and the mean sampled response length in characters (EOS not counted); keyed by
    `task`'s data source."""
    per_prompt: dict[str, list[float]] = {}
    for r in sampled_rows:
        per_prompt.setdefault(r["input"], []).append(float(r["score"]))
    counts = {len(v) for v in per_prompt.values()}
    if counts != {n}:
        raise ValueError(f"mean@{n} needs {n} samples per prompt, got counts {sorted(counts)}")
    return {greedy_key(task): sum(float(r["score"]) for r in greedy_rows) / len(greedy_rows),
            mean_at(n, task): sum(sum(v) / n for v in per_prompt.values()) / len(per_prompt),
            "val/response_length_chars": sum(len(r["output"]) for r in sampled_rows) / len(sampled_rows)}


STEP_KEYS = {"reward": "critic/score/mean", "kl": "actor/ref_kl", "response_length": "response_length/mean"}


def rl_run(spec: str, s: Settings, warm: Warmup, out: Path, device: str, log=print,
           trainer_overrides: tuple[str, ...] = ()) -> dict:
    """One RL run `ALGORITHM:SEED`: its record, written to `OUT/<algorithm>_<seed>.json` after every
    evaluation (`complete: false` until the run ends, so a call stopped by its time limit still
    leaves the curve so far); the trainer's own directory is `WORK/runs/<algorithm>_<seed>`.
    `trainer_overrides` (dotted config keys, e.g. `actor_rollout_ref.actor.use_torch_compile=true`)
    come last and are kept in the record."""
    algorithm, seed = parse_run(spec)
    name = f"{algorithm}_{seed}"
    run_dir = warm.dir.parent / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    run = MeshppoRun(overrides_for(algorithm, seed, s, warm, run_dir, device) + list(trainer_overrides))
    setup_s = time.perf_counter() - t0
    samples_per_step = s.prompts * s.n
    steps, points = [], []
    train_s, last = 0.0, {}

    def record(complete: bool) -> dict:
        rec = {"benchmark": "learn", "framework": "meshppo", "run": name, "algorithm": algorithm, "seed": seed,
               "complete": complete, "settings": dataclasses.asdict(s),
               "trainer_overrides": list(trainer_overrides), "warmup": warm.summary,
               "samples_per_step": samples_per_step, "setup_s": setup_s, "train_wall_s": train_s,
               "wall_s": time.perf_counter() - t0, "points": points, "steps": steps,
               **gain(points, greedy_key(s.task)),
               "hardware": hardware(), "commit": git_commit()}
        write_json(out / f"{name}.json", rec)
        return rec

    def evaluate(step: int):
        t = time.perf_counter()
        m = val_metrics(run.samples(1, 0.0), run.samples(s.eval_n, s.temperature), s.eval_n, s.task)
        point = {"step": step, "samples": step * samples_per_step, "train_wall_s": train_s, **m,
                 **{k: last.get(k) for k in STEP_KEYS}, "eval_s": time.perf_counter() - t}
        points.append(point)
        log(f"[{name}] step {step:4d} ({train_s:6.1f}s): greedy {m[greedy_key(s.task)]:.3f}  mean@{s.eval_n} "
            f"{m[mean_at(s.eval_n, s.task)]:.3f}  reward {last.get('reward', float('nan')):.3f}  "
            f"kl {last.get('kl', float('nan')):.4f}")
        record(complete=False)

    evaluate(0)
    step = 0
    while step < s.steps and train_s < s.max_minutes * 60:
        t = time.perf_counter()
        metrics = run.step()
        train_s += time.perf_counter() - t
        step += 1
        last = {k: float(metrics[v]) for k, v in STEP_KEYS.items() if v in metrics}
        # the trainer's phase times: where a step goes (generation, log-prob passes, update, ...)
        phases = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if k.startswith("timing_s/")}
        steps.append({"step": step, "samples": step * samples_per_step, "train_wall_s": train_s, **last,
                      "step_s": metrics.get("timing_s/step"), "phases_s": phases})
        if step % s.eval_every == 0 or step == s.steps:
            evaluate(step)
    if points[-1]["step"] != step:
        evaluate(step)
    run.close()
    return record(complete=True)


def gain(points: list[dict], metric: str = GREEDY) -> dict:
    first, final = points[0][metric], points[-1][metric]
    return {"greedy_start": first, "greedy_end": final, "greedy_gain": final - first,
            "reached_target": final - first >= TARGET_GAIN}


def parse_run(spec: str) -> tuple[str, int]:
    algorithm, _, seed = spec.partition(":")
    if algorithm not in ALGORITHMS or not seed.isdigit():
        raise ValueError(f"bad run {spec!r}: write ALGORITHM:SEED with ALGORITHM one of {sorted(ALGORITHMS)}, "
                         "e.g. grpo:0")
    return algorithm, int(seed)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- summary, comparison, curves
def load_records(out: Path) -> list[dict]:
    records = []
    for p in sorted(out.glob("*.json")):
        rec = json.loads(p.read_text())
        if rec.get("benchmark") == "learn":
            records.append(rec)
    return records


def accuracy_at(points: list[dict], x: float, key: str = "samples", metric: str = GREEDY) -> float | None:
    """`metric` linearly interpolated at `x` along `key`; None outside the measured range."""
    for a, b in zip(points, points[1:]):
        if a[key] <= x <= b[key]:
            w = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return a[metric] + w * (b[metric] - a[metric])
    return points[0][metric] if points and points[0][key] == x else None


def time_to_reach(points: list[dict], level: float, metric: str = GREEDY) -> float | None:
    """Training wall-clock of the first evaluation at or above `level` (None: never)."""
    return next((p["train_wall_s"] for p in points if p[metric] >= level), None)


def eval_grid(records: list[dict]) -> int:
    """The sample counts at which every one of `records` evaluated, as their interval: the least
    common multiple of each run's `eval_every * samples_per_step` (one run's interval when all
    share `--eval-every` and the batch)."""
    return math.lcm(*(r["settings"]["eval_every"] * r["samples_per_step"] for r in records))


def on_grid(points: list[dict], grid: int) -> list[dict]:
    """The evaluations at multiples of `grid` samples: those every run has (a run's last
    evaluation, where a budget stopped it between two, is not one of them)."""
    return [p for p in points if p["samples"] % grid == 0]


def compare(mesh_grpo: list[dict], trl: dict) -> dict:
    """meshppo's GRPO seeds against TRL's run (from the same warm-up checkpoint): at every TRL
    evaluation within meshppo's sample range, meshppo's mean greedy accuracy against TRL's minus
    the spread (max - min) of the seeds; meshppo's training wall-clock (median over seeds) to
    reach TRL's last accuracy against TRL's (target <= 1/4), and the same for each run's own
    start + 0.3, and the median seconds per step on both sides (`seconds_per_step`, whose ratio
    leaves out the first steps' one-time costs). The wall-clock is read on both sides at the
    same sample counts (`eval_grid`):
    a run evaluated more often would otherwise be seen reaching a level sooner; TRL's "last
    accuracy" is that of its last evaluation on the grid."""
    metric = greedy_key(task_of(trl))
    rows = []
    for p in trl["points"]:
        accs = [accuracy_at(r["points"], p["samples"], metric=metric) for r in mesh_grpo]
        if any(a is None for a in accs):
            continue
        spread = max(accs) - min(accs)
        mean = sum(accs) / len(accs)
        rows.append({"samples": p["samples"], "trl": p[metric], "meshppo_mean": mean, "meshppo_spread": spread,
                     "ok": mean >= p[metric] - spread})
    grid = eval_grid(mesh_grpo + [trl])
    trl_points, mesh_points = on_grid(trl["points"], grid), [on_grid(r["points"], grid) for r in mesh_grpo]
    level = trl_points[-1][metric]
    trl_t = time_to_reach(trl_points, level, metric)
    mesh_t = [time_to_reach(pts, level, metric) for pts in mesh_points]
    # the same for a level every run is meant to reach: its own start + TARGET_GAIN
    trl_gain_t = time_to_reach(trl_points, trl_points[0][metric] + TARGET_GAIN, metric)
    mesh_gain_t = [time_to_reach(pts, pts[0][metric] + TARGET_GAIN, metric) for pts in mesh_points]
    mesh_step, trl_step = [seconds_per_step(r.get("steps", [])) for r in mesh_grpo], seconds_per_step(trl.get("steps", []))
    return {"at_equal_samples": rows, "equal_samples_ok": bool(rows) and all(r["ok"] for r in rows),
            "meshppo_runs": [r["run"] for r in mesh_grpo],
            "eval_every": {"meshppo": sorted({r["settings"]["eval_every"] for r in mesh_grpo}),
                           "trl": trl["settings"]["eval_every"]}, "eval_grid_samples": grid,
            "trl_last_accuracy": level, "trl_last_samples": trl_points[-1]["samples"],
            "trl_wall_s_to_last": trl_t, "meshppo_wall_s_to_trl_last": mesh_t,
            "wall_ratio_median": _ratio(mesh_t, trl_t), "wall_ratio_target": 0.25,
            "trl_wall_s_to_gain": trl_gain_t, "meshppo_wall_s_to_gain": mesh_gain_t,
            "gain_wall_ratio_median": _ratio(mesh_gain_t, trl_gain_t),
            # the steady pace, which the ratios above mix with the first steps' one-time costs
            "meshppo_step_s": mesh_step, "trl_step_s": trl_step, "step_ratio_median": _ratio(mesh_step, trl_step)}


def seconds_per_step(steps: list[dict]) -> float | None:
    """A run's median training wall-clock per (meshppo-sized) step, read the same way on both
    frameworks: between consecutive step records (`step`, cumulative `train_wall_s`); None
    without two records."""
    rates = [(b["train_wall_s"] - a["train_wall_s"]) / (b["step"] - a["step"])
             for a, b in zip(steps, steps[1:]) if b["step"] > a["step"]]
    return statistics.median(rates) if rates else None


def _ratio(times: list[float | None], reference: float | None) -> float | None:
    """The median of `times` over `reference`; None if a time or the reference is missing."""
    if reference is None or reference <= 0 or any(t is None for t in times):
        return None
    return statistics.median(times) / reference


def summarize(out: Path) -> dict:
    records = load_records(out)
    if not records:
        raise SystemExit(f"no run records (*.json with benchmark 'learn') in {out}")
    runs = {r["run"]: {k: r[k] for k in ("framework", "complete", "greedy_start", "greedy_end", "greedy_gain",
                                          "reached_target", "train_wall_s", "samples_per_step")}
            | {"task": task_of(r), "trainer_overrides": r.get("trainer_overrides", [])}
            | {"steps": r["points"][-1]["step"], "samples": r["points"][-1]["samples"]} for r in records}
    checkpoints = sorted({(r["warmup"]["hash"], r["warmup"].get("weights_sha1")) for r in records})
    summary = {"benchmark": "learn_summary", "target_gain": TARGET_GAIN, "runs": runs,
               "warmup_checkpoints": [{"hash": h, "weights_sha1": w} for h, w in checkpoints],
               "all_meshppo_reached": all(v["reached_target"] for v in runs.values() if v["framework"] == "meshppo")}
    trl = next((r for r in records if r["framework"] == "trl"), None)
    # compared: meshppo's GRPO runs from TRL's checkpoint (the same task, settings and start)
    grpo = [r for r in records if r["framework"] == "meshppo" and r["algorithm"] == "grpo"
            and trl is not None and r["warmup"]["hash"] == trl["warmup"]["hash"]]
    if grpo:
        summary["vs_trl"] = compare(grpo, trl)
    elif trl is not None:
        summary["vs_trl_skipped"] = f"no meshppo GRPO run from TRL's warm-up checkpoint {trl['warmup']['hash']}"
    write_json(out / "summary.json", summary)
    plot(records, out)
    return summary


def plot(records: list[dict], out: Path) -> list[str]:
    """`curves_step.png` and `curves_wall.png` (accuracy, reward, KL, response length against step
    and training wall-clock, one line per run) and `accuracy_samples.png` (greedy accuracy
    against samples seen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    panels = (("greedy accuracy", "points", None), ("reward (train)", "steps", "reward"),
              ("KL to reference (k3)", "steps", "kl"), ("response length (tokens)", "steps", "response_length"))
    for xkey, fname, xlabel in (("step", "curves_step.png", "step"),
                                ("train_wall_s", "curves_wall.png", "training wall-clock (s)")):
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
        for ax, (title, series, key) in zip(axes.flat, panels):
            for r in records:
                k = key or greedy_key(task_of(r))  # accuracy: keyed by the record's task
                pts = [p for p in r[series] if p.get(k) is not None]
                ax.plot([p[xkey] for p in pts], [p[k] for p in pts], label=r["run"],
                        linestyle="--" if r["framework"] == "trl" else "-")
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            # Runs differ in length by 5× and more (TRL's budget is wall-clock), and learning
            # happens in the first steps: a log axis keeps both readable (linear below 1).
            ax.set_xscale("symlog", linthresh=1.0)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
        written.append(fname)
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in records:
        n, task = r["settings"]["eval_n"], task_of(r)
        line, = ax.plot([p["samples"] for p in r["points"]], [p[greedy_key(task)] for p in r["points"]],
                        label=f"{r['run']} greedy", linestyle="--" if r["framework"] == "trl" else "-")
        ax.plot([p["samples"] for p in r["points"]], [p[mean_at(n, task)] for p in r["points"]], color=line.get_color(),
                linestyle=":", alpha=0.6)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("validation accuracy (solid/dashed: greedy; dotted: mean@N)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_samples.png", dpi=100)
    plt.close(fig)
    return written + ["accuracy_samples.png"]


# --------------------------------------------------------------------------- CLI
def settings_parser(description: str) -> argparse.ArgumentParser:
    """The options every learning benchmark shares (also `bench/learn_trl.py`'s)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/learn", help="where warm-up checkpoints live (reused across calls)")
    p.add_argument("--out", default=None, help="run records, summary and curves (default: runs/learn/out, "
                                               "runs/learn/out_worked for --task worked)")
    p.add_argument("--tiny", action="store_true", help="a tiny model, task and batch (CPU checks of the wiring)")
    helps = {"task": "answer format: sum (0365) or worked (column by column, then the sum; also sets WORKED's "
                     "defaults)",
             "max_response_length": "response tokens (default: the task's answer + EOS + 3)",
             "eval_every": "training steps between evaluations (give bench/learn_trl.py the same)"}
    for f in dataclasses.fields(Settings):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None, help=helps.get(f.name),
                       choices=list(TASKS) if f.name == "task" else None)
    return p


def settings_from(a: argparse.Namespace, prog: str = "bench/learn.py") -> Settings:
    """The settings of a command line: the defaults, then `TINY`'s (`--tiny`) or `WORKED`'s
    (`--task worked` on the GPU), then every option given."""
    base = dict(TINY) if a.tiny else dict(WORKED) if a.task == "worked" else {}
    base.update({f.name: getattr(a, f.name) for f in dataclasses.fields(Settings) if getattr(a, f.name) is not None})
    try:
        return Settings(**base)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}")


def out_dir(a: argparse.Namespace, s: Settings) -> Path:
    """`--out`, by default one directory per task (a directory's TRL record is compared with its runs)."""
    return Path(a.out or ("runs/learn/out" if s.task == "sum" else f"runs/learn/out_{s.task}"))


def main(argv=None) -> int:
    started = time.perf_counter()
    p = settings_parser(__doc__)
    p.add_argument("--warmup-only", action="store_true", help="build (or reuse) the warm-up checkpoint and stop")
    p.add_argument("--trainer-override", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer config override for the RL runs (repeatable; kept in each record), e.g. "
                        "algorithm.rollout_correction.bypass_mode=false")
    p.add_argument("--runs", default="", help="comma-separated ALGORITHM:SEED (grpo, ppo, rloo), e.g. grpo:0,ppo:0")
    p.add_argument("--summarize", action="store_true", help="summary.json and curves of every record in --out")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="start a run only if it should end within this many minutes of the command's start, warm-up "
                        "included (judged by the longest run so far); the rest are listed as not_started")
    a = p.parse_args(argv)
    s = settings_from(a)
    specs = [r for r in a.runs.split(",") if r]
    try:
        for spec in specs:
            parse_run(spec)
    except ValueError as e:
        p.error(str(e))
    out = out_dir(a, s)
    if specs or a.warmup_only:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        warm = build_warmup(s, Path(a.work), device)
        print(json.dumps({"warmup": warm.summary}), flush=True)
        if (why := warmup_problem(warm.stats)) and not a.tiny:
            raise SystemExit(f"bench/learn.py: the warm-up checkpoint {warm.dir} is not a usable start: {why}; "
                             "change --warmup-steps, --warmup-lr or --init-std (a new checkpoint)")
        longest = s.max_minutes * 60 + 60  # a first guess at a run's wall time (set-up and evaluation included)
        for i, spec in enumerate(specs):
            elapsed = time.perf_counter() - started
            if a.budget_minutes and elapsed + longest > a.budget_minutes * 60:
                print(json.dumps({"not_started": specs[i:], "reason": f"--budget-minutes {a.budget_minutes}: "
                                  f"{elapsed:.0f}s spent, a run takes up to {longest:.0f}s"}), flush=True)
                break
            rec = rl_run(spec, s, warm, out, device.type, trainer_overrides=tuple(a.trainer_override))
            longest = max(longest if i else 0.0, rec["wall_s"])
            print(json.dumps({k: rec[k] for k in ("run", "greedy_start", "greedy_end", "greedy_gain",
                                                  "reached_target", "train_wall_s", "setup_s", "wall_s")}),
                  flush=True)
        if torch.distributed.is_initialized():  # the trainers' process group (one process, world size 1)
            torch.distributed.destroy_process_group()
    if a.summarize:
        print(json.dumps(summarize(out), indent=1))
    if not (specs or a.warmup_only or a.summarize):
        p.error("nothing to do: give --warmup-only, --runs and/or --summarize")
    return 0


if __name__ == "__main__":
    sys.exit(main())
