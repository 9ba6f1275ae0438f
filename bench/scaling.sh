#!/usr/bin/env bash
# Strong and weak scaling of the full PPO step on NPROC GPUs against one GPU, in one call:
#   OUT=dir NPROC=2 MODEL=qwen2.5-0.5b WORKLOADS=grpo,ppo bash bench/scaling.sh [dotted.key=value ...]
# Overrides (e.g. FSDP settings) apply to every run. JSON lines go to $OUT; a table is printed last.
# The one-GPU baseline is run every time; REUSE_ONE=1 keeps an earlier $OUT/one$TAG.jsonl instead,
# which the multi-GPU runs refuse (naming the difference) unless it ran the same workloads.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench}; N=${NPROC:-2}; MODEL=${MODEL:-qwen2.5-0.5b}; WL=${WORKLOADS:-grpo,ppo}
TAG=${TAG:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
common=(--model "$MODEL" --workloads "$WL" --work-dir /tmp/meshppo_bench)
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err" || { echo "!! $name failed (exit $?)"; tail -20 "$OUT/$name.err"; }
}
multi() { python -m torch.distributed.run --standalone --nproc_per_node="$N" bench/ppo_step.py "${common[@]}" "$@"; }
[[ "${REUSE_ONE:-0}" == 1 && -s "$OUT/one$TAG.jsonl" ]] || run "one$TAG" env CUDA_VISIBLE_DEVICES=0 python bench/ppo_step.py "${common[@]}" --profile "$@"
[[ "${SKIP_STRONG:-0}" == 1 ]] || run "strong$TAG" multi --baseline "$OUT/one$TAG.jsonl" --profile "$@"
[[ "${SKIP_WEAK:-0}" == 1 ]] || run "weak$TAG" multi --scaling weak --baseline "$OUT/one$TAG.jsonl" "$@"
python bench/table.py "$OUT"/*"$TAG".jsonl
