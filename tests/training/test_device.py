import contextlib

import pytest
import torch

from tformer.errors import TformerError
from tformer.training.device import autocast, pick_device


def test_auto_follows_what_torch_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == torch.device("cuda")
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")


@pytest.mark.filterwarnings("ignore:User provided device_type")
@pytest.mark.parametrize("bf16_units", [True, False])
def test_auto_precision_on_a_gpu_is_bf16_where_it_has_bf16(monkeypatch, bf16_units):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_units)
    context = autocast(torch.device("cuda"), "auto")
    if bf16_units:
        assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16
    else:
        assert isinstance(context, contextlib.nullcontext)


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
