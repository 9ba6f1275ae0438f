#!/usr/bin/env bash
# Training-side GPU benchmarks in one call (one H200): MFU of the actor update and forward
# log-prob, the chunked-vs-full log-prob memory, and the full PPO / GRPO steps. Each step's
# JSON lines go to $OUT (or runs/bench) and a short table is printed last.
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
[[ "${SKIP_STEP:-0}" == 1 ]] || {
  run ppo_step_ppo python bench/ppo_step.py --workloads ppo --steps "${STEPS:-4}" --work-dir /tmp/meshppo_bench
  run ppo_step_grpo python bench/ppo_step.py --workloads grpo --steps "${STEPS:-4}" --work-dir /tmp/meshppo_bench
}
python - "$OUT" <<'PY'
import json, sys, glob
print(f"{'bench':10} {'model':14} {'what':22} {'figure':>14} {'mfu':>6} {'peak GB':>8}")
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    for line in open(f):
        if not line.startswith("{"):
            continue
        r = json.loads(line); w = r["workload"]
        if r["benchmark"] == "train":
            fig = f"{r.get('tokens_per_s', 0):,.0f} tok/s" if "tokens_per_s" in r else f"{r['seconds']*1e3:.0f} ms"
            print(f"train      {w['model']:14} {w['variant'] + '/' + w['phase']:22} {fig:>14} "
                  f"{r.get('mfu', 0) * 100:5.1f}% {r['peak_memory_gb']:8.1f}")
        elif r["benchmark"] == "ppo_step":
            t = r["timing_s"]
            print(f"ppo_step   {w['model']:14} {w['workload']:22} {r['throughput_tok_s_per_gpu']:>10,.0f} tok/s "
                  f"{(r['mfu_actor'] or 0) * 100:5.1f}% {r['peak_memory_gb']:8.1f}  reshard {r['reshard_share']*100:.2f}%  "
                  + " ".join(f"{k.split('/')[1]}={v:.2f}" for k, v in t.items()))
PY
