"""Per-head GroupNorm, its affine and an optional swish gate as one fused Triton kernel pair: the
CUDA twin of ``head_group_norm`` (``mixers/base.py``).

For ``x [..., H, D]`` (one row per head of each token), per row::

    y = ((x - mean) * rsqrt(var + eps) * w[h] + b[h]) * silu(gate)

PyTorch's layer norm is slow on rows of only D = 64 features, and the affine, the gate and their
backward passes each add launches and round trips through memory. Here one launch does the forward and one the backward.

Each program takes one head of a block of ``TILE // BLOCK_D`` tokens: a ``[tokens, BLOCK_D]`` tile
whose rows share ``w[h]`` and ``b[h]``, so the backward sums ``dw`` and ``db`` over the tile's rows
in registers and writes one partial per (token block, head); PyTorch adds the partials up.
Statistics and everything else are in fp32 whatever the input dtypes; the mean and rstd of every
row are kept for the backward pass. Tested against the PyTorch form with Triton's interpreter on the
CPU (``tests/ops/triton_interpret_group_norm_gate.py``) and on CUDA (``tests/gpu/test_gpu_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements per program (tokens x BLOCK_D)


@triton.jit
def _tile(x_ptr, g_ptr, w_ptr, b_ptr, n_tok, H, D, g_stride,
          HAS_GATE: tl.constexpr, HAS_AFFINE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Head ``h``'s rows of token block ``pt``: row indices, offsets, mask, x (fp32), the gate (fp32,
    ones without one) and w, b (ones and zeros without the affine)."""
    h = tl.program_id(1)
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    dm = d < D
    m = (t < n_tok)[:, None] & dm[None, :]
    row = t * H + h
    x = tl.load(x_ptr + row[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(g_ptr + t[:, None] * g_stride + h * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        z = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_AFFINE:
        w = tl.load(w_ptr + h * D + d, mask=dm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + h * D + d, mask=dm, other=0.0).to(tl.float32)
    else:
        w = tl.full([BD], 1.0, dtype=tl.float32)
        b = tl.zeros([BD], dtype=tl.float32)
    return h, t, d, dm, m, row, x, z, w, b


@triton.jit
def _fwd(x_ptr, g_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_tok, H, D, g_stride, eps,
         HAS_GATE: tl.constexpr, HAS_AFFINE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    _, t, d, _, m, row, x, z, w, b = _tile(x_ptr, g_ptr, w_ptr, b_ptr, n_tok, H, D, g_stride,
                                           HAS_GATE, HAS_AFFINE, BT, BD)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(m, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    if HAS_GATE:
        y = y * z * tl.sigmoid(z)
    tl.store(y_ptr + row[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    rm = t < n_tok
    tl.store(mean_ptr + row, mean, mask=rm)
    tl.store(rstd_ptr + row, rstd, mask=rm)


@triton.jit
def _bwd(x_ptr, g_ptr, w_ptr, b_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dg_ptr, dwp_ptr, dbp_ptr,
         n_tok, H, D, g_stride,
         HAS_GATE: tl.constexpr, HAS_AFFINE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    h, t, d, dm, m, row, x, z, w, b = _tile(x_ptr, g_ptr, w_ptr, b_ptr, n_tok, H, D, g_stride,
                                            HAS_GATE, HAS_AFFINE, BT, BD)
    rm = t < n_tok
    mean = tl.load(mean_ptr + row, mask=rm, other=0.0)
    rstd = tl.load(rstd_ptr + row, mask=rm, other=0.0)
    xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
    g = tl.load(dy_ptr + row[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_GATE:
        s = tl.sigmoid(z)
        a = xhat * w[None, :] + b[None, :]
        dz = g * a * s * (1.0 + z * (1.0 - s))
        tl.store(dg_ptr + row[:, None] * D + d[None, :], dz.to(dg_ptr.dtype.element_ty), mask=m)
        g = g * z * s  # dL/da
    if HAS_AFFINE:
        part = tl.program_id(0) * H * D + h * D + d
        tl.store(dwp_ptr + part, tl.sum(g * xhat, axis=0), mask=dm)
        tl.store(dbp_ptr + part, tl.sum(g, axis=0), mask=dm)
    dxhat = g * w[None, :]
    c1 = tl.sum(dxhat * xhat, axis=1) / D
    c2 = tl.sum(dxhat, axis=1) / D
    dx = (dxhat - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
    tl.store(dx_ptr + row[:, None] * D + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor, h: int, d: int) -> torch.Tensor:
    """``x`` as ``[tokens, H, D]`` with contiguous heads and features; the token stride may be any
    (RetNet's gate is a column slice of a wider projection: no copy for it)."""
    x = x.reshape(-1, h, d)
    return x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous()


class _GroupNormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gate, eps, out_dtype):
        h, d = x.shape[-2:]
        xr = x.reshape(-1, h, d).contiguous()
        gr = _rows(gate, h, d) if gate is not None else None
        weight = weight.contiguous() if weight is not None else None
        bias = bias.contiguous() if bias is not None else None
        n_tok = xr.shape[0]
        bd = triton.next_power_of_2(d)
        bt = max(1, TILE // bd)
        y = torch.empty(xr.shape, device=x.device, dtype=out_dtype)
        mean = torch.empty(n_tok * h, device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        _fwd[(triton.cdiv(n_tok, bt), h)](
            xr, gr if gr is not None else xr, weight if weight is not None else xr,
            bias if bias is not None else xr, y, mean, rstd, n_tok, h, d, gr.stride(0) if gr is not None else 0,
            eps, HAS_GATE=gr is not None, HAS_AFFINE=weight is not None, BT=bt, BD=bd)
        ctx.save_for_backward(xr, gr, weight, bias, mean, rstd)
        ctx.shape, ctx.bt = x.shape, bt
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xr, gr, weight, bias, mean, rstd = ctx.saved_tensors
        shape, bt = ctx.shape, ctx.bt
        n_tok, h, d = xr.shape
        n_blocks = triton.cdiv(n_tok, bt)
        affine = weight is not None
        dy = dy.reshape(xr.shape).contiguous()
        dx = torch.empty_like(xr)
        dg = torch.empty(xr.shape, device=xr.device, dtype=gr.dtype) if gr is not None else None
        dwp = torch.empty(n_blocks, h * d, device=xr.device, dtype=torch.float32) if affine else None
        dbp = torch.empty_like(dwp) if affine else None
        _bwd[(n_blocks, h)](
            xr, gr if gr is not None else xr, weight if affine else xr, bias if affine else xr, dy, mean, rstd,
            dx, dg if dg is not None else dx, dwp if affine else dx, dbp if affine else dx,
            n_tok, h, d, gr.stride(0) if gr is not None else 0,
            HAS_GATE=gr is not None, HAS_AFFINE=affine, BT=bt, BD=triton.next_power_of_2(d))
        dw = dwp.sum(0).to(weight.dtype) if affine else None
        db = dbp.sum(0).to(bias.dtype) if affine else None
        return dx.view(shape), dw, db, dg.view(shape) if dg is not None else None, None, None


def group_norm_gate_triton(x, weight, bias, eps, gate=None, out_dtype=None):
    """``x [..., H, D]`` normalised over D per row, ``* weight[h, d] + bias[h, d]`` (``[H * D]``, or
    None: no affine), ``* silu(gate)`` where a gate (``x``'s shape) is given; in ``out_dtype``
    (default ``x.dtype``). Gradients come back in each input's dtype."""
    assert (weight is None) == (bias is None), "the affine needs both weight and bias"
    assert gate is None or gate.shape == x.shape, (gate.shape, x.shape)
    return _GroupNormGate.apply(x, weight, bias, gate, float(eps), out_dtype or x.dtype)
