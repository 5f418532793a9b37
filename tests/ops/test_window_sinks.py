"""Window softmax with attention sinks (``ops/window/sinks.py``) against its float64 definition: values and
gradients, grouped heads, left padding, sequences shorter than the window or than the sinks."""

import pytest
import torch

from linearize.ops.window import window_softmax_sdpa
from linearize.ops.window.sinks import sink_positions, window_softmax_sinks_sdpa


def _definition(q, k, v, window, sinks, scale, key_mask=None):
    """Dense float64 softmax: query t sees key j when 0 <= t - j < window, or j is among its sequence's first
    ``sinks`` real tokens and j <= t; padding keys never (a padding query: itself alone)."""
    b, h, t, _ = q.shape
    k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    pos = torch.arange(t)
    dist = pos[:, None] - pos[None, :]
    real = torch.ones(b, t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    rank = real.long().cumsum(1) - 1  # j's index among its sequence's real tokens
    is_sink = real & (rank < sinks)  # [B, T]
    allowed = (((dist >= 0) & (dist < window))[None] | ((dist >= 0)[None] & is_sink[:, None, :])) & real[:, None, :]
    allowed = allowed | (~real[:, :, None] & (dist == 0)[None])  # a padding query: itself
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


def _inputs(b, h, hk, t, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g, dtype=torch.float64, requires_grad=True) for n in (h, hk, hk)]


@pytest.mark.parametrize("t,window,sinks", [(40, 8, 4), (40, 7, 1), (13, 16, 4), (3, 8, 4), (50, 5, 9)])
@pytest.mark.parametrize("padded", [False, True])
def test_sinks_form_equals_the_definition_values_and_gradients(t, window, sinks, padded):
    q, k, v = _inputs(2, 6, 2, t)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, t, dtype=torch.bool)
        key_mask[1, :min(5, t - 1)] = False  # the second sequence left-padded
    got = window_softmax_sinks_sdpa(q, k, v, window=window, sinks=sinks, scale=0.3, key_mask=key_mask)
    want = _definition(q, k, v, window, sinks, 0.3, key_mask)
    real = torch.ones(2, t, dtype=torch.bool) if key_mask is None else key_mask
    keep = real[:, None, :, None].double()  # padding queries' outputs are the caller's to zero
    torch.testing.assert_close(got * keep, want * keep, rtol=1e-10, atol=1e-10)
    cot = torch.randn_like(want)
    grads = torch.autograd.grad((got * keep * cot).sum(), (q, k, v))
    wants = torch.autograd.grad((want * keep * cot).sum(), (q, k, v))
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
