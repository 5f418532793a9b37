"""The delta hybrid's decode step on a ring window as one Triton launch (CUDA).

``delta_step_fused_triton`` computes, from q/k/v as the projections give them (before RoPE) and the gates'
projections before their activations, what the mixer's PyTorch path computes in about forty launches
(RoPE, the unit feature maps, the gates, then ``window.delta_window_step_ring``). One program per
(sequence, key head):

1. the new key: RoPE, its delta features ``k^ = normalize(k W_k)`` (of the key before RoPE with
   ``feature_rope: false``), its gates ``g = -exp(A_log) softplus(x_a + dt_bias)`` and ``b = sigmoid(x_b)``;
2. the token in slot ``s`` (the oldest) leaves the window and is written to the memory,
   ``S <- a S;  S <- S + b k^ (v - S^T k^)^T`` with its own gates (an empty slot holds ``g = b = 0``:
   nothing changes); the new token takes slot ``s``;
3. for each query head of the group: RoPE, ``q^ = normalize(q W_q)``, softmax over the window's live
   slots, the memory's readout ``S^T q^``, and the convex mix ``(1 - m) softmax + m readout`` with
   ``m = sigmoid(x_l + c)`` once some real token has reached the memory.

The memory of a key head (``[K, V]`` fp32) stays in registers for the whole step: head widths up to
``MAX_WIDTH``. Each program keeps its own bookkeeping (``FusedRingDeltaState``: which slots are real, whether a
token has reached the memory, the next slot), so no program reads what another writes and nothing runs
after the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hybrid.step_triton import _rope, rope_arguments
from .state import FusedRingDeltaState

MAX_WIDTH = 128  # head dim the kernel holds: a [128, 128] fp32 memory in registers
STEP_WARPS: int | None = None  # None: by the tile (a module constant, for sweeps)


@triton.jit
def _unit_features(x, w_ptr, d, D):
    """``normalize(x W)`` of one head ``x`` ``[BD]`` with a square ``W`` ``[D, D]`` (fp32)."""
    dm = d < D
    wt = tl.load(w_ptr + d[:, None] * D + d[None, :], mask=dm[:, None] & dm[None, :], other=0.0)
    y = tl.sum(x[:, None] * wt.to(tl.float32), axis=0)
    return y / tl.maximum(tl.sqrt(tl.sum(y * y, axis=0)), 1e-12)


@triton.jit
def _feature_input(rotated, x_ptr, sx, d, D, FEATURE_ROPE: tl.constexpr):
    """What a head's features are computed from: ``rotated``, or the head before RoPE read from ``x_ptr``."""
    if FEATURE_ROPE:
        x = rotated
    else:
        x = tl.load(x_ptr + d * sx, mask=d < D, other=0.0).to(tl.float32)
    return x


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold


@triton.jit
def _delta_fused_step(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr,
                      xa_ptr, xb_ptr, xl_ptr, dt_ptr, alog_ptr, mixb_ptr,
                      keys_ptr, values_ptr, dkeys_ptr, gates_ptr, betas_ptr, valid_ptr, mem_ptr, written_ptr, ticks_ptr,
                      y_ptr, sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, sv_b, sv_h, sv_d, sc_b, sc_d, swq, swk,
                      sa_b, sa_h, sb_b, sb_h, sl_b, sl_h, scale, softcap, HK, W, D, R, G: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, FEATURE_ROPE: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr):
    bi = tl.program_id(0)
    hk = tl.program_id(1)
    head = bi * HK + hk
    w = tl.arange(0, BW)
    d = tl.arange(0, BD)
    wm, dm = w < W, d < D
    s = tl.load(ticks_ptr + head)  # this key head's next slot: its oldest token's
    here = w == s
    valid = tl.load(valid_ptr + head * W + w, mask=wm, other=0).to(tl.int1)
    old_real = tl.sum(tl.where(here & valid, 1, 0), axis=0) > 0

    # 1. the new token: rotated key, delta features, gates (rounded as the ring stores them)
    cos, sin = cos_ptr + bi * sc_b, sin_ptr + bi * sc_b
    k_rot = _rope(k_ptr + bi * sk_b + hk * sk_h, sk_d, cos, sin, sc_d, d, D, R)
    kd_new = _unit_features(_feature_input(k_rot, k_ptr + bi * sk_b + hk * sk_h, sk_d, d, D, FEATURE_ROPE),
                            wk_ptr + hk * swk, d, D)
    k_new = k_rot.to(keys_ptr.dtype.element_ty)
    kd_new = kd_new.to(dkeys_ptr.dtype.element_ty)
    v_new = tl.load(v_ptr + bi * sv_b + hk * sv_h + d * sv_d, mask=dm, other=0.0).to(values_ptr.dtype.element_ty)
    xa = tl.load(xa_ptr + bi * sa_b + hk * sa_h).to(tl.float32) + tl.load(dt_ptr + hk).to(tl.float32)
    g_new = -tl.exp(tl.load(alog_ptr + hk).to(tl.float32)) * _softplus(xa)
    b_new = tl.sigmoid(tl.load(xb_ptr + bi * sb_b + hk * sb_h).to(tl.float32))

    # 2. the oldest token leaves the window: written to the memory with its own gates
    ring = head * W
    rm = wm[:, None] & dm[None, :]
    keys = tl.load(keys_ptr + (ring + w[:, None]) * D + d[None, :], mask=rm, other=0.0).to(tl.float32)
    values = tl.load(values_ptr + (ring + w[:, None]) * D + d[None, :], mask=rm, other=0.0).to(tl.float32)
    v_old = tl.sum(tl.where(here[:, None], values, 0.0), axis=0)  # [BD]
    kd_old = tl.load(dkeys_ptr + (ring + s) * D + d, mask=dm, other=0.0).to(tl.float32)
    a_old = tl.exp(tl.load(gates_ptr + ring + s))
    b_old = tl.load(betas_ptr + ring + s)
    mem = mem_ptr + head * D * D + d[:, None] * D + d[None, :]
    mk = dm[:, None] & dm[None, :]
    state = tl.load(mem, mask=mk, other=0.0) * a_old
    read = tl.sum(state * kd_old[:, None], axis=0)  # S^T k^ after the decay
    state += kd_old[:, None] * (b_old * (v_old - read))[None, :]
    tl.store(mem, state, mask=mk)
    written = (tl.load(written_ptr + head).to(tl.int1)) | old_real
    tl.store(keys_ptr + (ring + s) * D + d, k_new, mask=dm)
    tl.store(values_ptr + (ring + s) * D + d, v_new, mask=dm)
    tl.store(dkeys_ptr + (ring + s) * D + d, kd_new, mask=dm)
    tl.store(gates_ptr + ring + s, g_new)
    tl.store(betas_ptr + ring + s, b_new)
    keys = tl.where(here[:, None], k_new.to(tl.float32)[None, :], keys)
    values = tl.where(here[:, None], v_new.to(tl.float32)[None, :], values)
    live = (valid | here) & wm

    # 3. each query head of the group: the window's softmax and the memory's readout, mixed
    for g in tl.static_range(G):  # unrolled: each head's loads can start before the memory's write ends
        h = hk * G + g
        qh = bi * HK * G + h
        q = _rope(q_ptr + bi * sq_b + h * sq_h, sq_d, cos, sin, sc_d, d, D, R)
        qd = _unit_features(_feature_input(q, q_ptr + bi * sq_b + h * sq_h, sq_d, d, D, FEATURE_ROPE), wq_ptr + h * swq,
                            d, D)
        scores = tl.sum(keys * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(scores / softcap)
        scores = tl.where(live, scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=0))
        p = tl.where(live, p, 0.0)
        o_win = tl.sum(p[:, None] * values, axis=0) / tl.sum(p, axis=0)
        o_mem = tl.sum(state * qd[:, None], axis=0)
        xl = tl.load(xl_ptr + bi * sl_b + h * sl_h).to(tl.float32) + tl.load(mixb_ptr + h).to(tl.float32)
        m = tl.where(written, tl.sigmoid(xl), 0.0)
        tl.store(y_ptr + qh * D + d, (o_win * (1.0 - m) + o_mem * m).to(y_ptr.dtype.element_ty), mask=dm)
    # the bookkeeping, this key head's own
    tl.store(valid_ptr + head * W + s, tl.full([], 1, tl.int1))
    tl.store(written_ptr + head, written)
    tl.store(ticks_ptr + head, (s + 1) % W)


def delta_step_fused_triton(q, k, v, position_embeddings, wq, wk, decay_input, beta_input, mix_input, dt_bias, a_log,
                            mix_bias, state, *, scale: float, softcap=None, feature_rope: bool = False):
    """The delta hybrid's ring step in one launch, in place on ``state`` (a
    ``FusedRingDeltaState``, as ``FusedRingDeltaState.from_ring`` lays it out).

    ``q`` ``[B, H, 1, D]`` and ``k``/``v`` ``[B, Hk, 1, D]`` before RoPE (any strides); ``position_embeddings``
    ``(cos, sin)`` ``[B or 1, 1, R]`` for RoPE by rotating halves over the first ``R`` dims, or None for no
    RoPE; ``wq`` ``[H, D, D]`` and ``wk`` ``[Hk, D, D]`` the unit feature maps' weights (a leading 1: shared);
    ``decay_input``/``beta_input`` ``[B, 1, Hk]`` and ``mix_input`` ``[B, 1, H]`` the gates' projections
    of the layer input before their biases and activations (any strides: slices of the fused q/k/v
    product); ``dt_bias``, ``a_log`` ``[Hk]`` and ``mix_bias`` ``[H]``. ``feature_rope``: the features of the
    rotated q/k (else of those before RoPE). Returns ``(y [B, H, 1, D], state)``, ``y`` a view of ``[B, 1, H, D]``
    memory (what o_proj reads)."""
    b, h, _, d = q.shape
    hk, w = k.shape[1], state.keys.shape[2]
    if not isinstance(state, FusedRingDeltaState):
        raise TypeError(f"the fused delta step takes a FusedRingDeltaState, not a {type(state).__name__}")
    if d > MAX_WIDTH:
        raise ValueError(f"the fused delta step holds head widths up to {MAX_WIDTH}, got {d}")
    if state.delta_keys.shape[-1] != d or state.memory.shape[-2:] != (d, d):
        raise ValueError("the fused delta step takes square feature maps: delta keys as wide as the heads")
    y = torch.empty(b, 1, h, d, device=q.device, dtype=q.dtype)  # the layout o_proj reads: no copy after
    cos, sin, rot, sc_b, sc_d = rope_arguments(position_embeddings, q)
    wq, wk = wq.contiguous(), wk.contiguous()
    bd = triton.next_power_of_2(d)
    _delta_fused_step[(b, hk)](
        q, k, v, cos, sin, wq, wk, decay_input, beta_input, mix_input, dt_bias, a_log, mix_bias,
        state.keys, state.values, state.delta_keys, state.gates, state.betas, state.valid, state.memory,
        state.written, state.ticks, y, q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3), sc_b, sc_d, wq.stride(0) if wq.shape[0] > 1 else 0,
        wk.stride(0) if wk.shape[0] > 1 else 0, decay_input.stride(0), decay_input.stride(-1), beta_input.stride(0),
        beta_input.stride(-1), mix_input.stride(0), mix_input.stride(-1), float(scale), float(softcap or 1.0), hk,
        w, d, rot, G=h // hk, HAS_SOFTCAP=softcap is not None, FEATURE_ROPE=feature_rope,
        BW=triton.next_power_of_2(w), BD=bd, num_warps=STEP_WARPS or min(8, max(2, bd * bd // 1024)))
    return y.transpose(1, 2), state
