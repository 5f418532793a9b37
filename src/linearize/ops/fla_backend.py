"""CUDA path: flash-linear-attention (fla) kernels computing the same function as the PyTorch forms.

fla's ``chunk_simple_gla`` is causal linear attention with a per-head constant log decay
(``g_gamma``), laid out ``[B, T, H, *]`` with one key head per query head. Grouped keys are
repeated here (the kernel has no notion of groups), and the normaliser ``q_t . sum_{s<=t} k_s`` is
a cumulative sum in PyTorch, as fla's own ``chunk_linear_attn`` does it.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .availability import fla_available, triton_available  # noqa: F401  (triton_available: re-exported)
from .linear_attention import accum_dtype


def use_fla(q: torch.Tensor, backend: str, dtype: torch.dtype | None = None) -> bool:
    """``backend``: "auto", "fla" (required) or "torch"; ``dtype``: decide as if ``q`` had it.

    "auto" takes fla on CUDA for half-precision inputs only: fla's kernels multiply fp32 inputs in
    TF32 (~1e-3 relative error, docs/RESULTS.md), so fp32 stays on the full-precision PyTorch path
    unless fla is asked for explicitly.
    """
    if backend == "torch":
        return False
    dtype = dtype or q.dtype
    ok = q.is_cuda and dtype != torch.float64 and fla_available()
    if backend == "fla" and not ok:
        raise RuntimeError("backend='fla' needs CUDA tensors (not float64) and the flash-linear-attention package")
    return ok and (backend == "fla" or dtype in (torch.bfloat16, torch.float16))


def fla_gated_backward_refused(capability: tuple[int, int], triton_version: str, tilelang: bool) -> bool:
    """Whether fla 0.6's ``chunk_bwd_dqkwg`` refuses a gated backward (a non-None ``g``, as in
    ``chunk_gated_delta_rule``'s; ``chunk_simple_gla`` with ``g_gamma`` passes None): it raises on
    Hopper (capability 9.x) with Triton >= 3.4.0 and < 3.7.1, which compile that kernel wrongly
    there (fla issue #640), unless its TileLang backend (``tilelang``) takes the call first. Versions
    are compared as fla compares them."""
    from packaging.version import Version

    bad = Version("3.4.0") <= Version(triton_version) < Version("3.7.1")
    return capability[0] == 9 and bad and not tilelang


def fla_tilelang_backward() -> bool:
    """fla's TileLang backend takes ``chunk_bwd_dqkwg``'s gated calls: tilelang and nvcc installed,
    neither ``FLA_TILELANG=0`` nor ``FLA_DISABLE_BACKEND_DISPATCH=1`` set (what fla's dispatch checks)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    try:
        from fla.ops.common.backends import CommonTileLangBackend
    except Exception:  # another fla layout: assume no TileLang
        return False
    return CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled()


@functools.cache
def fla_gated_backward_refused_on(device: torch.device) -> bool:
    """``fla_gated_backward_refused`` for this CUDA device, the installed Triton and fla."""
    import triton

    return fla_gated_backward_refused(torch.cuda.get_device_capability(device), triton.__version__,
                                      fla_tilelang_backward())


def linear_attention_fla(q, k, v, *, log_decay=None, normalize=True, eps=1e-6, initial_state=None,
                         output_final_state=False):
    """Same contract as ``linear_attention_chunked``: [B, H, T, F] in, (o, state) out."""
    from fla.ops.simple_gla import chunk_simple_gla

    b, h, t, f = q.shape
    n_kv, d = k.shape[1], v.shape[-1]
    acc = accum_dtype(q.dtype)  # fla keeps states in fp32; so does the post-processing here
    group = h // n_kv
    decay = log_decay is not None
    if decay and normalize:
        # rare combination: carry the normaliser as an extra value column (plus a zero column:
        # fla's backward wants an even value width)
        v = torch.cat([v, torch.ones_like(v[..., :1]), torch.zeros_like(v[..., :1])], dim=-1)
    # to fla's [B, T, H, *] first, so that the repeat (a copy) writes the layout fla reads
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=2), vh.repeat_interleave(group, dim=2)
    h0 = None
    if initial_state is not None:
        s0 = initial_state if decay else initial_state.expand(b, n_kv, group, *initial_state.shape[3:])
        h0 = s0.reshape(b, h, f, -1).to(acc)
        if decay and normalize:
            h0 = torch.nn.functional.pad(h0, (0, 1))
        if normalize and not decay:
            h0, z0 = h0[..., :-1].contiguous(), initial_state[..., -1]  # [B, Hk, 1, F]
    qh = q.transpose(1, 2)
    fk, fv = kh.shape[-1], vh.shape[-1]
    if fk != fv:
        # fla 0.6's chunk_simple_gla returns wrong dq and dk when the key and value widths differ
        # (32 vs 64, RetNet's shape: ~1x relative error on an H100, 2026-11-22; equal widths are
        # right): zero features and zero value columns up to one width change nothing else
        width = max(fk, fv)
        qh, kh, vh = F.pad(qh, (0, width - fk)), F.pad(kh, (0, width - fk)), F.pad(vh, (0, width - fv))
        if h0 is not None:
            h0 = F.pad(h0, (0, width - fv, 0, width - fk))
    o, ht = chunk_simple_gla(
        qh, kh, vh,
        g_gamma=log_decay.to(acc) if decay else None, scale=1.0,
        initial_state=h0, output_final_state=output_final_state,
    )
    # [B, H, T, Dv] in fp32. Keeping fla's bf16 output here (no cast round trip) made RetNet's
    # backward hit an illegal memory access in fla 0.6's chunk_bwd_dqkwg on an H100 (2026-11-22).
    o = o[..., :fv].transpose(1, 2).to(acc)
    if ht is not None and fk != fv:
        ht = ht[:, :, :fk, :fv].contiguous()
    state = None
    if ht is not None:
        state = ht.view(b, n_kv, group, f, -1) if decay else ht.view(b, n_kv, group, f, -1)[:, :, :1]
        if decay and normalize:
            state = state[..., : d + 1]
    if normalize and decay:
        o = o[..., :d] / (o[..., d : d + 1] + eps)
    elif normalize:
        z = torch.cumsum(k.to(acc), dim=2)  # [B, Hk, T, F]
        if initial_state is not None:
            z = z + z0.squeeze(2)[:, :, None, :]
        den = (q.to(acc).view(b, n_kv, group, t, f) * z.unsqueeze(2)).sum(-1, keepdim=True)
        o = o / (den.view(b, h, t, 1) + eps)
        if state is not None:
            state = torch.cat([state, z[:, :, -1].view(b, n_kv, 1, f, 1)], dim=-1)
    return o.to(q.dtype), state


def kernel_inputs(q, k, v, backend="auto"):
    """Under autocast, fp32 inputs in the autocast dtype when that lets fla's kernels take them.

    Training keeps fp32 master weights under bf16 autocast; autocast casts matmul inputs but not
    elementwise results, so features that pass through RoPE (fp32 cos/sin) arrive here in fp32
    and the "auto" backend would keep them on the PyTorch path: autocast asks for half precision,
    so give the kernels what it asks for.
    """
    dev = q.device.type
    if q.dtype != torch.float32 or not torch.is_autocast_enabled(dev):
        return q, k, v
    half = torch.get_autocast_dtype(dev)
    if half not in (torch.bfloat16, torch.float16) or not use_fla(q, backend, dtype=half):
        return q, k, v
    return q.to(half), k.to(half), v.to(half)
