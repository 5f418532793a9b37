"""Mamba's ops: selective scan and causal conv1d, naive = chunked = recurrent in float64, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from helpers import random_grads, run_triton_interpreter_script

from linearize.ops import selective_scan as ss

TOL = 1e-10
# (batch, length, channels, state size): lengths off the chunk size, shorter than it, and 1
SHAPES = [(2, 37, 5, 3), (1, 16, 4, 1), (2, 1, 3, 4), (1, 5, 6, 2), (3, 21, 2, 5)]


def _scan_inputs(b, t, dn, n, seed=0, strong=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = r(b, t, dn)
    dt = F.softplus(r(b, t, dn) + (1.5 if strong else 0.0))  # strong: fast decays stress the chunk carry
    A = -torch.exp(r(dn, n))
    B, C, D = r(b, t, n), r(b, t, n), r(dn)
    h0 = r(b, dn, n)
    xs = [u, dt, A, B, C, D, h0]
    for x in xs:
        x.requires_grad_(True)
    return xs


def _close(a, b, tol=TOL):
    assert torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("strong", [False, True])
def test_selective_scan_forms_agree(shape, chunk, with_state, strong):
    u, dt, A, B, C, D, h0 = xs = _scan_inputs(*shape, strong=strong)
    s0 = h0 if with_state else None
    ref = ss.selective_scan_naive(u, dt, A, B, C, D, initial_state=s0)
    chunked, s_chunk = ss.selective_scan_chunked(u, dt, A, B, C, D, chunk_size=chunk, initial_state=s0,
                                                 output_final_state=True)
    rec, s_rec = ss.selective_scan_recurrent(u, dt, A, B, C, D, initial_state=s0)
    _close(chunked, ref)
    _close(rec, ref)
    _close(s_chunk, s_rec)
    for g_ref, g_chunk, g_rec in zip(random_grads(ref, xs), random_grads(chunked, xs), random_grads(rec, xs)):
        _close(g_chunk, g_ref)
        _close(g_rec, g_ref)
    # the final state's gradient too (what a carried state feeds into the next segment)
    _, s_chunk = ss.selective_scan_chunked(u, dt, A, B, C, D, chunk_size=chunk, initial_state=s0,
                                           output_final_state=True)
    _, s_rec = ss.selective_scan_recurrent(u, dt, A, B, C, D, initial_state=s0)
    for g_chunk, g_rec in zip(random_grads(s_chunk, xs), random_grads(s_rec, xs)):
        _close(g_chunk, g_rec)


def test_selective_scan_matches_its_definition_by_hand():
    """Two tokens, one channel, one state: h1 = e^(dt1 a) h0 + dt1 u1 b1, ..."""
    u, dt, A, B, C, D, h0 = (x.detach() for x in _scan_inputs(1, 2, 1, 1))
    a = A[0, 0]
    h = h0[0, 0, 0]
    expect = []
    for t in range(2):
        h = torch.exp(dt[0, t, 0] * a) * h + dt[0, t, 0] * u[0, t, 0] * B[0, t, 0]
        expect.append(h * C[0, t, 0] + D[0] * u[0, t, 0])
    y = ss.selective_scan_naive(u, dt, A, B, C, D, initial_state=h0)
    _close(y[0, :, 0], torch.stack(expect))


def test_selective_scan_state_carries_across_splits():
    """Prefill a prefix, continue from its state: the same as one pass (how decoding resumes a prompt)."""
    u, dt, A, B, C, D, _ = (x.detach() for x in _scan_inputs(2, 29, 4, 3))
    whole, s_whole = ss.selective_scan_chunked(u, dt, A, B, C, D, chunk_size=8, output_final_state=True)
    cut = lambda x, sl: x[:, sl]  # noqa: E731
    first, s = ss.selective_scan_chunked(*(cut(x, slice(0, 11)) for x in (u, dt)), A,
                                         *(cut(x, slice(0, 11)) for x in (B, C)), D, chunk_size=8,
                                         output_final_state=True)
    rest, s_end = ss.selective_scan_chunked(*(cut(x, slice(11, None)) for x in (u, dt)), A,
                                            *(cut(x, slice(11, None)) for x in (B, C)), D, chunk_size=8,
                                            initial_state=s, output_final_state=True)
    _close(torch.cat([first, rest], dim=1), whole)
    _close(s_end, s_whole)


def test_selective_scan_state_is_fp32_for_half_inputs():
    u, dt, A, B, C, D, _ = (x.detach().to(torch.bfloat16) for x in _scan_inputs(1, 9, 3, 2))
    y, state = ss.selective_scan_chunked(u, dt, A, B, C, D, chunk_size=4, output_final_state=True)
    assert state.dtype == torch.float32 and y.dtype == torch.bfloat16
    y, state = ss.selective_scan_recurrent(u, dt, A, B, C, D)
    assert state.dtype == torch.float32 and y.dtype == torch.bfloat16


def _conv_inputs(b, dn, t, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [r(b, dn, t), r(dn, 1, k), r(dn), r(b, dn, k - 1)]
    for x in xs:
        x.requires_grad_(True)
    return xs


@pytest.mark.parametrize("t", [1, 2, 3, 17])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_forms_agree(t, k, with_state):
    x, w, bias, s0 = xs = _conv_inputs(2, 5, t, k)
    state = s0 if with_state else None
    ref = ss.causal_conv1d_naive(x, w, bias, initial_state=state)
    fast, s_fast = ss.causal_conv1d(x, w, bias, initial_state=state, output_final_state=True)
    rec, s_rec = ss.causal_conv1d_recurrent(x, w, bias, initial_state=state)
    _close(fast, ref)
    _close(rec, ref)
    _close(s_fast, s_rec)
    for g_ref, g_fast, g_rec in zip(random_grads(ref, xs), random_grads(fast, xs), random_grads(rec, xs)):
        _close(g_fast, g_ref)
        _close(g_rec, g_ref)
    if not with_state:  # zero state = the usual left zero padding of nn.Conv1d
        torch_conv = F.conv1d(x, w, bias, padding=k - 1, groups=5)[..., :t]
        _close(fast, torch_conv)


def test_triton_selective_scan_equals_the_pytorch_scan():
    """The fused CUDA kernels, run on the CPU by Triton's interpreter: values and every gradient."""
    run_triton_interpreter_script("triton_interpret_scan.py")


def test_triton_causal_conv1d_silu_equals_the_pytorch_conv():
    """The fused channels-last causal conv1d + SiLU, run on the CPU by Triton's interpreter: values, the
    final state and the gradients of x, weight, bias and initial state; and StripedMamba with it
    (forced on) against its PyTorch path, logits and every parameter gradient."""
    run_triton_interpreter_script("triton_interpret_conv.py")


def test_triton_group_norm_gate_equals_its_definition():
    """RetNet's and SUPRA's fused per-head GroupNorm (+ affine, + swish gate), run on the CPU by Triton's
    interpreter: values and the gradients of x, weight, bias and gate."""
    run_triton_interpreter_script("triton_interpret_group_norm_gate.py")
