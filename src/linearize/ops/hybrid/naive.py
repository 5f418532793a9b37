"""The quadratic references of the LoLCATs hybrid (``ops/hybrid/__init__.py`` has the math), the
definitions the other forms are tested against in float64: ``hybrid_attention_naive`` through its
attention weights ``[B, H, T, T]`` (``hybrid_attention_weights``, also LoLCATs' optional loss on
attention weights), and ``sparse_hybrid_attention_naive``, the sparse cache's definition simulated
literally (sets of positions evolving token by token, explicit sums)."""

from __future__ import annotations

import torch

from ..linear_attention import _group, accum_dtype
from .shared import _mix_shape, _normalise, _real_keys, _scores
from .sparse_select import PRIORITY_GRID, _check


def hybrid_attention_weights(q, k, qf, kf, gamma, *, window: int, scale: float, softcap: float | None = None,
                             key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None,
                             mix: torch.Tensor | None = None):
    """The hybrid's attention weights ``[B, H, T, T]`` (rows sum to one; zero for a padding query).
    ``mix`` ``[H]``: the window and linear terms normalised apart and mixed (see ``_mixed``).

    Quadratic: for the reference form and for LoLCATs' optional cross-entropy on attention weights.
    """
    acc = accum_dtype(q.dtype)
    n_kv, t = k.shape[1], q.shape[2]
    if key_mask is not None:
        (kf,) = _real_keys(key_mask, kf)
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    kk, kff = (x.to(acc).unsqueeze(2) for x in (k, kf))
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    pos = torch.arange(t, device=q.device)
    dist = pos[:, None] - pos[None, :]
    in_window = (dist >= 0) & (dist < window)
    older = dist >= window
    if key_mask is not None:
        in_window = in_window & key_mask[:, None, None, None, :]
    scores = _scores(qg, kk, scale, softcap)
    neg = torch.finfo(scores.dtype).min
    c = scores.masked_fill(~in_window, neg).amax(dim=-1, keepdim=True)
    a = g * torch.exp(scores.masked_fill(~in_window, neg) - c) * in_window
    linear = (qfg @ kff.transpose(-1, -2)) * older
    if log_gate is not None:
        linear = linear * _fade(log_gate.to(acc), window, older)
    if mix is None:
        a = _normalise(a + linear, (a + linear).sum(dim=-1, keepdim=True))
    else:
        den = linear.sum(dim=-1, keepdim=True)
        m = _mix_shape(mix, n_kv, 2, acc) * (den > 0)
        a = (1 - m) * _normalise(a, a.sum(dim=-1, keepdim=True)) + m * _normalise(linear, den)
    b, hk, grp = a.shape[:3]
    return a.reshape(b, hk * grp, t, t)


def _fade(log_gate, window: int, older):
    """``[B, Hk, 1, T, T]``: ``exp(G_t - G_{s+w})`` where key ``s`` is older than query ``t``'s window
    (``G`` the cumulative log gates), 0 elsewhere."""
    t = log_gate.shape[-1]
    cum = log_gate.cumsum(-1)
    # G at s + w for each key s (keys that never leave the window within T: any finite value)
    left = torch.nn.functional.pad(cum[..., window:], (0, min(window, t)))
    diff = cum[..., :, None] - left[..., None, :]
    return torch.where(older, diff, torch.full_like(diff, float("-inf"))).exp().unsqueeze(2)


def hybrid_attention_naive(q, k, qf, kf, v, gamma, *, window: int, scale: float, softcap: float | None = None,
                           key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None,
                           mix: torch.Tensor | None = None):
    """The quadratic reference. Returns ``[B, H, T, D]``.

    ``key_mask`` ``[B, T]`` (True = real token) leaves padding out of every query's sums; a padding
    query's own output is zero.
    """
    weights = hybrid_attention_weights(q, k, qf, kf, gamma, window=window, scale=scale, softcap=softcap,
                                       key_mask=key_mask, log_gate=log_gate, mix=mix)
    (v,) = _real_keys(key_mask, v)
    n_kv = k.shape[1]
    b, h, t, _ = weights.shape
    y = weights.view(b, n_kv, h // n_kv, t, t) @ v.to(weights.dtype).unsqueeze(2)
    return y.reshape(b, h, t, -1).to(q.dtype)


def _on_grid(x: torch.Tensor) -> float:
    """A priority rounded to ``PRIORITY_GRID`` as the batched forms round theirs."""
    return float(torch.round(x / PRIORITY_GRID) * PRIORITY_GRID)


def sparse_hybrid_attention_naive(q, k, qf, kf, v, gamma, *, window: int, cache_size: int, scale: float,
                                  softcap: float | None = None, key_mask: torch.Tensor | None = None,
                                  priority: str = "recall", anchor: str = "joint",
                                  log_gate: torch.Tensor | None = None):
    """The definition, literally: per sequence and key head, sets of positions (window, cache,
    folded) evolve token by token, and every output is an explicit sum (a folded token ``s`` weighs
    ``exp(L_t - L_{s+w})`` in query t's and the boundary's sums under gates). Slow (Python loops over
    tokens): for tests. Returns ``[B, H, T, D]``."""
    _check(priority, anchor)
    acc = accum_dtype(q.dtype)
    b, n_kv, t, d = k.shape
    group = q.shape[1] // n_kv
    w, cap = window, cache_size
    real = key_mask if key_mask is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
    real_l = real.tolist()
    out_dtype = q.dtype
    q, k, qf, kf, v = (x.to(acc) for x in (q, k, qf, kf, v))
    gamma = gamma.to(acc)
    cum = log_gate.to(acc).cumsum(-1) if log_gate is not None else None  # L: [B, Hk, T]
    rows = []
    for bi in range(b):
        heads = []
        for hk in range(n_kv):
            cached, folded, pri, origin = [], [], {}, None

            def fade(now):  # each folded token's weight in the linear state after time ``now``
                if cum is None:
                    return torch.ones(len(folded), dtype=acc, device=q.device)
                starts = torch.tensor(folded, dtype=torch.long, device=q.device) + w
                return torch.exp(cum[bi, hk, now] - cum[bi, hk, starts])
            outs = []
            for ti in range(t):
                if origin is None and real_l[bi][ti]:
                    origin = ti
                rel = ti - origin if origin is not None else -1
                if rel >= w and rel % w == 0:  # a boundary: priorities against the folded tokens
                    with torch.no_grad():
                        fk = kf[bi, hk, folded] * fade(ti - 1)[:, None]  # the state after time ti - 1
                        num, den = fk.T @ v[bi, hk, folded], fk.sum(0)
                        cands = cached + [s for s in range(ti - w, ti) if real_l[bi][s]]
                        unit = {s: v[bi, hk, s] / v[bi, hk, s].norm().clamp_min(torch.finfo(acc).tiny) for s in cands}
                        for s in cands:
                            if priority == "first":  # the older, the higher
                                pri[s] = -float(s - origin)
                                continue
                            if priority == "novelty":  # the most similar other candidate's cosine, negated
                                pri[s] = -max((_on_grid(unit[s] @ unit[y]) for y in cands if y != s), default=-1.0)
                                continue
                            f_s = kf[bi, hk, s]
                            dn = f_s @ den
                            read = (f_s @ num) / dn if dn > 0 else torch.zeros_like(v[bi, hk, s])
                            pri[s] = _on_grid((v[bi, hk, s] - read).norm())
                s = ti - w
                if s >= 0 and real_l[bi][s]:  # the oldest window token leaves
                    cached.append(s)
                    if len(cached) > cap:
                        victim = min(cached, key=lambda x: (pri[x], x))
                        cached.remove(victim)
                        folded.append(victim)
                if not real_l[bi][ti]:
                    outs.append(torch.zeros(group, d, dtype=acc, device=q.device))
                    continue
                in_window = [x for x in range(max(0, ti - w + 1), ti + 1) if real_l[bi][x]]
                soft = in_window + cached
                per_head = []
                for gi in range(group):
                    hq = hk * group + gi
                    sc = _scores(q[bi, hq, ti][None], k[bi, hk, soft], scale, softcap)[0]
                    a_soft = gamma[hq] * torch.exp(sc - sc.max())
                    a_lin = (kf[bi, hk, folded] @ qf[bi, hq, ti]) * fade(ti)
                    if anchor == "window":  # the linear terms against the window's largest score
                        a_lin = a_lin * torch.exp(sc[: len(in_window)].max() - sc.max())
                    num = a_soft @ v[bi, hk, soft] + a_lin @ v[bi, hk, folded]
                    per_head.append(num / (a_soft.sum() + a_lin.sum()))
                outs.append(torch.stack(per_head))
            heads.append(torch.stack(outs, dim=1))  # [G, T, D]
        rows.append(torch.cat(heads))
    return torch.stack(rows).to(out_dtype)
