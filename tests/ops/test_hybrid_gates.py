"""The hybrid's gated linear state (``log_gate``) and its separately normalised terms (``mix``): naive =
chunked = recurrent = ring step in float64, values and gradients (the gates' and the mix's too), GQA/MQA,
padding, lengths off the chunk, gates and mixes at their extremes."""

import pytest
import torch

from helpers import random_grads

from linearize import ops

TOL = 1e-10
SHAPES = [(2, 4, 4, 37), (2, 6, 2, 21), (1, 4, 1, 16), (2, 6, 3, 1), (1, 2, 1, 5)]


def _inputs(b, h, hk, t, d=4, f=6, seed=0, strength=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, h, t, d), r(b, hk, t, d), r(b, h, t, f).exp() * 0.3, r(b, hk, t, f).exp() * 0.3, r(b, hk, t, d)]
    gamma = torch.sigmoid(r(h))
    log_gate = -strength * torch.nn.functional.softplus(r(b, hk, t))  # data-dependent, <= 0
    mix = torch.sigmoid(r(h))
    for x in xs + [gamma, log_gate, mix]:
        x.requires_grad_(True)
    return xs, gamma, log_gate, mix


def _close(a, b, tol=TOL):
    assert torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 8, 64])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("options", ["gates", "mix", "gates+mix"])
def test_gated_hybrid_forms_agree(shape, window, softcap, options):
    b, h, hk, t = shape
    xs, gamma, lg, mix = _inputs(b, h, hk, t)
    kw = dict(window=window, scale=0.5, softcap=softcap, log_gate=lg if "gates" in options else None,
              mix=mix if "mix" in options else None)
    ref = ops.hybrid_attention_naive(*xs, gamma, **kw)
    chunked, s_chunk = ops.hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    rec, s_rec = ops.hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(chunked, ref)
    _close(rec, ref)
    for a, b_ in zip(s_chunk.tensors(), s_rec.tensors()):
        assert torch.equal(a, b_) if a.dtype == torch.bool else torch.allclose(a, b_, atol=TOL, rtol=0)
    inputs = (*xs, gamma, lg, mix)
    for g_ref, g_chunk, g_rec in zip(random_grads(ref, inputs), random_grads(chunked, inputs),
                                     random_grads(rec, inputs)):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)


def test_gates_matter_and_none_is_one():
    """Gates of 1 (log 0) are the ungated hybrid exactly; gates below 1 change the output once keys
    have left the window (a test that could not fail otherwise)."""
    xs, gamma, lg, _ = _inputs(2, 6, 2, 29)
    kw = dict(window=4, scale=0.5)
    plain = ops.hybrid_attention_chunked(*xs, gamma, **kw)[0]
    _close(ops.hybrid_attention_chunked(*xs, gamma, **kw, log_gate=torch.zeros_like(lg))[0], plain)
    _close(ops.hybrid_attention_naive(*xs, gamma, **kw, log_gate=torch.zeros_like(lg)), plain)
    gated = ops.hybrid_attention_chunked(*xs, gamma, **kw, log_gate=lg)[0]
    _close(gated[:, :, :5], plain[:, :, :5])  # nothing has faded before a key has left the window for a step
    assert (gated - plain).abs().max() > 1e-3


def test_gates_at_their_extremes():
    """A closed gate (log g = -60) leaves in the linear state only the key that left the window this
    very step: the hybrid then equals softmax over the window plus that one linear term."""
    xs, gamma, lg, _ = _inputs(1, 4, 2, 26)
    q, k, qf, kf, v = xs
    w = 5
    closed = torch.full_like(lg, -60.0)
    out = ops.hybrid_attention_chunked(*xs, gamma, window=w, scale=0.5, log_gate=closed)[0]
    t = q.shape[2]
    # reference: window softmax + linear term of key t - w only, one shared normaliser
    kr, vr, kfr = (x.repeat_interleave(2, 1) for x in (k, v, kf))
    s = (q @ kr.transpose(-1, -2)) * 0.5
    pos = torch.arange(t)
    dist = pos[:, None] - pos[None, :]
    inwin = (dist >= 0) & (dist < w)
    c = s.masked_fill(~inwin, -1e30).amax(-1, keepdim=True)
    a = gamma[None, :, None, None] * torch.exp(s - c) * inwin + (qf @ kfr.transpose(-1, -2)) * (dist == w)
    ref = (a @ vr) / a.sum(-1, keepdim=True)
    _close(out, ref, 1e-9)


def test_gated_final_state_matches_stepping_on_long_sequences():
    """Over many chunks the chunked form's state (its running sum) and outputs stay equal to the
    recurrent form's: the in-chunk sums keep their precision."""
    xs, gamma, lg, _ = _inputs(1, 2, 1, 300, seed=4, strength=0.02)
    kw = dict(window=8, scale=0.5, log_gate=lg)
    chunked, s_chunk = ops.hybrid_attention_chunked(*xs, gamma, **kw, output_final_state=True)
    rec, s_rec = ops.hybrid_attention_recurrent(*xs, gamma, **kw)
    _close(chunked, rec)
    _close(s_chunk.linear, s_rec.linear)


@pytest.mark.parametrize("window", [3, 8])
def test_gated_left_padding_is_invisible(window):
    xs, gamma, lg, mix = _inputs(2, 4, 2, 19)
    pad = 5
    kw = dict(window=window, scale=0.5, mix=mix)
    key_mask = torch.ones(2, 19, dtype=torch.bool)
    key_mask[1, :pad] = False
    ref = ops.hybrid_attention_naive(*xs, gamma, **kw, key_mask=key_mask, log_gate=lg)
    chunked, s_chunk = ops.hybrid_attention_chunked(*xs, gamma, **kw, key_mask=key_mask, log_gate=lg,
                                                    output_final_state=True)
    rec, _ = ops.hybrid_attention_recurrent(*xs, gamma, **kw, key_mask=key_mask, log_gate=lg)
    _close(chunked, ref)
    _close(rec, ref)
    alone = ops.hybrid_attention_naive(*(x[1:, :, pad:] for x in xs), gamma, **kw, log_gate=lg[1:, :, pad:])
    _close(ref[1:, :, pad:], alone)


@pytest.mark.parametrize("mixed", [False, True])
def test_gated_prefill_then_steps_and_ring_equal_one_pass(mixed):
    xs, gamma, lg, mix = _inputs(2, 4, 2, 23)
    mix = mix if mixed else None
    w = 5
    kw = dict(window=w, scale=0.5, mix=mix)
    whole = ops.hybrid_attention_naive(*xs, gamma, **kw, log_gate=lg)
    first, state = ops.hybrid_attention_chunked(*(x[:, :, :14] for x in xs), gamma, **kw, log_gate=lg[..., :14],
                                                output_final_state=True)
    rest, _ = ops.hybrid_attention_recurrent(*(x[:, :, 14:] for x in xs), gamma, **kw, initial_state=state,
                                             log_gate=lg[..., 14:])
    _close(torch.cat([first, rest], dim=2), whole)
    ring = ops.RingHybridState.from_state(state.map(lambda t: t.detach()), w)
    with torch.no_grad():
        for i in range(14, 23):
            one = [x[:, :, i : i + 1] for x in xs]
            out, ring = ops.hybrid_attention_step_ring(*one, gamma, ring, scale=0.5, log_gate=lg[..., i : i + 1],
                                                       mix=mix)
            _close(out, whole[:, :, i : i + 1])


def test_mix_at_its_extremes():
    """A mix of 0 is the window's softmax alone; of 1, the linear terms alone once a key has left the
    window (before that, the window's softmax: there is nothing else)."""
    xs, gamma, _, _ = _inputs(1, 4, 2, 21)
    q, k, qf, kf, v = xs
    w = 4
    zero = ops.hybrid_attention_chunked(*xs, gamma, window=w, scale=0.5, mix=torch.zeros(4, dtype=torch.float64))[0]
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    pos = torch.arange(21)
    dist = pos[:, None] - pos[None, :]
    window_only = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=(dist >= 0) & (dist < w),
                                                                   scale=0.5)
    _close(zero, window_only)
    one = ops.hybrid_attention_chunked(*xs, gamma, window=w, scale=0.5, mix=torch.ones(4, dtype=torch.float64))[0]
    a = (qf @ kf.repeat_interleave(2, 1).transpose(-1, -2)) * (dist >= w)
    linear_only = (a @ vr) / a.sum(-1, keepdim=True)
    _close(one[:, :, w:], linear_only[:, :, w:])
    _close(one[:, :, :w], window_only[:, :, :w])
