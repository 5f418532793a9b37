"""Fused Triton kernels for the LoLCATs hybrid's decode step on a ring window (CUDA).

``hybrid_step_fused_triton`` is the whole step for Hedgehog feature maps in one launch: RoPE of
the new query and key, the query's features, the window softmax, the linear terms, the ring and
linear-state updates and the slot bookkeeping (with RoPE and the feature maps in PyTorch around
the ring-step kernel below, a layer's step was 27 launches). One program per (sequence, query
head, part of the value columns), which takes its part ``STEP_CHUNK`` columns at a time (the scores,
features and normalisers first, then each chunk's values, linear-state rows and output; the owner's
state update likewise); the state is laid out so that no program writes what another reads
(``FusedRingState``). With attention sinks (a sparse cache of the first tokens, once every
sequence's are cached: ``FusedSinkState``) the cached tokens join the window's softmax.

``hybrid_step_ring_triton`` is the twin of ``hybrid_attention_step_ring`` for other feature maps:
one program per (sequence, key head), with the features computed before the call and the validity
flag and slot counter advanced after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hybrid_ring_step(q_ptr, qf_ptr, k_ptr, v_ptr, oldf_ptr, keys_ptr, values_ptr, valid_ptr, lin_ptr, gamma_ptr,
                      slot_ptr, y_ptr, scale, softcap, HK, G, W, D, F,
                      HAS_SOFTCAP: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr):
    bi = tl.program_id(0)
    hk = tl.program_id(1)
    w = tl.arange(0, BW)
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    wm, dm, fm = w < W, d < D, f < F
    s = tl.load(slot_ptr)
    head = bi * HK + hk
    # 1. the token leaving the window joins the linear state (an empty slot holds zeros)
    valid = tl.load(valid_ptr + bi * W + w, mask=wm, other=0).to(tl.int1)
    old_valid = tl.sum(tl.where((w == s) & valid, 1.0, 0.0), axis=0)
    ring = head * W * D + w[:, None] * D + d[None, :]
    rm = wm[:, None] & dm[None, :]
    keys = tl.load(keys_ptr + ring, mask=rm, other=0.0).to(tl.float32)
    values = tl.load(values_ptr + ring, mask=rm, other=0.0).to(tl.float32)
    old_v = tl.sum(tl.where((w == s)[:, None], values, 0.0), axis=0)  # [BD]
    old_f = tl.load(oldf_ptr + head * F + f, mask=fm, other=0.0).to(tl.float32) * old_valid
    lin = head * F * (D + 1) + f[:, None] * (D + 1)
    lm = fm[:, None] & dm[None, :]
    s_v = tl.load(lin_ptr + lin + d[None, :], mask=lm, other=0.0) + old_f[:, None] * old_v[None, :]
    s_n = tl.load(lin_ptr + head * F * (D + 1) + f * (D + 1) + D, mask=fm, other=0.0) + old_f
    tl.store(lin_ptr + lin + d[None, :], s_v, mask=lm)
    tl.store(lin_ptr + head * F * (D + 1) + f * (D + 1) + D, s_n, mask=fm)
    # 2. the new token takes the slot
    k_new = tl.load(k_ptr + head * D + d, mask=dm, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + head * D + d, mask=dm, other=0.0).to(tl.float32)
    here = (w == s)[:, None]
    keys = tl.where(here, k_new[None, :], keys)
    values = tl.where(here, v_new[None, :], values)
    tl.store(keys_ptr + head * W * D + s * D + d, k_new.to(keys_ptr.dtype.element_ty), mask=dm)
    tl.store(values_ptr + head * W * D + s * D + d, v_new.to(values_ptr.dtype.element_ty), mask=dm)
    live = (valid | (w == s)) & wm
    # 3. each query head of this key head: window softmax terms + linear terms, one normaliser
    for g in range(G):
        qh = (bi * HK + hk) * G + g
        q = tl.load(q_ptr + qh * D + d, mask=dm, other=0.0).to(tl.float32)
        qf = tl.load(qf_ptr + qh * F + f, mask=fm, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + hk * G + g).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(scores / softcap)
        scores = tl.where(live, scores, float("-inf"))
        a = gamma * tl.exp(scores - tl.max(scores, axis=0))
        a = tl.where(live, a, 0.0)
        num = tl.sum(a[:, None] * values, axis=0) + tl.sum(qf[:, None] * s_v, axis=0)
        den = tl.sum(a, axis=0) + tl.sum(qf * s_n, axis=0)
        tl.store(y_ptr + qh * D + d, num / tl.maximum(den, 1.1754943508222875e-38), mask=dm)


def hybrid_step_ring_triton(q, k, qf, v, gamma, old_features, state, *, scale: float, softcap=None):
    """The decode step on a ``RingHybridState`` without key features, in place.

    ``q`` ``[B, H, 1, D]``, ``k``/``v`` ``[B, Hk, 1, D]``, ``qf`` ``[B, H, 1, F]``, ``old_features``
    ``[B, Hk, 1, F]`` (the features of the key in the slot being overwritten), ``gamma`` ``[H]``.
    Returns ``y [B, H, 1, D]``; advances ``state.valid`` and ``state.slot`` like the PyTorch step."""
    b, h, _, d = q.shape
    hk, w, f = k.shape[1], state.keys.shape[2], qf.shape[-1]
    y = torch.empty(b, h, 1, d, device=q.device, dtype=torch.float32)
    _hybrid_ring_step[(b, hk)](
        q.contiguous(), qf.contiguous(), k.contiguous(), v.contiguous(), old_features.contiguous(),
        state.keys, state.values, state.valid, state.linear, gamma.float().contiguous(), state.slot, y,
        float(scale), float(softcap or 1.0), hk, h // hk, w, d, f,
        HAS_SOFTCAP=softcap is not None, BW=triton.next_power_of_2(w), BD=triton.next_power_of_2(d),
        BF=triton.next_power_of_2(f))
    state.valid.index_fill_(1, state.slot.view(1), True)
    state.slot.add_(1).remainder_(w)
    return y.to(q.dtype)


@triton.jit
def _rope(x_ptr, sx, cos_ptr, sin_ptr, sc, d, D, R):
    """One head ``[BD]`` in fp32, rotated by halves over its first ``R`` dims (none when R = 0)."""
    half = R // 2
    rot = d < R
    x = tl.load(x_ptr + d * sx, mask=d < D, other=0.0).to(tl.float32)
    partner = tl.load(x_ptr + tl.where(d < half, d + half, d - half) * sx, mask=rot, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + d * sc, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + d * sc, mask=rot, other=0.0).to(tl.float32)
    return x * cos + tl.where(d < half, -partner, partner) * sin


@triton.jit
def _hedgehog(x, w_ptr, d, f, D, FH):
    """Hedgehog features of one head ``x`` ``[BD]``: softmax(xW) and softmax(-xW), each ``[BF]``."""
    fm = f < FH
    wt = tl.load(w_ptr + d[:, None] * FH + f[None, :], mask=(d < D)[:, None] & fm[None, :], other=0.0)
    y = tl.sum(x[:, None] * wt.to(tl.float32), axis=0)
    pos = tl.where(fm, y, float("-inf"))
    neg = tl.where(fm, -y, float("-inf"))
    pos = tl.exp(pos - tl.max(pos, axis=0))
    neg = tl.exp(neg - tl.max(neg, axis=0))
    return pos / tl.sum(pos, axis=0), neg / tl.sum(neg, axis=0)


@triton.jit
def _hybrid_fused_step(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, logit_ptr,
                       keys_ptr, values_ptr, valid_ptr, lin_ptr, slot_ptr, ticks_ptr, y_ptr,
                       sinkk_ptr, sinkv_ptr, sinkm_ptr, lg_ptr, gb_ptr, ek_ptr, ev_ptr, kf_ptr,
                       sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, sv_b, sv_h, sv_d, sc_b, sc_d, swq, swk, sg_b, sg_h,
                       scale, softcap, H, HK, W, D, FH, R, NS, S,
                       HAS_SOFTCAP: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                       BF: tl.constexpr, BS: tl.constexpr, WINDOW_ANCHOR: tl.constexpr, GATED: tl.constexpr,
                       NOPE: tl.constexpr, GATE_INPUT: tl.constexpr, BC: tl.constexpr, WIDTH: tl.constexpr):
    bi = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    hk = h // (H // HK)
    owner = h % (H // HK) == 0  # the one program per key head (and value part) that updates its state
    w = tl.arange(0, BW)
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    j = tl.arange(0, BC)  # a chunk of this program's value columns
    dm, fm = d < D, f < FH
    tick = tl.load(ticks_ptr + (bi * H + h) * NS + c)
    s = tick % W  # the slot the new token takes; its old token is already in the linear state
    p = tick % 2  # the linear state read now; the other one is written
    here = w == s
    old = (w < W) & (w != s)  # slot s is never read: its owner overwrites it during the launch

    q = _rope(q_ptr + bi * sq_b + h * sq_h, sq_d, cos_ptr + bi * sc_b, sin_ptr + bi * sc_b, sc_d, d, D, R)
    if NOPE:  # the features of the query before RoPE
        q_raw = tl.load(q_ptr + bi * sq_b + h * sq_h + d * sq_d, mask=dm, other=0.0).to(tl.float32)
        q_pos, q_neg = _hedgehog(q_raw, wq_ptr + h * swq, d, f, D, FH)
    else:
        q_pos, q_neg = _hedgehog(q, wq_ptr + h * swq, d, f, D, FH)

    # the window's keys after this step: slot s holds the new key (rounded as the ring stores it)
    ring = (bi * HK + hk) * W * D
    k_new = _rope(k_ptr + bi * sk_b + hk * sk_h, sk_d, cos_ptr + bi * sc_b, sin_ptr + bi * sc_b, sc_d, d, D, R)
    k_new = k_new.to(keys_ptr.dtype.element_ty)
    keys = tl.load(keys_ptr + ring + w[:, None] * D + d[None, :], mask=old[:, None] & dm[None, :], other=0.0)
    keys = tl.where(here[:, None], k_new.to(tl.float32)[None, :], keys.to(tl.float32))
    live = tl.load(valid_ptr + bi * W + w, mask=old, other=0).to(tl.int1) | here

    # the scalars: softmax weights of the window (and sinks), the linear terms' normalisers, the gate
    scores = tl.sum(keys * q[None, :], axis=1) * scale
    if HAS_SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(scores / softcap)
    scores = tl.where(live, scores, float("-inf"))
    gamma = tl.sigmoid(tl.load(logit_ptr + h).to(tl.float32))
    top = tl.max(scores, axis=0)  # the window's largest score
    e = tl.arange(0, BS if BS > 0 else 1)
    cached = (bi * HK + hk) * S * D
    if BS > 0:  # a fixed exact cache of S tokens beside the window (attention sinks): one softmax with it
        sink_keys = tl.load(sinkk_ptr + cached + e[:, None] * D + d[None, :], mask=(e < S)[:, None] & dm[None, :],
                            other=0.0).to(tl.float32)
        sink_scores = tl.sum(sink_keys * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            sink_scores = softcap * (2.0 * tl.sigmoid(2.0 * sink_scores / softcap) - 1.0)
        sink_live = tl.load(sinkm_ptr + (bi * HK + hk) * S + e, mask=e < S, other=0).to(tl.int1)
        sink_scores = tl.where(sink_live, sink_scores, float("-inf"))
        peak = tl.maximum(top, tl.max(sink_scores, axis=0))
        a_sink = gamma * tl.exp(sink_scores - peak)
        lift = tl.exp(top - peak)
    else:
        peak = top
        a_sink = tl.zeros([1], tl.float32)
        lift = 1.0
    a = gamma * tl.exp(scores - peak)
    width = WIDTH  # a linear-state row's stride: the values, the normaliser, then padding to 16 bytes
    cur = lin_ptr + ((bi * HK + hk) * 2 + p) * 2 * FH * width
    nxt = lin_ptr + ((bi * HK + hk) * 2 + 1 - p) * 2 * FH * width
    n_pos = tl.load(cur + f * width + D, mask=fm, other=0.0)
    n_neg = tl.load(cur + (FH + f) * width + D, mask=fm, other=0.0)
    lin_pos = tl.sum(q_pos * n_pos, axis=0)
    lin_neg = tl.sum(q_neg * n_neg, axis=0)
    evict = ((bi * HK + hk) * 2 + p)
    gate = 1.0
    qe = 0.0
    if GATED:  # the state after the previous token, faded by this token's gate, plus the token this step evicts
        if GATE_INPUT:  # g = exp(-softplus(x + bias)) = sigmoid(-(x + bias)), x the gate's projection
            x = tl.load(lg_ptr + bi * sg_b + hk * sg_h).to(tl.float32) + tl.load(gb_ptr + hk).to(tl.float32)
            gate = tl.sigmoid(-x)
        else:
            gate = tl.exp(tl.load(lg_ptr + bi * sg_b + hk * sg_h).to(tl.float32))
        e_pos = tl.load(ek_ptr + evict * 2 * FH + f, mask=fm, other=0.0)
        e_neg = tl.load(ek_ptr + evict * 2 * FH + FH + f, mask=fm, other=0.0)
        qe_pos = tl.sum(q_pos * e_pos, axis=0)
        qe_neg = tl.sum(q_neg * e_neg, axis=0)
        qe = qe_pos + qe_neg
        lin_pos = gate * lin_pos + qe_pos
        lin_neg = gate * lin_neg + qe_neg
    lin_scale = gate
    if WINDOW_ANCHOR:  # the linear terms weigh against the window's softmax terms as without the cache
        lin_pos *= lift
        lin_neg *= lift
        lin_scale = gate * lift
        qe = qe * lift
    den = tl.sum(a, axis=0) + tl.sum(a_sink, axis=0) + lin_pos + lin_neg
    den = tl.maximum(den, 1.1754943508222875e-38)

    # the value columns a chunk at a time: what a chunk holds at once stays small
    for c0 in range(0, BDV, BC):
        dv = c * BDV + c0 + j
        dvm = dv < D
        v_new = tl.load(v_ptr + bi * sv_b + hk * sv_h + dv * sv_d, mask=dvm, other=0.0).to(values_ptr.dtype.element_ty)
        values = tl.load(values_ptr + ring + w[:, None] * D + dv[None, :], mask=old[:, None] & dvm[None, :], other=0.0)
        values = tl.where(here[:, None], v_new.to(tl.float32)[None, :], values.to(tl.float32))
        rows = f[:, None] * width + dv[None, :]
        lm = fm[:, None] & dvm[None, :]
        s_pos = tl.load(cur + rows, mask=lm, other=0.0)
        s_neg = tl.load(cur + FH * width + rows, mask=lm, other=0.0)
        lin_num = tl.sum(q_pos[:, None] * s_pos, axis=0) + tl.sum(q_neg[:, None] * s_neg, axis=0)
        num = tl.sum(a[:, None] * values, axis=0) + lin_scale * lin_num
        if GATED:
            e_v = tl.load(ev_ptr + evict * D + dv, mask=dvm, other=0.0)
            num += qe * e_v
        if BS > 0:
            sink_values = tl.load(sinkv_ptr + cached + e[:, None] * D + dv[None, :],
                                  mask=(e < S)[:, None] & dvm[None, :], other=0.0).to(tl.float32)
            num += tl.sum(a_sink[:, None] * sink_values, axis=0)
        tl.store(y_ptr + (bi * H + h) * D + dv, (num / den).to(y_ptr.dtype.element_ty), mask=dvm)
    tl.store(ticks_ptr + (bi * H + h) * NS + c, (tick + 1) % (2 * W))

    if owner:
        # the other linear state: this one plus the token the next step evicts, from slot s + 1
        # (nobody writes it now), or when w = 1 the new token
        s1 = (s + 1) % W
        kept = s1 != s
        k_old = tl.load(keys_ptr + ring + s1 * D + d, mask=tl.where(kept, dm, False), other=0.0).to(tl.float32)
        k_old = tl.where(kept, k_old, k_new.to(tl.float32))
        real = tl.load(valid_ptr + bi * W + s1, mask=kept, other=1).to(tl.float32)  # empty slots hold no key
        first = c == 0
        if NOPE:  # the features of the keys before RoPE: the window keeps them; the new key's are computed
            k_raw = tl.load(k_ptr + bi * sk_b + hk * sk_h + d * sk_d, mask=dm, other=0.0).to(tl.float32)
            new_pos, new_neg = _hedgehog(k_raw.to(keys_ptr.dtype.element_ty).to(tl.float32), wk_ptr + hk * swk, d,
                                         f, D, FH)
            new_pos = new_pos.to(kf_ptr.dtype.element_ty)
            new_neg = new_neg.to(kf_ptr.dtype.element_ty)
            feats = kf_ptr + (bi * HK + hk) * W * 2 * FH
            k_pos = tl.load(feats + s1 * 2 * FH + f, mask=tl.where(kept, fm, False), other=0.0)
            k_neg = tl.load(feats + s1 * 2 * FH + FH + f, mask=tl.where(kept, fm, False), other=0.0)
            k_pos = tl.where(kept, k_pos.to(tl.float32), new_pos.to(tl.float32))
            k_neg = tl.where(kept, k_neg.to(tl.float32), new_neg.to(tl.float32))
            tl.store(feats + s * 2 * FH + f, new_pos, mask=tl.where(first, fm, False))
            tl.store(feats + s * 2 * FH + FH + f, new_neg, mask=tl.where(first, fm, False))
        else:
            k_pos, k_neg = _hedgehog(k_old, wk_ptr + hk * swk, d, f, D, FH)
        k_pos, k_neg = k_pos * real, k_neg * real
        if GATED:
            tl.store(nxt + f * width + D, gate * n_pos + e_pos, mask=tl.where(first, fm, False))
            tl.store(nxt + (FH + f) * width + D, gate * n_neg + e_neg, mask=tl.where(first, fm, False))
            ahead = ((bi * HK + hk) * 2 + 1 - p)
            tl.store(ek_ptr + ahead * 2 * FH + f, k_pos, mask=tl.where(first, fm, False))
            tl.store(ek_ptr + ahead * 2 * FH + FH + f, k_neg, mask=tl.where(first, fm, False))
        else:
            # a vector mask and a scalar condition meet through tl.where: Triton 3.9's interpreter
            # turns `vector & scalar` into int32 and refuses it as a mask
            tl.store(nxt + f * width + D, n_pos + k_pos, mask=tl.where(first, fm, False))
            tl.store(nxt + (FH + f) * width + D, n_neg + k_neg, mask=tl.where(first, fm, False))
        for c0 in range(0, BDV, BC):  # the chunks' state rows again (this program read them just now: cached)
            dv = c * BDV + c0 + j
            dvm = dv < D
            rows = f[:, None] * width + dv[None, :]
            lm = fm[:, None] & dvm[None, :]
            s_pos = tl.load(cur + rows, mask=lm, other=0.0)
            s_neg = tl.load(cur + FH * width + rows, mask=lm, other=0.0)
            v_old = tl.load(values_ptr + ring + s1 * D + dv, mask=tl.where(kept, dvm, False), other=0.0)
            v_new = tl.load(v_ptr + bi * sv_b + hk * sv_h + dv * sv_d, mask=dvm, other=0.0).to(
                values_ptr.dtype.element_ty)
            v_old = tl.where(kept, v_old.to(tl.float32), v_new.to(tl.float32))
            if GATED:  # the state after this token, and (apart) the token the next step evicts
                e_v = tl.load(ev_ptr + evict * D + dv, mask=dvm, other=0.0)
                tl.store(nxt + rows, gate * s_pos + e_pos[:, None] * e_v[None, :], mask=lm)
                tl.store(nxt + FH * width + rows, gate * s_neg + e_neg[:, None] * e_v[None, :], mask=lm)
                tl.store(ev_ptr + ((bi * HK + hk) * 2 + 1 - p) * D + dv, v_old, mask=dvm)
            else:
                tl.store(nxt + rows, s_pos + k_pos[:, None] * v_old[None, :], mask=lm)
                tl.store(nxt + FH * width + rows, s_neg + k_neg[:, None] * v_old[None, :], mask=lm)
            tl.store(values_ptr + ring + s * D + dv, v_new, mask=dvm)
        tl.store(keys_ptr + ring + s * D + d, k_new, mask=tl.where(first, dm, False))
        tl.store(valid_ptr + bi * W + s, tl.full([], 1, tl.int1), mask=first & (h == 0))
        tl.store(slot_ptr, ((s + 1) % W).to(tl.int64), mask=first & (h == 0) & (bi == 0))


# The fused step's programs: value parts are added until a step has about this many (a batch-1 step would otherwise
# leave most of the GPU idle) for heads up to 64 wide, (D / 64)^2 times as many for wider ones (a rule fitted to the
# two widths measured, not derived); and its warps (None: by the tile, see below). On an H200 at Llama-3-8B's heads
# (32 of 128; dev/step_bench.py --shape llama-3-8b --splits 1 2 4 8) batch 1 took 14.1 / 11.0 / 10.3 / 11.4 us a
# layer in 1 / 2 / 4 / 8 parts (4: 128 programs) and batch 4 15.6 / 15.2 / 20.7 / 25.1 (1: 128 programs); the fast
# decoder's batch-1 step 4.77 against 4.85 ms (gpu_scale.sh decode). Module constants so that dev/step_bench.py can
# sweep them.
SPLIT_PROGRAMS = 32
STEP_WARPS: int | None = None
# The value columns a program takes at a time (its window values and linear state rows of them, and the
# state it writes) once a step has at least CHUNK_PROGRAMS programs: what a program holds at once stays
# small however wide its part. Fewer programs take their part whole. On an H200 at Llama-3-8B's heads (32 on 8,
# head dim 128; dev/step_bench.py --shape llama-3-8b, bab3af6) chunks of 32 took 431 / 112 us a layer at batch
# 256 / 64 against 462 / 117 whole (16: 624 / 161; 64: 445 / 114), and at batch 1 18.3 against 14.0 whole.
# Module constants so that dev/step_bench.py can sweep them.
STEP_CHUNK = 32
CHUNK_PROGRAMS = 2048


def value_splits(batch: int, n_heads: int, head_dim: int, programs: int | None = None, min_width: int = 16) -> int:
    """Parts of the value columns per head for ``FusedRingState``: halved until the step has about
    ``programs`` programs (default ``SPLIT_PROGRAMS``, times ``(head_dim / 64)^2`` for heads over 64 wide), each
    part at least ``min_width`` wide."""
    programs = SPLIT_PROGRAMS * max(1, head_dim // 64) ** 2 if programs is None else programs
    splits = 1
    while batch * n_heads * splits < programs and head_dim // (2 * splits) >= min_width:
        splits *= 2
    return splits


def rope_arguments(position_embeddings, placeholder: torch.Tensor):
    """What the fused steps' ``_rope`` takes for ``(cos, sin)`` ``[B or 1, 1, R]``: ``(cos, sin, R, batch
    stride, dim stride)``; for None (no RoPE) ``R = 0`` and ``placeholder`` stands in, never read."""
    if position_embeddings is None:
        return placeholder, placeholder, 0, 0, 0
    cos, sin = position_embeddings
    return cos, sin, cos.shape[-1], cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(-1)


def hybrid_step_fused_triton(q, k, v, position_embeddings, wq, wk, window_logit, state, *, scale: float,
                             softcap=None, anchor: str = "joint", log_gate=None, feature_rope: bool = True,
                             gate_input=None, gate_bias=None):
    """The LoLCATs decode step with Hedgehog maps on a ``FusedRingState``, in one launch, in place.

    ``q`` ``[B, H, 1, D]`` and ``k``/``v`` ``[B, Hk, 1, D]`` before RoPE (any strides);
    ``position_embeddings`` ``(cos, sin)`` ``[B or 1, 1, R]`` for RoPE by rotating halves over the
    first ``R`` dims of each head, or None for no RoPE; ``wq`` ``[H, D, F/2]`` and ``wk``
    ``[Hk, D, F/2]`` the Hedgehog weights (a leading 1: shared by all heads); ``window_logit``
    ``[H]`` (gamma = sigmoid of it). A ``FusedSinkState`` adds its fixed cache to the window's
    softmax, one maximum over both; ``anchor`` as the sparse cache's (``"window"``: the
    linear terms scaled by exp(window max - joint max)). ``log_gate`` ``[B, Hk, 1]``: this token's gates
    of the linear state (the state must be laid out for them, ``FusedRingState.from_ring(gated=True)``);
    or in its place ``gate_input`` ``[B, 1, Hk]`` (any strides: a slice of the fused q/k/v product) and
    ``gate_bias`` ``[Hk]``, the data-dependent gate before its activation, which the kernel takes as
    ``log g = -softplus(gate_input + gate_bias)`` (no launches of its own for the gate);
    ``feature_rope=False``: the features of q and k before RoPE, the window's kept in ``state.key_features``.
    Returns ``y`` ``[B, H, 1, D]``, a view of ``[B, 1, H, D]`` memory (what o_proj reads)."""
    b, h, _, d = q.shape
    hk, w, fh, splits = k.shape[1], state.keys.shape[2], wq.shape[-1], state.ticks.shape[-1]
    if state.linear.shape[-2:] != (2 * fh, d + 1) or state.ticks.shape[:2] != (b, h):
        raise ValueError(f"a state for {tuple(state.ticks.shape[:2])} sequences x query heads and features "
                         f"{tuple(state.linear.shape[-2:])} does not fit {(b, h)} and Hedgehog features of {fh}")
    width = state.linear.stride(-2)  # the rows' stride (FusedRingState pads them to 16 bytes)
    if state.linear.stride() != (hk * 4 * fh * width, 4 * fh * width, 2 * fh * width, width, 1):
        raise ValueError(f"the linear state's strides {state.linear.stride()} are not those of rows of {width} "
                         "elements one after another (FusedRingState lays them out so)")
    y = torch.empty(b, 1, h, d, device=q.device, dtype=q.dtype)
    cos, sin, rot, sc_b, sc_d = rope_arguments(position_embeddings, q)
    wq, wk = wq.contiguous(), wk.contiguous()
    bw, bd = triton.next_power_of_2(w), triton.next_power_of_2(d)
    bdv = triton.next_power_of_2(triton.cdiv(d, splits))  # a program's value columns
    # warps: a window of 64 x head dim 64 takes 2. At 8, ptxas (sm_90) gives 255 registers a thread and
    # no spills, but that is one program per SM. On an H100 (dev/step_bench.py, 30 layers' states in
    # one graph) the step took 132 / 75 / 58 us at 8 / 4 / 2 warps at batch 256, 36 / 23 / 21 at
    # batch 64 and 8 / 8 / 7 at batch 1, spills notwithstanding. Larger tiles take proportionally more
    # (not measured).
    sinks = getattr(state, "sink_keys", None) is not None  # a FusedSinkState: its fixed cache joins the softmax
    if anchor not in ("joint", "window"):
        raise ValueError(f"anchor must be 'joint' or 'window', got {anchor!r}")
    n_sinks = state.sink_keys.shape[2] if sinks else 0
    sink_k, sink_v, sink_m = (state.sink_keys, state.sink_values, state.sink_valid) if sinks else (q, q, state.valid)
    gated = getattr(state, "gated", False)
    if (gate_input is None) != (gate_bias is None) or (gate_input is not None and log_gate is not None):
        raise ValueError("a gate's input comes with its bias, in place of log gates")
    if gated != (log_gate is not None or gate_input is not None):
        raise ValueError("a gated decode step needs a state laid out for gates and the token's log gates, "
                         "and an ungated one neither")
    if not feature_rope and state.key_features.shape[2] != w:
        raise ValueError("features before RoPE need the window's key features in the state")
    if gate_input is not None:  # read in place: [B, 1, Hk] with any strides
        lg, gb, sg_b, sg_h = gate_input, gate_bias, gate_input.stride(0), gate_input.stride(-1)
    elif gated:
        lg = log_gate.reshape(b, hk).float().contiguous()
        gb, sg_b, sg_h = q, hk, 1
    else:
        lg, gb, sg_b, sg_h = q, q, 0, 0
    ek, ev = (state.evict_features, state.evict_values) if gated else (q, q)
    _hybrid_fused_step[(b, h, splits)](
        q, k, v, cos, sin, wq, wk, window_logit, state.keys, state.values, state.valid, state.linear, state.slot,
        state.ticks, y, sink_k, sink_v, sink_m, lg, gb, ek, ev, q if feature_rope else state.key_features, q.stride(0),
        q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3), v.stride(0), v.stride(1), v.stride(3), sc_b,
        sc_d, wq.stride(0) if wq.shape[0] > 1 else 0, wk.stride(0) if wk.shape[0] > 1 else 0, sg_b, sg_h, float(scale), float(softcap or 1.0), h, hk, w, d, fh, rot, splits,
        max(n_sinks, 1), HAS_SOFTCAP=softcap is not None, BW=bw, BD=bd,
        BDV=bdv, BF=triton.next_power_of_2(fh),
        BS=triton.next_power_of_2(n_sinks) if n_sinks else 0, WINDOW_ANCHOR=sinks and anchor == "window",
        GATED=gated, NOPE=not feature_rope, GATE_INPUT=gate_input is not None,
        BC=min(STEP_CHUNK if b * h * splits >= CHUNK_PROGRAMS else bdv, bdv), WIDTH=width,
        num_warps=STEP_WARPS or min(16, max(2, bw * bd // 2048)))
    return y.transpose(1, 2)
