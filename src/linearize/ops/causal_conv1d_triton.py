"""Mamba's causal depthwise convolution and the SiLU after it, fused into one Triton op that reads
and writes the channels-last layout ``[B, T, Dn]``: the CUDA twin of
``F.silu(causal_conv1d(x.transpose(1, 2), ...)).transpose(1, 2)`` (``selective_scan.py``).

The PyTorch path pays for its layout, not its arithmetic: it transposes the input projection's
slice to ``[B, Dn, T]``, concatenates the convolution's past in front of it (a copy of the whole
input), runs a depthwise ``conv1d``, applies SiLU as another pass, and transposes back (after which
the scan makes the result contiguous, one more copy); the backward pass mirrors all of it. Here the
forward pass is one launch that reads ``x`` where it lies and writes ``y`` once, and the backward
pass is one launch that reads ``x`` and ``dy`` and writes ``dx`` once.

Per channel ``d`` with a width-``K`` kernel ``w[d, 0, :]``::

    pre[t] = bias[d] + sum_{k<K} w[d, k] * xx[t - K + 1 + k]        y[t] = silu(pre[t])

where ``xx`` is ``x`` at positions ``0..T-1`` and, before the sequence, the ``K - 1`` inputs of
``initial_state`` (``[B, Dn, K - 1]``, oldest first; zeros without one). The final state is the
last ``K - 1`` entries of ``xx``, in fp32, as ``causal_conv1d`` returns it.

Programs cover (channel block, token block, sequence): each computes its ``[BLOCK_T, BLOCK_D]``
tile from the ``K`` shifted views of the input that the window needs (the ``K - 1`` tokens before
the tile come from the neighbouring tile or the initial state; the overlapping loads hit the
cache). ``x`` may have any token stride as long as its channels are contiguous, so the column
slice of the ``[B, T, 2 * Dn]`` input projection is read without a copy.

The backward pass saves nothing but ``x`` (and the parameters): it recomputes the pre-activation.
With ``g[t] = dy[t] * silu'(pre[t])`` (zero outside ``0..T-1``)::

    dxx[s]   = sum_k w[d, k] * g[s + K - 1 - k]      (dx for s >= 0, the initial state's gradient for s < 0)
    dw[d, k] = sum_{b, t} g[t] * xx[t - K + 1 + k]       dbias[d] = sum_{b, t} g[t]

A program needs ``g`` at its tile's tokens and the ``K - 1`` after them, so it recomputes ``pre``
at ``K`` shifts of its tile. The sums over ``B x T`` are written per program into a partial
buffer that PyTorch adds up (no atomics); the initial state's gradient comes from the first token
block of each sequence, which also evaluates ``dxx`` at the ``K - 1`` positions before the sequence.
A gradient of the final state is added in PyTorch to the last ``K - 1`` inputs it copied.

All arithmetic is fp32 whatever the dtypes of ``x``, the weight and the bias; ``y`` and ``dx`` are
in ``x``'s dtype, the parameter gradients in the parameters'. Tested against the float64 PyTorch
form with Triton's interpreter on the CPU (``tests/ops/triton_interpret_conv.py``) and on CUDA
(``tests/gpu/test_gpu_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear_attention import accum_dtype

BLOCK_T = 64  # tokens per program
BLOCK_D = 64  # channels per program (64 bf16 channels: one 128-byte line per token)
NUM_WARPS = 4
BWD_BLOCK_T = 64  # the same for the backward pass
BWD_BLOCK_D = 32  # 0.65 vs 0.73 ms fwd+bwd per layer at 64 (dev/conv_bench.py --sweep, H100)
BWD_NUM_WARPS = 4


@triton.jit
def _load_xx(x_ptr, s_ptr, x_base, s_base, p, d, dm, T, sxt, ssd, ssk,
             K: tl.constexpr, HAS_STATE: tl.constexpr):
    """``xx`` at positions ``p`` ([R]) of channels ``d`` ([BD]) in fp32: ``x`` for 0 <= p < T, the
    initial state for -(K-1) <= p < 0 (zeros without one), zeros elsewhere."""
    inx = (p >= 0) & (p < T)
    v = tl.load(x_ptr + x_base + p[:, None] * sxt + d[None, :], mask=inx[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    if HAS_STATE:
        ins = (p < 0) & (p >= 1 - K)
        v += tl.load(s_ptr + s_base + d[None, :] * ssd + (p + K - 1)[:, None] * ssk,
                     mask=ins[:, None] & dm[None, :], other=0.0).to(tl.float32)
    return v


@triton.jit
def _pre(x_ptr, w_ptr, bias_ptr, s_ptr, x_base, s_base, p, d, dm, T, sxt, ssd, ssk,
         K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """The pre-activation at positions ``p`` ([R]) of channels ``d``: ``[R, BD]`` fp32."""
    acc = tl.zeros([R, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        wk = tl.load(w_ptr + d * K + k, mask=dm, other=0.0).to(tl.float32)
        acc += wk[None, :] * _load_xx(x_ptr, s_ptr, x_base, s_base, p - (K - 1) + k, d, dm, T, sxt, ssd, ssk,
                                      K, HAS_STATE)
    return acc


@triton.jit
def _dpre(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, x_base, s_base, dy_base, p, d, dm, T, DN, sxt, ssd, ssk,
          K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """``g = dy * silu'(pre)`` at positions ``p``; zero outside the sequence."""
    pre = _pre(x_ptr, w_ptr, bias_ptr, s_ptr, x_base, s_base, p, d, dm, T, sxt, ssd, ssk,
               K, HAS_BIAS, HAS_STATE, R, BD)
    valid = ((p >= 0) & (p < T))[:, None] & dm[None, :]
    dy = tl.load(dy_ptr + dy_base + p[:, None] * DN + d[None, :], mask=valid, other=0.0).to(tl.float32)
    sg = tl.sigmoid(pre)
    return tl.where(valid, dy * sg * (1.0 + pre * (1.0 - sg)), 0.0)


@triton.jit
def _dxx(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, x_base, s_base, dy_base, p, d, dm, T, DN, sxt, ssd, ssk,
         K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, R: tl.constexpr, BD: tl.constexpr):
    """``dxx`` at positions ``p`` ([R, BD]: sum_j w[K-1-j] g[p + j]) and ``g`` at ``p`` itself."""
    g0 = _dpre(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, x_base, s_base, dy_base, p, d, dm, T, DN, sxt, ssd, ssk,
               K, HAS_BIAS, HAS_STATE, R, BD)
    acc = tl.load(w_ptr + d * K + (K - 1), mask=dm, other=0.0).to(tl.float32)[None, :] * g0
    for j in tl.static_range(1, K):
        wj = tl.load(w_ptr + d * K + (K - 1 - j), mask=dm, other=0.0).to(tl.float32)
        acc += wj[None, :] * _dpre(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, x_base, s_base, dy_base, p + j, d, dm,
                                   T, DN, sxt, ssd, ssk, K, HAS_BIAS, HAS_STATE, R, BD)
    return acc, g0


@triton.jit
def _tile(T, DN, BT: tl.constexpr, BD: tl.constexpr):
    """This program's tile: its token block ``pt``, sequence ``pb``, tokens ``t`` and channels ``d`` (mask ``dm``)."""
    pt = tl.program_id(1)
    pb = tl.program_id(2).to(tl.int64)
    t = pt.to(tl.int64) * BT + tl.arange(0, BT)  # int64: token offsets times strides may pass 2^31
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    return pt, pb, t, d, d < DN


@triton.jit
def _fwd(x_ptr, w_ptr, bias_ptr, s_ptr, y_ptr, T, DN, sxb, sxt, ssb, ssd, ssk,
         K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    _, pb, t, d, dm = _tile(T, DN, BT, BD)
    pre = _pre(x_ptr, w_ptr, bias_ptr, s_ptr, pb * sxb, pb * ssb, t, d, dm, T, sxt, ssd, ssk,
               K, HAS_BIAS, HAS_STATE, BT, BD)
    y = pre * tl.sigmoid(pre)
    m = (t < T)[:, None] & dm[None, :]
    tl.store(y_ptr + pb * T * DN + t[:, None] * DN + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, dx_ptr, dwp_ptr, dbp_ptr, ds_ptr, T, DN, n_t,
         sxb, sxt, ssb, ssd, ssk,
         K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, NEED_DS: tl.constexpr,
         BT: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr):
    pt, pb, t, d, dm = _tile(T, DN, BT, BD)
    x_base, s_base, dy_base = pb * sxb, pb * ssb, pb * T * DN
    dx, g = _dxx(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, x_base, s_base, dy_base, t, d, dm, T, DN, sxt, ssd, ssk,
                 K, HAS_BIAS, HAS_STATE, BT, BD)
    m = (t < T)[:, None] & dm[None, :]
    tl.store(dx_ptr + dy_base + t[:, None] * DN + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
    part = pb * n_t + pt  # this program's row of the partial sums
    if HAS_BIAS:
        tl.store(dbp_ptr + part * DN + d, tl.sum(g, axis=0), mask=dm)
    for k in tl.static_range(K):
        xk = _load_xx(x_ptr, s_ptr, x_base, s_base, t - (K - 1) + k, d, dm, T, sxt, ssd, ssk, K, HAS_STATE)
        tl.store(dwp_ptr + (part * K + k) * DN + d, tl.sum(g * xk, axis=0), mask=dm)
    if NEED_DS:
        if pt == 0:  # the sequence's first block: dxx at the K - 1 positions before it
            r = tl.arange(0, KP)
            ds, _ = _dxx(x_ptr, w_ptr, bias_ptr, s_ptr, dy_ptr, x_base, s_base, dy_base, r - (K - 1), d, dm, T, DN,
                         sxt, ssd, ssk, K, HAS_BIAS, HAS_STATE, KP, BD)
            tl.store(ds_ptr + pb * DN * (K - 1) + d[None, :] * (K - 1) + r[:, None], ds,
                     mask=(r < K - 1)[:, None] & dm[None, :])


def _final_state(x: torch.Tensor, initial_state: torch.Tensor | None, k: int) -> torch.Tensor:
    """The last ``K - 1`` entries of ``xx`` (initial state, then ``x``) as ``[B, Dn, K - 1]`` fp32 (a new tensor)."""
    b, t, dn = x.shape
    n = min(t, k - 1)  # how many of them come from x
    final = torch.empty(b, dn, k - 1, device=x.device, dtype=accum_dtype(x.dtype))
    final[..., k - 1 - n:] = x[:, t - n:].transpose(1, 2)
    if n < k - 1:
        final[..., : k - 1 - n] = initial_state[..., n:] if initial_state is not None else 0.0
    return final


def _strides(state: torch.Tensor | None) -> tuple[int, int, int]:
    return tuple(state.stride()) if state is not None else (0, 0, 0)


class _CausalConv1dSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, output_final_state):
        b, t, dn = x.shape
        k = weight.shape[-1]
        if x.stride(2) != 1:
            x = x.contiguous()
        w = weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        y = torch.empty(b, t, dn, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(dn, BLOCK_D), triton.cdiv(t, BLOCK_T), b)
        _fwd[grid](x, w, bias if bias is not None else w, initial_state if initial_state is not None else w, y,
                   t, dn, x.stride(0), x.stride(1), *_strides(initial_state),
                   K=k, HAS_BIAS=bias is not None, HAS_STATE=initial_state is not None, BT=BLOCK_T, BD=BLOCK_D,
                   num_warps=NUM_WARPS)
        final = _final_state(x, initial_state, k) if output_final_state else None
        ctx.save_for_backward(x, w, bias, initial_state)
        ctx.weight_dtype = weight.dtype
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, w, bias, s0 = ctx.saved_tensors
        b, t, dn = x.shape
        k = w.shape[-1]
        need_ds = s0 is not None and ctx.needs_input_grad[3]
        dx = torch.empty(b, t, dn, device=x.device, dtype=x.dtype)
        ds = torch.zeros(b, dn, k - 1, device=x.device, dtype=torch.float32) if need_ds else None
        if dy is not None:
            dy = dy.contiguous()
            n_t = triton.cdiv(t, BWD_BLOCK_T)
            dwp = torch.empty(b * n_t, k, dn, device=x.device, dtype=torch.float32)
            dbp = torch.empty(b * n_t, dn, device=x.device, dtype=torch.float32) if bias is not None else dwp
            _bwd[(triton.cdiv(dn, BWD_BLOCK_D), n_t, b)](
                x, w, bias if bias is not None else w, s0 if s0 is not None else w, dy, dx, dwp, dbp,
                ds if need_ds else dwp, t, dn, n_t, x.stride(0), x.stride(1), *_strides(s0),
                K=k, HAS_BIAS=bias is not None, HAS_STATE=s0 is not None, NEED_DS=need_ds,
                BT=BWD_BLOCK_T, BD=BWD_BLOCK_D, KP=triton.next_power_of_2(k - 1), num_warps=BWD_NUM_WARPS)
            dw = dwp.sum(0).t().reshape(dn, 1, k).to(ctx.weight_dtype)
            db = dbp.sum(0).to(bias.dtype) if bias is not None else None
        else:
            dx.zero_()
            dw = torch.zeros(dn, 1, k, device=x.device, dtype=ctx.weight_dtype)
            db = torch.zeros_like(bias) if bias is not None else None
        if dfinal is not None:  # the final state copied the last K - 1 entries of xx
            n = min(t, k - 1)
            if n:
                dx[:, t - n:] = (dx[:, t - n:].float() + dfinal[:, :, k - 1 - n:].transpose(1, 2).float()).to(dx.dtype)
            if need_ds and n < k - 1:
                ds[:, :, n:] += dfinal[:, :, : k - 1 - n].float()
        return (dx, dw, db, ds.to(s0.dtype) if need_ds else None, None)


def causal_conv1d_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(causal depthwise conv(x))`` over channels-last ``x [B, T, Dn]`` (any token stride, unit
    channel stride; other layouts are copied) with ``weight [Dn, 1, K]`` and ``bias [Dn]`` or None;
    ``initial_state [B, Dn, K - 1]`` (the last K - 1 inputs before ``x``, oldest first) or None for
    zeros. Returns ``(y [B, T, Dn] contiguous in x's dtype, final state [B, Dn, K - 1] fp32 or None)``."""
    b, _, dn = x.shape
    k = weight.shape[-1]
    assert weight.shape == (dn, 1, k) and k >= 2, (tuple(weight.shape), tuple(x.shape))
    assert bias is None or bias.shape == (dn,), tuple(bias.shape)
    assert initial_state is None or initial_state.shape == (b, dn, k - 1), tuple(initial_state.shape)
    return _CausalConv1dSilu.apply(x, weight, bias, initial_state, bool(output_final_state))
