"""meshppo: KL-regularized PPO for LLMs. Every rank runs this program under torchrun.

    launch/run_single_node.sh --config configs/demo.yaml [dotted.key=value ...]    # the launcher
    torchrun --nproc_per_node=N train_ppo.py --config configs/demo.yaml [dotted.key=value ...]
    python train_ppo.py --config configs/demo.yaml --print-config
"""

from __future__ import annotations

import argparse
import contextlib
import sys


def parse_args(argv=None):
    from trainer.launch import add_config_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print-config", action="store_true",
                   help="check the config against the launch it describes (trainer.nnodes x "
                        "trainer.n_gpus_per_node; on any machine: this one's GPUs are checked at launch), print the "
                        "resolved config and the start-up notes and exit")
    add_config_args(p)
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from trainer import launch
    from trainer.versions import check_versions

    if code := check_versions():  # an older torch or transformers than requirements.txt's: one line each
        return code

    launch.attach()
    with contextlib.ExitStack() as held:  # rank 0's hold on the run directory, for the run
        return launch.finish(_run(args, held))


def _run(args, held: contextlib.ExitStack) -> int:
    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, load_config
    from trainer.launch import (agreed_config_errors, config_error_lines, config_file, holding_run_dir,
                                local_world_size_from_env, print_config, rank_from_env, run_dir_held_by_launcher,
                                say_start_up_notes, world_size_from_env)
    from trainer.setup import preflight

    # The ranks agree on their config errors (one rank's alone too) before any work; rank 0 says them.
    is_main, error = rank_from_env() == 0, None
    try:
        cfg = load_config(PPOConfig, config_file(args), args.overrides)
        if args.print_config:  # the launch the config describes, on whatever machine this is
            preflight(cfg, devices=False)
        else:
            preflight(cfg, world_size_from_env(), local_world_size_from_env())
            # another run in the directory: refused before this one touches it (a one-node launch's
            # launcher holds it for its ranks)
            if is_main and not run_dir_held_by_launcher(cfg.trainer.default_local_dir):
                held.enter_context(holding_run_dir(cfg.trainer.default_local_dir))
    except ConfigError as e:
        error = str(e)
    try:
        errors = agreed_config_errors(error)
    except ConfigError as e:  # the ranks cannot meet to agree (MASTER_ADDR / MASTER_PORT): each says it
        print(f"meshppo: config error: {e}", file=sys.stderr)
        return 2
    if errors:
        if is_main:
            for line in config_error_lines(errors, world_size_from_env()):
                print(line, file=sys.stderr)
        return 2
    if args.print_config:
        if is_main:
            print_config(cfg)
        return 0
    if is_main:
        say_start_up_notes(cfg)
    from trainer.ppo_trainer import run

    return run(cfg)
