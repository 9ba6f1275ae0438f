# meshppo tasks. `make demo` and `make test` are the two commands of the README's quick start.
PYTHON ?= python3
NPROC ?= 2
SEED ?= 0
# Seed 0 keeps the README's paths; another seed gets its own assets and run directory.
DEMO_TAG = $(if $(filter 0,$(SEED)),,_seed$(SEED))
DEMO_DIR ?= runs/demo_assets$(DEMO_TAG)
DEMO_RUN ?= runs/demo$(DEMO_TAG)
PYTEST_ARGS ?=
CONFIG ?= configs/demo.yaml
# One stamp per interpreter (e.g. PYTHON=.venv/bin/python): `make install` runs pip again only
# when requirements.txt is newer than the stamp.
INSTALL_STAMP := .make/installed$(subst /,_,$(abspath $(shell command -v $(PYTHON))))

.PHONY: install demo train test test-slow test-trl test-gpu test-gpu-multi lint bench-gpu plot

install: $(INSTALL_STAMP)  ## install meshppo's dependencies (torch 2.13.0 where no torch is installed)

$(INSTALL_STAMP): requirements.txt
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -r requirements.txt "triton; platform_system == 'Linux'" pyflakes
	@mkdir -p $(dir $@) && touch $@

# NPROC given to make (make train NPROC=1, or in the environment) sets the config's trainer.n_gpus_per_node
# too; otherwise the launcher starts the config's n_gpus_per_node ranks.
TRAIN_NPROC = $(if $(filter command environment,$(origin NPROC)),trainer.n_gpus_per_node=$(NPROC))

train: install  ## train with the launcher: make train CONFIG=configs/demo.yaml ARGS="trainer.total_training_steps=5" [NPROC=n]
	launch/run_single_node.sh --config $(CONFIG) $(TRAIN_NPROC) $(ARGS)

# The demo trains through the launcher, as make train does: a config error in ARGS (or an NPROC the batch
# does not split over) is one line before any rank starts, not torchrun's report of failed ranks.
demo: install  ## build the demo assets, then train on them with the launcher: 2 CPU ranks (NPROC=n: n ranks; SEED=k: another seed)
	@case " $(ARGS) " in *trainer.default_local_dir=*) echo "make demo: move the run with DEMO_RUN=DIR, not trainer.default_local_dir in ARGS (the plots read DEMO_RUN)" >&2; exit 2;; esac
	$(PYTHON) -m tools.prepare_demo --out $(DEMO_DIR) --seed $(SEED)
	PYTHON=$(PYTHON) launch/run_single_node.sh --config configs/demo.yaml \
		trainer.n_gpus_per_node=$(NPROC) data.train_files=[$(DEMO_DIR)/train.jsonl] data.val_files=[$(DEMO_DIR)/val.jsonl] \
		actor_rollout_ref.model.path=$(DEMO_DIR)/sft_model trainer.default_local_dir=$(DEMO_RUN) \
		data.seed=$(SEED) trainer.seed=$(SEED) trainer.resume_mode=disable $(ARGS)
	$(PYTHON) -m tools.plot $(DEMO_RUN)

test: install lint  ## static checks, then the CPU test suite without the slow tests (what CI runs)
	$(PYTHON) -m pytest tests -m "not slow" -ra -q -p no:cacheprovider $(PYTEST_ARGS)

test-slow: install  ## the slow CPU tests: the full demo recipe on seeds 0, 1 and 2 (about 4.5 min on 2 cores)
	$(PYTHON) -m pytest tests -m "slow and not trl" -ra -q -p no:cacheprovider $(PYTEST_ARGS)

# requirements-bench.txt pins TRL's datasets, which may move transformers / huggingface_hub: a venv of its own
# (make test-trl PYTHON=.venv-bench/bin/python) keeps the product's environment as it is.
test-trl: install  ## the learning bench's TRL runs against meshppo's, tiny (installs requirements-bench.txt)
	$(PYTHON) -m pip install -r requirements-bench.txt
	$(PYTHON) -m pytest tests -m trl -ra -q -p no:cacheprovider $(PYTEST_ARGS)

test-gpu:  ## GPU-only tests (need CUDA)
	$(PYTHON) -m pytest tests/gpu -ra -q

test-gpu-multi:  ## multi-GPU tests (2+ CUDA GPUs): trainer configs, same update on 1 and 2 GPUs, engine TP, resharder
	NCCL_NVLS_ENABLE=0 $(PYTHON) -m pytest tests/gpu/test_multi_gpu.py -ra -q $(PYTEST_ARGS)

lint:  ## static checks (pyflakes)
	$(PYTHON) -m pyflakes train_ppo.py models sharding rollout kl ppo trainer data rewards agent bench tools tests

bench-gpu:  ## the GPU benchmarks (one H200): rollout, reshard, training MFU, end-to-end step
	$(PYTHON) bench/rollout.py --quick
	$(PYTHON) bench/reshard.py
	bash bench/run_gpu_suite.sh

plot:  ## PNG plots of a run: make plot RUN=runs/demo (the default)
	$(PYTHON) -m tools.plot $(or $(RUN),runs/demo)
