import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as the reference implementation does.

    `fused`: a device kernel with the same result, fn(x, weight, eps), set by the device adapter
    (the CPU one's engine.devices.cpu.kernels); None runs the torch ops below."""

    fused = None

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dtype == self.weight.dtype:
            return self.fused(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: the weight is stored as an offset from one, and the product is taken in float32
    before the cast (Llama casts first), which matters in bfloat16."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rms_norm(hidden_size: int, eps: float, gemma: bool) -> RMSNorm:
    return GemmaRMSNorm(hidden_size, eps) if gemma else RMSNorm(hidden_size, eps)
