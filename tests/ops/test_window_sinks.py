"""Window softmax with attention sinks (``ops/window/sinks.py``) against its float64 definition: values and
gradients, grouped heads, left padding, sequences shorter than the window or than the sinks, soft-capped scores; the
state after a prompt, the plain step and the fast decoder's ring (float8 codes too) continue it exactly."""

import pytest
import torch

from linearize.ops import window as W
from linearize.ops.window import window_softmax_sdpa
from linearize.ops.window.sinks import (settle_sinks, sink_positions, sink_ring_state, sink_window_state,
                                        sinks_window_step, window_softmax_sinks, window_softmax_sinks_sdpa)


def _scores(q, k, window, sinks, scale, key_mask, sink_q):
    """``q.k * scale`` ``[B, H, T, T]``, a sink that has left a query's window scored by ``sink_q`` where given."""
    h, t = q.shape[1], q.shape[2]
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if sink_q is None:
        return scores
    pos = torch.arange(t)
    real = torch.ones(q.shape[0], t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    is_sink = real & (real.long().cumsum(1) - 1 < sinks)
    far = (pos[:, None] - pos[None, :] >= window)[None] & is_sink[:, None, :]  # [B, T, T]
    return torch.where(far[:, None], (sink_q @ k.transpose(-1, -2)) * scale, scores)


def _own_queries(q, window, sinks, key_mask=None, seed=9):
    """Queries of the sinks' own (``sink_q``): random where every sink of the sequence has left the query's window,
    ``q`` before (the mixer's reach is past the window and the sinks, so that its sinks are scored so)."""
    b, _, t, _ = q.shape
    real = torch.ones(b, t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    last_sink = torch.where(real & (real.long().cumsum(1) <= sinks), torch.arange(t), -1).amax(1)  # [B]
    past = torch.arange(t)[None, :] - last_sink[:, None] >= window  # [B, T]
    other = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.where(past[:, None, :, None], other, q.detach()).requires_grad_(q.requires_grad)


def _definition(q, k, v, window, sinks, scale, key_mask=None, sink_q=None):
    """Dense float64 softmax: query t sees key j when 0 <= t - j < window, or j is among its sequence's first
    ``sinks`` real tokens and j <= t (scored by ``sink_q[t]`` once it has left the window, where given); padding
    keys never (a padding query: itself alone)."""
    b, h, t, _ = q.shape
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    pos = torch.arange(t)
    dist = pos[:, None] - pos[None, :]
    real = torch.ones(b, t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    rank = real.long().cumsum(1) - 1  # j's index among its sequence's real tokens
    is_sink = real & (rank < sinks)  # [B, T]
    allowed = (((dist >= 0) & (dist < window))[None] | ((dist >= 0)[None] & is_sink[:, None, :])) & real[:, None, :]
    allowed = allowed | (~real[:, :, None] & (dist == 0)[None])  # a padding query: itself
    scores = _scores(q, k, window, sinks, scale, key_mask, sink_q)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


def _inputs(b, h, hk, t, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g, dtype=torch.float64, requires_grad=True) for n in (h, hk, hk)]


@pytest.mark.parametrize("t,window,sinks", [(40, 8, 4), (40, 7, 1), (13, 16, 4), (3, 8, 4), (50, 5, 9)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("own_queries", [False, True])
def test_sinks_form_equals_the_definition_values_and_gradients(t, window, sinks, padded, own_queries):
    """``own_queries``: the sinks scored by queries of their own (``sink_q``, the reach's)."""
    q, k, v = _inputs(2, 6, 2, t)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, t, dtype=torch.bool)
        key_mask[1, :min(5, t - 1)] = False  # the second sequence left-padded
    sink_q = _own_queries(q, window, sinks, key_mask) if own_queries else None
    got = window_softmax_sinks_sdpa(q, k, v, window=window, sinks=sinks, scale=0.3, key_mask=key_mask, sink_q=sink_q)
    want = _definition(q, k, v, window, sinks, 0.3, key_mask, sink_q)
    real = torch.ones(2, t, dtype=torch.bool) if key_mask is None else key_mask
    keep = real[:, None, :, None].double()  # padding queries' outputs are the caller's to zero
    torch.testing.assert_close(got * keep, want * keep, rtol=1e-10, atol=1e-10)
    cot = torch.randn_like(want)
    inputs = (q, k, v) + ((sink_q,) if own_queries else ())
    grads = torch.autograd.grad((got * keep * cot).sum(), inputs)
    wants = torch.autograd.grad((want * keep * cot).sum(), inputs)
    for a, c in zip(grads, wants):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def test_no_sinks_is_the_window_alone_and_sinks_change_only_queries_past_the_window():
    q, k, v = _inputs(1, 4, 4, 30, seed=1)
    with torch.no_grad():
        plain = window_softmax_sdpa(q, k, v, window=6, scale=0.5)
        torch.testing.assert_close(window_softmax_sinks_sdpa(q, k, v, window=6, sinks=0, scale=0.5), plain)
        sunk = window_softmax_sinks_sdpa(q, k, v, window=6, sinks=2, scale=0.5)
    torch.testing.assert_close(sunk[:, :, :6], plain[:, :, :6])  # up to t = 5 the window holds token 0
    assert (sunk[:, :, 6:] - plain[:, :, 6:]).abs().amax(-1).min() > 0  # from t = 6 on, token 0 is a sink term


def test_sink_positions_are_each_sequences_first_real_tokens():
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    first, exists = sink_positions(mask, 3, 5, 2, "cpu")
    assert first.tolist() == [[0, 1], [2, 3], [4, 4]] and exists.tolist() == [[True, True], [True, True], [True, False]]
    first, exists = sink_positions(None, 2, 5, 3, "cpu")
    assert first.tolist() == [[0, 1, 2]] * 2 and bool(exists.all())


def _softcapped_definition(q, k, v, window, sinks, scale, softcap, key_mask=None, sink_q=None):
    """``_definition`` with Gemma 2's soft-capped scores; padding queries' outputs 0."""
    b, h, t, _ = q.shape
    scores = _scores(q, k, window, sinks, scale, key_mask, sink_q)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    pos = torch.arange(t)
    dist = pos[:, None] - pos[None, :]
    real = torch.ones(b, t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    is_sink = real & (real.long().cumsum(1) - 1 < sinks)
    allowed = (((dist >= 0) & (dist < window))[None] | ((dist >= 0)[None] & is_sink[:, None, :])) & real[:, None, :]
    allowed = allowed | (~real[:, :, None] & (dist == 0)[None])
    scores = softcap * torch.tanh(scores / softcap)
    o = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1) @ v
    return o * real[:, None, :, None]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("own_queries", [False, True])
def test_soft_capped_scores_take_the_blocks_by_hand(padded, own_queries):
    q, k, v = _inputs(2, 4, 2, 33, seed=2)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 33, dtype=torch.bool)
        key_mask[0, :6] = False
    sink_q = _own_queries(q, 7, 3, key_mask) if own_queries else None
    got = window_softmax_sinks(q, k, v, window=7, sinks=3, scale=0.4, softcap=1.5, key_mask=key_mask, sink_q=sink_q)
    want = _softcapped_definition(q, k, v, 7, 3, 0.4, 1.5, key_mask, sink_q)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, c in zip(grads, wants):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def _padded(b, t, pads):
    key_mask = torch.ones(b, t, dtype=torch.bool)
    for i, p in enumerate(pads):
        key_mask[i, :p] = False
    return key_mask


@pytest.mark.parametrize("prompt,window,sinks,pads", [
    (12, 5, 2, (0, 0)), (30, 7, 4, (0, 9)), (3, 6, 4, (0, 2)), (2, 4, 3, (1, 0)), (9, 16, 4, (0, 5)), (1, 3, 2, (0, 0))])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("own_queries", [False, True])
def test_state_plain_steps_and_ring_continue_the_prefill(prompt, window, sinks, pads, softcap, own_queries):
    """After a left-padded prompt (some shorter than the sinks: decoded tokens become their sinks), one token at a
    time from ``sink_window_state`` (the plain step) and from its ring (in place, wrapping many times) gives the
    sequence form's outputs; ``own_queries``: the sinks scored by queries of their own (the reach's)."""
    new = 3 * window + 5
    t = prompt + new
    q, k, v = (x.detach() for x in _inputs(2, 4, 2, t, seed=3))
    key_mask = _padded(2, t, pads)
    sink_q = _own_queries(q, window, sinks, key_mask) if own_queries else None
    want = _softcapped_definition(q, k, v, window, sinks, 0.4, softcap, key_mask, sink_q) if softcap else \
        _definition(q, k, v, window, sinks, 0.4, key_mask, sink_q) * key_mask[:, None, :, None]
    at = (lambda i: None) if sink_q is None else (lambda i: sink_q[:, :, i : i + 1])  # noqa: E731
    head = lambda x: x[:, :, :prompt]  # noqa: E731
    state = sink_window_state(head(k), head(v), window, sinks, key_mask[:, :prompt])
    ring = sink_ring_state(sink_window_state(head(k), head(v), window, sinks, key_mask[:, :prompt]), window)
    assert ring.keys.shape[2] == sinks + window and int(ring.slot) == sinks
    assert (ring.fill is None) == all(prompt - p >= sinks for p in pads)
    for i in range(prompt, t):
        one = [x[:, :, i : i + 1] for x in (q, k, v)]
        o, state = sinks_window_step(*one, state, window=window, scale=0.4, softcap=softcap,
                                     key_mask=key_mask[:, : i + 1], sink_q=at(i))
        o_ring, ring = W.window_softmax_step_ring(*one, ring, scale=0.4, softcap=softcap, sink_q=at(i))
        settle_sinks(ring)
        torch.testing.assert_close(o, want[:, :, i : i + 1], atol=1e-10, rtol=0)
        torch.testing.assert_close(o_ring, want[:, :, i : i + 1], atol=1e-10, rtol=0)
    assert state.window.keys.shape[2] == window and ring.keys.shape[2] == sinks + window
    assert state.fill.tolist() == [min(sinks, t - p) for p in pads]


def test_a_padding_token_in_a_continuation_is_neither_sink_nor_window_key():
    q, k, v = (x.detach() for x in _inputs(1, 2, 2, 8, seed=4))
    state = sink_window_state(k[:, :, :1], v[:, :, :1], 3, 2)
    one = [x[:, :, 1:2] for x in (q, k, v)]
    o, after = sinks_window_step(*one, state, window=3, scale=0.5, key_mask=torch.tensor([[True, False]]))
    assert torch.equal(o, torch.zeros_like(o)) and after.fill.tolist() == [1]
    assert after.window.valid.tolist() == [[False, False]]  # the sink held once, the padding not at all


def test_float8_sinks_keep_codes_and_agree_with_the_read_back_sequence_form():
    """A float8 layer's sinks are codes with their scales; its plain steps and ring give the sequence form of the
    read-back keys and values."""
    from linearize.ops.window.float8 import FLOAT8, Float8RingState, fake_quantize

    t, prompt, window, sinks = 40, 7, 5, 3
    q, k, v = (x.detach().float() for x in _inputs(2, 4, 2, t, seed=5))
    key_mask = _padded(2, t, (0, 5))
    (kr, k8, ks), (vr, v8, vs) = fake_quantize(k), fake_quantize(v)
    want = window_softmax_sinks(q, kr, vr, window=window, sinks=sinks, scale=0.4, key_mask=key_mask)
    cut = lambda x: x[:, :, :prompt]  # noqa: E731
    state = sink_window_state(cut(kr), cut(vr), window, sinks, key_mask[:, :prompt],
                              codes=(cut(k8), cut(ks), cut(v8), cut(vs)))
    assert state.keys.dtype == FLOAT8 and state.key_scale.shape == (2, 2, sinks, 1)
    ring = sink_ring_state(sink_window_state(cut(kr), cut(vr), window, sinks, key_mask[:, :prompt],
                                             codes=(cut(k8), cut(ks), cut(v8), cut(vs))), window)
    assert isinstance(ring, Float8RingState) and ring.fill is not None  # the padded prompt holds 2 real tokens
    from linearize.ops.window.float8 import float8_window_step_ring

    for i in range(prompt, t):
        one = [x[:, :, i : i + 1] for x in (q, k, v)]
        o, state = sinks_window_step(*one, state, window=window, scale=0.4, key_mask=key_mask[:, : i + 1])
        o_ring, ring = float8_window_step_ring(*one, ring, W.window_softmax_step_ring, scale=0.4)
        settle_sinks(ring)
        torch.testing.assert_close(o, want[:, :, i : i + 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(o_ring, want[:, :, i : i + 1], atol=1e-5, rtol=0)
