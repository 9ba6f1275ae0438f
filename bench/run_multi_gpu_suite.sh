#!/usr/bin/env bash
# Several GPUs in one call: the multi-GPU correctness checks, then the reshard and the 7b GRPO
# step on NPROC GPUs. Each piece has its own time limit so one hang costs only itself.
#   OUT=dir NPROC=2 bash bench/run_multi_gpu_suite.sh
# (the scaling of the PPO step against one GPU: bench/scaling.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench}; N=${NPROC:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
t=tests/gpu/test_multi_gpu.py
[[ "${SKIP_TESTS:-0}" == 1 ]] || timeout "${TEST_LIMIT:-300}" python -m pytest -ra -q -x \
  $t::test_resharder_over_nccl $t::test_engine_tp2_matches_tp1 $t::test_same_update_on_one_and_two_gpus \
  $t::test_trainer_layouts_on_two_gpus 2>&1 | tail -15
for tp in 1 2; do
  timeout "${RESHARD_LIMIT:-90}" python -m torch.distributed.run --standalone --nproc_per_node="$N" bench/reshard.py \
    --models "${RESHARD_MODELS:-qwen2.5-1.5b}" --tp $tp --no-naive --profile >> "$OUT/reshard.jsonl" 2> "$OUT/reshard_tp$tp.err" \
    || { echo "!! reshard tp $tp failed"; tail -5 "$OUT/reshard_tp$tp.err"; }
done
# 7b GRPO, FULL_SHARD over the GPUs, engine TP 2 (configs/gsm8k_qwen2.5_7b_2gpu.yaml's layout),
# random weights drawn by the ranks (no model or checkpoint written: the bench runs the steps alone).
[[ "${SKIP_7B:-0}" == 1 ]] || timeout "${LIMIT_7B:-240}" python -m torch.distributed.run --standalone \
  --nproc_per_node="$N" bench/ppo_step.py --model qwen2.5-7b --workloads grpo --dummy --steps "${STEPS_7B:-3}" \
  --work-dir /tmp/meshppo_bench actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.model.enable_gradient_checkpointing=true actor_rollout_ref.actor.fsdp_config.forward_prefetch=true \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.25 ${OVERRIDES_7B:-} > "$OUT/ppo_step_7b.jsonl" 2> "$OUT/ppo_step_7b.err" \
  || { echo "!! 7b step failed"; tail -20 "$OUT/ppo_step_7b.err"; }
python bench/table.py "$OUT"/*.jsonl
