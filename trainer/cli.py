"""meshppo: KL-regularized PPO for LLMs. Every rank runs this program under torchrun.

    launch/run_single_node.sh --config configs/demo.yaml [dotted.key=value ...]    # the launcher
    torchrun --nproc_per_node=N train_ppo.py --config configs/demo.yaml [dotted.key=value ...]
    python train_ppo.py --config configs/demo.yaml --print-config
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    from trainer.launch import add_config_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-config", action="store_true",
                   help="validate against the launch the config describes, print the resolved config and exit")
    add_config_args(p)
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from trainer import launch

    launch.attach()
    return launch.finish(_run(args))


def _run(args) -> int:
    from trainer.config import PPOConfig, config_notes, validate
    from trainer.configlib import ConfigError, load_config, to_commented_yaml
    from trainer.launch import local_world_size_from_env, rank_from_env, world_size_from_env

    # Every rank finds the same config error: only rank 0 says it.
    is_main = rank_from_env() == 0
    try:
        cfg = load_config(PPOConfig, args.config, args.overrides)
        if args.print_config:
            validate(cfg)
            print(to_commented_yaml(cfg))
        else:
            from trainer.setup import preflight

            preflight(cfg, world_size_from_env(), local_world_size_from_env())
    except ConfigError as e:
        if is_main:
            print(f"meshppo: config error: {e}", file=sys.stderr)
        return 2
    if is_main:
        from trainer.setup import model_notes

        for note in config_notes(cfg) + model_notes(cfg):
            print(f"meshppo: {note}", file=sys.stderr)
    if args.print_config:
        return 0
    from trainer.ppo_trainer import run

    return run(cfg)
