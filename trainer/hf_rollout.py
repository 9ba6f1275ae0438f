"""`rollout.name=hf`: the reference rollout, a plain sampling loop on the training model.

No KV cache: every new token re-runs the model over the whole (padded) batch, so it is slow
and only meant for tiny models, tests and cross-checking the engine. It runs on the FSDP
actor itself, so every rank must make the same number of forward calls: the loop continues
until no rank has an unfinished sequence (an all-reduce per token), and a rank without
prompts runs a one-token dummy batch.

Sampling and log-probs follow the engine's conventions: log-probs are
`log_softmax(logits / temperature)` of the chosen token (logits / 1 for greedy), top-k /
top-p only restrict which tokens can be drawn.
"""

from __future__ import annotations

import torch

from rollout.config import RequestOutput
from rollout.sampler import truncation_threshold
from sharding import comm
from sharding.fsdp import keep_compute_copies


@torch.no_grad()
def generate_no_cache(model, prompts: list[list[int]], *, n: int, max_tokens: int, eos_ids: list[int],
                      ignore_eos: bool, seed: int, temperature: float, top_p: float, top_k: int,
                      device: torch.device, pad_token_id: int = 0) -> list[RequestOutput]:
    with keep_compute_copies(model):  # one cast of the masters for the whole loop, not one per token
        reqs = [(i, s, p) for i, p in enumerate(prompts) for s in range(n)]
        gen = torch.Generator(device=device).manual_seed(seed)
        seqs = [list(p) for _, _, p in reqs]
        outs = [[] for _ in reqs]
        lps = [[] for _ in reqs]
        done = [False] * len(reqs)
        reasons = ["length"] * len(reqs)
        eos = set(eos_ids)
        for _ in range(max_tokens):
            active = [k for k, d in enumerate(done) if not d]
            if comm.all_reduce_values([len(active)], "max")[0] == 0:
                break
            batch = [seqs[k] for k in active] or [[pad_token_id]]
            width = max(len(s) for s in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, s in enumerate(batch):
                ids[b, width - len(s):] = torch.tensor(s)
                mask[b, width - len(s):] = 1
            logits = model(ids.to(device), attention_mask=mask.to(device))[:, -1].float()
            if not active:
                continue
            scaled = logits / (temperature if temperature > 0 else 1.0)
            logp_all = torch.log_softmax(scaled, -1)
            if temperature > 0:
                keep = scaled >= truncation_threshold(scaled, top_k, top_p)[:, None]
                probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1)
                tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
            else:
                tok = logits.argmax(-1)
            chosen = logp_all.gather(-1, tok[:, None])[:, 0].tolist()
            for b, k in enumerate(active):
                t = int(tok[b])
                seqs[k].append(t)
                outs[k].append(t)
                lps[k].append(chosen[b])
                if t in eos and not ignore_eos:
                    done[k], reasons[k] = True, "stop"
        return [RequestOutput(prompt_index=i, sample_index=s, prompt_token_ids=list(p), token_ids=outs[k],
                              logprobs=lps[k], finish_reason=reasons[k])
                for k, (i, s, p) in enumerate(reqs)]
