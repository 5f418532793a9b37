"""One fused Triton kernel for the decode step of (decayed, normalised) linear attention (CUDA):
the in-place twin of ``linear_attention_step``.

One program per (sequence, key head) decays its state(s), adds ``phi(k) [v, 1]^T`` and reads every
query head of the group out of it — the state never leaves registers between the update and
the read. Used by the linear, SUPRA and RetNet mixers when decoding without gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _linear_step(q_ptr, k_ptr, v_ptr, state_ptr, decay_ptr, y_ptr, eps, HK, G, GS, F, DV,
                 HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr):
    bi = tl.program_id(0)
    hk = tl.program_id(1)
    f = tl.arange(0, BF)
    d = tl.arange(0, BD)
    fm, dm = f < F, d < DV
    m2 = fm[:, None] & dm[None, :]
    head = bi * HK + hk
    k = tl.load(k_ptr + head * F + f, mask=fm, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + head * DV + d, mask=dm, other=0.0).to(tl.float32)
    width = DV + NORMALIZE  # a state row: the values, then the normaliser
    per_state = G // GS  # query heads reading one state: all G without decay, one with
    for gs in range(GS):
        base = (head * GS + gs) * F * width
        s_v = tl.load(state_ptr + base + f[:, None] * width + d[None, :], mask=m2, other=0.0)
        if NORMALIZE:
            s_n = tl.load(state_ptr + base + f * width + DV, mask=fm, other=0.0)
        if HAS_DECAY:
            decay = tl.exp(tl.load(decay_ptr + hk * G + gs).to(tl.float32))
            s_v = s_v * decay
            if NORMALIZE:
                s_n = s_n * decay
        s_v += k[:, None] * v[None, :]
        tl.store(state_ptr + base + f[:, None] * width + d[None, :], s_v, mask=m2)
        if NORMALIZE:
            s_n += k
            tl.store(state_ptr + base + f * width + DV, s_n, mask=fm)
        for j in range(per_state):
            qh = head * G + gs * per_state + j
            q = tl.load(q_ptr + qh * F + f, mask=fm, other=0.0).to(tl.float32)
            o = tl.sum(q[:, None] * s_v, axis=0)
            if NORMALIZE:
                o = o / (tl.sum(q * s_n, axis=0) + eps)
            tl.store(y_ptr + qh * DV + d, o, mask=dm)


def linear_step_triton(q, k, v, state, *, log_decay=None, normalize: bool = True, eps: float = 1e-6):
    """``linear_attention_step`` updating ``state`` (``[B, Hk, Gs, F, Dv (+1)]`` fp32) in place.
    ``q`` ``[B, H, 1, F]``, ``k`` ``[B, Hk, 1, F]``, ``v`` ``[B, Hk, 1, Dv]``. Returns ``(o, state)``."""
    b, h, _, f = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    gs = state.shape[2]
    y = torch.empty(b, h, 1, dv, device=q.device, dtype=torch.float32)
    decay = log_decay.float().contiguous() if log_decay is not None else y
    _linear_step[(b, hk)](q.contiguous(), k.contiguous(), v.contiguous(), state, decay, y, float(eps),
                          hk, h // hk, gs, f, dv, HAS_DECAY=log_decay is not None, NORMALIZE=int(bool(normalize)),
                          BF=triton.next_power_of_2(f), BD=triton.next_power_of_2(dv))
    return y.to(q.dtype), state
