"""The LoLCATs hybrid's prelude as Triton kernels (CUDA): RoPE and Hedgehog feature maps of one side
(queries or keys) of one layer, forward and backward, for ``_HybridTriton.backward``.

For ``x`` ``[B, H, T, D]`` (unrotated), ``cos``/``sin`` ``[B or 1, T, R]`` (or none) and ``W``
``[H or 1, D, F/2]``:

* ``xr = rope(x)``: the rotation by halves of the first R dims (``rope_half`` of ``chunk_triton``);
* ``phi = [softmax(xr W), softmax(-xr W)]`` per head (``hedgehog_features``).

``hedgehog_rope_forward``, one launch: ``xr`` and ``phi`` in x's dtype, as the forward kernels of
``chunk_triton`` compute them (the rotation in fp32 from cos/sin as given, rounded to x's dtype; the
projection a product of x's dtype with fp32 accumulation; the softmax in fp32, rounded on store).

``hedgehog_rope_backward``, one launch and a sum: for the gradients ``d_rot`` (of ``xr``, may be
absent) and ``d_feat`` (of ``phi``), with ``dY = softmax'(d_pos) - softmax'(d_neg)`` the gradient of
the projection ``xr W`` (softmax backward through both halves, in fp32),

* ``dx = rope^T(d_rot + dY W^T)`` in x's dtype: a rotated dim j gets ``g_j cos_j +/- g_p sin_p``
  with p its partner dim (``+`` in the first half); the partner's ``(dY W^T)_p`` is a second
  product with W's rows permuted, not a gather of registers;
* ``dW = sum xr^T dY`` in fp32 with W's shape: each program sums the products of its tokens (a
  span of one sequence and head) in registers and writes them to its own slot; one torch sum over
  the slots (and the heads, when W is shared) follows: deterministic, no atomics.

The products take x's dtype (bf16/fp16: ``dY`` and ``xr`` rounded to it, fp32 accumulation; fp32:
full fp32 products), every sum is fp32: the conventions of ``chunk_triton``.

``nope=True`` (``feature_rope: false``): ``phi`` are the features of the unrotated ``x``; ``xr`` is still
``rope(x)``. The backward is then ``dx = rope^T(d_rot) + dY W^T`` and ``dW = sum x^T dY``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tiles import _features, _pow2, _precision, _rotated, _tile, tiles_for

# Tiles and warps for 16-bit inputs: the fastest of ``dev/hybrid_bench.py --sweep`` on an H100 (D = 64, F/2 = 64,
# 8 x 1,024, with the hybrid's kernels): the backward 0.073 ms of device time against 0.133 under the values
# without spills of sm_90 builds (``dev/hybrid_registers.py``: forward 64 rows and 8 warps, 96 registers a
# thread; backward 32 rows and 8 warps, 214; PRELUDE_PROGRAMS 1024), which 32- and 64-bit inputs keep (``WIDE``)
FWD_ROWS = 128  # token rows per program of the forward
FWD_WARPS = 4
BWD_ROWS = 64  # token rows per tile of the backward
BWD_WARPS = 4
PRELUDE_PROGRAMS = 2048  # about how many backward programs (sets how many tiles each one sums into dW)
WIDE = dict(FWD_ROWS=64, FWD_WARPS=8, BWD_ROWS=32, BWD_WARPS=8, PRELUDE_PROGRAMS=1024)


def _knobs(dtype) -> dict:
    """The tile constants for inputs of ``dtype`` (``tiles_for``)."""
    return tiles_for(dtype, ("FWD_ROWS", "FWD_WARPS", "BWD_ROWS", "BWD_WARPS", "PRELUDE_PROGRAMS"), globals(), WIDE)


@triton.jit
def _prelude_forward(x_ptr, cos_ptr, sin_ptr, w_ptr, xr_ptr, f_ptr, sxb, sxh, sxt, scb, sct, swh, H, T, D, FW, R,
                     ROPE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
                     NOPE: tl.constexpr = False):
    bh = tl.program_id(1).to(tl.int64)  # 64-bit bases: large batches x long sequences
    b = bh // H
    h = bh % H
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    dt = f_ptr.dtype.element_ty  # x's dtype
    x = _rotated(x_ptr + b * sxb + h * sxh, t, ok, sxt, d, D, cos_ptr + b * scb, sin_ptr + b * scb, sct, R,
                 ROPE).to(dt)
    if ROPE:
        tl.store(xr_ptr + bh * T * D + t[:, None] * D + d[None, :], x, mask=ok[:, None] & (d < D)[None, :])
    if NOPE:  # the features of x before RoPE
        x = _tile(x_ptr + b * sxb + h * sxh, t, ok, sxt, d, D).to(dt)
    parts = _features(x, f_ptr, t, ok, 0, w_ptr + h * swh, d, D, FW, BF, 2, True, PREC)
    out = f_ptr + bh * T * (2 * FW) + t[:, None] * (2 * FW)
    m = ok[:, None] & (f < FW)[None, :]
    tl.store(out + f[None, :], parts[0], mask=m)
    tl.store(out + (FW + f)[None, :], parts[1], mask=m)


@triton.jit
def _softmax(z, fm):
    z = tl.where(fm, z, float("-inf"))
    z = tl.exp(z - tl.max(z, axis=1)[:, None])
    return z / tl.sum(z, axis=1)[:, None]


@triton.jit
def _unrotated(g, gp, cb, sb, t, sct, d, partner, half, rm):
    """``rope^T`` of a gradient ``g`` whose values at each dim's partner are ``gp``: dim j gets ``g_j cos_j
    +/- gp_j sin_p`` (``+`` in the first half); dims outside ``rm`` (past R, or not ``ok``) keep ``g``."""
    cos = tl.load(cb + t[:, None] * sct + d[None, :], mask=rm, other=1.0).to(tl.float32)
    sin_p = tl.load(sb + t[:, None] * sct + partner[None, :], mask=rm, other=0.0).to(tl.float32)
    return g * cos + tl.where((d < half)[None, :], gp, -gp) * sin_p


@triton.jit
def _prelude_backward(x_ptr, cos_ptr, sin_ptr, w_ptr, drot_ptr, dfeat_ptr, dx_ptr, dw_ptr,
                      sxb, sxh, sxt, scb, sct, swh, sgb, sgh, sgt, sfb, sfh, sft, H, T, D, FW, R, STEPS, S,
                      ROPE: tl.constexpr, DROT: tl.constexpr, DX: tl.constexpr, DW: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
                      NOPE: tl.constexpr = False):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    dm = d < D
    fm = (f < FW)[None, :]
    dt = x_ptr.dtype.element_ty
    wb = w_ptr + h * swh
    w = tl.load(wb + d[:, None] * FW + f[None, :], mask=dm[:, None] & fm, other=0.0).to(dt)
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    rot = d < R
    wp = w
    if ROPE & DX & (not NOPE):  # W's rows at each dim's partner: (dY W^T)_partner as a product
        wp = tl.load(wb + partner[:, None] * FW + f[None, :], mask=rot[:, None] & fm, other=0.0).to(dt)
    xb = x_ptr + b * sxb + h * sxh
    cb, sb = cos_ptr + b * scb, sin_ptr + b * scb
    gb = drot_ptr + b * sgb + h * sgh
    fb = dfeat_ptr + b * sfb + h * sfh
    acc = tl.zeros([BD, BF], dtype=tl.float32)
    for i in range(STEPS):
        t = (pid * STEPS + i) * BT + tl.arange(0, BT)
        ok = t < T
        x = _rotated(xb, t, ok, sxt, d, D, cb, sb, sct, R, ROPE and not NOPE).to(dt)  # the projection's input
        proj = tl.dot(x, w, input_precision=PREC)
        pos = _softmax(proj, fm)
        neg = _softmax(-proj, fm)
        m = ok[:, None] & fm
        dpos = tl.load(fb + t[:, None] * sft + f[None, :], mask=m, other=0.0).to(tl.float32)
        dneg = tl.load(fb + t[:, None] * sft + (FW + f)[None, :], mask=m, other=0.0).to(tl.float32)
        dy = pos * (dpos - tl.sum(pos * dpos, axis=1)[:, None]) - neg * (dneg - tl.sum(neg * dneg, axis=1)[:, None])
        dy = dy.to(dt)
        if DW:
            acc = tl.dot(tl.trans(x), dy, acc, input_precision=PREC)
        if DX:
            xm = ok[:, None] & dm[None, :]
            g = tl.dot(dy, tl.trans(w), input_precision=PREC)
            rm = ok[:, None] & rot[None, :]
            if NOPE:  # only the rotated x's gradient goes back through the rotation
                if DROT:
                    dr = tl.load(gb + t[:, None] * sgt + d[None, :], mask=xm, other=0.0).to(tl.float32)
                    drp = tl.load(gb + t[:, None] * sgt + partner[None, :], mask=rm, other=0.0).to(tl.float32)
                    g += _unrotated(dr, drp, cb, sb, t, sct, d, partner, half, rm)
            elif DROT:
                g += tl.load(gb + t[:, None] * sgt + d[None, :], mask=xm, other=0.0).to(tl.float32)
            if ROPE and not NOPE:
                gp = tl.dot(dy, tl.trans(wp), input_precision=PREC)
                if DROT:
                    gp += tl.load(gb + t[:, None] * sgt + partner[None, :], mask=rm, other=0.0).to(tl.float32)
                g = _unrotated(g, gp, cb, sb, t, sct, d, partner, half, rm)
            tl.store(dx_ptr + bh * T * D + t[:, None] * D + d[None, :], g.to(dx_ptr.dtype.element_ty), mask=xm)
    if DW:
        tl.store(dw_ptr + (bh * S + pid) * (D * FW) + d[:, None] * FW + f[None, :], acc, mask=dm[:, None] & fm)


def _check(x, cos, sin, w):
    b, h, t, d = x.shape
    if w.dim() != 3 or w.shape[0] not in (1, h) or w.shape[1] != d:
        raise ValueError(f"hedgehog_rope: weights {tuple(w.shape)} for x {tuple(x.shape)} (need [H or 1, D, F/2])")
    if cos is not None and (cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != t or cos.shape[2] % 2
                            or cos.shape[2] > d or sin is None or sin.shape != cos.shape):
        raise ValueError(f"hedgehog_rope: cos/sin {tuple(cos.shape)} for x {tuple(x.shape)} (need [B or 1, T, R])")


def _rope_args(x, cos, sin):
    if cos is None:
        return x, x, 0, 0, 0  # not read
    cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1), cos.shape[-1]


def _x(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def hedgehog_rope_forward(x, cos, sin, w, *, nope: bool = False):
    """``(rope(x), [softmax(rope(x) W), softmax(-rope(x) W)])`` in x's dtype, one launch: ``x``
    ``[B, H, T, D]`` (any strides, last dim contiguous), ``cos``/``sin`` ``[B or 1, T, R]`` or None
    (then the first output is ``x`` itself), ``w`` ``[H or 1, D, F/2]``. ``nope``: the features of
    ``x`` itself (before RoPE)."""
    _check(x, cos, sin, w)
    x = _x(x)
    b, h, t, d = x.shape
    w = w.contiguous()
    fw = w.shape[-1]
    cos, sin, scb, sct, r = _rope_args(x, cos, sin)
    xr = torch.empty(b, h, t, d, device=x.device, dtype=x.dtype) if r else x
    feat = torch.empty(b, h, t, 2 * fw, device=x.device, dtype=x.dtype)
    kn = _knobs(x.dtype)
    bt = kn["FWD_ROWS"]
    _prelude_forward[(triton.cdiv(t, bt), b * h)](
        x, cos, sin, w, xr, feat, x.stride(0), x.stride(1), x.stride(2), scb, sct, w.stride(0) if w.shape[0] > 1 else 0,
        h, t, d, fw, r, ROPE=r > 0, BT=bt, BD=_pow2(d), BF=_pow2(fw), PREC=_precision(x.dtype),
        NOPE=nope and r > 0, num_warps=kn["FWD_WARPS"])
    return xr, feat


def hedgehog_rope_backward(x, cos, sin, w, d_rot, d_feat, *, need_dx: bool = True, need_dw: bool = True,
                           nope: bool = False):
    """Gradients of ``hedgehog_rope_forward``'s outputs, one launch and a sum: ``(dx, dw)`` for
    ``d_rot`` ``[B, H, T, D]`` (of the rotated x; None: zero) and ``d_feat`` ``[B, H, T, F]`` (of the
    features), any strides with a contiguous last dim. ``dx`` in x's dtype (None without
    ``need_dx``), ``dw`` in fp32 with w's shape (None without ``need_dw``); ``nope`` as the forward's."""
    _check(x, cos, sin, w)
    x, d_feat = _x(x), _x(d_feat)
    b, h, t, d = x.shape
    w = w.contiguous()
    fw = w.shape[-1]
    if d_feat.shape != (b, h, t, 2 * fw):
        raise ValueError(f"hedgehog_rope: d_feat {tuple(d_feat.shape)} for x {tuple(x.shape)} and {2 * fw} features")
    cos, sin, scb, sct, r = _rope_args(x, cos, sin)
    dev = x.device
    kn = _knobs(x.dtype)
    bt = kn["BWD_ROWS"]
    tiles = triton.cdiv(t, bt)
    steps = triton.cdiv(tiles, min(tiles, max(1, triton.cdiv(kn["PRELUDE_PROGRAMS"], b * h))))
    s = triton.cdiv(tiles, steps)  # programs per sequence and head, `steps` tiles each
    dx = torch.empty(b, h, t, d, device=dev, dtype=x.dtype) if need_dx else x  # not written without
    part = torch.empty(b, h, s, d, fw, device=dev, dtype=torch.float32) if need_dw else d_feat
    drot = _x(d_rot) if d_rot is not None and need_dx else d_feat  # not read without
    _prelude_backward[(s, b * h)](
        x, cos, sin, w, drot, d_feat, dx, part, x.stride(0), x.stride(1), x.stride(2), scb, sct,
        w.stride(0) if w.shape[0] > 1 else 0, drot.stride(0), drot.stride(1), drot.stride(2),
        d_feat.stride(0), d_feat.stride(1), d_feat.stride(2), h, t, d, fw, r, steps, s,
        ROPE=r > 0, DROT=d_rot is not None and need_dx, DX=need_dx, DW=need_dw, BT=bt, BD=_pow2(d), BF=_pow2(fw),
        PREC=_precision(x.dtype), NOPE=nope and r > 0, num_warps=kn["BWD_WARPS"])
    dw = None
    if need_dw:
        dw = part.sum(dim=(0, 2))
        if w.shape[0] == 1:
            dw = dw.sum(dim=0, keepdim=True)
    return dx if need_dx else None, dw
