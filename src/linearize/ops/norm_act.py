"""The PyTorch twins of the fast decoder's norm and activation kernels (``rms_norm_triton``,
``gated_act_triton``): the functions the families' modules compute, op for op.

``rms_norm`` is both RMSNorm variants of the Llama family, with their roundings:

* Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 (``offset=False``): normalised in fp32, rounded to the
  input's dtype, then times the weight (the result in the promotion of the two dtypes);
* Gemma 1/2/3 (``offset=True``): normalised in fp32, times ``1 + weight`` in fp32, rounded to the input's dtype.

``add_rms_norm`` is a pre-norm decoder layer's residual add followed by the next RMSNorm (the sum rounded first).

``gated_act`` is a gated MLP's ``act(gate) * up`` over the ``[..., 2I]`` output of its fused gate/up
product (``models.fusion.FusedGatedMLP``): ``act(gate)`` rounded to the input's dtype, then the product.
No Triton here: ``models.fusion`` checks the modules against these twins on the CPU before a kernel
stands in for them.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

# the gated MLPs' activations the kernel computes (``ACT2FN`` names: silu for Llama, Qwen and SmolLM,
# gelu_pytorch_tanh for Gemma 1/2/3)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NORM_D = 16384  # longer rows: the module's own path (the kernel holds a row in registers)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """``x [..., D]`` over its last dim by its root mean square, times ``weight [D]`` (``1 + weight``
    with ``offset``), rounded as the families' RMSNorm modules round (module docstring)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder layer's residual add and the RMSNorm after it: ``(rms_norm(s), s)`` for
    ``s = residual + x`` (rounded to the inputs' dtype first, as the layer's ``residual + hidden_states``)."""
    s = residual + x
    return rms_norm(s, weight, eps, offset), s


def add_rms_norm_kernel_takes(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm_triton.add_rms_norm_triton`` takes these inputs: one dtype and shape for the two
    summands, and what the norm's kernel takes."""
    return x.dtype == residual.dtype and x.shape == residual.shape and rms_norm_kernel_takes(x, weight)


def rms_norm_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype, offset: bool) -> torch.dtype:
    """The dtype ``rms_norm`` returns."""
    return x_dtype if offset else torch.promote_types(weight_dtype, x_dtype)


def rms_norm_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm_triton`` takes these inputs (else the module's own path runs)."""
    return (x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and weight.shape == x.shape[-1:]
            and 0 < x.shape[-1] <= MAX_NORM_D and x.numel() > 0)


def gated_act(h: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for ``h = [gate | up]`` ``[..., 2I]``; ``act`` a key of ``ACTIVATIONS``."""
    gate, up = h.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def gated_act_kernel_takes(h: torch.Tensor) -> bool:
    """Whether ``gated_act_triton`` takes ``h`` (else the split and PyTorch's activation run)."""
    return h.dtype in KERNEL_DTYPES and h.shape[-1] % 2 == 0 and h.numel() > 0
