"""A rank that stops answering: the others fail after trainer.nccl_timeout with one line that
names the rank, the phase and the timeout as the config set it (here verl's
actor_rollout_ref.nccl_timeout, the other name of trainer.nccl_timeout), instead of hanging."""

from tests.e2e.conftest import demo_args, torchrun


def test_a_hung_rank_times_out_with_rank_and_phase(tiny_assets, tmp_path):
    r = torchrun(demo_args(tiny_assets, tmp_path / "run", "trainer.total_training_steps=2", "trainer.test_freq=-1",
                           "trainer.val_before_train=false", "actor_rollout_ref.nccl_timeout=5", "data.train_batch_size=8",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"),
                 env_extra={"MESHPPO_FAULTS": "hang@2:1"}, timeout=300)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("meshppo: error (rank 0)")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "a collective failed in phase '" in lines[0] and "actor_rollout_ref.nccl_timeout=5 s" in lines[0], lines[0]
    assert "phase 'setup'" not in lines[0]  # step 2's first collective, inside a named phase
