"""Int8 weights for CPU decoding, with PyTorch's own dynamic quantization.

Every nn.Linear becomes an int8 one: weights stored as int8 with one scale per output row,
activations quantized on the fly for each matmul. At batch 1 a decoding step reads every
weight once, so a quarter of the bytes is most of the speed-up. Embedding tables stay fp32
(a step reads only one row of them).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from tformer.errors import TformerError


def quantize_int8(model: nn.Module) -> nn.Module:
    """An int8 copy of `model` for inference on the CPU; the original is left as it is."""
    if next(model.parameters()).device.type != "cpu":
        raise TformerError("--int8 runs on the CPU; pass --device cpu")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    skip = set(getattr(model, "int8_skip", ()))
    spec = {
        name: per_channel_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in skip
    }
    with warnings.catch_warnings():
        # torch.ao.quantization announces its move to torchao; it still does this job well.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantized = quantize_dynamic(copy.deepcopy(model).eval(), spec, dtype=torch.qint8)
    return quantized
