"""RMSNorm as one Triton kernel (CUDA): the fast decoder's stand-in for the families' RMSNorm modules,
the CUDA twin of ``norm_act.rms_norm`` (forward only: decoding needs no gradients).

The modules run about eight kernels each (to fp32, square, mean, add eps, rsqrt, multiply, round,
times the weight), two or four per decoder layer plus the final norm and, in Qwen3 and Gemma 3, the
per-head q/k norms: a decode step is bound by kernel launches, and these were most of its launches
outside the attention and the products. Here one launch does the whole norm, with the roundings of
``rms_norm`` (``offset`` False: Llama's, normalised in fp32, rounded to x's dtype, then times the
weight; True: Gemma's, times ``1 + weight`` in fp32, rounded once). The sum of squares is fp32 in
another order than PyTorch's, so results may differ from the module in the last bit.

Rows are ``x``'s vectors over its last dim, which must be contiguous; the leading dims may be one
stride (hidden states) or two (Qwen3's per-head q/k norm on a view of the fused q/k/v product, whose
heads lie ``D`` apart within a token and tokens ``(H + 2 Hk) D`` apart): no copy for either. Each
program normalises ``ROWS`` rows of ``BLOCK_D`` (the row's length rounded up to a power of 2). The
number of rows is not specialised on, so a prefill and the decode steps share one compiled kernel.
Tested against the modules with Triton's interpreter on the CPU (``tests/ops/triton_interpret_norm_act.py``)
and on CUDA (``tests/gpu/test_gpu_norm_act.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_act import rms_norm_dtype

TILE = 4096  # elements per program (rows x BLOCK_D); rows of up to norm_act.MAX_NORM_D


@triton.jit
def _normalised(x, w_ptr, d, dm, D, eps, x_ty: tl.constexpr, OFFSET: tl.constexpr):
    """Rows ``x`` (fp32, from ``x_ty``) normalised and weighted with ``rms_norm``'s roundings (fp32 result)."""
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if OFFSET:  # Gemma: (h * (1 + w)) rounded once
        return h * (1.0 + w[None, :])
    return h.to(x_ty).to(tl.float32) * w[None, :]  # Llama: h rounded to x's dtype, then times the weight


def _tiles(d: int) -> tuple[int, int, int]:
    """A row of ``d`` as the kernels take it: (its block, rows a program, warps)."""
    bd = triton.next_power_of_2(d)
    per = max(1, min(16, TILE // bd))
    return bd, per, 8 if per * bd > TILE else 4


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm(x_ptr, w_ptr, y_ptr, n_rows, R, D, s_outer, s_inner, eps,
              OFFSET: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # rows, 64-bit: large batches x lengths
    d = tl.arange(0, BD)
    dm = d < D
    m = (i < n_rows)[:, None] & dm[None, :]
    outer = i // R
    base = outer * s_outer + (i - outer * R) * s_inner
    x = tl.load(x_ptr + base[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    y = _normalised(x, w_ptr, d, dm, D, eps, x_ptr.dtype.element_ty, OFFSET)
    tl.store(y_ptr + i[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_rows"])
def _add_rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_rows, D, eps, OFFSET: tl.constexpr, ROWS: tl.constexpr,
                  BD: tl.constexpr):
    """``s = r + x`` rounded to their dtype (stored), then ``_rms_norm`` of ``s``; contiguous rows."""
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BD)
    dm = d < D
    m = (i < n_rows)[:, None] & dm[None, :]
    at = i[:, None] * D + d[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + at, mask=m, other=0.0).to(tl.float32)
    s = (r + x).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + at, s, mask=m)
    y = _normalised(s.to(tl.float32), w_ptr, d, dm, D, eps, s_ptr.dtype.element_ty, OFFSET)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` as rows without a copy where its layout allows: (tensor, rows per outer index R, outer
    stride, inner stride), row ``i`` starting at ``(i // R) * outer + (i % R) * inner``."""
    d = x.shape[-1]
    if x.stride(-1) == 1:
        try:  # one stride between rows (hidden states, contiguous or a slice of tokens)
            flat = x.view(-1, d)
            return flat, 1, flat.stride(0), 0
        except RuntimeError:
            pass
        if x.dim() >= 3:
            try:  # two: heads within a token, tokens (Qwen3's q/k norm on the fused product's view)
                three = x.view(-1, x.shape[-2], d)
                return three, three.shape[1], three.stride(0), three.stride(1)
            except RuntimeError:
                pass
    flat = x.reshape(-1, d).contiguous()
    return flat, 1, flat.stride(0), 0


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """``norm_act.rms_norm(x, weight, eps, offset)`` in one launch: a new contiguous tensor of x's
    shape, in ``norm_act.rms_norm_dtype`` (inputs as ``norm_act.rms_norm_kernel_takes`` allows)."""
    d = x.shape[-1]
    rows, r, s_outer, s_inner = _rows(x)
    n_rows = rows.numel() // d
    y = torch.empty(x.shape, dtype=rms_norm_dtype(x.dtype, weight.dtype, offset), device=x.device)
    bd, per, warps = _tiles(d)
    _rms_norm[(triton.cdiv(n_rows, per),)](rows, weight.contiguous(), y, n_rows, r, d, s_outer, s_inner, float(eps),
                                           OFFSET=offset, ROWS=per, BD=bd, num_warps=warps)
    return y


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_act.add_rms_norm(x, residual, weight, eps, offset)`` in one launch where PyTorch takes the add and
    the norm apart: ``(normed, summed)``, new contiguous tensors (inputs as ``norm_act.add_rms_norm_kernel_takes``
    allows)."""
    d = x.shape[-1]
    x, residual = x.contiguous(), residual.contiguous()
    n_rows = x.numel() // d
    y = torch.empty(x.shape, dtype=rms_norm_dtype(x.dtype, weight.dtype, offset), device=x.device)
    s = torch.empty_like(x)
    bd, per, warps = _tiles(d)
    _add_rms_norm[(triton.cdiv(n_rows, per),)](x, residual, weight.contiguous(), y, s, n_rows, d, float(eps),
                                               OFFSET=offset, ROWS=per, BD=bd, num_warps=warps)
    return y, s
