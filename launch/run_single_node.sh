#!/usr/bin/env bash
# One node: meshppo's launcher (python -m trainer.launch, around torchrun) with one rank per GPU the
# config describes (trainer.n_gpus_per_node; CPU ranks with gloo where there is no GPU).
#
#   launch/run_single_node.sh --config configs/gsm8k_qwen2.5_0.5b.yaml trainer.total_epochs=2
#
# What the launcher adds to torchrun (trainer/launch.py): the config is checked in one process before
# any rank starts; a config or input error is one line and exit code 2 or 1; SIGTERM, SIGUSR1 or
# Ctrl-C make the ranks write a checkpoint and exit 0, reported in one line (Ctrl-C twice: stop at
# once); only rank 0's output reaches the terminal, every rank's log is kept; a run directory another
# launch is running in is refused.
#
# Environment: NPROC (ranks; default trainer.n_gpus_per_node, which it must equal), LOG_DIR
# (default <trainer.default_local_dir>/logs), MAX_RESTARTS (default 0; with >0 a crashed rank, or a
# collective that timed out or lost its peer, restarts the job, which resumes from the last checkpoint
# through trainer.resume_mode=auto),
# PYTHON (default python3). Run it from anywhere: relative paths (--config, trainer.default_local_dir,
# data files, LOG_DIR) are relative to the working directory, as with python; the repository is put
# on PYTHONPATH. `--print-config` checks the config against this launch and prints it, starting nothing
# (this machine's GPUs are checked only when launching).
set -euo pipefail
repo=$(CDPATH= cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# Never let NCCL use NVLink multicast (NVLS) on shared machines.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
args=(--max-restarts="${MAX_RESTARTS:-0}")
if [[ -n "${NPROC:-}" ]]; then args+=(--nproc-per-node="$NPROC"); fi
if [[ -n "${LOG_DIR:-}" ]]; then args+=(--log-dir="$LOG_DIR"); fi
exec "${PYTHON:-python3}" -m trainer.launch "${args[@]}" "$@"
