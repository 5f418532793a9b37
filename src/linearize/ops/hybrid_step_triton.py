"""One fused Triton kernel for the LoLCATs hybrid's decode step on a ring window (CUDA): the twin
of ``hybrid_attention_step_ring`` for states that keep no key features.

The PyTorch step is some twenty small kernels per layer (select the evicted slot, fold it into the
linear state, write the new token, score the window, normalise); here one program per (sequence,
key head) does all of it for the head's ``G`` query heads with the window, the linear state and
the new token in registers. What needs the feature map — the evicted key's features — is computed
before the call; the validity flag and the slot counter are advanced after it (they are shared by
the key heads of a sequence, so no program may write them while others read).
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
