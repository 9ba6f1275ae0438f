"""meshppo: KL-regularized PPO for LLMs. Every rank runs this program under torchrun.

    launch/run_single_node.sh --config configs/demo.yaml [dotted.key=value ...]    # the launcher
    torchrun --nproc_per_node=N train_ppo.py --config configs/demo.yaml [dotted.key=value ...]
    python train_ppo.py --config configs/demo.yaml --print-config
"""

import os
import sys

from trainer.cli import main

if __name__ == "__main__":
    code = main()
    # Everything is written and closed and the process group destroyed: leave without the
    # interpreter's teardown, in which the collective backends' C++ threads and the objects
    # still holding tensors can abort a rank that has finished (exit -6; seen with gloo under
    # torch 2.13 on a loaded machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
