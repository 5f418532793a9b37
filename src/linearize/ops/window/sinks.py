"""Softmax over each query's last ``window`` keys and its sequence's first ``sinks`` real tokens (StreamingLLM's
attention sinks): a window-softmax layer's ``spec.softmax_window_sinks``.

Why: a layer kept as the teacher's softmax over a sliding window loses, once a text outgrows the window, the first
tokens on which the teacher parks much of its attention. Keeping the first 4 tokens brought a trained student's code
perplexity at 4k-8k tokens from 1.24x to 1.12x the teacher's (14 layers over 1,280 tokens; docs/RESULTS.md), for 4
tokens of state.

Query ``t`` attends to key ``j`` when ``0 <= t - j < window`` or ``j`` is one of its sequence's first ``sinks``
real tokens (``j <= t``): each key once. Padding keys are left out; a padding query outputs zero.

**Reach.** Every form takes ``sink_q``, queries of the sinks' own (like ``q``, rotated): the sinks that have left a
query's window are scored by it instead of ``q`` (a sink still inside the window is a window key; the steps and
rings score their sink slots by ``sink_q`` throughout, so the caller keeps ``sink_q = q`` until every sink has
left the window). The window layer (``mixers/window.py``) passes each query rotated as if it stood at
``min(p, reach)``, ``reach`` the teacher's context less one: past it, the sinks' distance grows beyond anything
the teacher's RoPE saw: a trained student's perplexity at 16k-32k tokens was up to 8x its own at 1k-4k; scored from
the reach, no more than it (docs/RESULTS.md, "Across domains"). The window's own scores are relative and need
nothing. The Triton kernels that rotate q themselves (the prefill's and the ring step's) also make these queries
from q and the reach's tables (``sink_rope``), with no pass over q before them.

* ``window_softmax_sinks``: the sequence form, the queries in blocks with the sinks appended to each block's keys
  (SDPA; soft-capped scores by hand), with its gradient; without one on CUDA the window's Triton kernel, which
  weighs the sinks first (``parallel_triton.py``);
* ``SinkWindowState`` (``sink_window_state``): after a prompt, the window's last ``window`` tokens (the sinks
  among them marked not valid: they are held once, as sinks) and the sinks, float8 codes too;
  ``sinks_window_step``: one token from it (a sequence's first real tokens become its sinks as they come);
* the fast decoder's ring (``sink_ring_state``): ``S + W`` slots, the first ``S`` the sinks, which never move, the
  ring the others (``RingHybridState.advance``); the steps write and attend as on any ring, then
  ``settle_sinks`` moves the new token into a sink slot while some sequence still lacks sinks (``fill``), which
  only prompts of fewer than ``S`` real tokens leave to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..hybrid import HybridState, RingHybridState
from ..hybrid.shared import _scores
from ..linear_attention import accum_dtype
from . import _window_block, attend_slots, window_state
from .float8 import FLOAT8, dequantize, float8_window_state, quantize


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


def _sinks_blocks(q, k, v, window: int, sinks: int, key_mask, sink_q=None):
    """The queries in blocks of ``C >= window - 1`` tokens ``[B N, H, C, D]``, each with its own and the previous
    block's keys and values and the ``S`` sinks' ``[B N, Hk, 2C + S, D]``, and which it may see ``[B N, 1, C, 2C + S]``
    (a window key within the window, a sink once it has left it; a padding query itself alone).

    With ``sink_q`` (the queries that score the sinks: ``WindowSoftmax._sink_queries``) queries and keys are twice as wide:
    ``[q, sink_q]`` against ``[k, 0]`` for the window's keys and ``[0, k]`` for the sinks'."""
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
    if sink_q is not None:
        q = torch.cat([q, sink_q.to(q.dtype)], dim=-1)
        k = torch.cat([k, torch.zeros_like(k)], dim=-1)
        ks = torch.cat([torch.zeros_like(ks), ks], dim=-1)
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
    flat = lambda x: x.reshape(b * n, x.shape[2], x.shape[3], x.shape[4])  # noqa: E731
    return flat(qb), flat(kb), flat(vb), allowed, n, c


def sink_index(key_mask, b: int, t: int, sinks: int, device) -> torch.Tensor:
    """Each sequence's first ``sinks`` real positions ``[B, min(sinks, T)]`` (long), -1 where a sequence has fewer:
    what the prefill kernel takes (``parallel_triton.window_softmax_triton``'s ``sink_positions``)."""
    first, exists = sink_positions(key_mask, b, t, min(sinks, t), device)
    return torch.where(exists, first, -1)


def window_softmax_sinks_sdpa(q, k, v, *, window: int, sinks: int, scale: float, key_mask=None, sink_q=None):
    """``[B, H, T, D]`` in ``q``'s dtype (padding queries: whatever SDPA gives a query that sees itself alone): the
    queries in blocks of ``C >= window - 1`` tokens, each attending to its own block's and the previous block's keys
    within the window (as ``window_softmax_sdpa``) and to the sinks that have left its window (scored by ``sink_q``
    where given), all in one SDPA call per block batch."""
    from . import window_softmax_sdpa

    if sinks <= 0:
        return window_softmax_sdpa(q, k, v, window=window, scale=scale, key_mask=key_mask)
    b, h, t, d = q.shape
    qb, kb, vb, allowed, n, c = _sinks_blocks(q, k, v, window, sinks, key_mask, sink_q)
    if qb.shape[-1] != vb.shape[-1]:  # widened queries and keys (sink_q): values padded to their width
        vb = F.pad(vb, (0, qb.shape[-1] - vb.shape[-1]))
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scale, enable_gqa=kb.shape[1] != h)
    return o[..., :d].reshape(b, n, h, c, d).transpose(1, 2).flatten(2, 3)[:, :, :t]


def window_softmax_sinks(q, k, v, *, window: int, sinks: int, scale: float, softcap: float | None = None,
                         key_mask=None, sink_q=None):
    """The window-softmax layer's sequence form with ``sinks`` (see the module; ``sink_q``: the queries that score
    the sinks, ``WindowSoftmax._sink_queries``): without a gradient on CUDA one Triton launch (``parallel_triton.py``), else SDPA
    on blocks, or with soft-capped scores (Gemma 2) the same blocks by hand in fp32. ``[B, H, T, D]`` in ``q``'s
    dtype; padding queries output 0."""
    from . import _use_window_triton

    if _use_window_triton(q, k, v, window):  # without a gradient, on CUDA: one launch
        from .parallel_triton import window_softmax_triton

        return window_softmax_triton(q, k, v, window=window, scale=scale, softcap=softcap, key_mask=key_mask,
                                     sink_positions=sink_index(key_mask, q.shape[0], q.shape[2], sinks, q.device),
                                     sink_q=sink_q)
    if softcap is None:
        o = window_softmax_sinks_sdpa(q, k, v, window=window, sinks=sinks, scale=scale, key_mask=key_mask,
                                      sink_q=sink_q)
    else:
        b, h, t, _ = q.shape
        qb, kb, vb, allowed, n, c = _sinks_blocks(q, k, v, window, sinks, key_mask, sink_q)
        acc = accum_dtype(q.dtype)
        grp = h // kb.shape[1]
        kb, vb = (x.repeat_interleave(grp, dim=1).to(acc) for x in (kb, vb))
        scores = _scores(qb.to(acc), kb, scale, softcap).masked_fill(~allowed, torch.finfo(acc).min)
        o = (torch.softmax(scores, dim=-1) @ vb).to(q.dtype)
        o = o.view(b, n, h, c, -1).transpose(1, 2).flatten(2, 3)[:, :, :t]
    return o if key_mask is None else o * key_mask[:, None, :, None]


@dataclass
class SinkWindowState:
    """A window layer's decoding state with sinks (the plain loop's and the cache's; the fast decoder turns it into
    a ring, ``sink_ring_state``). ``window``: the last ``window`` tokens as ``window_state`` keeps them (a
    ``Float8WindowState`` for float8 layers), each sink among them marked not valid; ``keys``/``values``
    ``[B, Hk, S, D]`` (float8 codes, with ``key_scale``/``value_scale`` ``[B, Hk, S, 1]``) and ``valid`` ``[B, S]``:
    the sinks held; ``fill`` ``[B]`` long: how many."""

    window: HybridState
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    fill: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def float8(self) -> bool:
        return self.key_scale is not None

    def _own(self) -> tuple[torch.Tensor, ...]:
        scales = (self.key_scale, self.value_scale) if self.float8 else ()
        return (self.keys, self.values, self.valid, self.fill, *scales)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.window.tensors(), *self._own())

    def map(self, fn) -> "SinkWindowState":
        return SinkWindowState(self.window.map(fn), *(fn(x) for x in self._own()))

    @classmethod
    def cat(cls, states: list["SinkWindowState"]) -> "SinkWindowState":
        """The states of consecutive slices of a batch as one."""
        kind = type(states[0].window)
        window = kind(*(torch.cat(xs) for xs in zip(*(s.window.tensors() for s in states))))
        return cls(window, *(torch.cat(xs) for xs in zip(*(s._own() for s in states))))

    def read(self, dtype) -> tuple[HybridState, torch.Tensor, torch.Tensor]:
        """The window (an exact layer's state) and the sinks' keys and values, read back in ``dtype``."""
        if not self.float8:
            return self.window, self.keys, self.values
        return (self.window.read(dtype), dequantize(self.keys, self.key_scale, dtype),
                dequantize(self.values, self.value_scale, dtype))


def sink_window_state(k, v, window: int, sinks: int, key_mask=None, codes=None) -> SinkWindowState:
    """The state after a prompt of keys ``k`` (rotated) and values ``v`` ``[B, Hk, T, D]`` (a float8 layer's read
    back, with ``codes`` ``(k8, ks, v8, vs)``, the whole prompt's codes and scales): its first ``sinks`` real
    tokens (fewer where a sequence has fewer) and its last ``window`` tokens but those."""
    b, n_kv, t, d = k.shape
    s = min(sinks, t)
    first, exists = sink_positions(key_mask, b, t, s, k.device)  # [B, s]
    real = torch.ones(b, t, dtype=torch.bool, device=k.device) if key_mask is None else key_mask.bool()
    held = real & (real.long().cumsum(1) <= s)  # the sinks, held once: as sinks, not in the window
    win = window_state(k, v, window, real & ~held)
    pad = sinks - s  # slots for sinks still to come (a prompt shorter than the sinks)
    keep = exists[:, None, :, None]

    def take(x):  # [B, Hk, T, .] -> the sinks' [B, Hk, S, .], zero where none
        got = x.gather(2, first[:, None, :, None].expand(b, n_kv, s, x.shape[-1]))
        got = torch.where(keep, got, torch.zeros((), dtype=got.dtype, device=got.device))
        return F.pad(got, (0, 0, 0, pad)).contiguous()

    valid = F.pad(exists, (0, pad)).contiguous()
    fill = exists.sum(1)
    if codes is None:
        return SinkWindowState(win, take(k), take(v), valid, fill)
    k8, ks, v8, vs = codes
    win = float8_window_state(win, k8, ks, v8, vs)
    code = lambda x: take(x.view(torch.uint8)).view(FLOAT8)  # noqa: E731
    return SinkWindowState(win, code(k8), code(v8), valid, fill, key_scale=take(ks), value_scale=take(vs))


def _put(buf, at, x, where):
    """``buf`` ``[B, Hk, S, .]`` with ``x`` ``[B, Hk, 1, .]`` in slot ``at[b]`` of each sequence where ``where[b]``
    (a new tensor; float8 codes as bytes)."""
    raw = buf.view(torch.uint8) if buf.dtype == FLOAT8 else buf
    new = x.view(torch.uint8) if x.dtype == FLOAT8 else x.to(raw.dtype)
    slot = torch.arange(buf.shape[2], device=buf.device)[None, :] == at[:, None]  # [B, S]
    out = torch.where((slot & where[:, None])[:, None, :, None], new, raw)
    return out.view(FLOAT8) if buf.dtype == FLOAT8 else out


def sinks_window_step(q, k, v, state: SinkWindowState, *, window: int, scale: float, softcap=None, key_mask=None,
                      sink_q=None):
    """One token (``T = 1``; q and k rotated) from ``state``: ``(o [B, H, 1, D], new_state)``. A sequence's real
    token becomes one of its sinks while it holds fewer than ``S`` (the window then keeps it as padding), else it
    enters the window; the query sees the sinks held (scored by ``sink_q`` where given) and the window."""
    from . import window_softmax_step
    from .float8 import float8_window_step

    b, n_sinks = q.shape[0], state.keys.shape[2]
    real = (torch.ones(b, dtype=torch.bool, device=q.device) if key_mask is None
            else key_mask[:, -1].to(device=q.device, dtype=torch.bool))
    sink = real & (state.fill < n_sinks)
    kw = dict(window=window, scale=scale, softcap=softcap, key_mask=(real & ~sink)[:, None])
    at = state.fill.clamp(max=max(n_sinks - 1, 0))
    if state.float8:
        _, win = float8_window_step(q, k, v, state.window, window_softmax_step, **kw)
        k8, ks = quantize(k)
        v8, vs = quantize(v)
        new = SinkWindowState(win, _put(state.keys, at, k8, sink), _put(state.values, at, v8, sink), state.valid,
                              state.fill, key_scale=_put(state.key_scale, at, ks, sink),
                              value_scale=_put(state.value_scale, at, vs, sink))
    else:
        _, win = window_softmax_step(q, k, v, state.window, **kw)
        new = SinkWindowState(win, _put(state.keys, at, k, sink), _put(state.values, at, v, sink), state.valid,
                              state.fill)
    slots = torch.arange(n_sinks, device=q.device)[None, :] == at[:, None]
    new.valid = state.valid | (slots & sink[:, None])
    new.fill = state.fill + sink.long()
    window_read, sink_keys, sink_values = new.read(q.dtype)
    keys = torch.cat([sink_keys.to(window_read.keys.dtype), window_read.keys], dim=2)
    values = torch.cat([sink_values.to(window_read.values.dtype), window_read.values], dim=2)
    o = attend_slots(q, keys, values, torch.cat([new.valid, window_read.valid], dim=1), scale, softcap, sink_q,
                     n_sinks)
    return o * real[:, None, None, None], new


def sink_ring_state(state: SinkWindowState, window: int):
    """The fast decoder's ring from a prompt's ``SinkWindowState`` (whose buffers it may take over): ``S + window``
    slots, the sinks first (they never move), then the window oldest first (empty slots in front); ``slot = S``.
    ``fill`` is kept only while some sequence lacks sinks (asked once, here)."""
    from .float8 import Float8RingState

    n_sinks = state.keys.shape[2]
    if state.float8:
        ring = Float8RingState.from_state(state.window, window, copy=False)
    else:
        ring = RingHybridState.from_state(state.window, window, keep_key_features=False, copy=False)

    def front(sinks, ring_part):  # the sinks' slots, then the ring's (float8 codes joined as bytes)
        if sinks.dtype == FLOAT8:
            return torch.cat([sinks.view(torch.uint8), ring_part.view(torch.uint8)], dim=2).view(FLOAT8).contiguous()
        return torch.cat([sinks, ring_part.to(sinks.dtype)], dim=2).contiguous()

    keys, values = front(state.keys, ring.keys), front(state.values, ring.values)
    valid = torch.cat([state.valid, ring.valid], dim=1).contiguous()
    slot = torch.full((), n_sinks, dtype=torch.long, device=keys.device)
    fill = state.fill.clone() if bool((state.fill < n_sinks).any()) else None
    if state.float8:
        scales = [torch.cat([a, b], dim=2).contiguous() for a, b in ((state.key_scale, ring.key_scale),
                                                                      (state.value_scale, ring.value_scale))]
        return Float8RingState(keys, ring.key_features, values, ring.linear, valid, slot=slot, sinks=n_sinks,
                               fill=fill, key_scale=scales[0], value_scale=scales[1])
    return RingHybridState(keys, ring.key_features, values, ring.linear, valid, slot=slot, sinks=n_sinks, fill=fill)


def settle_sinks(state: RingHybridState) -> None:
    """After a ring step (the new token written in the slot before ``state.slot``): in each sequence that holds
    fewer than ``S`` sinks, the new token moves to sink slot ``fill`` (its ring slot emptied). In place, no host
    sync; nothing once every sequence has its sinks (``fill`` None)."""
    if state.fill is None:
        return
    n_sinks, n = state.sinks, state.keys.shape[2]
    b = state.keys.shape[0]
    prev = (state.slot - n_sinks - 1).remainder(n - n_sinks) + n_sinks  # 0-d
    at = prev.view(1).expand(b)
    take = (state.fill < n_sinks) & state.valid.gather(1, at[:, None]).squeeze(1)
    dst = torch.where(take, state.fill, at)
    rows = torch.arange(b, device=state.keys.device)
    bufs = [state.keys, state.values]
    if getattr(state, "key_scale", None) is not None:
        bufs += [state.key_scale, state.value_scale]
    for buf in bufs:
        raw = buf.view(torch.uint8) if buf.dtype == FLOAT8 else buf
        raw[rows, :, dst] = raw.index_select(2, prev.view(1)).squeeze(2)
    state.valid[rows, dst] = state.valid[rows, dst] | take
    state.valid[rows, at] = state.valid[rows, at] & ~take
    state.fill.add_(take.long())


__all__ = ["SinkWindowState", "settle_sinks", "sink_index", "sink_positions", "sink_ring_state", "sink_window_state",
           "sinks_window_step", "window_softmax_sinks", "window_softmax_sinks_sdpa"]
