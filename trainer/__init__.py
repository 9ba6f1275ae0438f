"""The PPO runtime: the trainer loop, the roles (actor, critic, reference, reward model) and the
rollout phase, the config, checkpoints, tracking, launch and faults. The maths it runs is in
`ppo/`; see docs/ARCHITECTURE.md for the packages and who imports whom."""
