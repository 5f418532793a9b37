"""The LoLCATs hybrid over whole sequences as Triton kernels (CUDA): the twin of
``hybrid_attention_chunked``, values, gradients and the prefill's final state.

For query t (``ops/hybrid/__init__.py`` has the math): ``gamma exp(s_ts - c_t)`` over the last ``w``
keys, ``phi_q(q_t) . phi_k(k_s)`` over older ones, one normaliser. The sequence is cut into chunks
of ``w`` tokens, aligned to its end (a virtual ``N w - T`` tokens of nothing in front), so that

* the queries of chunk c see the keys of chunks c-1 and c exactly (window and youngest linear
  keys, two ``[w, w]`` tiles) and the linear state of chunks <= c-2;
* the prefill's final state is the state of chunks <= N-2 plus chunk N-1 raw: no partial chunk.

Forward, three launches (``hybrid_triton_forward``):

1. ``_chunk_sums``, one program per (chunk, sequence, key head): ``phi(K_c)^T [V_c, 1]``; the last
   chunk also writes the decoding window (rotated keys, key features, values);
2. ``_scan``, a cumulative sum over chunks, parallel over the state's ``F (D + 1)`` entries (a
   ``tl.cumsum`` per tile of chunks): the linear state entering each chunk; the prefill's final
   state is written in ``HybridState``'s layout on the way;
3. ``_forward``, one program per (block of a chunk's queries, sequence, query head): the state's
   terms, the youngest linear terms, then the two window tiles with a running maximum (the
   softmax terms), one normaliser. For the backward it keeps per query the denominator and the
   maximum ``c_t`` (a function of q and k: its gradient is part of the reference's; the backward
   finds where it was).

Backward, four launches (``hybrid_triton_backward``), after the per-query quantities
``delta_t = dy_t / den_t`` and ``rho_t = -delta_t . y_t`` (so ``d a_ts = delta_t . v_s + rho_t``
for every term):

1. ``_backward_q``, per (chunk, sequence, query head): dq (window scores, including the
   maximum's term), dphi(q) (youngest linear keys and the state), dgamma per chunk, and the
   chunk's ``phi(Q_c)^T [delta, rho]`` for the reverse state;
2. ``_scan`` in reverse, summing the query heads of each key head: what the queries of chunks
   >= j+2 ask of key chunk j;
3. ``_backward_kv``, per (block of a chunk's keys, sequence, key head), over the query heads of its
   group: dk and the window's part of dv, from the queries of chunks j and j+1;
4. ``_backward_kf``, the same programs: dphi(k) and the linear part of dv, from chunk j+1's queries
   and the reverse state.

RoPE and Hedgehog feature maps may run inside the forward kernels (``rope`` / ``hedgehog``
arguments of ``hybrid_triton``): the rotation by halves of the first R dims of each head, and
``[softmax(x W), softmax(-x W)]`` per tile, so neither rotated q/k nor features are written to
memory. The backward kernels take features from memory: the backward recomputes rotation and
features, and carries dphi and the rotated gradients back to q, k and the feature weights. With
``FUSED_PRELUDE`` (the default) that prelude is Triton too (``prelude_triton.py``): per side,
one launch writes the rotated q/k and their features (as the forward kernels compute them: fp32
rotation from cos/sin as given), one launch gives the gradient of the unrotated q/k (softmax backward
of both halves, ``dY W^T`` and the rotated gradient, rotated back) and per-program partial sums of
the weights' gradient, reduced by one torch sum (deterministic). Without it, PyTorch recomputes them
(``rope_half`` and ``hedgehog_features`` below, in the input dtype) and autograd carries them back:
~25 small launches per side and layer on an H100 profile of a training step.

Gates (``log_gate`` ``[B, Hk, T]``, log g <= 0; a constexpr ``GATED``, every launch unchanged
without): the linear state fades, a key ``s`` older than query ``t``'s window weighing
``exp(G_t - G_{s+w})`` (``G`` the cumulative log gates). PyTorch sums the log gates within each
chunk once per call (``chunk_log_gates``: ``Gl [B, Hk, N, w]``, the virtual tokens' gates 0), and
only differences of ``Gl`` within one chunk are exponentiated (never above 0, no overflow):

* ``_chunk_sums`` fades key j of chunk m to the end of chunk m+1 (where it left the window),
  ``exp(Gl[m+1, w-1] - Gl[m+1, j])``; the forward ``_scan`` is a decayed one, ``E_{c+1} =
  exp(Gl[c, w-1]) E_c + P_{c-1}`` (an associative scan per tile of chunks, the carry decayed from tile
  to tile), whose entry N-2 is the prefill's final state as before;
* ``_forward`` weighs the state by ``exp(Gl[c, i])`` and a youngest key j by ``exp(Gl[c, i] - Gl[c, j])``;
* the backward puts the same factors on every linear term's gradient (the query side's asks to the
  reverse state by ``exp(Gl[c, i])``, the reverse scan decayed by each chunk's gate, a key's answer
  by ``exp(Gl[j+1, w-1] - Gl[j+1, jj])``); ``_backward_q`` and ``_backward_kf`` also store
  ``phi_q . dphi_q`` per query and ``phi_k . dphi_k`` per key (both from the same fp32 terms of the
  youngest keys, not through a 16-bit operand: their pairs cancel), from which PyTorch takes the log
  gates' gradient (``log_gate_grad``: sums within each chunk, the pairs crossing a chunk's end from the
  states there). Window terms are untouched. Not with the sinks' form.

Precision: products of bf16/fp16 inputs on tensor cores with fp32 accumulation (softmax weights,
features and the fp32 states rounded to the input dtype first, as flash attention and fla do),
every sum and state in fp32; fp32 inputs use full fp32 products throughout.

Register pressure decides the layout (``cuobjdump -res-usage`` of sm_90 builds): the keys'
Hedgehog features are computed once, in the first pass, and written for the output pass; no
pass computes more than it stores at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .prelude_triton import hedgehog_rope_backward, hedgehog_rope_forward
from .triton_tiles import _features, _load_features, _pow2, _precision, _rotated, _tile, tiles_for

# Tiles and warps for 16-bit inputs (bf16, fp16): the fastest of ``dev/hybrid_bench.py --sweep`` on an H100
# (SmolLM2's shape, w = D = 64, Hedgehog F = 2 x 64, 8 x 1,024): the kernels of a forward + backward took 0.84
# ms of device time against 1.07 under the fewest register spills of sm_90 builds (8 warps everywhere, query
# blocks of 32 rows, key blocks of 16), which 32- and 64-bit inputs keep (``WIDE``): their registers are
# twice as wide, and the 16-bit tiles made the fp32 CUDA tests crawl
SUM_WARPS = 4  # warps of the chunk sums
FWD_WARPS = 4  # warps of the output pass
BWD_WARPS = 4  # warps of the query-side backward pass
KEY_WARPS = 4  # warps of the key-side backward passes
QUERY_ROWS = 16  # query rows per program of the output pass
BWD_QUERY_ROWS = 16  # query rows per program of the query-side backward
KEY_ROWS = 32  # key rows per program of the key-side backward passes
# The output pass with no backward to follow (prefill, scoring) saves nothing and takes its own tiles:
# a whole window of queries per program loads each chunk's linear state once, where 16 rows load it four
# times (an H100 sweep of the forward alone, ``dev/hybrid_bench.py --sweep-prefill``: 64 rows / 4 warps
# fastest at every shape tried)
PREFILL_QUERY_ROWS = 64  # query rows per program of the output pass without a backward
PREFILL_WARPS = 4  # its warps
WIDE = dict(SUM_WARPS=8, FWD_WARPS=8, BWD_WARPS=8, KEY_WARPS=8, QUERY_ROWS=32, BWD_QUERY_ROWS=32, KEY_ROWS=16,
            PREFILL_QUERY_ROWS=32, PREFILL_WARPS=8)
SCAN_TILE = 8192  # chunks x state entries per program of the scans
SCAN_CHUNKS = 256  # chunks per tile of the scans (more: a carry from tile to tile)
TINY = tl.constexpr(1.1754943508222875e-38)  # the clamp of the denominator (fp32's smallest normal)
# The backward's prelude with Hedgehog maps (RoPE, the maps and their gradients): the Triton kernels of
# ``prelude_triton`` (True) or PyTorch with autograd (False; ``rope_half``, ``hedgehog_features``)
FUSED_PRELUDE = True


def _knobs(dtype) -> dict:
    """The tile constants for inputs of ``dtype`` (``tiles_for``)."""
    return tiles_for(dtype, ("SUM_WARPS", "FWD_WARPS", "BWD_WARPS", "KEY_WARPS", "QUERY_ROWS", "BWD_QUERY_ROWS",
                             "KEY_ROWS", "PREFILL_QUERY_ROWS", "PREFILL_WARPS"), globals(), WIDE)


@triton.jit
def _only(m, valid):
    """The mask ``m`` where the scalar ``valid`` holds, else all False (not ``m & valid``: Triton
    3.9's interpreter gives that an int32 dtype, which loads and stores refuse as a mask)."""
    return tl.where(valid, m, False)


@triton.jit
def _rows(c, T, W, OFF, BW: tl.constexpr):
    """Chunk ``c``'s tokens ``t`` (``BW`` rows, the first ``W`` used) and which exist."""
    i = tl.arange(0, BW)
    t = c * W + i - OFF
    return t, (i < W) & (t >= 0) & (t < T)


@triton.jit
def _query_rows(pid, T, W, OFF, BW: tl.constexpr, BQ: tl.constexpr):
    """Program ``pid``'s chunk ``c``, its query rows' positions ``i`` in the chunk (``BQ`` of the
    chunk's ``BW``), their tokens ``t`` and which exist."""
    c = pid // (BW // BQ)
    i = (pid % (BW // BQ)) * BQ + tl.arange(0, BQ)
    t = c * W + i - OFF
    return c, i, t, (i < W) & (t >= 0) & (t < T)


@triton.jit
def _real(mask_ptr, t, ok, MASK: tl.constexpr):
    """Which rows are real tokens: they exist and (with ``MASK``) the key mask says so."""
    real = ok
    if MASK:
        real = ok & (tl.load(mask_ptr + t, mask=ok, other=0) != 0)
    return real


@triton.jit
def _gates(gl_ptr, c, i, N, W):
    """``Gl[c, i]``, the log gates' cumulative sum within chunk ``c`` up to its row ``i`` (``gl_ptr``: one
    key head's ``[N, W]``); rows past the chunk (``i >= W``, a tile's padding) take its last, so that a
    fade ``exp(Gl[c, i] - Gl[c, j])``, ``j <= i``, never overflows there; 0 for a chunk outside 0..N-1."""
    return tl.load(gl_ptr + c * W + tl.minimum(i, W - 1), mask=_only(i >= 0, (c >= 0) & (c < N)), other=0.0)


@triton.jit
def _decayed(a1, x1, a2, x2):
    """The gated scan's step as an associative operation: ``x2 + a2 x1``, decays multiplied."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _scale_rows(parts, scale, FP: tl.constexpr):
    out = ()
    for i in tl.static_range(FP):
        out = out + ((parts[i].to(tl.float32) * scale[:, None]).to(parts[i].dtype),)
    return out


@triton.jit
def _fade(g_rows, g_cols, near):
    """``exp(g_rows - g_cols)`` where ``near`` (a pair's fade: the log gates summed between the key's
    leaving the window and the query), 0 elsewhere (never an overflow there)."""
    return tl.exp(tl.where(near, g_rows[:, None] - g_cols[None, :], float("-inf")))


@triton.jit
def _zero_rows(parts, keep, FP: tl.constexpr):
    out = ()
    for i in tl.static_range(FP):
        out = out + (tl.where(keep[:, None], parts[i], 0.0).to(parts[i].dtype),)
    return out


@triton.jit
def _feature_dot(a, b, FP: tl.constexpr, PREC: tl.constexpr):
    """``sum_i a[i] b[i]^T``: ``[BW, BW]`` products of two rows' features."""
    acc = tl.dot(a[0], tl.trans(b[0]), input_precision=PREC)
    for i in tl.static_range(1, FP):
        acc = tl.dot(a[i], tl.trans(b[i]), acc, input_precision=PREC)
    return acc


@triton.jit
def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, PREC: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    return s


@triton.jit
def _chunk_sums(k_ptr, v_ptr, kf_ptr, wk_ptr, cos_ptr, sin_ptr, mask_ptr, slot_ptr, sums_ptr, kf_out_ptr,
                win_k_ptr, win_f_ptr, win_v_ptr, cache_k_ptr, cache_f_ptr, cache_v_ptr, gl_ptr,
                skb, skh, skt, svb, svh, svt, sfb, sfh, sft, swk, scb, sct, T, W, OFF, N, HK, D, FW, R, L, S,
                ROPE: tl.constexpr, HEDGEHOG: tl.constexpr, FP: tl.constexpr, MASK: tl.constexpr,
                STATE: tl.constexpr, SINKS: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
                PREC: tl.constexpr, GATED: tl.constexpr = False, NOPE: tl.constexpr = False):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit bases: large batches x long sequences
    b = bh // HK
    hk = bh % HK
    t, ok = _rows(c, T, W, OFF, BW)
    real = _real(mask_ptr + b * T, t, ok, MASK)
    vdt = v_ptr.dtype.element_ty  # the inputs' dtype: operands of the products
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    k = _rotated(k_ptr + b * skb + hk * skh, t, ok, skt, d, D, cos_ptr + b * scb, sin_ptr + b * scb, sct, R, ROPE)
    k = k.to(vdt)
    if NOPE:  # the features of the keys before RoPE (``feature_rope: false``)
        kx = _tile(k_ptr + b * skb + hk * skh, t, ok, skt, d, D).to(vdt)
    else:
        kx = k
    kf = _features(kx, kf_ptr + b * sfb + hk * sfh, t, ok, sft, wk_ptr + hk * swk, d, D, FW, BF, FP, HEDGEHOG, PREC)
    kf = _zero_rows(kf, real, FP)
    v = tl.where(real[:, None], _tile(v_ptr + b * svb + hk * svh, t, ok, svt, d, D), 0.0).to(vdt)
    F = FP * FW
    if HEDGEHOG:  # for the output pass: [B, Hk, T, F], zero at padding
        for i in tl.static_range(FP):
            tl.store(kf_out_ptr + bh * T * F + t[:, None] * F + (i * FW + f)[None, :], kf[i],
                     mask=ok[:, None] & (f < FW)[None, :])
    base = sums_ptr + (bh * N + c) * (F * (D + 1))
    m2 = (f < FW)[:, None] & (d < D)[None, :]
    kl = kf
    if SINKS:  # the cached first tokens (a slot of the cache: >= 0) stay out of the linear state
        slot = tl.load(slot_ptr + b * T + t, mask=ok, other=-1)
        kl = _zero_rows(kf, slot < 0, FP)
    if GATED:  # each key faded to the end of the next chunk (it leaves the window in that chunk)
        rows = tl.arange(0, BW)
        gl = gl_ptr + bh * N * W
        last = _gates(gl, c + 1, rows * 0 + W - 1, N, W)
        kl = _scale_rows(kl, tl.exp(last - _gates(gl, c + 1, rows, N, W)), FP)
    for i in tl.static_range(FP):
        tl.store(base + (i * FW + f)[:, None] * D + d[None, :],
                 tl.dot(tl.trans(kl[i]), v, input_precision=PREC), mask=m2)
        tl.store(base + F * D + i * FW + f, tl.sum(kl[i].to(tl.float32), axis=0), mask=f < FW)
    if STATE:  # the last chunk is the decoding window: its last L = min(T, w) tokens raw
        keep = _only(ok, c == N - 1)
        row = t - (T - L)
        tl.store(win_k_ptr + bh * L * D + row[:, None] * D + d[None, :], k, mask=keep[:, None] & (d < D)[None, :])
        tl.store(win_v_ptr + bh * L * D + row[:, None] * D + d[None, :], v, mask=keep[:, None] & (d < D)[None, :])
        for i in tl.static_range(FP):
            tl.store(win_f_ptr + bh * L * F + row[:, None] * F + (i * FW + f)[None, :],
                     kf[i].to(win_f_ptr.dtype.element_ty), mask=keep[:, None] & (f < FW)[None, :])
        if SINKS:  # the cache's rows: the first tokens' rotated keys, features and values
            row = bh * S + tl.maximum(slot, 0)
            put = slot >= 0
            tl.store(cache_k_ptr + row[:, None] * D + d[None, :], k, mask=put[:, None] & (d < D)[None, :])
            tl.store(cache_v_ptr + row[:, None] * D + d[None, :], v, mask=put[:, None] & (d < D)[None, :])
            for i in tl.static_range(FP):
                tl.store(cache_f_ptr + row[:, None] * F + (i * FW + f)[None, :],
                         kf[i].to(cache_f_ptr.dtype.element_ty), mask=put[:, None] & (f < FW)[None, :])


@triton.jit
def _scan(src_ptr, dst_ptr, fin_ptr, gl_ptr, N, E, D, F, G, S, W,
          REVERSE: tl.constexpr, FINAL: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr,
          GATED: tl.constexpr = False):
    """Cumulative sums over chunks of ``[rows, N, E]`` (inclusive; from the end with ``REVERSE``),
    each output row and chunk the sum of ``G`` input rows of ``S`` parts each (``[rows, G, N, S, E]``
    in). ``FINAL``: also write the sum of chunks <= N-2 in ``HybridState``'s ``[F, D + 1]`` layout.
    ``GATED``: decayed sums, ``out[n] = x[n] + a[n] out[n -+ 1]`` with ``a[n]`` the gate of a whole chunk
    (``exp(Gl[., W-1])`` of row ``r``'s ``gl_ptr`` ``[rows, N, W]``), of chunk ``n + 1`` forward (the
    state of chunks <= n at the end of chunk n + 1), of chunk ``n`` in reverse."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    em = e < E
    carry = tl.zeros([BE], dtype=tl.float32)
    fin = tl.zeros([BE], dtype=tl.float32)
    tiles = tl.cdiv(N, BN)
    for j in range(tiles):
        if GATED and REVERSE:  # the tile's rows from its last chunk: the scan runs down the rows
            n = (tiles - 1 - j) * BN + (BN - 1 - tl.arange(0, BN))
        elif REVERSE:
            n = (tiles - 1 - j) * BN + tl.arange(0, BN)
        else:
            n = j * BN + tl.arange(0, BN)
        m = (n < N)[:, None] & em[None, :]
        x = tl.zeros([BN, BE], dtype=tl.float32)
        for g in range(G):
            for part in range(S):
                x += tl.load(src_ptr + (r * G + g) * N * S * E + (n[:, None] * S + part) * E + e[None, :], mask=m,
                             other=0.0)
        if GATED:
            whole = n + 1  # the chunk whose gate multiplies the scan's previous row
            if REVERSE:
                whole = n
            a = tl.exp(tl.load(gl_ptr + (r * N + whole) * W + W - 1, mask=(whole < N) & (n < N), other=0.0))
            decay, cum = tl.associative_scan((tl.broadcast_to(a[:, None], [BN, BE]), x), 0, _decayed)
            cum = cum + decay * carry[None, :]
            carry = tl.sum(tl.where((tl.arange(0, BN) == BN - 1)[:, None], cum, 0.0), axis=0)
        else:
            cum = tl.cumsum(x, axis=0, reverse=REVERSE) + carry[None, :]
            carry += tl.sum(x, axis=0)
        tl.store(dst_ptr + r * N * E + n[:, None] * E + e[None, :], cum, mask=m)
        if FINAL:
            fin += tl.sum(tl.where((n == N - 2)[:, None], cum, 0.0), axis=0)
    if FINAL:
        values = e < F * D
        row = tl.where(values, e // D, e - F * D)
        col = tl.where(values, e % D, D)
        tl.store(fin_ptr + r * (F * (D + 1)) + row * (D + 1) + col, fin, mask=em)


@triton.jit
def _forward(q_ptr, k_ptr, v_ptr, qf_ptr, kf_ptr, wq_ptr, cos_ptr, sin_ptr, mask_ptr, gamma_ptr, sums_ptr,
             y_ptr, den_ptr, mx_ptr, slot_ptr, sink_pos_ptr, gl_ptr,
             sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sqfb, sqfh, sqft, skfb, skfh, skft, swq, scb, sct,
             syb, syh, syt, T, W, OFF, N, H, G, D, FW, R, S, scale, softcap,
             ROPE: tl.constexpr, HEDGEHOG: tl.constexpr, FP: tl.constexpr, MASK: tl.constexpr,
             SOFTCAP: tl.constexpr, SAVE: tl.constexpr, LOGIT: tl.constexpr, SINKS: tl.constexpr,
             WINDOW_ANCHOR: tl.constexpr, BW: tl.constexpr, BQ: tl.constexpr, BS: tl.constexpr,
             BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr = False,
             NOPE: tl.constexpr = False):
    c, i, tq, okq = _query_rows(tl.program_id(0), T, W, OFF, BW, BQ)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit bases: large batches x long sequences
    b = bh // H
    h = bh % H
    hk = h // G
    HK = H // G
    vdt = v_ptr.dtype.element_ty  # the inputs' dtype: operands of the products
    d = tl.arange(0, BD)
    j = tl.arange(0, BW)  # keys: the previous chunk's and this one's
    tp, okp = _rows(c - 1, T, W, OFF, BW)
    tc, okc = _rows(c, T, W, OFF, BW)
    real_p = _real(mask_ptr + b * T, tp, okp, MASK)
    real_c = _real(mask_ptr + b * T, tc, okc, MASK)
    cos_b, sin_b = cos_ptr + b * scb, sin_ptr + b * scb
    kb = k_ptr + b * skb + hk * skh
    vb = v_ptr + b * svb + hk * svh

    q = _rotated(q_ptr + b * sqb + h * sqh, tq, okq, sqt, d, D, cos_b, sin_b, sct, R, ROPE).to(vdt)
    if NOPE:  # the features of the queries before RoPE
        qx = _tile(q_ptr + b * sqb + h * sqh, tq, okq, sqt, d, D).to(vdt)
    else:
        qx = q
    qf = _features(qx, qf_ptr + b * sqfb + h * sqfh, tq, okq, sqft, wq_ptr + h * swq, d, D, FW, BF, FP, HEDGEHOG,
                   PREC)
    # (the order keeps few tiles alive at once: each part is folded into num / den when computed)
    # 1. the linear state of chunks <= c-2
    F = FP * FW
    state = sums_ptr + ((b * HK + hk) * N + c - 2) * (F * (D + 1))
    f = tl.arange(0, BF)
    num = tl.zeros([BQ, BD], dtype=tl.float32)
    den = tl.zeros([BQ], dtype=tl.float32)
    for p in tl.static_range(FP):
        sv = tl.load(state + (p * FW + f)[:, None] * D + d[None, :],
                     mask=_only((f < FW)[:, None] & (d < D)[None, :], c >= 2), other=0.0)
        sz = tl.load(state + F * D + p * FW + f, mask=_only(f < FW, c >= 2), other=0.0)
        num = tl.dot(qf[p], sv.to(vdt), num, input_precision=PREC)  # the state rounded as fla does
        den += tl.sum(qf[p].to(tl.float32) * sz[None, :], axis=1)
    if GATED:  # the state (at the end of chunk c-1) fades to the query: exp(Gl[c, i])
        gl = gl_ptr + (b * HK + hk) * N * W
        g_q = _gates(gl, c, i, N, W)
        num = num * tl.exp(g_q)[:, None]
        den = den * tl.exp(g_q)
    # 2. the youngest linear keys: the previous chunk's up to the query's position
    kf_p = _load_features(kf_ptr + b * skfb + hk * skfh, tp, okp, skft, FW, vdt, BF, FP)  # the keys' from memory
    lin_p = real_p
    if SINKS:  # the first tokens are cached, not linear terms
        lin_p = real_p & (tl.load(slot_ptr + b * T + tp, mask=okp, other=-1) < 0)
    lin = tl.where((j[None, :] <= i[:, None]) & lin_p[None, :], _feature_dot(qf, kf_p, FP, PREC), 0.0)
    if GATED:  # key j left the window at row j of chunk c: exp(Gl[c, i] - Gl[c, j])
        lin = lin * _fade(g_q, _gates(gl, c, j, N, W), j[None, :] <= i[:, None])
    v_p = tl.where(real_p[:, None], _tile(vb, tp, okp, svt, d, D), 0.0).to(vdt)
    num = tl.dot(lin.to(vdt), v_p, num, input_precision=PREC)
    den += tl.sum(lin, axis=1)
    # 3. the window, one key tile at a time with a running maximum (flash attention's way; the
    # linear part above is not scaled by it): keys of the previous chunk after the query's
    # position in its chunk, then this chunk's up to it
    win = real_p[None, :] & (j[None, :] > i[:, None])
    k_p = _rotated(kb, tp, okp, skt, d, D, cos_b, sin_b, sct, R, ROPE).to(vdt)
    s = tl.where(win, _scores(q, k_p, scale, softcap, SOFTCAP, PREC), float("-inf"))
    m1 = tl.max(s, axis=1)
    safe1 = tl.where(m1 == float("-inf"), 0.0, m1)
    a = tl.where(win, tl.exp(s - safe1[:, None]), 0.0)
    num_w = tl.dot(a.to(vdt), v_p, input_precision=PREC)
    den_w = tl.sum(a, axis=1)
    win = real_c[None, :] & (j[None, :] <= i[:, None])
    k_c = _rotated(kb, tc, okc, skt, d, D, cos_b, sin_b, sct, R, ROPE).to(vdt)
    s = tl.where(win, _scores(q, k_c, scale, softcap, SOFTCAP, PREC), float("-inf"))
    m2 = tl.maximum(m1, tl.max(s, axis=1))
    mx = tl.where(m2 == float("-inf"), 0.0, m2)  # c_t (0 where no window key: a padding query)
    alpha = tl.where(m1 == float("-inf"), 0.0, tl.exp(safe1 - mx))
    a = tl.where(win, tl.exp(s - mx[:, None]), 0.0)
    v_c = tl.where(real_c[:, None], _tile(vb, tc, okc, svt, d, D), 0.0).to(vdt)
    num_w = tl.dot(a.to(vdt), v_c, num_w * alpha[:, None], input_precision=PREC)
    den_w = den_w * alpha + tl.sum(a, axis=1)
    if SINKS:  # 4. the cached first tokens that have left the query's window: softmax terms beside the window's
        js = tl.arange(0, BS)
        pos = tl.load(sink_pos_ptr + b * S + js, mask=js < S, other=T)  # their positions (T: an empty slot)
        oks = (js < S) & (pos < T)
        cached = (pos[None, :] <= tq[:, None] - W) & oks[None, :]
        k_s = _rotated(kb, pos, oks, skt, d, D, cos_b, sin_b, sct, R, ROPE).to(vdt)
        s = tl.where(cached, _scores(q, k_s, scale, softcap, SOFTCAP, PREC), float("-inf"))
        m3 = tl.maximum(m2, tl.max(s, axis=1))
        top = tl.where(m3 == float("-inf"), 0.0, m3)  # the largest score over window and cache
        beta = tl.where(m2 == float("-inf"), 0.0, tl.exp(mx - top))
        a = tl.where(cached, tl.exp(s - top[:, None]), 0.0)
        v_s = tl.where(oks[:, None], _tile(vb, pos, oks, svt, d, D), 0.0).to(vdt)
        num_w = tl.dot(a.to(vdt), v_s, num_w * beta[:, None], input_precision=PREC)
        den_w = den_w * beta + tl.sum(a, axis=1)
        if WINDOW_ANCHOR:  # the linear terms against the window's largest score
            num = num * beta[:, None]
            den = den * beta
        mx = top
    gamma = tl.load(gamma_ptr + h).to(tl.float32)
    if LOGIT:
        gamma = tl.sigmoid(gamma)
    num += gamma * num_w
    den += gamma * den_w
    y = num / tl.maximum(den, TINY)[:, None]
    out = y_ptr + b * syb + h * syh
    tl.store(out + tq[:, None] * syt + d[None, :], y.to(y_ptr.dtype.element_ty), mask=okq[:, None] & (d < D)[None, :])
    if SAVE:  # (where the maximum is, the backward finds)
        row = bh * T + tq
        tl.store(den_ptr + row, den, mask=okq)
        tl.store(mx_ptr + row, mx, mask=okq)


@triton.jit
def _delta(dy_ptr, den_ptr, row, tq, okq, sdt, d, D):
    """``delta = dy / den`` ``[BW, BD]`` in fp32 (zero for a query with no term: its output is 0)."""
    dy = _tile(dy_ptr, tq, okq, sdt, d, D).to(tl.float32)
    den = tl.load(den_ptr + row, mask=okq, other=0.0)
    return dy * tl.where(den > 0.0, 1.0 / tl.maximum(den, TINY), 0.0)[:, None]


@triton.jit
def _capped(ds, s, softcap, SOFTCAP: tl.constexpr):
    """``ds`` times the soft cap's derivative at the capped scores ``s``."""
    if SOFTCAP:
        u = s / softcap
        ds = ds * (1.0 - u * u)
    return ds


@triton.jit
def _backward_q(q_ptr, k_ptr, v_ptr, qf_ptr, kf_ptr, mask_ptr, gamma_ptr, sums_ptr, y_ptr, dy_ptr,
                den_ptr, mx_ptr, am_ptr, dq_ptr, dqf_ptr, rho_ptr, dc_ptr, dgamma_ptr, qsums_ptr, gl_ptr, dgq_ptr,
                sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sqfb, sqfh, sqft, skfb, skfh, skft,
                syb, syh, syt, sdb, sdh, sdt, T, W, OFF, N, H, G, D, F, scale, softcap,
                MASK: tl.constexpr, SOFTCAP: tl.constexpr, BW: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr,
                BF: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr = False):
    c, i, tq, okq = _query_rows(tl.program_id(0), T, W, OFF, BW, BQ)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit bases: large batches x long sequences
    b = bh // H
    h = bh % H
    hk = h // G
    HK = H // G
    vdt = v_ptr.dtype.element_ty  # the inputs' dtype: operands of the products
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    j = tl.arange(0, BW)  # keys: the previous chunk's and this one's
    tp, okp = _rows(c - 1, T, W, OFF, BW)
    tc, okc = _rows(c, T, W, OFF, BW)
    real_p = _real(mask_ptr + b * T, tp, okp, MASK)
    real_c = _real(mask_ptr + b * T, tc, okc, MASK)
    kb = k_ptr + b * skb + hk * skh
    vb = v_ptr + b * svb + hk * svh
    row = bh * T + tq
    dm = okq[:, None] & (d < D)[None, :]
    fm = okq[:, None] & (f < F)[None, :]

    qf = _tile(qf_ptr + b * sqfb + h * sqfh, tq, okq, sqft, f, F).to(vdt)
    delta = _delta(dy_ptr + b * sdb + h * sdh, den_ptr, row, tq, okq, sdt, d, D)
    rho = -tl.sum(delta * _tile(y_ptr + b * syb + h * syh, tq, okq, syt, d, D).to(tl.float32), axis=1)
    dd = delta.to(vdt)
    # phi(Q_c)^T [delta, rho]: what this chunk's queries ask of keys two or more chunks back
    qs = qsums_ptr + (bh * (N * (BW // BQ)) + tl.program_id(0)) * (F * (D + 1))
    if GATED:  # each query's ask from the end of chunk c-1 (exp(Gl[c, i])); the reverse scan fades it on
        gl = gl_ptr + (b * HK + hk) * N * W
        g_q = _gates(gl, c, i, N, W)
        e_q = tl.exp(g_q)
        tl.store(qs + f[:, None] * D + d[None, :],
                 tl.dot(tl.trans(qf), (delta * e_q[:, None]).to(vdt), input_precision=PREC),
                 mask=(f < F)[:, None] & (d < D)[None, :])
        tl.store(qs + F * D + f, tl.sum(qf.to(tl.float32) * (rho * e_q)[:, None], axis=0), mask=f < F)
    else:
        tl.store(qs + f[:, None] * D + d[None, :], tl.dot(tl.trans(qf), dd, input_precision=PREC),
                 mask=(f < F)[:, None] & (d < D)[None, :])
        tl.store(qs + F * D + f, tl.sum(qf.to(tl.float32) * rho[:, None], axis=0), mask=f < F)
    # (each part is folded in and stored as soon as it is complete: few tiles alive at once)
    # 1. the linear state of chunks <= c-2: dphi(q) += S delta + z rho
    state = sums_ptr + ((b * HK + hk) * N + c - 2) * (F * (D + 1))
    sv = tl.load(state + f[:, None] * D + d[None, :], mask=_only((f < F)[:, None] & (d < D)[None, :], c >= 2),
                 other=0.0)
    sz = tl.load(state + F * D + f, mask=_only(f < F, c >= 2), other=0.0)
    dqf = tl.dot(dd, tl.trans(sv.to(vdt)), input_precision=PREC) + rho[:, None] * sz[None, :]
    if GATED:
        dqf = dqf * e_q[:, None]
    p_lin = tl.sum(qf.to(tl.float32) * dqf, axis=1)  # sum over the state's terms of l dl
    den_lin = tl.sum(qf.to(tl.float32) * sz[None, :], axis=1)
    if GATED:
        den_lin = den_lin * e_q
    # 2. the youngest linear keys (the previous chunk's up to the query's position)
    near = (j[None, :] <= i[:, None]) & real_p[None, :]
    k_p = _tile(kb, tp, okp, skt, d, D)
    v_p = tl.where(real_p[:, None], _tile(vb, tp, okp, svt, d, D), 0.0).to(vdt)
    kf_p = _tile(kf_ptr + b * skfb + hk * skfh, tp, okp, skft, f, F).to(vdt)
    da_p = tl.dot(dd, tl.trans(v_p), input_precision=PREC) + rho[:, None]  # d a_ts = delta_t . v_s + rho_t
    lin = tl.where(near, tl.dot(qf, tl.trans(kf_p), input_precision=PREC), 0.0)
    dl = tl.where(near, da_p, 0.0)
    if GATED:
        fade = _fade(g_q, _gates(gl, c, j, N, W), near)
        lin = lin * fade
        dqf = tl.dot((dl * fade).to(vdt), kf_p, dqf, input_precision=PREC)
    else:
        dqf = tl.dot(dl.to(vdt), kf_p, dqf, input_precision=PREC)
    tl.store(dqf_ptr + bh * T * F + tq[:, None] * F + f[None, :], dqf, mask=fm)
    p_lin += tl.sum(lin * dl, axis=1)
    den_lin += tl.sum(lin, axis=1)
    if GATED:  # phi_q . dphi_q = the sum of a da over the query's linear terms: G_t's gradient from its queries
        tl.store(dgq_ptr + row, p_lin, mask=okq)
    # 3. the window: scores, where their maximum c_t is, softmax terms
    mx = tl.load(mx_ptr + row, mask=okq, other=0.0)
    gamma = tl.load(gamma_ptr + h).to(tl.float32)
    win_p = real_p[None, :] & (j[None, :] > i[:, None])
    win_c = real_c[None, :] & (j[None, :] <= i[:, None])
    q = _tile(q_ptr + b * sqb + h * sqh, tq, okq, sqt, d, D)
    s_p = _scores(q, k_p, scale, softcap, SOFTCAP, PREC)
    k_c = _tile(kb, tc, okc, skt, d, D)
    s_c = _scores(q, k_c, scale, softcap, SOFTCAP, PREC)
    m_p, j_p = tl.max(tl.where(win_p, s_p, float("-inf")), axis=1, return_indices=True)
    m_c, j_c = tl.max(tl.where(win_c, s_c, float("-inf")), axis=1, return_indices=True)
    am = tl.where(m_c >= m_p, c * W + j_c - OFF, (c - 1) * W + j_p - OFF)
    a_p = tl.where(win_p, gamma * tl.exp(s_p - mx[:, None]), 0.0)
    a_c = tl.where(win_c, gamma * tl.exp(s_c - mx[:, None]), 0.0)
    v_c = tl.where(real_c[:, None], _tile(vb, tc, okc, svt, d, D), 0.0).to(vdt)
    da_c = tl.dot(dd, tl.trans(v_c), input_precision=PREC) + rho[:, None]
    # P_t = sum over the window of a da = -dc_t (c_t's gradient goes to the key where the maximum
    # is): from the window's terms, so that at a window of one key ds cancels exactly
    p_win = tl.sum(a_p * da_p, axis=1) + tl.sum(a_c * da_c, axis=1)
    ds_p = a_p * da_p + tl.where(am[:, None] == tp[None, :], -p_win[:, None], 0.0)
    ds_c = a_c * da_c + tl.where(am[:, None] == tc[None, :], -p_win[:, None], 0.0)
    ds_p = tl.where(win_p, _capped(ds_p, s_p, softcap, SOFTCAP), 0.0)
    ds_c = tl.where(win_c, _capped(ds_c, s_c, softcap, SOFTCAP), 0.0)
    dq = tl.dot(ds_p.to(vdt), k_p, input_precision=PREC)
    dq = tl.dot(ds_c.to(vdt), k_c, dq, input_precision=PREC) * scale
    tl.store(dq_ptr + bh * T * D + tq[:, None] * D + d[None, :], dq, mask=dm)
    tl.store(rho_ptr + row, rho, mask=okq)
    tl.store(dc_ptr + row, -p_win, mask=okq)
    tl.store(am_ptr + row, am.to(tl.int32), mask=okq)
    # gamma's gradient sums P_t / gamma over every query, where cancellation makes rounding count:
    # every term's a da sums to 0 (d den and d num cancel), so P_t is also minus the linear terms'
    # sum; taken from the smaller side, the rounding of delta and of the stored y (in rho) stays
    # relative to P_t rather than to the whole row
    den_win = tl.sum(a_p, axis=1) + tl.sum(a_c, axis=1)
    pw = tl.where(den_win <= den_lin, p_win, -p_lin)
    tl.store(dgamma_ptr + bh * (N * (BW // BQ)) + tl.program_id(0), tl.sum(pw, axis=0) / gamma)


@triton.jit
def _backward_kv(q_ptr, k_ptr, v_ptr, mask_ptr, gamma_ptr, dy_ptr, den_ptr, mx_ptr, am_ptr, rho_ptr, dc_ptr,
                 dk_ptr, dv_ptr, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                 T, W, OFF, HK, D, scale, softcap, G: tl.constexpr,
                 MASK: tl.constexpr, SOFTCAP: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                 PREC: tl.constexpr):
    """Key side, window terms: dk and the window's part of dv from the queries of chunks j and j+1."""
    j, ik, tk, okk = _query_rows(tl.program_id(0), T, W, OFF, BW, BK)  # this program's keys: BK of chunk j's
    bh = tl.program_id(1).to(tl.int64)  # 64-bit bases: large batches x long sequences
    b = bh // HK
    hk = bh % HK
    H = HK * G
    vdt = v_ptr.dtype.element_ty  # the inputs' dtype: operands of the products
    d = tl.arange(0, BD)
    iq = tl.arange(0, BW)  # queries: chunk j's, then chunk j+1's
    real = _real(mask_ptr + b * T, tk, okk, MASK)
    k = _tile(k_ptr + b * skb + hk * skh, tk, okk, skt, d, D)
    v = tl.where(real[:, None], _tile(v_ptr + b * svb + hk * svh, tk, okk, svt, d, D), 0.0).to(vdt)
    dk = tl.zeros([BK, BD], dtype=tl.float32)
    dv = tl.zeros([BK, BD], dtype=tl.float32)
    for g in tl.static_range(G):
        h = hk * G + g
        gamma = tl.load(gamma_ptr + h).to(tl.float32)
        for nxt in tl.static_range(2):  # queries of chunk j, then of chunk j+1
            tq, okq = _rows(j + nxt, T, W, OFF, BW)
            row = (b * H + h) * T + tq
            # [keys, queries]: key row a, query column b; window when t - s < w
            if nxt == 0:
                win = real[:, None] & okq[None, :] & (iq[None, :] >= ik[:, None])
            else:
                win = real[:, None] & okq[None, :] & (iq[None, :] < ik[:, None])
            q = _tile(q_ptr + b * sqb + h * sqh, tq, okq, sqt, d, D)
            s = _scores(k, q, scale, softcap, SOFTCAP, PREC)
            a = tl.where(win, gamma * tl.exp(s - tl.load(mx_ptr + row, mask=okq, other=0.0)[None, :]), 0.0)
            dd = _delta(dy_ptr + b * sdb + h * sdh, den_ptr, row, tq, okq, sdt, d, D).to(vdt)
            dv = tl.dot(a.to(vdt), dd, dv, input_precision=PREC)
            da = tl.dot(v, tl.trans(dd), input_precision=PREC) + tl.load(rho_ptr + row, mask=okq, other=0.0)[None, :]
            am = tl.load(am_ptr + row, mask=okq, other=-1)
            ds = a * da + tl.where(am[None, :] == tk[:, None], tl.load(dc_ptr + row, mask=okq, other=0.0)[None, :], 0.0)
            ds = tl.where(win, _capped(ds, s, softcap, SOFTCAP), 0.0)
            dk = tl.dot(ds.to(vdt), q, dk, input_precision=PREC)
    dm = okk[:, None] & (d < D)[None, :]
    tl.store(dk_ptr + bh * T * D + tk[:, None] * D + d[None, :], dk * scale, mask=dm)
    tl.store(dv_ptr + bh * T * D + tk[:, None] * D + d[None, :], dv, mask=dm)


@triton.jit
def _backward_kf(v_ptr, qf_ptr, kf_ptr, mask_ptr, rsums_ptr, dy_ptr, den_ptr, rho_ptr, dv_ptr, dkf_ptr, gl_ptr,
                 dgk_ptr, svb, svh, svt, sqfb, sqfh, sqft, skfb, skfh, skft, sdb, sdh, sdt,
                 T, W, OFF, N, HK, D, F, G: tl.constexpr, MASK: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr,
                 BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr = False):
    """Key side, linear terms: dphi(k) and the linear part of dv (added to ``dv``, which holds the
    window's), from chunk j+1's queries (the youngest linear keys) and the reverse state of chunks
    >= j+2. ``GATED``: also ``phi_k . dphi_k`` per key (``dgk_ptr``)."""
    j, ik, tk, okk = _query_rows(tl.program_id(0), T, W, OFF, BW, BK)  # this program's keys: BK of chunk j's
    bh = tl.program_id(1).to(tl.int64)  # 64-bit bases: large batches x long sequences
    b = bh // HK
    hk = bh % HK
    H = HK * G
    vdt = v_ptr.dtype.element_ty  # the inputs' dtype: operands of the products
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    iq = tl.arange(0, BW)
    real = _real(mask_ptr + b * T, tk, okk, MASK)
    v = tl.where(real[:, None], _tile(v_ptr + b * svb + hk * svh, tk, okk, svt, d, D), 0.0).to(vdt)
    kf = tl.where(real[:, None], _tile(kf_ptr + b * skfb + hk * skfh, tk, okk, skft, f, F), 0.0).to(vdt)
    # queries of chunks >= j+2, through the reverse state
    base = rsums_ptr + (bh * N + j + 2) * (F * (D + 1))
    rv = tl.load(base + f[:, None] * D + d[None, :], mask=_only((f < F)[:, None] & (d < D)[None, :], j + 2 < N),
                 other=0.0).to(vdt)  # the state rounded as fla does
    dv = tl.dot(kf, rv, input_precision=PREC)
    dkf = tl.dot(v, tl.trans(rv), input_precision=PREC)
    dkf += tl.load(base + F * D + f, mask=_only(f < F, j + 2 < N), other=0.0)[None, :]
    # the youngest linear keys of chunk j+1's queries: those at or after the key's position
    tq, okq = _rows(j + 1, T, W, OFF, BW)
    near = real[:, None] & okq[None, :] & (iq[None, :] >= ik[:, None])
    if GATED:  # the key leaves the window at row ik of chunk j+1: the state's asks come from the chunk's end
        gl = gl_ptr + bh * N * W
        g_k = _gates(gl, j + 1, ik, N, W)
        to_end = tl.exp(_gates(gl, j + 1, ik * 0 + W - 1, N, W) - g_k)
        dv = dv * to_end[:, None]
        dkf = dkf * to_end[:, None]
        fade = tl.exp(tl.where(near, _gates(gl, j + 1, iq, N, W)[None, :] - g_k[:, None], float("-inf")))
        # phi_k . dphi_k from fp32 terms, as _backward_q's phi_q . dphi_q: log_gate_grad subtracts the two,
        # and a pair that cancels there must round the same on both sides (not through dkf's 16-bit operand)
        p_k = tl.sum(kf.to(tl.float32) * dkf, axis=1)
    for g in tl.static_range(G):
        h = hk * G + g
        row = (b * H + h) * T + tq
        qf = _tile(qf_ptr + b * sqfb + h * sqfh, tq, okq, sqft, f, F).to(vdt)
        dd = _delta(dy_ptr + b * sdb + h * sdh, den_ptr, row, tq, okq, sdt, d, D).to(vdt)
        lin = tl.where(near, tl.dot(kf, tl.trans(qf), input_precision=PREC), 0.0)
        if GATED:
            lin = lin * fade
        dv = tl.dot(lin.to(vdt), dd, dv, input_precision=PREC)
        da = tl.dot(v, tl.trans(dd), input_precision=PREC) + tl.load(rho_ptr + row, mask=okq, other=0.0)[None, :]
        if GATED:
            p_k += tl.sum(lin * tl.where(near, da, 0.0), axis=1)
            dkf = tl.dot((tl.where(near, da, 0.0) * fade).to(vdt), qf, dkf, input_precision=PREC)
        else:
            dkf = tl.dot(tl.where(near, da, 0.0).to(vdt), qf, dkf, input_precision=PREC)
    dm = okk[:, None] & (d < D)[None, :]
    out = dv_ptr + bh * T * D + tk[:, None] * D + d[None, :]
    tl.store(out, tl.where(real[:, None], dv + tl.load(out, mask=dm, other=0.0), 0.0), mask=dm)
    dkf = tl.where(real[:, None], dkf, 0.0)
    tl.store(dkf_ptr + bh * T * F + tk[:, None] * F + f[None, :], dkf, mask=okk[:, None] & (f < F)[None, :])
    if GATED:  # G_{s+w}'s gradient from its key s: minus phi_k . dphi_k
        tl.store(dgk_ptr + bh * T + tk, tl.where(real, p_k, 0.0), mask=okk)


# --- PyTorch side -------------------------------------------------------------------------------

def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by rotating halves over the first ``R = cos.shape[-1]`` dims of each head, the same
    rotation the kernels apply: ``x`` ``[B, H, T, D]``, ``cos``/``sin`` ``[B or 1, T, R]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    half = r // 2
    rot = x[..., :r] if r < x.shape[-1] else x
    # rotate_half(x) * sin as roll(x) * [-sin1, sin2]: one operation forward and backward on x
    out = rot * cos + rot.roll(half, dims=-1) * torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return out if rot is x else torch.cat([out, x[..., r:]], dim=-1)


def hedgehog_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[softmax(x W), softmax(-x W)]`` per head: ``x`` ``[B, H, T, D]``, ``w`` ``[H or 1, D, F/2]``."""
    y = x @ w.to(x.dtype)
    return torch.cat([torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)], dim=-1)


def _heads_stride(x: torch.Tensor) -> int:
    return x.stride(0) if x.shape[0] > 1 else 0


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, token) strides of a ``[B, H, T, *]`` tensor whose last dim is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _last_contiguous(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def chunk_log_gates(log_gate: torch.Tensor, window: int) -> torch.Tensor:
    """``Gl`` ``[B, Hk, N, w]`` fp32: the log gates ``[B, Hk, T]`` summed within each of the kernels' chunks
    (aligned to the sequence's end: the ``N w - T`` virtual tokens in front have log gate 0)."""
    b, hk, t = log_gate.shape
    n = -(-t // window)
    lg = torch.nn.functional.pad(log_gate.float(), (n * window - t, 0))
    return lg.view(b, hk, n, window).cumsum(-1).contiguous()


def log_gate_grad(dgq: torch.Tensor, dgk: torch.Tensor, window: int, states: torch.Tensor,
                  asks: torch.Tensor) -> torch.Tensor:
    """The log gates' gradient ``[B, Hk, T]`` (fp32) from the backward's ``phi_q . dphi_q`` per query
    ``dgq`` ``[B, H, T]``, ``phi_k . dphi_k`` per key ``dgk`` ``[B, Hk, T]`` and the chunks' states.

    A linear term is ``A_ts = exp(G_t - G_l) phi_q(q_t) . phi_k(k_s)``, ``l = s + w`` where the key
    leaves the window (``G`` the cumulative log gates); a log gate ``u`` is in the terms with
    ``l < u <= t``, so its gradient is ``sum_{t >= u} dgq_t - sum_{l >= u} dgk_{l - w}`` (``dgq`` summed
    over the key head's query heads). Summed over the whole sequence, the pairs with ``l >= u``
    cancel between the two sums, and their rounding grew with the length (bf16 products: percents
    at 4k tokens); so the sums run within each chunk only, and the pairs crossing the end of chunk c
    (``l`` up to its end, ``t`` after it) come from the states there: ``X_c = <E_{c+1}, R_{c+1}>``,
    the forward state at the end of chunk c (``states`` ``[B, Hk, N, E]``, entry c - 1: the forward
    scan's) against the queries' asks from there (``asks``, entry c + 1: the reverse scan's)."""
    b, hk, t = dgk.shape
    n = -(-t // window)
    off = n * window - t
    d = dgq.view(b, hk, -1, t).sum(2)
    if t > window:
        d[..., window:] -= dgk[..., : t - window]
    d = torch.nn.functional.pad(d, (off, 0)).view(b, hk, n, window)
    grad = d.flip(-1).cumsum(-1).flip(-1)
    if n >= 3:  # (the first chunk has no state before its end's keys, the last no queries after it)
        cross = (states[:, :, : n - 2] * asks[:, :, 2:]).sum(-1)  # X_c, c = 1 .. N-2
        grad[:, :, 1 : n - 1] += cross[..., None]
    return grad.view(b, hk, n * window)[..., off:]


def hybrid_triton_forward(q, k, v, gamma, *, window: int, scale: float, softcap=None, key_mask=None, qf=None,
                          kf=None, hedgehog=None, rope=None, save: bool = False, state: bool = False,
                          logit: bool = False, sinks=None, window_anchor: bool = False, log_gate=None,
                          nope: bool = False):
    """The three forward launches. Returns ``(y, saved, state)``: ``y`` ``[B, H, T, D]`` (a view of
    ``[B, T, H, D]`` memory, what the output projection reads); ``saved`` (with ``save``) the
    per-chunk states and per-query quantities the backward needs; ``state`` (with ``state``) the
    ``HybridState`` after the sequence.

    ``sinks = (slot [B, T] int32, pos [B, S] int32)``: each sequence's first ``S`` real tokens kept
    exactly (``sparse_priority="first"``, see ``hybrid_triton_sinks``): ``slot`` gives each position's
    place in the cache (-1: none), ``pos`` each slot's position (``T``: empty). They leave the linear
    terms (and the state's linear part), and a query ``t`` gives softmax terms to those with ``pos <=
    t - w``, under one maximum with the window's; ``window_anchor`` scales the linear terms by
    ``exp(c_window - c)``. With ``state``, ``state`` is ``(HybridState, (keys, features, values))``,
    the cache's rows ``[B, Hk, S, *]`` (keys rotated; slots past the sequence's real tokens unset).
    No backward (``save`` refused).

    ``log_gate`` ``[B, Hk, T]`` (log gates <= 0, any float dtype): the linear state fades (see
    ``ops/hybrid/__init__.py``); ``saved`` then also holds the chunks' cumulative log gates
    (``chunk_log_gates``). Not with ``sinks``.

    ``nope`` (with ``hedgehog``): the Hedgehog features of q and k before RoPE (``feature_rope: false``);
    the window's scores and the state's keys stay rotated."""
    from .state import HybridState

    b, h, t, d = q.shape
    hk = k.shape[1]
    dt = q.dtype
    kn = _knobs(dt)
    w = window
    n = -(-t // w)
    off = n * w - t
    q, k, v, qf, kf = (_last_contiguous(x) for x in (q, k, v, qf, kf))
    if nope and (hedgehog is None or sinks is not None):
        raise ValueError("hybrid_triton_forward: features before RoPE (nope) need the Hedgehog weights and no sinks")
    if hedgehog is not None:
        wq, wk = (x.to(dt).contiguous() for x in hedgehog)
        fw = wq.shape[-1]
        fp = 2
        swq, swk = _heads_stride(wq), _heads_stride(wk)
        qf = kf = q  # not read
    else:
        wq = wk = q  # not read
        swq = swk = 0
        fw = qf.shape[-1]
        fp = 1
        qf, kf = qf.to(dt), kf.to(dt)
    f = fw * fp
    if rope is not None:
        cos, sin = (x.contiguous() for x in rope)
        rot, scb, sct = cos.shape[-1], _heads_stride(cos), cos.stride(1)
    else:
        cos = sin = q  # not read
        rot = scb = sct = 0
    mask = key_mask if key_mask is not None else q
    gamma = gamma.contiguous()
    bw, bd, bf = _pow2(w), _pow2(d), _pow2(fw)
    prec = _precision(dt)
    dev = q.device
    e = f * (d + 1)
    sums = torch.empty(b, hk, n, e, device=dev, dtype=torch.float32)
    l = min(t, w)
    if state:
        win_k = torch.empty(b, hk, l, d, device=dev, dtype=dt)
        win_f = torch.empty(b, hk, l, f, device=dev, dtype=dt)
        win_v = torch.empty(b, hk, l, d, device=dev, dtype=dt)
    else:
        win_k = win_f = win_v = sums  # not written
    common = dict(ROPE=rope is not None, HEDGEHOG=hedgehog is not None, FP=fp, MASK=key_mask is not None,
                  SINKS=sinks is not None, BW=bw, BD=bd, BF=bf, PREC=prec, NOPE=nope and rope is not None)
    gated = log_gate is not None
    if gated:
        if sinks is not None:
            raise ValueError("hybrid_triton_forward: the sinks' form has no gates (log_gate)")
        if tuple(log_gate.shape) != (b, hk, t):
            raise ValueError(f"hybrid_triton: log_gate must be [B, Hk, T] = {[b, hk, t]}, got {list(log_gate.shape)}")
        gl = chunk_log_gates(log_gate, w)
    if sinks is not None:
        if save:
            raise ValueError("hybrid_triton_forward: the sinks' form has no backward")
        slot, sink_pos = (x.contiguous() for x in sinks)
        n_sinks = sink_pos.shape[1]
    else:
        slot = sink_pos = q  # not read
        n_sinks = 0
    # Hedgehog: the first pass writes the keys' features for the output pass (recomputing them there
    # spilled registers at w = D = 64)
    kf_out = torch.empty(b, hk, t, f, device=dev, dtype=dt) if hedgehog is not None else sums
    if state and sinks is not None:
        cache = tuple(torch.empty(b, hk, n_sinks, e, device=dev, dtype=dt) for e in (d, f, d))
    else:
        cache = (sums,) * 3  # not written
    if not gated:
        gl = sums  # not read
    _chunk_sums[(n, b * hk)](k, v, kf, wk, cos, sin, mask, slot, sums, kf_out, win_k, win_f, win_v, *cache, gl,
                             *_strides(k), *_strides(v), *_strides(kf), swk, scb, sct,
                             t, w, off, n, hk, d, fw, rot, l, n_sinks, STATE=state, num_warps=kn["SUM_WARPS"],
                             GATED=gated, **common)
    if hedgehog is not None:
        kf = kf_out
    linear = torch.empty(b, hk, 1, f, d + 1, device=dev, dtype=torch.float32) if state else sums
    scan(sums, sums, n, e, d, f, 1, reverse=False, final=linear if state else None, gates=gl if gated else None)
    y = torch.empty(b, t, h, d, device=dev, dtype=dt).transpose(1, 2)
    if save:
        den = torch.empty(b, h, t, device=dev, dtype=torch.float32)
        mx = torch.empty_like(den)
    else:
        den = mx = sums  # not written
    bq = min(kn["QUERY_ROWS" if save else "PREFILL_QUERY_ROWS"], bw)
    warps = kn["FWD_WARPS" if save else "PREFILL_WARPS"]
    _forward[(n * (bw // bq), b * h)](q, k, v, qf, kf, wq, cos, sin, mask, gamma, sums, y, den, mx,
                         slot, sink_pos, gl,
                         *_strides(q), *_strides(k), *_strides(v), *_strides(qf), *_strides(kf), swq, scb, sct,
                         *_strides(y), t, w, off, n, h, h // hk, d, fw, rot, n_sinks, float(scale),
                         float(softcap or 1.0), SOFTCAP=softcap is not None, SAVE=save, LOGIT=logit,
                         WINDOW_ANCHOR=window_anchor, BQ=bq, BS=_pow2(n_sinks), num_warps=warps,
                         GATED=gated, **common)
    saved = ((sums, den, mx, gl) if gated else (sums, den, mx)) if save else None
    out_state = None
    if state:
        valid = key_mask[:, t - l:] if key_mask is not None else torch.ones(b, l, dtype=torch.bool, device=dev)
        out_state = HybridState(win_k, win_f, win_v, linear, valid)
        if sinks is not None:
            out_state = (out_state, cache)
    return y, saved, out_state


def scan(src, dst, n, e, d, f, groups, *, reverse: bool, final=None, parts: int = 1, gates=None):
    """``_scan`` over ``src`` ``[rows, groups, n, parts, e]`` into ``dst`` ``[rows, n, e]``; ``gates``: the
    chunks' cumulative log gates ``[rows, n, w]`` (``chunk_log_gates``), a decayed scan."""
    rows = dst.numel() // (n * e)
    bn = min(triton.next_power_of_2(n), SCAN_CHUNKS)
    be = max(16, min(triton.next_power_of_2(e), SCAN_TILE // bn))
    extra = {} if gates is None else dict(GATED=True)
    gl, w = (dst, 1) if gates is None else (gates, gates.shape[-1])
    _scan[(rows, triton.cdiv(e, be))](src, dst, final if final is not None else dst, gl, n, e, d, f, groups, parts,
                                       w, REVERSE=reverse, FINAL=final is not None, BN=bn, BE=be, num_warps=4, **extra)


def hybrid_triton_backward(dy, q, k, v, qf, kf, gamma, y, saved, *, window: int, scale: float, softcap=None,
                           key_mask=None):
    """Gradients of the kernels' output ``y`` for ``dy``, from rotated ``q``/``k`` and the features
    ``qf``/``kf`` (all in the input dtype): ``(dq, dk, dv, dqf, dkf, dgamma, dlog_gate)`` in fp32
    (``dlog_gate`` ``[B, Hk, T]``, None without gates: ``saved`` of a gated forward holds them)."""
    sums, den, mx, *gates = saved
    gl = gates[0] if gates else None
    b, h, t, d = q.shape
    hk = k.shape[1]
    f = qf.shape[-1]
    dt = q.dtype
    kn = _knobs(dt)
    w = window
    n = -(-t // w)
    off = n * w - t
    q, k, v, qf, kf, y, dy = (_last_contiguous(x) for x in (q, k, v, qf, kf, y, dy))
    qf, kf, dy = qf.to(dt), kf.to(dt), dy.to(dt)
    mask = key_mask if key_mask is not None else q
    gamma = gamma.float().contiguous()
    bw, bd, bf = _pow2(w), _pow2(d), _pow2(f)
    prec = _precision(dt)
    dev = q.device
    e = f * (d + 1)
    f32 = dict(device=dev, dtype=torch.float32)
    dq = torch.empty(b, h, t, d, **f32)
    dqf = torch.empty(b, h, t, f, **f32)
    rho = torch.empty(b, h, t, **f32)
    dc = torch.empty(b, h, t, **f32)
    bq = min(kn["BWD_QUERY_ROWS"], bw)
    parts = bw // bq  # query programs per chunk
    dgamma = torch.empty(b, h, n * parts, **f32)
    am = torch.empty(b, h, t, device=dev, dtype=torch.int32)
    qsums = torch.empty(b, h, n * parts, e, **f32)
    common = dict(MASK=key_mask is not None, SOFTCAP=softcap is not None, BW=bw, BD=bd, BF=bf, PREC=prec,
                  num_warps=kn["BWD_WARPS"])
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(qf), *_strides(kf), *_strides(y), *_strides(dy))
    gated = gl is not None
    dgq = torch.empty(b, h, t, **f32) if gated else rho  # (not written without gates)
    dgk = torch.empty(b, hk, t, **f32) if gated else rho
    gl_arg = gl if gated else rho  # not read
    _backward_q[(n * parts, b * h)](q, k, v, qf, kf, mask, gamma, sums, y, dy, den, mx, am, dq, dqf, rho, dc, dgamma,
                                    qsums, gl_arg, dgq, *strides, t, w, off, n, h, h // hk, d, f, float(scale),
                                    float(softcap or 1.0), BQ=bq, GATED=gated, **common)
    rsums = torch.empty(b, hk, n, e, **f32)
    scan(qsums, rsums, n, e, d, f, h // hk, reverse=True, parts=parts, gates=gl)
    dk = torch.empty(b, hk, t, d, **f32)
    dv = torch.empty(b, hk, t, d, **f32)
    dkf = torch.empty(b, hk, t, f, **f32)
    bk = min(kn["KEY_ROWS"], bw)
    grid = (n * (bw // bk), b * hk)
    key_side = dict(MASK=key_mask is not None, BW=bw, BK=bk, BD=bd, PREC=prec, num_warps=kn["KEY_WARPS"], G=h // hk)
    _backward_kv[grid](q, k, v, mask, gamma, dy, den, mx, am, rho, dc, dk, dv, *_strides(q), *_strides(k),
                       *_strides(v), *_strides(dy), t, w, off, hk, d, float(scale), float(softcap or 1.0),
                       SOFTCAP=softcap is not None, **key_side)
    _backward_kf[grid](v, qf, kf, mask, rsums, dy, den, rho, dv, dkf, gl_arg, dgk, *_strides(v), *_strides(qf),
                       *_strides(kf), *_strides(dy), t, w, off, n, hk, d, f, BF=bf, GATED=gated, **key_side)
    dlog_gate = log_gate_grad(dgq, dgk, w, sums, rsums) if gated else None
    return dq, dk, dv, dqf, dkf, dgamma.sum(dim=(0, 2)), dlog_gate


class _HybridTriton(torch.autograd.Function):
    """The kernels with autograd. Inputs: ``q, k, v, gamma``, then the features ``qf, kf`` or the
    Hedgehog weights ``wq, wk`` (one pair; the other None), then ``cos, sin`` (or None), ..., and the
    log gates (or None)."""

    @staticmethod
    def forward(ctx, q, k, v, gamma, qf, kf, wq, wk, cos, sin, key_mask, window, scale, softcap, logit, log_gate,
                nope=False):
        hedgehog = (wq, wk) if wq is not None else None
        rope = (cos, sin) if cos is not None else None
        y, saved, _ = hybrid_triton_forward(q, k, v, gamma, window=window, scale=scale, softcap=softcap,
                                            key_mask=key_mask, qf=qf, kf=kf, hedgehog=hedgehog, rope=rope, save=True,
                                            logit=logit, log_gate=log_gate, nope=nope)
        ctx.nope = nope
        ctx.save_for_backward(q, k, v, gamma, qf, kf, wq, wk, cos, sin, key_mask, y, *saved)
        ctx.kw = dict(window=window, scale=scale, softcap=softcap)
        ctx.logit = logit
        ctx.gate_dtype = None if log_gate is None else log_gate.dtype
        return y

    @staticmethod
    def _gate_grad(ctx, dlog_gate):
        return dlog_gate.to(ctx.gate_dtype) if dlog_gate is not None and ctx.needs_input_grad[15] else None

    @staticmethod
    def backward(ctx, dy):
        tensors = ctx.saved_tensors  # once: a checkpointed layer's saved tensors unpack only once
        q, k, v, gamma, qf, kf, wq, wk, cos, sin, key_mask, y, *saved = tensors
        needs = ctx.needs_input_grad
        if FUSED_PRELUDE and wq is not None:
            return _HybridTriton._fused_prelude_backward(ctx, dy, tensors)
        inputs = (q, k, qf, kf, wq, wk)
        # the prelude the forward kernels fused (RoPE, feature maps), again in PyTorch with autograd
        leaves = [None if x is None else x.detach().requires_grad_(need)
                  for x, need in zip(inputs, (needs[0], needs[1], needs[4], needs[5], needs[6], needs[7]))]
        lq, lk, lqf, lkf, lwq, lwk = leaves
        with torch.enable_grad():  # in the kernels' dtype: fp32 cos/sin (autocast) would double the traffic
            if cos is not None:
                cos, sin = cos.to(q.dtype), sin.to(q.dtype)
                qr, kr = rope_half(lq, cos, sin), rope_half(lk, cos, sin)
            else:
                qr, kr = lq, lk
            if lwq is not None:  # (features before RoPE: of the unrotated q/k)
                fq, fk = (hedgehog_features(lq, lwq), hedgehog_features(lk, lwk)) if ctx.nope else \
                    (hedgehog_features(qr, lwq), hedgehog_features(kr, lwk))
            else:
                fq, fk = lqf, lkf
        weight = torch.sigmoid(gamma.float()) if ctx.logit else gamma
        dq, dk, dv, dfq, dfk, dgamma, dlog_gate = hybrid_triton_backward(
            dy, qr.detach().to(q.dtype), kr.detach().to(q.dtype), v, fq.detach(), fk.detach(), weight, y, saved,
            key_mask=key_mask, **ctx.kw)
        if ctx.logit:
            dgamma = dgamma * weight * (1.0 - weight)
        pairs = [(x, g) for x, g in zip((qr, kr, fq, fk), (dq, dk, dfq, dfk)) if x.requires_grad]
        wanted = [x for x in leaves if x is not None and x.requires_grad]
        found = {}
        if pairs and wanted:
            outs, grads = zip(*pairs)
            found = dict(zip(map(id, wanted), torch.autograd.grad(outs, wanted, grads, allow_unused=True)))
        result = [None if x is None or found.get(id(x)) is None else found[id(x)].to(orig.dtype)
                  for x, orig in zip(leaves, inputs)]
        dq_, dk_, dqf_, dkf_, dwq, dwk = result
        return (dq_, dk_, dv.to(v.dtype) if needs[2] else None, dgamma.to(gamma.dtype) if needs[3] else None,
                dqf_, dkf_, dwq, dwk, None, None, None, None, None, None, None, _HybridTriton._gate_grad(ctx, dlog_gate),
                None)

    @staticmethod
    def _fused_prelude_backward(ctx, dy, tensors):
        """``backward`` with Hedgehog maps, the prelude as Triton kernels (``prelude_triton``):
        rotated q/k and their features in one launch each, then their gradients (of the unrotated
        q/k and the maps' weights) in one launch and a sum each, no autograd. With features before RoPE
        (``nope``) the launches compute the features of the unrotated q/k beside their rotation, and only
        the rotated q/k's gradients go back through the rotation."""
        q, k, v, gamma, _, _, wq, wk, cos, sin, key_mask, y, *saved = tensors
        needs = ctx.needs_input_grad
        nope = ctx.nope
        qr, fq = hedgehog_rope_forward(q, cos, sin, wq, nope=nope)
        kr, fk = hedgehog_rope_forward(k, cos, sin, wk, nope=nope)
        weight = torch.sigmoid(gamma.float()) if ctx.logit else gamma
        dq, dk, dv, dfq, dfk, dgamma, dlog_gate = hybrid_triton_backward(dy, qr, kr, v, fq, fk, weight, y, saved,
                                                                         key_mask=key_mask, **ctx.kw)
        if ctx.logit:
            dgamma = dgamma * weight * (1.0 - weight)
        out = []
        for x, w, dr, df, need_x, need_w in ((q, wq, dq, dfq, needs[0], needs[6]),
                                             (k, wk, dk, dfk, needs[1], needs[7])):
            dx = dw = None
            if need_x or need_w:
                dx, dw = hedgehog_rope_backward(x, cos, sin, w, dr, df, need_dx=need_x, need_dw=need_w, nope=nope)
            out.append((dx, None if dw is None else dw.to(w.dtype)))
        (dq_, dwq), (dk_, dwk) = out
        return (dq_, dk_, dv.to(v.dtype) if needs[2] else None, dgamma.to(gamma.dtype) if needs[3] else None,
                None, None, dwq, dwk, None, None, None, None, None, None, None, _HybridTriton._gate_grad(ctx, dlog_gate),
                None)


def hybrid_triton(q, k, v, gamma, *, window: int, scale: float, softcap: float | None = None, key_mask=None,
                  output_final_state: bool = False, qf=None, kf=None, hedgehog=None, rope=None, logit: bool = False,
                  log_gate=None, nope: bool = False):
    """The hybrid over whole sequences on CUDA (or Triton's interpreter): ``(y, state or None)``.

    ``q`` ``[B, H, T, D]``, ``k``/``v`` ``[B, Hk, T, D]`` in one dtype (bf16, fp16 or fp32), any
    strides with a contiguous last dim; ``gamma`` ``[H]``; ``key_mask`` ``[B, T]`` bool (True =
    real token) or None. Features: ``qf`` ``[B, H, T, F]`` and ``kf`` ``[B, Hk, T, F]`` of the
    rotated q/k, or ``hedgehog = (wq [H or 1, D, F/2], wk [Hk or 1, D, F/2])`` computed in the
    kernels. ``rope = (cos, sin)`` ``[B or 1, T, R]`` (Hedgehog only): q and k come unrotated and
    the kernels rotate halves of their first R dims; the state's keys are the rotated ones.
    ``logit``: ``gamma`` holds the window weights' logits (sigmoid taken in the kernels: a launch
    fewer per layer). ``log_gate`` ``[B, Hk, T]`` (<= 0): a fading linear state, as
    ``hybrid_attention_chunked``'s. Gradients flow to q, k, v, gamma, the features or Hedgehog weights and
    the log gates; the final state (``HybridState``, window of ``min(T, window)`` tokens) carries none.
    ``nope`` (Hedgehog only): the features are of q and k before RoPE (``feature_rope: false``); the
    state's window then keeps those features beside its rotated keys.
    """
    if rope is not None and hedgehog is None:
        raise ValueError("hybrid_triton rotates q and k only when it computes Hedgehog features itself")
    if (hedgehog is None) == (qf is None or kf is None):
        raise ValueError("hybrid_triton needs the features qf/kf or the Hedgehog weights, not both")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"hybrid_triton needs q, k and v in one dtype (bf16, fp16 or fp32), got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if key_mask is not None and key_mask.dtype != torch.bool:
        key_mask = key_mask.bool()
    key_mask = None if key_mask is None else key_mask.contiguous()
    tensors = (q, k, v, gamma, qf, kf, *(hedgehog or (None, None)), log_gate)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    kw = dict(window=window, scale=scale, softcap=softcap, logit=logit, log_gate=log_gate)
    state = None
    if output_final_state:  # the decoding state carries no gradient
        with torch.no_grad():
            y, _, state = hybrid_triton_forward(q, k, v, gamma, **kw, key_mask=key_mask, qf=qf, kf=kf,
                                                hedgehog=hedgehog, rope=rope, state=True, nope=nope)
        if not grad:
            return y, state
    if not grad:
        y, _, _ = hybrid_triton_forward(q, k, v, gamma, **kw, key_mask=key_mask, qf=qf, kf=kf, hedgehog=hedgehog,
                                        rope=rope, nope=nope)
        return y, None
    wq, wk = hedgehog or (None, None)
    cos, sin = rope or (None, None)
    y = _HybridTriton.apply(q, k, v, gamma, qf, kf, wq, wk, cos, sin, key_mask, window, scale, softcap, logit,
                            log_gate, nope)
    return y, state


@dataclass
class SinkPlan:
    """Where each sequence's first ``S`` real tokens sit, shared by every layer of one forward (it depends on
    the key mask and the length only): ``slot`` ``[B, T]`` int32 (each position's cache slot, -1 for
    none), ``pos`` ``[B, S]`` int32 (each slot's position, ``T`` for empty), ``has`` ``[B, S]``, the
    origins ``first`` ``[B]`` and whether the cache is settled (every sequence's first tokens have left
    its window: ``sinks_settled``)."""

    key_mask: torch.Tensor | None  # (a copy: the plan is taken again only for an equal mask)
    shape: tuple
    slot: torch.Tensor
    pos: torch.Tensor
    has: torch.Tensor
    first: torch.Tensor
    settled: bool


_PLAN: list[SinkPlan] = []  # the last one (layers after the first take it)


def sink_plan(key_mask, b: int, t: int, window: int, cache_size: int, device) -> SinkPlan:
    """The ``SinkPlan`` of this key mask (None: none) and shape, computed once per forward: a later layer
    with an equal mask (each layer reads its own from the attention mask) and shape takes it."""
    shape = (b, t, window, cache_size, str(device))
    if _PLAN and _PLAN[0].shape == shape and (
            key_mask is None if _PLAN[0].key_mask is None
            else key_mask is not None and torch.equal(_PLAN[0].key_mask, key_mask.bool())):
        return _PLAN[0]
    real = key_mask.bool() if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=device)
    rank = real.long().cumsum(-1) - 1  # each real token's place among the sequence's
    sink = real & (rank < cache_size)
    slot = torch.where(sink, rank, -1)
    pos = torch.full((b, cache_size + 1), t, dtype=torch.long, device=device)  # (a last column for the others)
    pos.scatter_(1, torch.where(sink, rank, cache_size), torch.arange(t, device=device).expand(b, t).contiguous())
    pos = pos[:, :cache_size]
    first = real.long().argmax(dim=1)
    plan = SinkPlan(None if key_mask is None else real.clone(), shape, slot.to(torch.int32).contiguous(),
                    pos.to(torch.int32).contiguous(), pos < t, first, sinks_settled(key_mask, t, window, cache_size))
    _PLAN[:] = [plan]
    return plan


def hybrid_triton_sinks(q, k, v, gamma, *, window: int, cache_size: int, scale: float, softcap=None, key_mask=None,
                        hedgehog, rope=None, logit: bool = False, anchor: str = "joint",
                        output_final_state: bool = False, plan: SinkPlan | None = None, log_gate=None):
    """``sparse_hybrid_attention_chunked`` under ``priority="first"`` (each sequence's first ``S =
    cache_size`` real tokens cached for good, StreamingLLM's attention sinks) through the forward
    kernels, without gradients: ``(y, state or None)``. The kernels leave the first tokens out of the
    linear sums and add, for query ``t``, softmax terms of those with position ``<= t - w`` (those
    still in the window are window terms, as in the reference), reading them from ``k`` and ``v``.
    Inputs as ``hybrid_triton``'s with Hedgehog weights (``hedgehog``), ``anchor`` as the sparse op's.

    ``output_final_state``: the ``SparseHybridState`` after the sequence, for a prefill whose cache
    is settled, every sequence's first ``S`` tokens having left its window (the caller checks:
    ``sink_plan(...).settled``); the window, the linear state and the cache as the reference gives them.
    ``plan``: the caller's ``sink_plan`` for this key mask and shape (else looked up here).
    No gates: ``log_gate`` is refused (the sparse forms have no fading state).
    """
    from .state import SparseHybridState

    if log_gate is not None:
        raise ValueError("hybrid_triton_sinks has no gates (log_gate): the sparse cache does not combine with a "
                         "fading linear state")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, gamma, *hedgehog)):
        raise ValueError("hybrid_triton_sinks has no backward: call it without gradients")
    b, _, t, _ = q.shape
    hk, cap = k.shape[1], cache_size
    plan = plan or sink_plan(key_mask, b, t, window, cap, q.device)
    if output_final_state and not plan.settled:
        raise ValueError("hybrid_triton_sinks: the prefill's first tokens are not all out of the window")
    y, _, out = hybrid_triton_forward(q, k, v, gamma, window=window, scale=scale, softcap=softcap,
                                      key_mask=None if key_mask is None else key_mask.bool().contiguous(),
                                      hedgehog=hedgehog, rope=rope, state=output_final_state, logit=logit,
                                      sinks=(plan.slot, plan.pos), window_anchor=anchor == "window")
    if not output_final_state:
        return y, None
    plain, (ck, cf, cv) = out
    acc = plain.linear.dtype
    # the window's tokens that leave during the last token's epoch (chunk c - 1 counted from the origin) keep
    # the boundary's priority, minus their position from the origin; the others' is rescored at the next boundary
    nwin = plain.keys.shape[2]
    rel = (t - nwin + torch.arange(nwin, device=q.device))[None, :] - plan.first[:, None]  # [B, n]
    epoch = ((t - 1 - plan.first) // window)[:, None]
    leaving = (epoch >= 1) & (rel >= (epoch - 1) * window) & (rel < epoch * window)
    per_head = lambda x: x[:, None].expand(b, hk, *x.shape[1:]).clone()  # noqa: E731  (each layer's own)
    cpos = plan.pos.long() - plan.first[:, None]
    return y, SparseHybridState(
        plain.keys, plain.key_features, plain.values, plain.valid, per_head(torch.where(leaving, -rel.to(acc), 0.0)),
        plain.linear, ck, cf, cv, per_head(plan.has), per_head(-cpos.to(acc)), per_head(cpos), t - plan.first)


def sinks_settled(key_mask, t: int, window: int, cache_size: int) -> bool:
    """Whether every sequence's first ``cache_size`` real tokens have left its window after ``t`` tokens
    (``key_mask`` ``[B, t]`` or None): the prefill's cache under ``priority="first"`` will not change again
    (reads a flag on the host where there is a mask)."""
    if key_mask is None:
        return t >= cache_size + window
    real = key_mask.bool()
    nth = torch.where(real.long().cumsum(-1) == cache_size, torch.arange(t, device=real.device), t).amin(-1)
    return bool((nth <= t - 1 - window).all())
