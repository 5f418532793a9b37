"""Softmax over each query's last ``window`` keys and its sequence's first ``sinks`` real tokens (StreamingLLM's
attention sinks), the sequence form as SDPA on blocks, with its gradient.

Why: a layer kept as the teacher's softmax over a sliding window loses, once a text outgrows the window, the first
tokens on which the teacher parks much of its attention; on the CPU stand-in of the default student
(``dev/window_sinks.py``) keeping the first 4 tokens closes 40-75 % of the loss gap to the teacher past a
1,280-token window on code and technical text, for 4 tokens of state.

Query ``t`` attends to key ``j`` when ``0 <= t - j < window`` or ``j`` is one of its sequence's first ``sinks``
real tokens (``j <= t``): each key once. Padding keys are left out; a padding query attends to itself alone (as
``window_softmax_sdpa``; callers zero its output). Not yet wired into the window mixer, its states or the decoding
steps (a ring whose first ``sinks`` slots never move).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _window_block


def sink_positions(key_mask, b: int, t: int, sinks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first ``sinks`` real positions ``[B, S]`` (long) and whether each exists (a sequence of
    fewer real tokens has fewer sinks) ``[B, S]``: positions ``0..S-1`` without ``key_mask``."""
    pos = torch.arange(t, device=device)
    if key_mask is None:
        first = pos[:sinks].expand(b, -1)
        return first, torch.ones_like(first, dtype=torch.bool)
    real_first = torch.where(key_mask.bool(), pos, t).sort(dim=1).values[:, :sinks]  # padding sorts last
    valid = real_first < t
    return real_first.clamp(max=t - 1), valid


def window_softmax_sinks_sdpa(q, k, v, *, window: int, sinks: int, scale: float, key_mask=None):
    """``[B, H, T, D]`` in ``q``'s dtype: the queries in blocks of ``C >= window - 1`` tokens, each attending to its
    own block's and the previous block's keys within the window (as ``window_softmax_sdpa``) and to the sinks that
    have left its window, all in one SDPA call per block batch."""
    from . import window_softmax_sdpa

    if sinks <= 0:
        return window_softmax_sdpa(q, k, v, window=window, scale=scale, key_mask=key_mask)
    b, h, t, d = q.shape
    n_kv = k.shape[1]
    s = min(sinks, t)
    c = _window_block(window)
    n = -(-t // c)
    pad = n * c - t
    k, v = k.to(q.dtype), v.to(q.dtype)
    first, exists = sink_positions(key_mask, b, t, s, q.device)  # [B, S]
    gather = lambda x: x.gather(2, first[:, None, :, None].expand(b, n_kv, s, x.shape[-1]))  # noqa: E731
    ks, vs = gather(k), gather(v)  # [B, Hk, S, D]
    blocks = lambda x: F.pad(x, (0, 0, 0, pad)).unflatten(2, (n, c)).transpose(1, 2)  # noqa: E731  [B, N, H, C, D]
    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    before = lambda x: F.pad(x, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]  # noqa: E731  the previous block (zeros first)
    sink = lambda x: x[:, None].expand(b, n, n_kv, s, x.shape[-1])  # noqa: E731
    kb = torch.cat([before(kb), kb, sink(ks)], dim=3)  # [B, N, Hk, 2C + S, D]
    vb = torch.cat([before(vb), vb, sink(vs)], dim=3)
    pos = torch.arange(n * c, device=q.device).view(n, c)
    key_pos = torch.cat([pos - c, pos], dim=1)  # [N, 2C]
    dist = pos[:, :, None] - key_pos[:, None, :]  # [N, C, 2C]
    near = (dist >= 0) & (dist < window) & (key_pos >= 0)[:, None, :]
    near = near[None].expand(b, n, c, 2 * c)
    if key_mask is not None:
        real = F.pad(key_mask.bool(), (c, pad))  # [B, C + N C]: position p at p + C
        near = near & real[:, key_pos + c][:, :, None, :]
    sink_dist = pos[None, :, :, None] - first[:, None, None, :]  # [B, N, C, S]
    far = (sink_dist >= window) & exists[:, None, None, :]  # left the window (within it: a window key already)
    if key_mask is not None:
        query_real = F.pad(key_mask.bool(), (0, pad)).view(b, n, c)
        far = far & query_real[..., None]  # a padding query sees no sink
    allowed = torch.cat([near | (dist == 0)[None], far], dim=-1).reshape(b * n, 1, c, 2 * c + s)
    o = F.scaled_dot_product_attention(qb.reshape(b * n, h, c, d), kb.reshape(b * n, n_kv, 2 * c + s, d),
                                       vb.reshape(b * n, n_kv, 2 * c + s, v.shape[-1]), attn_mask=allowed, scale=scale,
                                       enable_gqa=n_kv != h)
    return o.view(b, n, h, c, -1).transpose(1, 2).flatten(2, 3)[:, :, :t]


__all__ = ["sink_positions", "window_softmax_sinks_sdpa"]
