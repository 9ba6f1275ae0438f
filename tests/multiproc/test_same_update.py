"""The workers' promise, on gloo: the same global batch gives the same update on 1 and on 2
ranks, with FULL_SHARD and with data parallelism (the replicated runtime, whose gradients are
reduced once per mini-batch: the micro-batches before the last run under `no_gradient_sync`).
The check is tests/gpu/multi_gpu_checks.py's `same_update` (the GPU suite runs it over NCCL);
its micro-batch budget makes each rank's mini-batch several micro-batches. The same with the 2 ranks
as one Ulysses sequence-parallel group. The 1-rank update of each fsdp_size is run once for the file
(`one_rank_update`): every case of that fsdp_size compares its ranks' update against it."""

from __future__ import annotations

import pytest

from tests.gpu.test_multi_gpu import same_update_on_one_and_two_ranks, same_update_run


@pytest.fixture(scope="module")
def one_rank_update(tmp_path_factory):
    """`fsdp_size` -> the 1-rank update of that fsdp_size (`same_update_run`), launched at its first use."""
    runs = {}

    def of(fsdp_size: int) -> dict:
        if fsdp_size not in runs:
            out = tmp_path_factory.mktemp(f"one_rank_fsdp{fsdp_size}") / "update_1.pt"
            runs[fsdp_size] = same_update_run(out, 1, fsdp_size, "cpu")
        return runs[fsdp_size]

    return of


@pytest.mark.parametrize("fsdp_size", [-1, 1])
def test_same_update_on_one_and_two_ranks(tmp_path, one_rank_update, fsdp_size):
    same_update_on_one_and_two_ranks(tmp_path, fsdp_size, "cpu", one=one_rank_update(fsdp_size))


@pytest.mark.parametrize("fsdp_size", [-1, 1])
def test_same_update_ulysses(tmp_path, one_rank_update, fsdp_size):
    """The 2 ranks as one Ulysses group: they pool their rows and split every micro-batch's tokens;
    the update equals the 1-rank one (a wrong gradient scale or loss normaliser is off by 2x), under
    FSDP2 and under data parallelism's bucketed all-reduce."""
    same_update_on_one_and_two_ranks(tmp_path, fsdp_size, "cpu", sp=2, one=one_rank_update(fsdp_size))


def test_same_update_two_ulysses_groups(tmp_path, one_rank_update):
    """4 ranks as 2 Ulysses groups of 2 (2 data-parallel groups, each pooling its 2 ranks' rows): the
    loss normaliser counts each token once over the groups and the gradients average over them."""
    same_update_on_one_and_two_ranks(tmp_path, -1, "cpu", sp=2, ranks=4, one=one_rank_update(-1))
