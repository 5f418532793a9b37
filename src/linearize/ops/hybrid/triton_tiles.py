"""Tile helpers shared by the hybrid's kernels (``chunk_triton``) and the backward's RoPE + Hedgehog
prelude (``prelude_triton``): loading rows, rotating them by halves, Hedgehog features, and the
host-side block and precision choices. Their own module, so that neither kernel module imports the other's
internals in a circle."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(ptr, t, ok, st, d, D):
    """Rows ``t`` of a ``[T, D]`` slice with token stride ``st`` (zeros where not ``ok``)."""
    return tl.load(ptr + t[:, None] * st + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _rotated(ptr, t, ok, st, d, D, cos_ptr, sin_ptr, sct, R, ROPE: tl.constexpr):
    """Rows ``t`` rotated by halves over their first ``R`` dims (``ROPE``), in fp32."""
    x = _tile(ptr, t, ok, st, d, D).to(tl.float32)
    if ROPE:
        half = R // 2
        m = ok[:, None] & (d < R)[None, :]
        partner = tl.where(d < half, d + half, d - half)
        p = tl.load(ptr + t[:, None] * st + partner[None, :], mask=m, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + t[:, None] * sct + d[None, :], mask=m, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + t[:, None] * sct + d[None, :], mask=m, other=0.0).to(tl.float32)
        x = x * cos + tl.where((d < half)[None, :], -p, p) * sin
    return x


@triton.jit
def _load_features(f_ptr, t, ok, sft, FW, dtype, BF: tl.constexpr, FP: tl.constexpr):
    """Rows ``t`` of ``FP * FW`` features as FP parts ``[BW, BF]`` of ``FW`` features each."""
    f = tl.arange(0, BF)
    out = ()
    for i in tl.static_range(FP):
        out = out + (tl.load(f_ptr + t[:, None] * sft + (i * FW + f)[None, :], mask=ok[:, None] & (f < FW)[None, :],
                             other=0.0).to(dtype),)
    return out


@triton.jit
def _features(x, f_ptr, t, ok, sft, w_ptr, d, D, FW, BF: tl.constexpr, FP: tl.constexpr, HEDGEHOG: tl.constexpr,
              PREC: tl.constexpr):
    """The features of rows ``x`` ``[BW, BD]`` as a tuple of ``[BW, BF]`` parts in ``x``'s dtype:
    Hedgehog's ``(softmax(x W), softmax(-x W))`` from ``W`` ``[D, FW]`` (computed in fp32), or
    loaded from ``f_ptr`` (``_load_features``)."""
    if HEDGEHOG:
        f = tl.arange(0, BF)
        fm = (f < FW)[None, :]
        w = tl.load(w_ptr + d[:, None] * FW + f[None, :], mask=(d < D)[:, None] & fm, other=0.0)
        proj = tl.dot(x, w.to(x.dtype), input_precision=PREC)
        pos = tl.where(fm, proj, float("-inf"))
        pos = tl.exp(pos - tl.max(pos, axis=1)[:, None])
        pos = (pos / tl.sum(pos, axis=1)[:, None]).to(x.dtype)
        neg = tl.where(fm, -proj, float("-inf"))
        neg = tl.exp(neg - tl.max(neg, axis=1)[:, None])
        out = (pos, (neg / tl.sum(neg, axis=1)[:, None]).to(x.dtype))
    else:
        out = _load_features(f_ptr, t, ok, sft, FW, x.dtype, BF, FP)
    return out


def tiles_for(dtype: torch.dtype, names, constants: dict, wide: dict) -> dict:
    """A kernel module's tile constants ``names`` for inputs of ``dtype``, from its ``constants`` (its
    globals, read at each call so a sweep may set them), with ``wide`` over them past 16 bits (their
    registers are twice as wide)."""
    base = {name: constants[name] for name in names}
    return {**base, **wide} if dtype.itemsize > 2 else base


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's precision: fp32 inputs multiply in full fp32 (the others are half-precision products)."""
    return "tf32" if dtype in (torch.bfloat16, torch.float16) else "ieee"
