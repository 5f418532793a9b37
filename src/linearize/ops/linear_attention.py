"""Causal linear attention, optionally decayed and normalised, in three equal forms.

    o_t = sum_{s<=t} g^(t-s) (q_t . k_s) v_s   [/ (sum_{s<=t} g^(t-s) q_t . k_s + eps)  if normalize]

Shapes: ``q`` is ``[B, H, T, F]`` (already feature-mapped), ``k`` is ``[B, Hk, T, F]``, ``v`` is
``[B, Hk, T, D]``, with ``H = Hk * G`` (grouped-query attention; ``G = 1`` is multi-head, ``Hk = 1``
multi-query). Keys and values are never repeated: queries are viewed as ``[B, Hk, G, T, F]`` and
keys broadcast over the group.

``log_decay`` is ``None`` (no decay) or a ``[H]`` tensor of ``log g_h <= 0``, one fixed decay per
query head. The recurrent state is then kept per query head; without decay it is kept per key head.

State: one fp32 tensor ``[B, Hk, Gs, F, D + n]`` where ``Gs`` is ``G`` with decay and ``1`` without,
and ``n = 1`` when normalising: the normaliser ``z = sum k_s`` rides along as an extra value column
(values are augmented with a column of ones), so numerator and denominator share one code path.

Three forms, equal up to rounding (the tests prove it in float64, values and gradients):
``linear_attention_naive`` (quadratic, the reference), ``linear_attention_chunked`` (linear in T;
training and prefill) and ``linear_attention_step`` (one token; decoding).
"""

from __future__ import annotations

import torch

State = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """States accumulate in fp32 whatever the input dtype (float64 stays float64 for tests)."""
    return torch.promote_types(dtype, torch.float32)


def _group(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, H, T, F] -> [B, Hk, G, T, F] (a view)."""
    b, h, t, f = q.shape
    if h % n_kv:
        raise ValueError(f"{h} query heads are not a multiple of {n_kv} key heads")
    return q.view(b, n_kv, h // n_kv, t, f)


def _augment(v: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Append a column of ones to the values, so the normaliser is computed as one more value."""
    if not normalize:
        return v
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _finish(o: torch.Tensor, normalize: bool, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """[B, Hk, G, T, D(+1)] -> [B, H, T, D], dividing by the normaliser column when present."""
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + eps)
    b, hk, g, t, d = o.shape
    return o.reshape(b, hk * g, t, d).to(out_dtype)


def _log_decay(log_decay: torch.Tensor | None, n_kv: int, group: int, dtype) -> torch.Tensor | None:
    """[H] -> [Hk, G] in the accumulation dtype."""
    if log_decay is None:
        return None
    return log_decay.to(dtype).reshape(n_kv, group)


def empty_state(
    batch: int, n_heads: int, n_kv: int, feature_dim: int, value_dim: int, *,
    decay: bool, normalize: bool, device=None, dtype=torch.float32,
) -> State:
    """A zero state for ``batch`` sequences (the state before any token)."""
    groups = n_heads // n_kv if decay else 1
    return torch.zeros(batch, n_kv, groups, feature_dim, value_dim + int(normalize), device=device, dtype=dtype)


def linear_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    log_decay: torch.Tensor | None = None, normalize: bool = True, eps: float = 1e-6,
    initial_state: State | None = None,
) -> torch.Tensor:
    """The quadratic reference: materialises the [T, T] score matrix. Returns ``[B, H, T, D]``."""
    acc = accum_dtype(q.dtype)
    n_kv, t = k.shape[1], q.shape[2]
    qg = _group(q, n_kv).to(acc)
    kk, vv = k.to(acc).unsqueeze(2), _augment(v.to(acc), normalize).unsqueeze(2)
    scores = qg @ kk.transpose(-1, -2)  # [B, Hk, G, T, T]
    pos = torch.arange(t, device=q.device)
    dist = (pos[:, None] - pos[None, :]).to(acc)
    causal = dist >= 0
    ld = _log_decay(log_decay, n_kv, qg.shape[2], acc)
    if ld is None:
        weights = causal.to(acc)
    else:
        weights = torch.exp(ld[..., None, None] * dist.clamp(min=0)) * causal
    o = (scores * weights) @ vv
    if initial_state is not None:
        o = o + _initial_state_term(qg, initial_state.to(acc), ld)
    return _finish(o, normalize, eps, q.dtype)


def _initial_state_term(qg: torch.Tensor, state: torch.Tensor, ld: torch.Tensor | None) -> torch.Tensor:
    """Contribution of a state carried in from before the sequence: g^(t+1) q_t S0."""
    o = qg @ state
    if ld is not None:
        steps = torch.arange(1, qg.shape[3] + 1, device=qg.device, dtype=qg.dtype)
        o = o * torch.exp(ld[..., None] * steps)[..., None]
    return o


def linear_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    log_decay: torch.Tensor | None = None, normalize: bool = True, eps: float = 1e-6,
    chunk_size: int = 64, initial_state: State | None = None, output_final_state: bool = False,
) -> tuple[torch.Tensor, State | None]:
    """Linear-time form: exact attention inside chunks of ``chunk_size``, a carried state between.

    Returns ``(o [B, H, T, D], final_state or None)``.
    """
    acc = accum_dtype(q.dtype)
    b, n_kv, t, f = k.shape
    qg = _group(q, n_kv).to(acc)
    group = qg.shape[2]
    kk = k.to(acc).unsqueeze(2)
    vv = _augment(v.to(acc), normalize).unsqueeze(2)
    ld = _log_decay(log_decay, n_kv, group, acc)
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t
    # Padding at the end changes no earlier output; the final state is computed directly below.
    if pad:
        qg = torch.nn.functional.pad(qg, (0, 0, 0, pad))
        kk = torch.nn.functional.pad(kk, (0, 0, 0, pad))
        vv = torch.nn.functional.pad(vv, (0, 0, 0, pad))
    qc = qg.unflatten(3, (n, c))  # [B, Hk, G, N, C, F]
    kc = kk.unflatten(3, (n, c))  # [B, Hk, 1, N, C, F]
    vc = vv.unflatten(3, (n, c))  # [B, Hk, 1, N, C, Dv]

    i = torch.arange(c, device=q.device)
    dist = (i[:, None] - i[None, :]).to(acc)
    causal = dist >= 0
    if ld is None:
        intra_w = causal.to(acc)
        to_end = None
    else:
        ldx = ld[..., None, None, None]  # [Hk, G, 1, 1, 1]
        intra_w = torch.exp(ldx * dist.clamp(min=0)) * causal  # [Hk, G, 1, C, C]
        to_end = torch.exp(ld[..., None] * (c - 1 - i).to(acc))  # [Hk, G, C]: g^(C-1-j)
        from_start = torch.exp(ld[..., None] * (i + 1).to(acc))  # [Hk, G, C]: g^(i+1)
        chunk_decay = torch.exp(ld * c)[..., None, None]  # [Hk, G, 1, 1]

    o = ((qc @ kc.transpose(-1, -2)) * intra_w) @ vc  # intra-chunk part

    # Each chunk's own contribution to the state at its end: sum_j g^(C-1-j) k_j v_j^T.
    if to_end is None:
        local = kc.transpose(-1, -2) @ vc  # [B, Hk, 1, N, F, Dv]
    else:
        local = (kc * to_end[:, :, None, :, None]).transpose(-1, -2) @ vc  # [B, Hk, G, N, F, Dv]
    groups_s = local.shape[2]
    state = (
        initial_state.to(acc).expand(b, n_kv, groups_s, f, vv.shape[-1]).clone()
        if initial_state is not None
        else torch.zeros(b, n_kv, groups_s, f, vv.shape[-1], dtype=acc, device=q.device)
    )
    before = []
    for j in range(n):  # a short scan over chunks: each step is one [F, Dv] update per head
        before.append(state)
        state = state + local[:, :, :, j] if to_end is None else state * chunk_decay + local[:, :, :, j]
    before = torch.stack(before, dim=3)  # state before each chunk: [B, Hk, Gs, N, F, Dv]
    inter = qc @ before
    if to_end is not None:
        inter = inter * from_start[:, :, None, :, None]
    o = (o + inter).flatten(3, 4)[..., :t, :]

    final = None
    if output_final_state:
        final = _final_state(kk[..., :t, :], vv[..., :t, :], ld, initial_state, acc)
    return _finish(o, normalize, eps, q.dtype), final


def _final_state(kk, vv, ld, initial_state, acc) -> State:
    """sum_s g^(T-1-s) k_s v_s^T + g^T S0, computed in one product (no division by decays)."""
    t = kk.shape[3]
    if ld is None:
        state = kk.transpose(-1, -2) @ vv
        scale0 = None
    else:
        steps = (t - 1 - torch.arange(t, device=kk.device)).to(acc)
        state = (kk * torch.exp(ld[..., None] * steps)[..., None]).transpose(-1, -2) @ vv
        scale0 = torch.exp(ld * t)[..., None, None]
    if initial_state is not None:
        s0 = initial_state.to(acc)
        state = state + (s0 if scale0 is None else s0 * scale0)
    return state


def linear_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, *,
    log_decay: torch.Tensor | None = None, normalize: bool = True, eps: float = 1e-6, backend: str = "auto",
) -> tuple[torch.Tensor, State]:
    """One token: ``q`` is ``[B, H, 1, F]``, ``k`` ``[B, Hk, 1, F]``, ``v`` ``[B, Hk, 1, D]``.

    Returns ``(o [B, H, 1, D], new_state)``; the state is updated out of place, except when decoding
    on CUDA without gradients (``backend`` not ``torch``), where one fused Triton kernel updates it
    in place (``linear_step_triton.py``).
    """
    if (backend != "torch" and q.is_cuda and not torch.is_grad_enabled() and state.dtype == torch.float32
            and state.is_contiguous()):
        from .availability import triton_available

        if triton_available():
            from .linear_step_triton import linear_step_triton

            return linear_step_triton(q, k, v, state, log_decay=log_decay, normalize=normalize, eps=eps)
    acc = state.dtype
    n_kv = k.shape[1]
    qg = _group(q, n_kv).to(acc)  # [B, Hk, G, 1, F]
    kv = k.to(acc).transpose(-1, -2) @ _augment(v.to(acc), normalize)  # [B, Hk, F, Dv]
    kv = kv.unsqueeze(2)
    ld = _log_decay(log_decay, n_kv, qg.shape[2], acc)
    state = state + kv if ld is None else state * torch.exp(ld)[..., None, None] + kv
    o = qg @ state  # [B, Hk, G, 1, Dv]
    return _finish(o, normalize, eps, q.dtype), state


def linear_attention_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    log_decay: torch.Tensor | None = None, normalize: bool = True, eps: float = 1e-6,
    initial_state: State | None = None,
) -> tuple[torch.Tensor, State]:
    """Token by token through ``linear_attention_step`` (the decoding form, used as a reference)."""
    b, h, t, f = q.shape
    if initial_state is None:
        initial_state = empty_state(
            b, h, k.shape[1], f, v.shape[-1], decay=log_decay is not None, normalize=normalize,
            device=q.device, dtype=accum_dtype(q.dtype),
        )
    state, outs = initial_state, []
    for i in range(t):
        o, state = linear_attention_step(
            q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], state,
            log_decay=log_decay, normalize=normalize, eps=eps,
        )
        outs.append(o)
    return torch.cat(outs, dim=2), state
