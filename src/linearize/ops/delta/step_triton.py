"""The delta hybrid's decode step on a ring window (``window.delta_window_step_ring``) as one Triton launch.

One program per (sequence, key head) does what the PyTorch ring step does in about twenty launches:

1. the token in slot ``s`` (the oldest) leaves the window and is written to the memory,
   ``S <- a S;  S <- S + b k^ (v - S^T k^)^T`` with its own gates (an empty slot holds ``g = b = 0``:
   nothing changes);
2. the new token takes slot ``s`` (raw key and value for the softmax, delta key and gates for its own
   write later);
3. for each query head of the group: softmax over the window's live slots, the memory's readout
   ``S^T q^``, and the convex mix ``(1 - m) softmax + m readout`` with ``m = lambda`` once some real
   token has reached the memory.

The memory of a key head (``[K, V]`` fp32) stays in registers for the whole step: head widths up to
``MAX_WIDTH``. The shared bookkeeping (``valid``, ``written``, ``slot``: one per sequence, read by every
key head's program) advances after the launch, so no program reads what another writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 128  # head dim and delta-key width the kernel holds: a [128, 128] fp32 memory in registers


@triton.jit
def _delta_ring_step(q_ptr, k_ptr, v_ptr, qd_ptr, kd_ptr, g_ptr, b_ptr, lam_ptr,
                     keys_ptr, values_ptr, dkeys_ptr, gates_ptr, betas_ptr, valid_ptr, mem_ptr, written_ptr, slot_ptr,
                     y_ptr, scale, softcap, HK, G, W, D, K,
                     HAS_SOFTCAP: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr):
    bi = tl.program_id(0)
    hk = tl.program_id(1)
    head = bi * HK + hk
    w = tl.arange(0, BW)
    d = tl.arange(0, BD)
    kk = tl.arange(0, BK)
    wm, dm, km = w < W, d < D, kk < K
    s = tl.load(slot_ptr)
    here = w == s
    valid = tl.load(valid_ptr + bi * W + w, mask=wm, other=0).to(tl.int1)
    old_real = tl.sum(tl.where(here & valid, 1, 0), axis=0) > 0

    # 1. the oldest token leaves the window: written to the memory with its own gates
    ring = head * W
    rm = wm[:, None] & dm[None, :]
    keys = tl.load(keys_ptr + (ring + w[:, None]) * D + d[None, :], mask=rm, other=0.0).to(tl.float32)
    values = tl.load(values_ptr + (ring + w[:, None]) * D + d[None, :], mask=rm, other=0.0).to(tl.float32)
    v_old = tl.sum(tl.where(here[:, None], values, 0.0), axis=0)  # [BD]
    kd_old = tl.load(dkeys_ptr + (ring + s) * K + kk, mask=km, other=0.0).to(tl.float32)  # [BK]
    a_old = tl.exp(tl.load(gates_ptr + ring + s))
    b_old = tl.load(betas_ptr + ring + s)
    mem = mem_ptr + head * K * D + kk[:, None] * D + d[None, :]
    mk = km[:, None] & dm[None, :]
    state = tl.load(mem, mask=mk, other=0.0) * a_old
    read = tl.sum(state * kd_old[:, None], axis=0)  # S^T k^ after the decay
    state += kd_old[:, None] * (b_old * (v_old - read))[None, :]
    tl.store(mem, state, mask=mk)
    written = (tl.load(written_ptr + bi).to(tl.int1)) | old_real

    # 2. the new token takes the slot (rounded as the ring stores it)
    k_new = tl.load(k_ptr + head * D + d, mask=dm, other=0.0).to(keys_ptr.dtype.element_ty)
    v_new = tl.load(v_ptr + head * D + d, mask=dm, other=0.0).to(values_ptr.dtype.element_ty)
    kd_new = tl.load(kd_ptr + head * K + kk, mask=km, other=0.0).to(dkeys_ptr.dtype.element_ty)
    tl.store(keys_ptr + (ring + s) * D + d, k_new, mask=dm)
    tl.store(values_ptr + (ring + s) * D + d, v_new, mask=dm)
    tl.store(dkeys_ptr + (ring + s) * K + kk, kd_new, mask=km)
    tl.store(gates_ptr + ring + s, tl.load(g_ptr + head).to(tl.float32))
    tl.store(betas_ptr + ring + s, tl.load(b_ptr + head).to(tl.float32))
    keys = tl.where(here[:, None], k_new.to(tl.float32)[None, :], keys)
    values = tl.where(here[:, None], v_new.to(tl.float32)[None, :], values)
    live = (valid | here) & wm

    # 3. each query head of the group: the window's softmax and the memory's readout, mixed
    for g in range(G):
        qh = head * G + g
        q = tl.load(q_ptr + qh * D + d, mask=dm, other=0.0).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(scores / softcap)
        scores = tl.where(live, scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=0))
        p = tl.where(live, p, 0.0)
        o_win = tl.sum(p[:, None] * values, axis=0) / tl.sum(p, axis=0)
        qd = tl.load(qd_ptr + qh * K + kk, mask=km, other=0.0).to(tl.float32)
        o_mem = tl.sum(state * qd[:, None], axis=0)
        m = tl.where(written, tl.load(lam_ptr + qh).to(tl.float32), 0.0)
        tl.store(y_ptr + qh * D + d, o_win * (1.0 - m) + o_mem * m, mask=dm)


def delta_window_step_ring_triton(q, k, qd, kd, v, g, beta, lam, state, *, scale: float, softcap=None):
    """``delta_window_step_ring`` in one launch, in place: ``q`` ``[B, H, 1, D]`` (after RoPE), ``k``/``v``
    ``[B, Hk, 1, D]``, ``qd`` ``[B, H, 1, K]`` and ``kd`` ``[B, Hk, 1, K]`` (the delta features), ``g``/``beta``
    ``[B, Hk, 1]``, ``lam`` ``[B, H, 1]``; ``state`` a ``RingDeltaState`` with contiguous buffers (as
    ``RingDeltaState.from_state`` builds them). Returns ``(y [B, H, 1, D], state)``."""
    b, h, _, d = q.shape
    hk, w, kdim = k.shape[1], state.keys.shape[2], kd.shape[-1]
    if max(d, kdim) > MAX_WIDTH:
        raise ValueError(f"the fused delta step holds head widths up to {MAX_WIDTH}, got {d} and {kdim}")
    y = torch.empty(b, h, 1, d, device=q.device, dtype=torch.float32)
    flat = lambda x: x.contiguous()  # noqa: E731
    bd, bk = triton.next_power_of_2(d), triton.next_power_of_2(kdim)
    _delta_ring_step[(b, hk)](
        flat(q), flat(k), flat(v), flat(qd), flat(kd), flat(g), flat(beta), flat(lam),
        state.keys, state.values, state.delta_keys, state.gates, state.betas, state.valid, state.memory,
        state.written, state.slot, y, float(scale), float(softcap or 1.0), hk, h // hk, w, d, kdim,
        HAS_SOFTCAP=softcap is not None, BW=triton.next_power_of_2(w), BD=bd, BK=bk,
        num_warps=min(8, max(2, bk * bd // 2048)))
    idx = state.slot.view(1)
    state.written.logical_or_(state.valid.index_select(1, idx)[:, 0])
    state.valid.index_fill_(1, idx, True)
    state.slot.add_(1).remainder_(w)
    return y.to(q.dtype), state
