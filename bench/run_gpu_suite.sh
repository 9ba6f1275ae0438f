#!/usr/bin/env bash
# Training-side GPU benchmarks in one call (one H200): MFU of the actor update and forward
# log-prob, the chunked-vs-full log-prob memory, the capped (Gemma 2) attention's paths, and the
# full PPO / GRPO steps. Each step's JSON lines go to $OUT (or runs/bench) and a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err" || { echo "!! $name failed (exit $?)"; tail -20 "$OUT/$name.err"; }
}
[[ "${SKIP_TRAIN:-0}" == 1 ]] || run train python bench/train.py --variants "${TRAIN_VARIANTS:-base,full_logits}"
[[ "${SKIP_ATTENTION:-0}" == 1 ]] || run attention python bench/attention.py
[[ "${SKIP_STEP:-0}" == 1 ]] || {
  run ppo_step_ppo python bench/ppo_step.py --workloads ppo --steps "${STEPS:-4}" --work-dir /tmp/meshppo_bench
  run ppo_step_grpo python bench/ppo_step.py --workloads grpo --steps "${STEPS:-4}" --work-dir /tmp/meshppo_bench
}
python bench/table.py "$OUT"/*.jsonl
