"""Build the embedded demo's starting point: tokenizer, prompt files and a warm-started model.

Real RLHF starts from a supervised (SFT) model; so does the demo. This writes

    OUT/tokenizer/           character-level tokenizer (data.demo)
    OUT/train.jsonl, val.jsonl   addition prompts in verl's format
    OUT/sft_model/           a tiny Qwen2-shaped model after a short supervised warm-up,
                             as a Hugging Face directory (config, safetensors, tokenizer)

The warm-up is deliberately short: it stops once greedy decoding answers 30 % of the
validation prompts exactly, leaving room for PPO to raise the exact-match score. Everything is seeded, so the
same command gives the same files; an existing, complete OUT is left alone.

    python -m tools.prepare_demo --out runs/demo_assets
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import torch

from data.dataset import RLHFDataset, read_records
from data.demo import prepare_demo
from models import ModelArgs, Transformer
from ppo.forward import build_micro_batch, response_logprobs

DEFAULTS = dict(n_train=8192, n_val=256, max_value=99, hidden=96, layers=3, heads=4, kv_heads=2,
                sft_target_accuracy=0.3, sft_max_steps=800, sft_batch=64, lr=3e-3, seed=0)
STAMP = "prepare_demo.json"


def demo_model_args(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, eos: int, pad: int):
    # Vocab rounded up to a multiple of 8 so the engine can shard it over up to 8 TP ranks.
    return ModelArgs(vocab_size=(vocab_size + 7) // 8 * 8, hidden_size=hidden, intermediate_size=hidden * 2,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=64, model_type="qwen2", attention_bias=True,
                     tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=1)


def _answer_ids(tokenizer, path: str) -> list[list[int]]:
    return [tokenizer(str(rec["reward_model"]["ground_truth"]), add_special_tokens=False)["input_ids"]
            + [tokenizer.eos_token_id] for _, rec in read_records(path)]


@torch.no_grad()
def greedy_accuracy(model, prompts: list[list[int]], answers: list[list[int]], batch: int = 128) -> float:
    """Share of prompts whose answer (+ EOS) greedy decoding reproduces exactly: with teacher
    forcing, every answer token must be the argmax after the correct prefix (then greedy
    decoding emits exactly that prefix and stops at EOS) — the demo's exact-match reward."""
    exact = 0
    for s in range(0, len(prompts), batch):
        mb = build_micro_batch(prompts[s:s + batch], answers[s:s + batch], "cpu", packed=True)
        logits = model(mb.input_ids, **mb.model_kwargs()).reshape(-1, model.args.vocab_size)
        wrong = (logits[mb.src_index].argmax(-1) != mb.labels.reshape(-1)[mb.src_index]).long()
        exact += int((torch.zeros(mb.batch_size, dtype=torch.long).index_add_(0, mb.dst_row, wrong) == 0).sum())
    return exact / max(len(prompts), 1)


def supervised_warmup(model, tokenizer, train_file: str, val_file: str, target_accuracy: float, max_steps: int,
                      batch: int, lr: float, seed: int, check_every: int = 10, log=print) -> tuple[int, float]:
    """Teacher-forced training on `answer + eos` after each chat-formatted prompt, until the
    greedy exact-match accuracy on the validation prompts reaches `target_accuracy` (checked
    every `check_every` steps) or `max_steps`. Returns (steps, accuracy).

    Stopping on accuracy rather than after a fixed step count gives PPO the same kind of start
    whatever the seed: this tiny model learns addition in a sudden transition whose timing
    varies by a few hundred steps between seeds (and with rounding-level changes to the code),
    and a start before it leaves PPO too few correct samples to learn from in 20 steps."""
    ds = RLHFDataset([train_file], tokenizer, max_prompt_length=32)
    answers = _answer_ids(tokenizer, train_file)
    val = RLHFDataset([val_file], tokenizer, max_prompt_length=32)
    val_prompts = [val[i]["input_ids"] for i in range(len(val))]
    val_answers = _answer_ids(tokenizer, val_file)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Linear warm-up, then cosine decay to a tenth over max_steps: at a constant 3e-3 some
    # seeds never settle into the solution.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(s, max_steps) / max(max_steps, 1)))))
    step, acc = 0, 0.0
    for step in range(1, max_steps + 1):
        idx = torch.randint(0, len(ds), (batch,), generator=gen).tolist()
        mb = build_micro_batch([ds[i]["input_ids"] for i in idx], [answers[i] for i in idx], "cpu", packed=True)
        width = max(len(answers[i]) for i in idx)
        logp, _ = response_logprobs(model, mb, width, 1.0, with_entropy=False)
        mask = torch.zeros_like(logp)
        for b, i in enumerate(idx):
            mask[b, :len(answers[i])] = 1
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % check_every == 0 or step == max_steps:
            acc = greedy_accuracy(model, val_prompts, val_answers)
            if step % 100 == 0 or acc >= target_accuracy or step == max_steps:
                log(f"sft step {step}: loss {loss.item():.4f}, greedy val accuracy {acc:.3f}")
            if acc >= target_accuracy:
                break
    return step, acc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo_assets")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT is complete")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    a = p.parse_args(argv)
    settings = {k: getattr(a, k) for k in DEFAULTS}
    stamp = os.path.join(a.out, STAMP)
    if not a.force and os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == settings:
                print(f"demo assets in {a.out} are up to date")
                return 0
    t0 = time.time()
    torch.manual_seed(a.seed)
    paths = prepare_demo(a.out, n_train=a.n_train, n_val=a.n_val, seed=a.seed, max_value=a.max_value)
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(paths.tokenizer_dir)
    args = demo_model_args(len(tok), a.hidden, a.layers, a.heads, a.kv_heads, tok.eos_token_id, tok.pad_token_id)
    model = Transformer.build(args, seed=a.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    steps, acc = supervised_warmup(model, tok, paths.train_file, paths.val_file, a.sft_target_accuracy,
                                   a.sft_max_steps, a.sft_batch, a.lr, a.seed)
    if a.sft_max_steps > 0 and acc < a.sft_target_accuracy:
        print(f"warning: the supervised warm-up stopped at --sft-max-steps={a.sft_max_steps} with greedy val "
              f"accuracy {acc:.3f} < --sft-target-accuracy={a.sft_target_accuracy}", file=sys.stderr)
    out_model = os.path.join(a.out, "sft_model")
    tmp = out_model + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_model, ignore_errors=True)
    os.replace(tmp, out_model)
    with open(stamp, "w") as f:
        json.dump(settings, f)
    print(f"demo assets written to {a.out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
