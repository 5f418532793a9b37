"""A gated MLP's ``act(gate) * up`` as one Triton kernel (CUDA), over the ``[..., 2I]`` output of its
fused gate/up product (``models.fusion.FusedGatedMLP``): the CUDA twin of ``norm_act.gated_act``
(forward only: decoding needs no gradients).

PyTorch runs the activation and the product as two kernels (and the split of the product as views);
one launch here, with PyTorch's roundings: ``act(gate)`` computed in fp32 and rounded to the input's
dtype, then the product in fp32, rounded. Activations (``ACT``): SiLU ``g / (1 + exp(-g))`` (Llama,
Qwen, SmolLM) and GELU's tanh form (Gemma 1/2/3), computed as ``g / (1 + exp(-2z))``, which is
``0.5 g (1 + tanh(z))`` for ``z = sqrt(2 / pi) (g + 0.044715 g^3)`` (no tanh in portable Triton);
either may differ from PyTorch's in the last bit.

Each program takes ``BLOCK`` columns of one row; the number of rows is not specialised on, so a
prefill and the decode steps share one compiled kernel. Tested against the modules with Triton's
interpreter on the CPU (``tests/ops/triton_interpret_norm_act.py``) and on CUDA
(``tests/gpu/test_gpu_norm_act.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_act import ACTIVATIONS

BLOCK = 1024  # columns per program
CODES = {"silu": 0, "gelu_tanh": 1}
assert set(CODES) == set(ACTIVATIONS)


@triton.jit(do_not_specialize=["n_rows"])
def _gated_act(h_ptr, y_ptr, n_rows, I, s_row, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(h_ptr + row * s_row + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * s_row + I + c, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    a = a.to(h_ptr.dtype.element_ty).to(tl.float32)  # act(gate) is a tensor of the input's dtype in PyTorch
    tl.store(y_ptr + row * I + c, (a * u).to(y_ptr.dtype.element_ty), mask=m)


def gated_act_triton(h: torch.Tensor, act: str) -> torch.Tensor:
    """``norm_act.gated_act(h, act)`` in one launch: ``[..., I]`` from ``h = [gate | up]`` ``[..., 2I]``
    (inputs as ``norm_act.gated_act_kernel_takes`` allows)."""
    two_i = h.shape[-1]
    i = two_i // 2
    try:  # rows one stride apart (the product's output: contiguous)
        rows = h.view(-1, two_i) if h.stride(-1) == 1 else None
    except RuntimeError:
        rows = None
    if rows is None:
        rows = h.reshape(-1, two_i).contiguous()
    n_rows = rows.shape[0]
    y = torch.empty(*h.shape[:-1], i, dtype=h.dtype, device=h.device)
    block = min(BLOCK, triton.next_power_of_2(i))
    _gated_act[(n_rows, triton.cdiv(i, block))](rows, y, n_rows, i, rows.stride(0), ACT=CODES[act], BLOCK=block,
                                                num_warps=4)
    return y
