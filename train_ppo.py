"""meshppo: KL-regularized PPO for LLMs. Every rank runs this program under torchrun.

    launch/run_single_node.sh --config configs/demo.yaml [dotted.key=value ...]    # the launcher
    torchrun --nproc_per_node=N train_ppo.py --config configs/demo.yaml [dotted.key=value ...]
    python train_ppo.py --config configs/demo.yaml --print-config
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
