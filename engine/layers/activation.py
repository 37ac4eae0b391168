"""The MLP activations of the checkpoints we serve, by their config.json names."""

from functools import partial

import torch.nn.functional as F

from engine.errors import ModelLoadError

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelLoadError(
            f"activation {name!r} is not supported natively (supported: {', '.join(ACTIVATIONS)})"
        ) from None
