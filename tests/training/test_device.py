import contextlib

import pytest
import torch

from tformer.errors import TformerError
from tformer.training.device import autocast, pick_device


def test_auto_is_cuda_when_present_else_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected
    assert pick_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_a_missing_gpu_is_a_clear_error():
    with pytest.raises(TformerError, match="no CUDA device is available"):
        pick_device("cuda:1")


def test_auto_precision_is_fp32_on_the_cpu():
    cpu = torch.device("cpu")
    assert isinstance(autocast(cpu, "auto"), contextlib.nullcontext)
    assert isinstance(autocast(cpu, "fp32"), contextlib.nullcontext)
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_a_bad_device_name_is_a_clear_error():
    with pytest.raises(TformerError, match="'gpu0' is not a device"):
        pick_device("gpu0")
