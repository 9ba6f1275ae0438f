"""The sampler at TP 2 over two gloo processes: each rank races over half the vocabulary (in groups
of 1 and of 16), top-k gathers the ranks' top k, top-p all-gathers the scaled logits. The draws fit
softmax(logits / T) (truncated), equal the TP=1 draws, and greedy stays an exact argmax at the
hash's extremes."""

import torch

from tests.dist_utils import run_distributed


def _body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from rollout.ops import TorchOps
    from rollout.parallel import TPGroup
    from tests.unit.test_sampler import (FITS, P_REJECT, check_extremes, check_group_extremes, chi_square_pvalue,
                                         draw_tokens, expected_probs)

    torch.set_num_threads(1)
    tp = TPGroup.from_mesh(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])
    assert tp.size == 2
    # TOP_TOKEN (10) lies on rank 1, the greedy argmax (3) on rank 0: a NaN race there would win.
    check_extremes(TorchOps, tp=tp)
    check_group_extremes(TorchOps, tp=tp)  # 96 tokens a rank: groups of 16 as at TP 1
    for logits, case in FITS:  # 12 tokens: groups of 1; 32 tokens: one group of 16 a rank
        tokens, logprobs = draw_tokens(*case, tp=tp, logits=logits)
        p = chi_square_pvalue(tokens, expected_probs(*case, logits=logits))
        assert p > P_REJECT, (case, p)
        ref_tokens, ref_logprobs = draw_tokens(*case, n=4096, logits=logits)
        assert torch.equal(tokens[:4096], ref_tokens), case
        assert torch.allclose(logprobs[:4096], ref_logprobs, atol=1e-6), case


def test_sampler_tp2_fits_softmax_and_equals_tp1():
    run_distributed(_body, 2)
