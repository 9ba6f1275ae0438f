"""The learning benchmark (`bench/learn.py`) through TRL's `GRPOTrainer`, for a side-by-side.

    pip install -r requirements-bench.txt        # trl 1.16 and datasets: benchmark-only dependencies
    python bench/learn_trl.py --minutes 8        # then: python bench/learn.py --summarize
    python bench/learn_trl.py --task worked --minutes 8   # then: python bench/learn.py --task worked --summarize

Same task (`--task sum`, 5-token answers, or `--task worked`, 42-token worked answers whose
generation is a large part of a step: see `bench/learn.py`), warm-up checkpoint
(`WORK/warmup-<hash>/`, built by `bench/learn.py` if missing: a Hugging Face Qwen2 directory that
TRL loads as it is; the character-level tokenizer is passed as the processing class), training
prompts, prompts per step, samples per prompt, mini-batches, learning rate, KL coefficient,
clipping, gradient clipping and temperature as meshppo's GRPO runs. TRL generates with
`transformers`' `generate` (vLLM does not travel to the GPU machine); the reward is
`rewards/arith.py`'s, told the task by the dataset's `data_source` column. The pinned
`GRPOConfig` values are printed and kept in the record (`trl_args`):

  beta = kl_coef                 k3 KL term added to the token loss (meshppo: use_kl_loss, low_var_kl)
  loss_type = "dapo"             token losses summed over an optimizer step's completions and divided by
                                 their token count (meshppo: loss_agg_mode=token-mean per mini-batch)
  scale_rewards = "group"        advantages divided by the group's std (norm_adv_by_std_in_grpo=true)
  per_device_train_batch_size    mini_batch x n completions per optimizer step, one micro-batch
  steps_per_generation           prompts / mini_batch optimizer steps per generated batch (meshppo's
                                 mini-batches), gradient_accumulation_steps = 1
  num_iterations = epochs        passes over a generated batch (ppo_epochs)
  epsilon = clip_ratio, max_grad_norm = grad_clip, temperature, top_p = 1, top_k = 0
  max_completion_length = max_response_length   (the task's answer + EOS + 3 unless given)
  learning_rate = lr, constant schedule, no warm-up, weight_decay = 0, AdamW (0.9, 0.999, 1e-8; fused on a GPU)
  bf16 autocast on a GPU (meshppo: bf16 compute, fp32 master weights), no gradient checkpointing

It trains until `--minutes` of training wall-clock (evaluation excluded), `--steps` meshppo-sized
steps or `--deadline-minutes` after its start (less a minute), evaluating like `bench/learn.py`
(same validation prompts, greedy and mean@N, here with `generate`) every `--eval-every`
meshppo-sized steps, the same setting and default as meshppo's runs, so both evaluate at the same
sample counts (and once more when a budget stops it between two), and writes `OUT/trl.json` in
`bench/learn.py`'s schema (`OUT`: `--out`, by default the task's, as `bench/learn.py`'s).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import git_commit, hardware  # noqa: E402
from bench.learn import (Settings, build_warmup, gain, greedy_key, mean_at, out_dir, settings_from,  # noqa: E402
                         settings_parser, val_metrics, warmup_problem, write_json)


def trl_args(s: Settings, output_dir: str, max_steps: int, cuda: bool) -> dict:
    """`GRPOConfig` keyword arguments pinned to meshppo's GRPO settings (see the module docstring)."""
    return dict(
        output_dir=output_dir, seed=s.seed, max_steps=max_steps,
        per_device_train_batch_size=s.mini_batch * s.n, gradient_accumulation_steps=1,
        steps_per_generation=s.prompts // s.mini_batch, num_generations=s.n, num_iterations=s.epochs,
        beta=s.kl_coef, loss_type="dapo", scale_rewards="group", epsilon=s.clip_ratio, max_grad_norm=s.grad_clip,
        temperature=s.temperature, top_p=1.0, top_k=0, max_completion_length=s.max_response_length,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="adamw_torch_fused" if cuda else "adamw_torch",  # fused on a GPU, as meshppo's AdamW
        bf16=cuda, use_cpu=not cuda, gradient_checkpointing=False, use_vllm=False,
        mask_truncated_completions=False, shuffle_dataset=True, remove_unused_columns=False,
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )


def reward_fn(prompts, completions, ground_truth, data_source, **_):
    """TRL's reward-function signature around the task's verl-style scorer (`rewards/arith.py`);
    `ground_truth` and `data_source` are the dataset's columns."""
    from rewards.arith import compute_score

    return [compute_score(ds, c, gt) for c, gt, ds in zip(completions, ground_truth, data_source, strict=True)]


@torch.no_grad()
def generate_rows(model, tokenizer, prompts: list[str], ground_truths: list[str], n: int, temperature: float,
                  max_new_tokens: int, seed: int, data_source: str) -> list[dict]:
    """`n` completions per prompt with `generate` (greedy at temperature 0), scored as
    `data_source`, prompt-major, as the rows `bench.learn.val_metrics` reads."""
    from rewards.arith import compute_score

    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    enc = {k: v.to(model.device) for k, v in enc.items()}
    sample = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
        dict(do_sample=False)
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
        out = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=n,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sample)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return [{"input": prompts[k // n], "output": t, "score": compute_score(data_source, t, ground_truths[k // n])}
            for k, t in enumerate(texts)]


def main(argv=None) -> int:
    started = time.perf_counter()
    p = settings_parser(__doc__)
    p.add_argument("--minutes", type=float, default=8.0, help="training wall-clock budget (evaluation excluded)")
    p.add_argument("--deadline-minutes", type=float, default=None,
                   help="also stop training this many minutes after the command started, less a minute for the "
                        "last evaluation (a device call with a time limit, a warm-up rebuilt first)")
    a = p.parse_args(argv)
    # options of bench/learn.py's parser that this script has no use for: refused, not ignored
    for dest, why in (("max_minutes", "the budget here is --minutes"), ("critic_lr", "TRL's GRPO has no critic")):
        if getattr(a, dest) != p.get_default(dest):
            p.error(f"--{dest.replace('_', '-')} is bench/learn.py's option: {why}")
    if a.steps is None and not a.tiny:
        a.steps = 10**6  # the wall-clock budget decides
    a.max_minutes = a.minutes
    s = settings_from(a, "bench/learn_trl.py")

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from data.dataset import read_records
    from models.tokenizer import load_tokenizer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    out = out_dir(a, s)
    t_setup = time.perf_counter()
    warm = build_warmup(s, Path(a.work), device)
    if (problem := warmup_problem(warm.stats)) and not a.tiny:
        raise SystemExit(f"bench/learn_trl.py: the warm-up checkpoint {warm.dir} is not a usable start: {problem}")
    tokenizer = load_tokenizer(str(warm.dir))
    render = lambda row: tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)  # noqa: E731
    train = [row for _, row in read_records(warm.train_file)]
    val = [row for _, row in read_records(warm.val_file)]
    dataset = Dataset.from_list([{"prompt": render(r), "ground_truth": r["reward_model"]["ground_truth"],
                                  "data_source": r["data_source"]} for r in train])
    val_prompts, val_truths = [render(r) for r in val], [r["reward_model"]["ground_truth"] for r in val]
    (val_source,) = {r["data_source"] for r in val}
    model = AutoModelForCausalLM.from_pretrained(str(warm.dir), dtype=torch.float32).to(device)

    per_generation = s.prompts // s.mini_batch  # optimizer steps per meshppo step
    args = trl_args(s, str(warm.dir.parent / "runs" / "trl"), s.steps * per_generation, cuda)
    print("TRL GRPOConfig pinned to meshppo's settings:\n" + "\n".join(f"  {k} = {v!r}" for k, v in args.items()))
    samples_per_opt_step = s.mini_batch * s.n
    points, steps = [], []
    clock = {"start": None, "eval": 0.0, "last": {}}

    def record(complete: bool) -> dict:
        """`OUT/trl.json` in `bench/learn.py`'s schema, rewritten after every evaluation."""
        rec = {"benchmark": "learn", "framework": "trl", "run": f"trl_grpo_{s.seed}", "algorithm": "grpo",
               "seed": s.seed, "complete": complete, "settings": dataclasses.asdict(s), "trl_args": args,
               "generation": "transformers generate (vLLM cannot travel to the GPU machine)",
               "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                            "torch": torch.__version__},
               "warmup": warm.summary, "samples_per_step": s.prompts * s.n, "setup_s": clock.get("setup_s"),
               "train_wall_s": points[-1]["train_wall_s"], "points": points, "steps": steps,
               **gain(points, greedy_key(s.task)),
               "hardware": hardware(), "commit": git_commit()}
        write_json(out / "trl.json", rec)
        return rec

    def train_s() -> float:
        return time.perf_counter() - clock["start"] - clock["eval"]

    def evaluate(trainer_model, opt_step: int):
        now = train_s()  # read before this evaluation, whose time is then added to the excluded time
        t = time.perf_counter()
        greedy = generate_rows(trainer_model, tokenizer, val_prompts, val_truths, 1, 0.0, s.max_response_length,
                               s.seed, val_source)
        sampled = generate_rows(trainer_model, tokenizer, val_prompts, val_truths, s.eval_n, s.temperature,
                                s.max_response_length, s.seed, val_source)
        m = val_metrics(greedy, sampled, s.eval_n, s.task)
        points.append({"step": opt_step / per_generation, "samples": opt_step * samples_per_opt_step,
                       "train_wall_s": now, **m, **clock["last"], "eval_s": time.perf_counter() - t})
        record(complete=False)
        print(f"[trl] step {opt_step / per_generation:6.1f} ({now:6.1f}s): greedy {m[greedy_key(s.task)]:.3f}  "
              f"mean@{s.eval_n} {m[mean_at(s.eval_n, s.task)]:.3f}  {clock['last']}", flush=True)
        clock["eval"] += time.perf_counter() - t  # the evaluation, record and log: not training time

    class Bench(TrainerCallback):
        def on_train_begin(self, args_, state, control, model=None, **kw):
            clock["start"] = time.perf_counter()
            evaluate(model, 0)

        def on_log(self, args_, state, control, logs=None, **kw):
            keys = {"reward": "reward", "kl": "kl", "response_length": "completions/mean_length"}
            if logs and "reward" in logs:
                clock["last"] = {k: float(logs[v]) for k, v in keys.items() if v in logs}
                steps.append({"step": state.global_step / per_generation,
                              "samples": state.global_step * samples_per_opt_step, "train_wall_s": train_s(),
                              **clock["last"]})

        def on_step_end(self, args_, state, control, model=None, **kw):
            late = a.deadline_minutes is not None and time.perf_counter() - started >= (a.deadline_minutes - 1) * 60
            done = late or train_s() >= s.max_minutes * 60 or state.global_step >= args_.max_steps
            if state.global_step % (s.eval_every * per_generation) == 0 or done:
                evaluate(model, state.global_step)
            if done:
                control.should_training_stop = True

    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=trl.GRPOConfig(**args),
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[Bench()])
    clock["setup_s"] = time.perf_counter() - t_setup
    trainer.train()
    rec = record(complete=True)
    print(json.dumps({k: rec[k] for k in ("run", "greedy_start", "greedy_end", "greedy_gain", "train_wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
