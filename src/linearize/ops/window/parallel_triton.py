"""The window softmax over a whole sequence as one Triton launch (no gradient): prefill and evaluation.

Each program takes ``BM`` queries of one query head and walks the key blocks that any of them can see, from
``W - 1`` tokens before its first query to its last, with the online softmax of flash attention (fp32 running
maximum, sum and output; the weights rounded to the values' dtype for the second product, as flash kernels do).
The band's two edges are masks on the blocks that cross them, so each query weighs exactly its last ``W`` keys.

What the blocked forms cost it does not: no padded copies of the sequence, no key heads repeated to the query
heads (a program reads its key head's rows; the ``G`` query heads of a group read the same rows from L2), no
reversed blocks or log-sum-exp merge (``flash.py``), no band mask over twice the keys (``window_softmax_sdpa``).
q, k and v are read through their strides (the projections' transposed views as they come), the output is
written as ``[B, T, H, D]`` memory, which is what the output projection reads, and returned as its
``[B, H, T, D]`` view.

With attention sinks (``sinks.py``) each program first weighs its sequence's first ``S`` real tokens, one tile of
keys gathered by position, for the queries they have left the window of.

Padding (``key_mask`` ``[B, T]``, True for real tokens) leaves padding keys out of every real query's window;
a padding query weighs itself alone and outputs zero, as the dispatcher's other forms do. Soft-capping
(``softcap * tanh(s / softcap)``) as Gemma's. The products run on tensor cores in the inputs' half precision
(fp32 inputs, and everything under the interpreter: IEEE fp32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Queries per program, keys per block of the loop, warps per program and pipeline stages (None: Triton's
# default). Module constants so that a benchmark can sweep them (dev/window_prefill_bench.py). On the H200 at
# 1 x 32,768, SmolLM2's heads, a 1,280-token window: 64 / 64 / 4 / 2 took 0.377 ms a layer, the best of 16 tilings
# (128 / 64 / 4 / 3 0.441, 128 / 128 0.43-0.49, 8 warps on 64-query tiles 0.82-1.0; flash blocks 1.66).
PARALLEL_BM = 64
PARALLEL_BN = 64
PARALLEL_WARPS = 4
PARALLEL_STAGES: int | None = 2
MAX_HEAD_DIM = 256


@triton.jit
def _scored(q, keys, values, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr,
            PREC: tl.constexpr):
    """A tile of keys and values as the products take them (fp32, else q's dtype) and its base-2 scores."""
    if F32_DOT:
        keys = keys.to(tl.float32)
        values = values.to(tl.float32)
    else:
        keys = keys.to(q.dtype)
        values = values.to(q.dtype)
    s = tl.dot(q, tl.trans(keys), input_precision=PREC) * qk_scale
    if HAS_SOFTCAP:  # on natural-log scores, then to base 2
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634
    return s, values


@triton.jit
def _absorb(s, values, m, l, acc, PREC: tl.constexpr):
    """Masked scores ``s`` and their values into the running maximum ``m``, sum ``l`` and output ``acc``."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet for this row: nothing to weigh
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(values.dtype), values, acc * alpha[:, None], input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _keys(q, k_base, v_base, sk_t, sv_t, mask_ptr, start_n, rows, d, dm, m, l, acc, T, W, qk_scale, softcap,
          MASKED: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr,
          PREC: tl.constexpr, BN: tl.constexpr):
    """One block of ``BN`` keys into the running maximum ``m``, sum ``l`` and output ``acc`` (base-2 scores);
    ``MASKED``: the block crosses the band's edges (or the sequence's end), else every query weighs all of it."""
    cols = start_n + tl.arange(0, BN)
    cm = cols < T
    tile = cols[:, None].to(tl.int64)
    if MASKED:
        keys = tl.load(k_base + tile * sk_t + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
        values = tl.load(v_base + tile * sv_t + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
    else:
        keys = tl.load(k_base + tile * sk_t + d[None, :], mask=dm[None, :], other=0.0)
        values = tl.load(v_base + tile * sv_t + d[None, :], mask=dm[None, :], other=0.0)
    s, values = _scored(q, keys, values, qk_scale, softcap, HAS_SOFTCAP, F32_DOT, PREC)
    if MASKED:
        dist = rows[:, None] - cols[None, :]
        ok = (dist >= 0) & (dist < W) & cm[None, :]
        if HAS_MASK:
            real = tl.load(mask_ptr + cols, mask=cm, other=0) != 0
            ok = (ok & real[None, :]) | (dist == 0)
        s = tl.where(ok, s, float("-inf"))
    return _absorb(s, values, m, l, acc, PREC)


@triton.jit
def _sink_keys(q, k_base, v_base, sk_t, sv_t, pos_ptr, rows, d, dm, m, l, acc, W, qk_scale, softcap, real_row,
               HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr,
               BS: tl.constexpr):
    """The sequence's sinks (their positions at ``pos_ptr``, -1 for none) into the running softmax, each weighed
    by the queries it has left the window of (``row - pos >= W``; within it, the band's blocks weigh it)."""
    pos = tl.load(pos_ptr + tl.arange(0, BS))
    there = pos >= 0
    tile = tl.maximum(pos, 0)[:, None].to(tl.int64)
    keys = tl.load(k_base + tile * sk_t + d[None, :], mask=there[:, None] & dm[None, :], other=0.0)
    values = tl.load(v_base + tile * sv_t + d[None, :], mask=there[:, None] & dm[None, :], other=0.0)
    s, values = _scored(q, keys, values, qk_scale, softcap, HAS_SOFTCAP, F32_DOT, PREC)
    ok = (rows[:, None] - pos[None, :] >= W) & there[None, :]
    if HAS_MASK:  # a padding query sees no sink
        ok = ok & real_row[:, None]
    return _absorb(tl.where(ok, s, float("-inf")), values, m, l, acc, PREC)


@triton.jit
def _window_parallel(q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, cos_ptr, sin_ptr, pos_ptr, qs_ptr, rc_ptr, rs_ptr, rp_ptr,
                     sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, sm_b, sc_b, sc_t, ss_b, ss_h,
                     ss_t, sp_b, sp_t, T, H, G, W, D, R, REACH, scale, softcap, HAS_MASK: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr,
                     SINKS: tl.constexpr, SINK_Q: tl.constexpr, SINK_ROPE: tl.constexpr, BS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // G
    rows = start_m + tl.arange(0, BM)
    d = tl.arange(0, BD)
    dm = d < D
    rm = rows < T
    q_rows = q_ptr + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_t
    q = tl.load(q_rows + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    qs = q
    if ROPE:  # by rotating halves over the first R dims, in fp32, rounded back as the family's RoPE rounds
        half = R // 2
        rot = (d < R)[None, :] & rm[:, None]
        partner = tl.load(q_rows + tl.where(d < half, d + half, d - half)[None, :], mask=rot, other=0.0)
        at = b * sc_b + rows[:, None].to(tl.int64) * sc_t + d[None, :]
        cos = tl.load(cos_ptr + at, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + at, mask=rot, other=0.0).to(tl.float32)
        turned = tl.where((d < half)[None, :], -partner.to(tl.float32), partner.to(tl.float32))
        raw = q
        q = (raw.to(tl.float32) * cos + turned * sin).to(raw.dtype)
        qs = q
        if SINK_ROPE:  # the sinks' queries (sinks.py's reach): a row past REACH rotated by the tables at REACH
            at_cos = tl.load(rc_ptr + d, mask=d < R, other=1.0).to(tl.float32)
            at_sin = tl.load(rs_ptr + d, mask=d < R, other=0.0).to(tl.float32)
            far = tl.load(rp_ptr + b * sp_b + rows.to(tl.int64) * sp_t, mask=rm, other=0) > REACH
            moved = (raw.to(tl.float32) * at_cos[None, :] + turned * at_sin[None, :]).to(raw.dtype)
            qs = tl.where(far[:, None], moved, q)
    if F32_DOT:
        q = q.to(tl.float32)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    mask_row = mask_ptr + b * sm_b
    # scores in base 2 (exp2), the soft-cap on natural ones
    qk_scale = scale if HAS_SOFTCAP else scale * 1.4426950408889634

    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    real_row = rm
    if HAS_MASK:
        real_row = tl.load(mask_row + rows, mask=rm, other=0) != 0
    if F32_DOT:
        qs = qs.to(tl.float32)
    if SINKS:  # first the sinks (a sink at p is seen from p + W on); in every tile, masked: no branch around a dot
        if SINK_Q:  # their own queries, rotated already (sinks.py's reach)
            qs = tl.load(qs_ptr + b * ss_b + h * ss_h + rows[:, None].to(tl.int64) * ss_t + d[None, :],
                         mask=rm[:, None] & dm[None, :], other=0.0).to(q.dtype)
        m, l, acc = _sink_keys(qs, k_base, v_base, sk_t, sv_t, pos_ptr + b * BS, rows, d, dm, m, l, acc, W,
                               qk_scale, softcap, real_row, HAS_MASK, HAS_SOFTCAP, F32_DOT, PREC, BS)
    # key blocks: [lo, full) cross the window's lower edge for some of these queries, [full, start_m) are whole
    # for all of them, [start_m, hi) cross the diagonal (BM is a multiple of BN)
    lo = tl.maximum(start_m - W + 1, 0) // BN * BN
    hi = tl.minimum(start_m + BM, T)
    if HAS_MASK:  # padding: every block masked
        for start_n in range(lo, hi, BN):
            m, l, acc = _keys(q, k_base, v_base, sk_t, sv_t, mask_row, start_n, rows, d, dm, m, l, acc, T, W,
                              qk_scale, softcap, True, HAS_MASK, HAS_SOFTCAP, F32_DOT, PREC, BN)
    else:
        full = tl.minimum(tl.maximum((tl.maximum(start_m + BM - W, 0) + BN - 1) // BN * BN, lo), start_m)
        for start_n in range(lo, full, BN):
            m, l, acc = _keys(q, k_base, v_base, sk_t, sv_t, mask_row, start_n, rows, d, dm, m, l, acc, T, W,
                              qk_scale, softcap, True, HAS_MASK, HAS_SOFTCAP, F32_DOT, PREC, BN)
        for start_n in range(full, start_m, BN):
            m, l, acc = _keys(q, k_base, v_base, sk_t, sv_t, mask_row, start_n, rows, d, dm, m, l, acc, T, W,
                              qk_scale, softcap, False, HAS_MASK, HAS_SOFTCAP, F32_DOT, PREC, BN)
        for start_n in range(start_m, hi, BN):
            m, l, acc = _keys(q, k_base, v_base, sk_t, sv_t, mask_row, start_n, rows, d, dm, m, l, acc, T, W,
                              qk_scale, softcap, True, HAS_MASK, HAS_SOFTCAP, F32_DOT, PREC, BN)

    o = acc / tl.where(rm, l, 1.0)[:, None]  # l >= 1 on a real row: its largest term is exp(0)
    if HAS_MASK:
        o = tl.where(real_row[:, None], o, 0.0)
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_t + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(q, k, v, window: int) -> bool:
    """Whether ``window_softmax_triton`` takes these inputs: no gradient wanted, CUDA with Triton (or the
    interpreter), half precision or fp32, head dims up to ``MAX_HEAD_DIM``, values as wide as keys."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return False
    if q.dtype not in KERNEL_DTYPES or q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] != q.shape[-1] or window < 1:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    from ..availability import triton_available

    return q.is_cuda and triton_available()


def window_softmax_triton(q, k, v, *, window: int, scale: float, softcap: float | None = None, key_mask=None,
                          position_embeddings=None, sink_positions=None, sink_q=None, sink_rope=None):
    """Softmax over each query's last ``window`` keys (itself included; padding keys left out) and, with
    ``sink_positions`` ``[B, S]`` (``sinks.sink_index``: each sequence's first real tokens, -1 for none), those once
    they have left its window (attention sinks, ``sinks.py``), ``q``
    ``[B, H, T, D]``, ``k``/``v`` ``[B, Hk, T, D]`` with any strides but the last, in one launch. Returns
    ``[B, H, T, D]`` in q's dtype: a view of ``[B, T, H, D]`` memory. Padding queries output zero.

    ``position_embeddings`` ``(cos, sin)`` ``[B or 1, T, R]``: q comes unrotated and the kernel rotates it (RoPE by
    rotating halves over its first ``R`` dims, in fp32, rounded to q's dtype), saving the passes of q's RoPE; the
    keys come rotated (``models.base.rope_rotate_half``: the state keeps them so). ``sink_q`` (like ``q``, rotated
    whatever ``position_embeddings``): the queries that weigh the sinks instead (``sinks.py``'s reach).
    ``sink_rope`` ``(cos, sin, positions, reach)`` instead of ``sink_q``, with ``position_embeddings``: the kernel
    makes those queries itself, a query whose position (``positions`` ``[B or 1, T]``) passes ``reach`` rotated by
    the tables ``cos``/``sin`` ``[R]`` (the reach's row), the others as ``q`` (no pass over q before the launch)."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    if h % hk:
        raise ValueError(f"{h} query heads are not a multiple of {hk} key heads")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = torch.empty(b, t, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    f32_dot = interpret or torch.float32 in (q.dtype, k.dtype, v.dtype)
    mask = key_mask.to(torch.uint8).contiguous() if key_mask is not None else o
    if position_embeddings is not None:
        cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in position_embeddings)
        rot, sc_b, sc_t = cos.shape[-1], cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1)
        if sin.stride() != cos.stride() or rot > d or rot % 2:
            raise ValueError(f"RoPE tables {tuple(cos.shape)} / {tuple(sin.shape)} do not fit heads of {d}")
    else:
        cos = sin = o  # never read
        rot = sc_b = sc_t = 0
    n_sinks = 0 if sink_positions is None else sink_positions.shape[1]
    bs = max(16, triton.next_power_of_2(max(n_sinks, 1)))  # the sinks' key tile: a dot's narrowest
    if n_sinks:
        pos = torch.nn.functional.pad(sink_positions.to(torch.int32), (0, bs - n_sinks), value=-1).contiguous()
    else:
        pos = o  # never read
    use_qs = n_sinks > 0 and sink_q is not None
    qs = (sink_q if sink_q.stride(-1) == 1 else sink_q.contiguous()) if use_qs else o  # o: never read
    if sink_rope is not None and (sink_q is not None or position_embeddings is None):
        raise ValueError("sink_rope rotates the sinks' queries inside the kernel beside q's own RoPE: give "
                         "position_embeddings and no sink_q")
    use_rope = n_sinks > 0 and sink_rope is not None
    if use_rope:
        at_cos, at_sin, at_pos, reach = sink_rope
        at_cos, at_sin = (x.reshape(-1).to(cos.dtype).contiguous() for x in (at_cos, at_sin))
        at_pos = at_pos if at_pos.stride(-1) == 1 else at_pos.contiguous()
        sp_b, sp_t = (at_pos.stride(0) if at_pos.shape[0] > 1 else 0), at_pos.stride(1)
        if at_cos.numel() != rot or at_pos.shape[-1] != t:
            raise ValueError(f"sink_rope: tables of {at_cos.numel()} for a rotary of {rot}, positions "
                             f"{tuple(at_pos.shape)} for {t} queries")
    else:
        at_cos = at_sin = at_pos = o  # never read
        sp_b = sp_t = reach = 0
    bm, bn = PARALLEL_BM, PARALLEL_BN
    if bm % bn:
        raise ValueError(f"PARALLEL_BM ({bm}) must be a multiple of PARALLEL_BN ({bn})")
    grid = (triton.cdiv(t, bm), b * h)
    _window_parallel[grid](
        q, k, v, o, mask, cos, sin, pos, qs, at_cos, at_sin, at_pos, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
        o.stride(2), mask.stride(0) if key_mask is not None else 0, sc_b, sc_t, qs.stride(0), qs.stride(1),
        qs.stride(2), sp_b, sp_t, t, h, h // hk, window, d, rot, int(reach), float(scale), float(softcap or 1.0),
        HAS_MASK=key_mask is not None, HAS_SOFTCAP=softcap is not None, ROPE=rot > 0, F32_DOT=f32_dot,
        SINKS=n_sinks > 0, SINK_Q=use_qs, SINK_ROPE=use_rope, BS=bs,
        PREC="ieee" if f32_dot else "tf32", BM=bm, BN=bn,  # half-precision products ignore it (as in the ring step)
        BD=max(16, triton.next_power_of_2(d)), num_warps=PARALLEL_WARPS,
        **({} if PARALLEL_STAGES is None else dict(num_stages=PARALLEL_STAGES)))
    return o


__all__ = ["PARALLEL_BM", "PARALLEL_BN", "PARALLEL_STAGES", "PARALLEL_WARPS", "supported", "window_softmax_triton"]
