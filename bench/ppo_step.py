"""The full PPO step of the trainer (same code path as train_ppo.py) on random-weight models.

    python bench/ppo_step.py [--model qwen2.5-0.5b] [--workloads ppo,grpo] [--steps 4]
    torchrun --nproc_per_node=N bench/ppo_step.py [--scaling strong|weak] [--baseline ONE_GPU.jsonl] ...

On N GPUs, `--scaling strong` (default) keeps the one-GPU global batch (each GPU does 1/N of
it) and `--scaling weak` multiplies the prompts and the mini-batch by N (each GPU keeps the
one-GPU work). `--baseline` names the JSON lines of the same workloads on one GPU (the same
model, lengths, samples, overrides and `--smoke`; a file without them is refused): each
record then carries `scaling` — the strong-scaling speedup of the step and of each phase, or
the weak-scaling efficiency of the per-GPU throughput. `--profile` profiles one more step and
reports, per phase, the NCCL time and the part of it no compute kernel hides.

Workloads (`bench/common.py`, issue 7), 128 prompt tokens and 256 response tokens, EOS ignored:
  ppo:  critic (GAE) + reference + k3 KL loss, 256 prompts x 1 sample
  grpo: reference + k3 KL loss (beta 0.04), 32 prompts x 8 samples
The model, a word-level tokenizer over its whole vocabulary and random prompts are written to
`--work-dir` first (random weights: speed does not depend on their values); the reward is a
rule (a custom function scoring a token's frequency). The bench runs the trainer's steps, not its
`train()` loop: no checkpoint, validation or metrics log is written. Prints one JSON object per workload:
`perf/throughput` (prompt + response tokens per second per GPU, median over the measured
steps), the phase breakdown `timing_s/*`, the reshard share of the step and peak memory in GiB
(`peak_memory_gib`, `peak_memory_update_gib`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import emit, model_args  # noqa: E402
from models.checkpoint import hf_architecture  # noqa: E402

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str.count(ground_truth) / max(len(solution_str), 1)
'''


def token_chars(n: int) -> list[str]:
    """One character per token id: a character-level tokenizer over the model's whole
    vocabulary, built like the demo's. Printable characters and private-use code points (there
    are too few assigned printable ones for a 152k vocabulary); no spaces, no surrogates."""
    import unicodedata

    chars = []
    for c in range(0x21, 0x110000):
        ch = chr(c)
        if (ch.isprintable() or unicodedata.category(ch) == "Co") and not ch.isspace():
            chars.append(ch)
            if len(chars) == n:
                return chars
    raise ValueError(f"not enough characters for a vocabulary of {n}")


SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, eos_token_id=1)


def bench_files(work: Path, name: str, n_prompts: int, prompt_len: int, shape: dict, dummy: bool = False):
    """`prepare`'s paths: the model directory, the prompt file and the reward function."""
    tag = name + ("-smoke" if shape else "") + ("-dummy" if dummy else "")
    return work / f"{tag}-random", work / f"{tag}_prompts_{n_prompts}x{prompt_len}.jsonl", work / "reward.py"


def prepare(work: Path, name: str, n_prompts: int, prompt_len: int, rank: int, shape: dict, dummy: bool = False):
    """Random HF checkpoint + tokenizer + prompt file (rank 0 writes, others wait). `dummy`:
    config.json and the tokenizer only, for `actor_rollout_ref.model.load_format=dummy` (the
    ranks draw their shards themselves: nothing large is built or written)."""
    import torch.distributed as dist

    model_dir, data, reward = bench_files(work, name, n_prompts, prompt_len, shape, dummy)
    if rank == 0 and not (model_dir / "tokenizer.json").exists():
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        from models import Transformer

        args = model_args(name, **shape)
        if dummy:
            args.to_hf_config(architecture=hf_architecture(args.model_type)).save_pretrained(str(model_dir))
        else:
            Transformer.build(args, device="cpu", dtype=torch.bfloat16, seed=0).save_pretrained(model_dir)
        chars = token_chars(args.vocab_size)
        backend = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(chars)}, unk_token=chars[0]))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=chars[args.eos_token_id], pad_token=chars[0],
                                      unk_token=chars[0], clean_up_tokenization_spaces=False)
        tok.save_pretrained(model_dir)
    if rank == 0 and not data.exists():
        g = torch.Generator().manual_seed(0)
        chars = token_chars(model_args(name, **shape).vocab_size)
        with open(data, "w") as f:
            for i in range(n_prompts):
                ids = torch.randint(1, len(chars), (prompt_len,), generator=g).tolist()
                f.write(json.dumps({"data_source": "bench", "prompt": "".join(chars[t] for t in ids),
                                    "reward_model": {"ground_truth": chars[ids[0]]}}) + "\n")
        reward.write_text(REWARD)
    if dist.is_initialized():
        dist.barrier()
    return model_dir, data, reward


def overrides_for(workload: str, prompts: int, prompt_len: int, response_len: int, mini_scale: int = 1) -> list[str]:
    common = [f"data.max_prompt_length={prompt_len}", f"data.max_response_length={response_len}","actor_rollout_ref.rollout.ignore_eos=true",
              "actor_rollout_ref.actor.use_torch_compile=true",
              "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
              "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
              "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768",
              "actor_rollout_ref.ref.fsdp_config.model_dtype=bf16",
              "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "trainer.val_before_train=false",
              "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.export_hf_at_end=false",
              "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "algorithm.kl_guard.enable=false"]
    if workload == "ppo":
        return common + [f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={min(64 * mini_scale, prompts)}",
                         "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae",
                         "actor_rollout_ref.actor.kl_loss_coef=0.001", "critic.use_dynamic_bsz=true",
                         "critic.ppo_max_token_len_per_gpu=32768", "critic.forward_max_token_len_per_gpu=32768"]
    return common + [f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={min(8 * mini_scale, prompts)}",
                     "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.actor.kl_loss_coef=0.04"]


def baseline_record(records: list[dict], run: dict, scale: int) -> dict:
    """The record among `records` (`--baseline`'s) of the workload `run` (this run's record
    workload) as one GPU runs it: the same model, workload, samples, lengths, overrides and smoke
    mode, on one rank, with the global batch divided by `scale` (weak scaling's world size; 1 for
    strong scaling). A ValueError naming what differs when there is none: figures against a
    baseline of another configuration would be meaningless."""
    prompts = run["prompts"] // scale if run["prompts"] % scale == 0 else run["prompts"] / scale
    one_gpu = {**run, "world_size": 1, "prompts": prompts}
    same_name = [r for r in records if r.get("benchmark") == "ppo_step"
                 and (r["workload"].get("model"), r["workload"].get("workload")) == (run["model"], run["workload"])]
    for rec in same_name:
        if all(rec["workload"].get(k) == v for k, v in one_gpu.items()):
            return rec
    if not same_name:
        raise ValueError(f"no ppo_step record of model {run['model']}, workload {run['workload']}")
    differences = ["; ".join(f"{k} {rec['workload'].get(k)!r}" for k, v in one_gpu.items()
                             if rec["workload"].get(k) != v) for rec in same_name]
    wanted = ", ".join(f"{k} {v!r}" for k, v in one_gpu.items() if k not in ("model", "workload"))
    raise ValueError(f"no record of {run['model']} {run['workload']} as one GPU runs this run's workload "
                     f"({wanted}); its records differ in: {' | '.join(differences)}")


def scaling(base: dict | None, timing: dict, throughput: float, world: int, mode: str) -> dict | None:
    """Against the one-GPU record of the same workload: strong scaling, the step's speed-up
    (one-GPU time / this time; ideal: the world size) and each phase's time ratio (this time /
    one-GPU time; ideal: 1 / world size); weak scaling, the per-GPU throughput as a share of
    one GPU's (ideal: 1)."""
    if base is None or world == 1:
        return None
    if mode == "weak":
        return {"efficiency": throughput / base["throughput_tok_s_per_gpu"]}
    return {"step_speedup": base["timing_s"]["timing_s/step"] / timing["timing_s/step"],
            "phase_time_ratio": {k.removeprefix("timing_s/"): timing[k] / v for k, v in base["timing_s"].items()
                                 if k in timing and v > 0}}


# What only the trainer's `train()` loop acts on: the bench drives `step()` (`measured_steps`).
TRAIN_LOOP_KEYS = ("trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
                   "trainer.val_before_train", "trainer.val_only", "trainer.logger", "trainer.resume_mode",
                   "trainer.export_hf_at_end")


def measured_steps(trainer, steps: int) -> list[dict]:
    """Each step's metrics, `steps` steps of the trainer's `step()` (as bench/learn.py drives it),
    each under the trainer's step profiler (`global_profiler` acts as in a run). Not `train()`: it
    writes a checkpoint at the last step whatever `trainer.save_freq` says (about 91 GB of weights
    and Adam states at 7b, on the clock of the bench's time limit), and logs and validates."""
    rows = []
    try:
        for _ in range(steps):
            with trainer.profiler.step(trainer.global_step + 1):
                rows.append(trainer.step())
    finally:
        trainer.profiler.close()
    return rows


def profile_step(trainer, trace: str | None = None) -> dict:
    """One more step under torch.profiler: per phase, NCCL time and the exposed part of it;
    `trace`: also write this rank's Chrome trace there (open it in Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.common import comm_exposure

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.step()
    trainer.timer.pop()
    if trace:
        prof.export_chrome_trace(trace)
    return comm_exposure(prof)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--workloads", default="ppo,grpo")
    p.add_argument("--steps", type=int, default=4, help="steps per workload; the first is warm-up")
    p.add_argument("--work-dir", default="runs/bench_ppo_step")
    p.add_argument("--smoke", action="store_true", help="a tiny model and batch (CPU check that the bench runs)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (the workloads' 128 by default; 16 with --smoke)")
    p.add_argument("--response-len", type=int,
                   help="response tokens (the workloads' 256 by default; 8 with --smoke)")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="on N ranks: the one-GPU global batch (strong) or N times it (weak)")
    p.add_argument("--baseline", help="JSON lines of the same workloads on one GPU (the same model, lengths, "
                   "samples and overrides; refused otherwise): adds the scaling figures")
    p.add_argument("--profile", action="store_true", help="profile one more step: exposed NCCL time per phase")
    p.add_argument("--trace", metavar="DIR", help="with --profile: each rank's Chrome trace of the profiled step "
                   "goes to DIR/<workload>_rank<r>.json")
    p.add_argument("--dummy", action="store_true",
                   help="random weights drawn by the ranks (model.load_format=dummy): no model written to "
                        "--work-dir (only its config.json and tokenizer)")
    p.add_argument("overrides", nargs="*", help="extra dotted.key=value config overrides (not those of the "
                   f"trainer's train() loop, which the bench does not run: {', '.join(TRAIN_LOOP_KEYS)})")
    a = p.parse_args(argv)
    if loop_keys := [o for o in a.overrides if o.split("=", 1)[0].lstrip("+") in TRAIN_LOOP_KEYS]:
        p.error(f"{', '.join(loop_keys)}: the bench runs the trainer's steps, not its train() loop, where "
                "these act (the step count is --steps)")
    if a.trace and not a.profile:
        p.error("--trace needs --profile (the trace is of the profiled step)")
    if a.steps < 2:
        p.error(f"--steps {a.steps}: the first step is warm-up, so at least 2 are needed for a measurement")
    prompt_len = a.prompt_len if a.prompt_len is not None else (16 if a.smoke else 128)
    response_len = a.response_len if a.response_len is not None else (8 if a.smoke else 256)
    if min(prompt_len, response_len) < 1:
        p.error(f"--prompt-len {prompt_len} / --response-len {response_len}: both must be >= 1")

    from trainer.launch import init_distributed

    ctx = init_distributed("auto")
    try:
        return run_workloads(a, p, ctx, prompt_len, response_len)
    finally:
        # main() is also called in-process (the tests): the caller gets its process back without
        # the group, after a refusal (p.error's SystemExit) or an error too
        if ctx.owns_group:
            torch.distributed.destroy_process_group()


def run_workloads(a: argparse.Namespace, p: argparse.ArgumentParser, ctx, prompt_len: int, response_len: int) -> int:
    """Every workload of `a` checked (its config, its --baseline record), then each run and, on rank 0,
    its record written; `ctx`: the ranks' process group."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import PPOTrainer

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shape = SMOKE_SHAPE if a.smoke else {}
    scale = ctx.world_size if a.scaling == "weak" else 1
    steps = a.steps + (1 if a.profile else 0)
    runs = []  # (workload, prompts, config, the record's workload): every configuration checked before any run
    for workload in a.workloads.split(","):
        prompts = (256 if workload == "ppo" else 32) // (16 if a.smoke else 1) * scale
        model_dir, data, reward = bench_files(work, a.model, prompts * steps, prompt_len, shape, a.dummy)
        ov = overrides_for(workload, prompts, prompt_len, response_len, scale) + [
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data}]",
            f"custom_reward_function.path={reward}", f"trainer.default_local_dir={work / f'run_{workload}'}",
            f"trainer.total_training_steps={a.steps}", f"trainer.n_gpus_per_node={ctx.world_size}",
            "data.shuffle=false", *(["actor_rollout_ref.model.load_format=dummy"] if a.dummy else []), *a.overrides]
        cfg = load_config(PPOConfig, None, ov)
        runs.append((workload, prompts, cfg, {
            "model": a.model, "workload": workload, "prompts": cfg.data.train_batch_size,
            "n": cfg.actor_rollout_ref.rollout.n, "prompt_len": prompt_len, "response_len": response_len,
            "smoke": a.smoke, "world_size": ctx.world_size, "overrides": list(a.overrides)}))
    baselines = {}
    if a.baseline:
        try:
            with open(a.baseline) as f:
                records = [json.loads(line) for line in f if line.startswith("{")]
            baselines = {record["workload"]: baseline_record(records, record, scale) for *_, record in runs}
        except (OSError, ValueError) as e:
            p.error(f"--baseline {a.baseline}: {e}")
    for workload, prompts, cfg, record in runs:
        prepare(work, a.model, prompts * steps, prompt_len, ctx.rank, shape, a.dummy)
        trainer = PPOTrainer(cfg, ctx)
        try:
            rows = measured_steps(trainer, a.steps)
            trace = None
            if a.trace:
                Path(a.trace).mkdir(parents=True, exist_ok=True)
                trace = str(Path(a.trace) / f"{workload}_rank{ctx.rank}.json")
            exposure = profile_step(trainer, trace) if a.profile else None
        finally:
            trainer.reward_manager.close()
        if ctx.is_main:
            measured = rows[1:]
            med = lambda k: statistics.median(r[k] for r in measured if k in r)  # noqa: E731
            timing = {k: med(k) for k in measured[0] if k.startswith("timing_s/")}
            emit("ppo_step", record,
                 throughput_tok_s_per_gpu=med("perf/throughput"), timing_s=timing,
                 reshard_share=timing.get("timing_s/reshard", 0.0) / timing["timing_s/step"],
                 # the trainer's peaks are GiB (bytes / 2**30, under verl's names `*perf/*_gb`)
                 peak_memory_gib=max(r.get("actor/perf/max_memory_allocated_gb", 0.0) for r in measured),
                 # the update phase's own peak (after generation: what the actor trains in)
                 peak_memory_update_gib=max(r.get("perf/max_memory_allocated_update_gb", 0.0) for r in measured),
                 mfu_actor=med("perf/mfu/actor") if "perf/mfu/actor" in measured[0] else None,
                 # actor.use_prefix_grouper: the share of the update's tokens not run
                 prefix_tokens_saved=(med("perf/prefix_tokens_saved") if "perf/prefix_tokens_saved" in measured[0]
                                      else None),
                 # every step's, the warm-up included: a recapture after step 1 hides in the median
                 graph_capture_s_steps=[round(r.get("timing_s/graph_capture", 0.0), 4) for r in rows],
                 response_tok_s_per_gpu=med("perf/response_throughput"), scaling_mode=a.scaling,
                 scaling=scaling(baselines.get(workload), timing, med("perf/throughput"), ctx.world_size, a.scaling),
                 comm_exposure=exposure, steps_measured=len(measured))
        del trainer
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
