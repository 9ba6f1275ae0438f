#!/usr/bin/env bash
# One node: torchrun with one process per GPU (or NPROC CPU ranks when there is no GPU).
# Only rank 0's output reaches the terminal; every rank's full log is kept under LOG_DIR.
#
#   launch/run_single_node.sh --config configs/gsm8k_qwen2.5_0.5b.yaml trainer.total_epochs=2
#
# Environment: NPROC (default: number of visible GPUs, else 2), LOG_DIR (default runs/logs),
# MAX_RESTARTS (default 0; with >0 a crashed rank restarts the job, which resumes from the last
# checkpoint through trainer.resume_mode=auto).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${NPROC:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
      NPROC=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
    else
      NPROC=$(nvidia-smi -L | wc -l)
    fi
  else
    NPROC=2
  fi
fi
LOG_DIR=${LOG_DIR:-runs/logs}
mkdir -p "$LOG_DIR"
# Never let NCCL use NVLink multicast (NVLS) on shared machines.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# An explicit c10d rendezvous on a free local port rather than --standalone: restarted workers
# (--max-restarts) hang in init_process_group under --standalone (seen with torch 2.13).
PORT=${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
exec python -m torch.distributed.run --nnodes=1 --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$PORT" \
  --nproc_per_node="$NPROC" \
  --max-restarts="${MAX_RESTARTS:-0}" --log-dir="$LOG_DIR" --redirects=3 --tee=3 \
  --local-ranks-filter=0 \
  train_ppo.py "$@"
