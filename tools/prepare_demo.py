"""Build the embedded demo's starting point: tokenizer, prompt files and a warm-started model.

Real RLHF starts from a supervised (SFT) model; so does the demo. This writes

    OUT/tokenizer/           character-level tokenizer (data.demo)
    OUT/train.jsonl, val.jsonl   addition prompts in verl's format
    OUT/sft_model/           a tiny Qwen2-shaped model after a short supervised warm-up,
                             as a Hugging Face directory (config, safetensors, tokenizer)

The warm-up is deliberately short: the model learns the answer format and part of the
task, leaving room for PPO to raise the exact-match score. Everything is seeded, so the
same command gives the same files; an existing, complete OUT is left alone.

    python -m tools.prepare_demo --out runs/demo_assets
"""

from __future__ import annotations

import argparse
import json
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
                sft_steps=300, sft_batch=64, lr=3e-3, seed=0)
STAMP = "prepare_demo.json"


def demo_model_args(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, eos: int, pad: int):
    # Vocab rounded up to a multiple of 8 so the engine can shard it over up to 8 TP ranks.
    return ModelArgs(vocab_size=(vocab_size + 7) // 8 * 8, hidden_size=hidden, intermediate_size=hidden * 2,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=64, model_type="qwen2", attention_bias=True,
                     tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=1)


def supervised_warmup(model, tokenizer, train_file: str, steps: int, batch: int, lr: float, seed: int, log=print):
    """Teacher-forced training on `answer + eos` after each chat-formatted prompt."""
    ds = RLHFDataset([train_file], tokenizer, max_prompt_length=32)
    answers = [tokenizer(str(rec["reward_model"]["ground_truth"]), add_special_tokens=False)["input_ids"]
               + [tokenizer.eos_token_id] for _, rec in read_records(train_file)]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    for step in range(steps):
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
        if step % 50 == 0 or step == steps - 1:
            log(f"sft step {step}: loss {loss.item():.4f}")
    return model


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
    supervised_warmup(model, tok, paths.train_file, a.sft_steps, a.sft_batch, a.lr, a.seed)
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
