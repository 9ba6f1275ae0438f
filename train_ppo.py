"""meshppo: KL-regularized PPO for LLMs. Every rank runs this program under torchrun.

    torchrun --nproc_per_node=N train_ppo.py --config configs/demo.yaml [dotted.key=value ...]
    python train_ppo.py --config configs/demo.yaml --print-config
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.yaml", help="YAML config file (default: configs/demo.yaml)")
    p.add_argument("--print-config", action="store_true", help="validate, print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.total_training_steps=5")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ppo.configlib import ConfigError, load_config, to_commented_yaml
    from ppo.config import PPOConfig

    try:
        cfg = load_config(PPOConfig, args.config, args.overrides)
        if args.print_config:
            from ppo.config import validate
            from ppo.launch import world_size_from_env

            validate(cfg, world_size_from_env())
            print(to_commented_yaml(cfg))
            return 0
        from ppo.trainer import run

        return run(cfg)
    except ConfigError as e:
        print(f"meshppo: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
