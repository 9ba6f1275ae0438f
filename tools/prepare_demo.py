"""Build the embedded demo's starting point: tokenizer, prompt files and a warm-started model.

Real RLHF starts from a supervised (SFT) model that imitates imperfect demonstrations; so does
the demo. This writes

    OUT/tokenizer/           character-level tokenizer (data.demo)
    OUT/train.jsonl, val.jsonl   addition prompts in verl's format, with the true sums
    OUT/sft_model/           a tiny Qwen2-shaped model (`--model-type`: or Qwen3, Llama) after a supervised warm-up,
                             as a Hugging Face directory (config, safetensors, tokenizer)

The warm-up imitates a demonstrator who is right, except that on `--slip` (70 %) of the
problems with a carry out of the units column (45 % of them) they forget it: 37+58=85
(`data.demo.forgotten_carry`). After its `--sft-max-steps` (1000) steps the model adds, but
its greedy answer to a carry problem is the slip, while the right answer is still among its
samples (18 to 31 % of the time on seeds 0-2): the exact-match reward of PPO has something to fix on
every seed, and the greedy validation score shows it. `--seed` seeds everything (the data,
the model's initialisation, the warm-up's batches and slips), so the same command gives the
same files; an existing, complete OUT is left alone.

    python -m tools.prepare_demo --out runs/demo_assets [--seed 0]
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

from data.dataset import RLHFDataset, read_records, render_prompt
from data.demo import build_demo_tokenizer, forgotten_carry, operands, prepare_demo
from models import ModelArgs
from models.args import EVERY_LAYER_SPARSE, GRANITE_TYPES, MOE_TYPES, SHARED_EXPERT_TYPES, SUPPORTED_MODEL_TYPES

DEFAULTS = dict(model_type="qwen2", n_train=8192, n_val=256, max_value=99, hidden=96, layers=3, heads=4,
                kv_heads=2, init_std=0.1, slip=0.7, sft_max_steps=1000, sft_batch=64, lr=3e-3, seed=0)
# init_std 0.1, not the usual 0.02: from 0.02 this 96-wide model sat on a loss plateau for 500
# to more than 1500 warm-up steps depending on the seed; from 0.1 seeds 0-2 leave it within ~300.
STAMP = "prepare_demo.json"


def demo_model_args(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, eos: int, pad: int,
                    init_std: float, model_type: str = "qwen2"):
    # Vocab rounded up to a multiple of 8 so the engine can shard it over up to 8 TP ranks. Qwen2 has
    # q/k/v biases; Qwen3 per-head q/k norms instead; Llama neither. A Granite gets granite-3.x's scalars
    # (granite-3.1-2b's: embeddings times 12, branches times 0.22, attention scale 1 / head_dim, logits / 8), a
    # Granite-MoE (and -Shared) too. A Gemma 2 gets gemma-2's soft caps (attention 50, logits 30).
    granite = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=heads / hidden,
                   logits_scaling=8.0) if model_type in GRANITE_TYPES else {}
    granite |= dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0) if model_type == "gemma2" else {}
    # A mixture of experts: 4 experts of a quarter of the dense MLP's width, each token through 2, every layer sparse
    # (a Qwen3-MoE as Qwen3-30B-A3B's: its top 8 of 128 renormalised; a Mixtral's top 2 of 8, always renormalised; an
    # OLMoE's top 8 of 64, not renormalised; a Qwen2-MoE's, as Qwen1.5-MoE-A2.7B's top 4 of 60, not renormalised, with
    # a shared expert twice a routed one's width, and Qwen2's q/k/v biases; a Granite-MoE's, as granite-3.1-1b-a400m's
    # top 8 of 32, its softmax over the top-k logits, renormalised; a Granite-MoE-Shared's with its ungated shared
    # expert twice a routed one's width). Mixtral's, OLMoE's and Granite-MoE's experts are intermediate_size wide.
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
               norm_topk_prob=model_type not in ("olmoe", "qwen2_moe")) if model_type in MOE_TYPES else {}
    if model_type in SHARED_EXPERT_TYPES:
        moe["shared_expert_intermediate_size"] = hidden
    dense = hidden // 2 if model_type in EVERY_LAYER_SPARSE else hidden * 2
    return ModelArgs(vocab_size=(vocab_size + 7) // 8 * 8, hidden_size=hidden, intermediate_size=dense,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=64, model_type=model_type,
                     attention_bias=model_type in ("qwen2", "qwen2_moe"),
                     tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=1,
                     initializer_range=init_std, **granite, **moe)


@torch.no_grad()
def greedy_accuracy(model, prompts: list[list[int]], answers: list[list[int]], batch: int = 128) -> float:
    """Share of prompts whose answer (+ EOS) greedy decoding reproduces exactly: with teacher
    forcing, every answer token must be the argmax after the correct prefix (then greedy
    decoding emits exactly that prefix and stops at EOS) — the demo's exact-match reward."""
    from trainer.forward import build_micro_batch

    exact = 0
    for s in range(0, len(prompts), batch):
        mb = build_micro_batch(prompts[s:s + batch], answers[s:s + batch], "cpu", packed=True)
        logits = model(mb.input_ids, **mb.model_kwargs()).reshape(-1, model.args.vocab_size)
        wrong = (logits[mb.src_index].argmax(-1) != mb.src_labels).long()
        exact += int((torch.zeros(mb.batch_size, dtype=torch.long).index_add_(0, mb.dst_row, wrong) == 0).sum())
    return exact / max(len(prompts), 1)


def supervised_warmup(model, tokenizer, train_file: str, val_file: str, slip: float, steps: int, batch: int,
                      lr: float, seed: int, log=print) -> float:
    """`steps` steps of teacher-forced training on `answer + eos` after each chat-formatted
    prompt, where the answer is the demonstrator's: `forgotten_carry(a, b)` with probability
    `slip` (drawn anew each time a prompt is drawn, so that no prompt is always slipped), else
    `a + b`. Returns the share of validation prompts on which greedy decoding then gives the
    demonstrator's most likely answer.

    A fixed length rather than a stop on accuracy: greedy decoding imitates the demonstrator
    soon after this tiny model's sudden transition into adding (300 to 400 steps on seeds 0-2),
    but the probability it gives the right answer to a carry problem, which is what PPO needs
    to sample, keeps rising towards 1 - slip for a few hundred steps more."""
    from trainer.forward import build_micro_batch, response_logprobs

    ds = RLHFDataset([train_file], tokenizer, max_prompt_length=SFT_PROMPT_LIMIT)
    encode = lambda n: tokenizer(str(n), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # noqa: E731
    pairs = [operands(rec) for _, rec in read_records(train_file)]
    right = [encode(a + b) for a, b in pairs]
    slipped = [encode(forgotten_carry(a, b)) for a, b in pairs]
    val = RLHFDataset([val_file], tokenizer, max_prompt_length=SFT_PROMPT_LIMIT)
    val_prompts = [val[i]["input_ids"] for i in range(len(val))]
    likely = forgotten_carry if slip > 0.5 else (lambda a, b: a + b)
    val_answers = [encode(likely(*operands(rec))) for _, rec in read_records(val_file)]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Linear warm-up, then cosine decay to a tenth: at a constant 3e-3 some seeds never
    # settle into the solution.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))))
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(ds), (batch,), generator=gen).tolist()
        slips = (torch.rand(batch, generator=gen) < slip).tolist()
        answers = [slipped[i] if s else right[i] for i, s in zip(idx, slips)]
        mb = build_micro_batch([ds[i]["input_ids"] for i in idx], answers, "cpu", packed=True)
        logp, _ = response_logprobs(model, mb, max(map(len, answers)), 1.0, with_entropy=False)
        mask = torch.zeros_like(logp)
        for b, ans in enumerate(answers):
            mask[b, :len(ans)] = 1
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 and step < steps:
            log(f"sft step {step}: loss {loss.item():.4f}")
    acc = greedy_accuracy(model, val_prompts, val_answers)
    log(f"sft done after {steps} steps: greedy decoding gives the demonstrator's most likely answer to "
        f"{acc:.1%} of the validation prompts")
    return acc


def missing_assets(out: str) -> list[str]:
    """The files of a complete OUT (see the module docstring) that are absent; the stamp alone
    cannot tell, since a file may have been deleted after it was written."""
    files = [os.path.join(out, *parts) for parts in (
        ("tokenizer", "tokenizer.json"), ("tokenizer", "tokenizer_config.json"), ("train.jsonl",), ("val.jsonl",),
        ("sft_model", "config.json"), ("sft_model", "tokenizer.json"), ("sft_model", "tokenizer_config.json"))]
    missing = [path for path in files if not os.path.isfile(path)]
    model_dir = os.path.join(out, "sft_model")
    if not (os.path.isdir(model_dir) and any(name.endswith(".safetensors") for name in os.listdir(model_dir))):
        missing.append(os.path.join(model_dir, "*.safetensors"))
    return missing


def why_out_of_date(out: str, settings: dict) -> str | None:
    """Why OUT must be (re)built with `settings`, or None when it is up to date: its stamp reads
    back equal to `settings` (an unreadable or corrupt stamp is out of date) and no asset is
    missing."""
    stamp = os.path.join(out, STAMP)
    if not os.path.exists(stamp):
        return "not built yet"
    try:
        with open(stamp) as f:
            stamped = json.load(f)
    except (OSError, ValueError) as err:
        return f"unreadable stamp {stamp} ({err})"
    if isinstance(stamped, dict):
        stamped.setdefault("model_type", "qwen2")  # stamps written before --model-type existed
    if stamped != settings:
        return "built with other settings"
    missing = missing_assets(out)
    return f"incomplete (missing {', '.join(missing)})" if missing else None


SFT_PROMPT_LIMIT = 32  # tokens: the longest prompt the demonstrator's training reads


def check_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse, with `p.error` (exit 2), options that would fail mid-build or give a broken model."""
    if not a.out.strip():  # (an unset shell variable) no directory to build in
        p.error(f"--out {a.out!r} is empty: give the assets directory, e.g. runs/demo_assets")
    if not 0.0 <= a.slip <= 1.0:
        p.error(f"--slip must be in [0, 1], got {a.slip}")
    for name in ("n_train", "n_val", "hidden", "layers", "heads", "kv_heads", "sft_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    for name in ("init_std", "lr"):
        if not getattr(a, name) > 0:  # NaN included
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.sft_max_steps < 0:
        p.error(f"--sft-max-steps must be at least 0, got {a.sft_max_steps}")
    if a.max_value < 0:
        p.error(f"--max-value must be at least 0, got {a.max_value}")
    tok = build_demo_tokenizer()
    text, _ = render_prompt(tok, [{"role": "user", "content": f"{a.max_value}+{a.max_value}="}], "--max-value")
    longest = len(tok(text, add_special_tokens=False)["input_ids"])
    if longest > SFT_PROMPT_LIMIT:
        p.error(f"--max-value {a.max_value}: its prompts are up to {longest} tokens, more than the "
                f"{SFT_PROMPT_LIMIT} the demo reads")
    if a.n_train + a.n_val > (a.max_value + 1) ** 2:
        p.error(f"--n-train + --n-val = {a.n_train + a.n_val} exceeds the {(a.max_value + 1) ** 2} distinct "
                f"problems with operands up to --max-value {a.max_value}")
    # Rotary embeddings rotate pairs of dimensions: each head needs an even width.
    if a.hidden % a.heads or (a.hidden // a.heads) % 2:
        p.error(f"--hidden {a.hidden} must be a multiple of 2 x --heads {a.heads} (an even head width)")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo_assets")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT is complete")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v,
                       choices=SUPPORTED_MODEL_TYPES if k == "model_type" else None)
    a = p.parse_args(argv)
    check_options(p, a)
    settings = {k: getattr(a, k) for k in DEFAULTS}
    stamp = os.path.join(a.out, STAMP)
    from trainer.configlib import ConfigError
    from trainer.setup import check_output_dir

    try:
        check_output_dir("--out", a.out)
    except ConfigError as e:
        p.error(str(e))
    reason = "--force" if a.force else why_out_of_date(a.out, settings)
    if reason is None:
        print(f"demo assets in {a.out} are up to date")
        return 0
    print(f"building demo assets in {a.out}: {reason}")
    if os.path.exists(stamp):
        # Gone while rebuilding: an interrupted rebuild must not pass for the old, complete OUT.
        os.remove(stamp)
    t0 = time.time()
    # One thread: this model's ops take microseconds, so a second OpenMP thread gains ~10 % on an
    # idle 2-core machine, while on a busy one every op's barrier waits for a descheduled thread
    # (2 threads there took over 10x longer than 1).
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    paths = prepare_demo(a.out, n_train=a.n_train, n_val=a.n_val, seed=a.seed, max_value=a.max_value)
    from models import Transformer  # (the model's implementation: imported once OUT needs building)
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(paths.tokenizer_dir)
    args = demo_model_args(len(tok), a.hidden, a.layers, a.heads, a.kv_heads, tok.eos_token_id, tok.pad_token_id,
                           init_std=a.init_std, model_type=a.model_type)
    model = Transformer.build(args, seed=a.seed)
    supervised_warmup(model, tok, paths.train_file, paths.val_file, a.slip, a.sft_max_steps, a.sft_batch, a.lr,
                      a.seed)
    out_model = os.path.join(a.out, "sft_model")
    tmp = out_model + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_model, ignore_errors=True)
    os.replace(tmp, out_model)
    with open(stamp + ".tmp", "w") as f:
        json.dump(settings, f)
    os.replace(stamp + ".tmp", stamp)  # all or nothing: a half-written stamp would read as corrupt
    print(f"demo assets written to {a.out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
