"""The start-up record of a CUDA run: CUDA and NCCL versions, the GPU's name."""

from types import SimpleNamespace

import pytest
import torch

from trainer.tracking import banner, run_info

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_run_info_on_cuda_names_cuda_nccl_and_the_gpu(tmp_path):
    dims = SimpleNamespace(hsdp=False, dp_shard=1, dp_replicate=1, tp=1, rollout_dp=1)
    info = run_info(torch.device("cuda", 0), 1, 1, dims, str(tmp_path), 0)
    assert info["device"] == "cuda" and info["cuda"] == torch.version.cuda
    assert info["gpu"] == torch.cuda.get_device_name(0)
    assert info["nccl"] and info["nccl"][0].isdigit(), info["nccl"]
    first, second, _ = banner(info).splitlines()
    assert f"CUDA {torch.version.cuda}, NCCL {info['nccl']}" in first
    assert f"cuda ({info['gpu']})" in second
