"""Mamba's selective scan (S6) and its causal depthwise convolution, each in three equal forms.

The scan, per channel ``d`` and state index ``n``, with input-dependent step ``dt``, ``B`` and ``C``:

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] u_t[d] B_t[n]
    y_t[d]    = sum_n C_t[n] h_t[d, n] + D[d] u_t[d]

Shapes (Mamba's layout, channels last): ``u`` and ``dt`` are ``[B, T, Dn]`` (``dt`` already through
softplus), ``A`` is ``[Dn, N]`` (negative: ``-exp(A_log)``), ``B`` and ``C`` are ``[B, T, N]``, ``D``
is ``[Dn]`` or None. State: one ``[B, Dn, N]`` tensor in the accumulation dtype (fp32, or float64
for float64 inputs).

Three forms, equal up to rounding (the tests prove it in float64, values and gradients):
On CUDA, ``selective_scan`` runs the fused Triton kernels of ``selective_scan_triton.py`` instead.

``selective_scan_naive`` (quadratic: every pair s <= t with its decay exp(sum_{s<r<=t} dt_r A),
materialised; the reference), ``selective_scan_chunked`` (linear in T: a scan of ``chunk_size``
steps run for every chunk at once, then a scan over chunks that carries the state between them;
about ``chunk_size + T / chunk_size`` sequential steps, only decays <= 1 are ever exponentiated)
and ``selective_scan_step`` (one token; decoding).

The causal convolution (``causal_conv1d*``) is depthwise over ``[B, Dn, T]`` with a ``[Dn, 1, K]``
weight; its decoding state is the last ``K - 1`` inputs, ``[B, Dn, K - 1]`` (zeros before the
first token, which is the same as the usual left zero padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear_attention import accum_dtype


# --------------------------------------------------------------------------- selective scan


def empty_ssm_state(batch: int, channels: int, state_size: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """The scan state before any token: zeros ``[B, Dn, N]``."""
    return torch.zeros(batch, channels, state_size, device=device, dtype=dtype)


def _prepare(u, dt, A, B, C, acc):
    """Everything in the accumulation dtype; per-step log decays dt*A and inputs dt*u*B, [B, T, Dn, N]."""
    u, dt, A, B, C = (x.to(acc) for x in (u, dt, A, B, C))
    log_a = dt[..., None] * A  # <= 0
    bx = (dt * u)[..., None] * B[:, :, None, :]
    return u, log_a, bx, C


def _skip(y, u, D):
    return y if D is None else y + u * D.to(y.dtype)


def selective_scan_naive(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, *, initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """The quadratic reference: every (t, s <= t) pair with its decay materialised. Returns ``y [B, T, Dn]``.

    y_t = sum_{s<=t} C_t . (exp(L_t - L_s) * dt_s u_s B_s) + C_t . (exp(L_t) * h_0) + D u_t,
    with L_t = sum_{r<=t} dt_r A.
    """
    acc = accum_dtype(u.dtype)
    uu, log_a, bx, Cm = _prepare(u, dt, A, B, C, acc)
    t = u.shape[1]
    L = log_a.cumsum(1)  # [B, T, Dn, N]
    seg = L[:, :, None] - L[:, None, :]  # [B, T(t), T(s), Dn, N]: L_t - L_s
    causal = torch.ones(t, t, dtype=torch.bool, device=u.device).tril()[None, :, :, None, None]
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
    h = (decay * bx[:, None]).sum(2)  # [B, T, Dn, N]: the state after each token, from zero
    if initial_state is not None:
        h = h + torch.exp(L) * initial_state.to(acc)[:, None]
    y = (h * Cm[:, :, None, :]).sum(-1)
    return _skip(y, uu, D).to(u.dtype)


def selective_scan_step(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``u``, ``dt`` ``[B, Dn]``, ``B``, ``C`` ``[B, N]``. Returns ``(y [B, Dn], new_state)``."""
    acc = state.dtype
    uu, dtt, Am, Bm, Cm = (x.to(acc) for x in (u, dt, A, B, C))
    state = torch.exp(dtt[..., None] * Am) * state + (dtt * uu)[..., None] * Bm[:, None, :]
    y = (state * Cm[:, None, :]).sum(-1)
    return _skip(y, uu, D).to(u.dtype), state


def selective_scan_recurrent(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, *, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token through ``selective_scan_step`` (the decoding form, used as a reference)."""
    b, t, dn = u.shape
    state = initial_state
    if state is None:
        state = empty_ssm_state(b, dn, A.shape[-1], device=u.device, dtype=accum_dtype(u.dtype))
    outs = []
    for i in range(t):
        y, state = selective_scan_step(u[:, i], dt[:, i], A, B[:, i], C[:, i], D, state)
        outs.append(y)
    return torch.stack(outs, dim=1), state


def selective_scan_chunked(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, *, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear-time form. Returns ``(y [B, T, Dn], final_state or None)``.

    The sequence is cut into chunks of ``chunk_size``. First every chunk is scanned from a zero
    state, all chunks at once (``chunk_size`` steps on ``[B, N_chunks, Dn, N]``), which gives each
    token's chunk-local output and each chunk's local end state. Then one short scan over chunks
    carries the true state into each chunk, whose contribution at token t is
    C_t . (exp(L_t) * h_start), with L_t the decay since the chunk began (<= 0). Padding the end with
    dt = 0 (decay 1, input 0) leaves the state unchanged, so the final state is the last carried one.
    """
    acc = accum_dtype(u.dtype)
    uu, log_a, bx, Cm = _prepare(u, dt, A, B, C, acc)
    b, t, dn, n_state = bx.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    if pad:
        log_a = F.pad(log_a, (0, 0, 0, 0, 0, pad))
        bx = F.pad(bx, (0, 0, 0, 0, 0, pad))
        Cm = F.pad(Cm, (0, 0, 0, pad))
    la = log_a.unflatten(1, (n, c))  # [B, Nc, C, Dn, N]
    bc = bx.unflatten(1, (n, c))
    cc = Cm.unflatten(1, (n, c))  # [B, Nc, C, N]

    # 1. every chunk from a zero state, all chunks at once
    h = torch.zeros(b, n, dn, n_state, dtype=acc, device=u.device)
    local = []
    for i in range(c):
        h = torch.exp(la[:, :, i]) * h + bc[:, :, i]
        local.append((h * cc[:, :, i, None, :]).sum(-1))  # [B, Nc, Dn]
    y = torch.stack(local, dim=2)  # [B, Nc, C, Dn]

    # 2. carry the state across chunks: S_{j+1} = exp(L_end_j) S_j + h_end_j
    L = la.cumsum(2)  # decay since the chunk began, <= 0
    chunk_decay = torch.exp(L[:, :, -1])  # [B, Nc, Dn, N]
    state = (initial_state.to(acc) if initial_state is not None
             else torch.zeros(b, dn, n_state, dtype=acc, device=u.device))
    starts = []
    for j in range(n):
        starts.append(state)
        state = chunk_decay[:, j] * state + h[:, j]
    starts = torch.stack(starts, dim=1)  # [B, Nc, Dn, N]: the state entering each chunk

    # 3. each token sees the carried state decayed since its chunk began
    y = y + ((torch.exp(L) * starts[:, :, None]) * cc[:, :, :, None, :]).sum(-1)
    y = y.flatten(1, 2)[:, :t]
    return _skip(y, uu, D).to(u.dtype), (state if output_final_state else None)


def selective_scan(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, *, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, backend: str = "auto", delta_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linear-time scan: the fused Triton kernels on CUDA (``backend`` auto/fla/triton, when
    Triton is installed), else ``selective_scan_chunked``. Same contract as the latter, except that
    with ``delta_softplus`` ``dt`` comes before its softplus, which is applied in the accumulation
    dtype (inside the Triton kernels, as in Mamba's own)."""
    from .availability import triton_available

    if backend != "torch" and u.is_cuda and triton_available():
        from .selective_scan_triton import selective_scan_triton

        return selective_scan_triton(u, dt, A, B, C, D, initial_state=initial_state,
                                     output_final_state=output_final_state, delta_softplus=delta_softplus)
    if delta_softplus:
        dt = F.softplus(dt.to(accum_dtype(dt.dtype)))
    return selective_scan_chunked(u, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state,
                                  output_final_state=output_final_state)


# --------------------------------------------------------------------------- causal conv1d


def empty_conv_state(batch: int, channels: int, width: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """The convolution state before any token: ``K - 1`` zero inputs, ``[B, Dn, K - 1]``."""
    return torch.zeros(batch, channels, width - 1, device=device, dtype=dtype)


def causal_conv1d_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: y_t[d] = sum_k w[d, k] x_{t-K+1+k}[d] + b[d], inputs before the sequence from the state."""
    b, dn, t = x.shape
    k = weight.shape[-1]
    past = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(b, dn, k - 1)
    xx = torch.cat([past, x], dim=-1)
    w = weight[:, 0, :].to(x.dtype)
    y = torch.stack([(xx[:, :, i : i + k] * w).sum(-1) for i in range(t)], dim=-1)
    return y if bias is None else y + bias.to(x.dtype)[:, None]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution over ``x [B, Dn, T]``: ``(y [B, Dn, T], last K-1 inputs or None)``."""
    b, dn, t = x.shape
    k = weight.shape[-1]
    past = initial_state.to(x.dtype) if initial_state is not None else x.new_zeros(b, dn, k - 1)
    xx = torch.cat([past, x], dim=-1)
    y = F.conv1d(xx, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), groups=dn)
    final = None
    if output_final_state:
        final = xx[:, :, xx.shape[-1] - (k - 1):].to(accum_dtype(x.dtype))
    return y, final


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token ``x [B, Dn]``: ``(y [B, Dn], new_state [B, Dn, K-1])``; the state is updated out of place."""
    window = torch.cat([state, x[:, :, None].to(state.dtype)], dim=-1)  # [B, Dn, K]
    y = (window * weight[:, 0, :].to(state.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(state.dtype)
    return y.to(x.dtype), window[:, :, 1:]


def causal_conv1d_recurrent(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token through ``causal_conv1d_step``."""
    b, dn, t = x.shape
    state = initial_state
    if state is None:
        state = empty_conv_state(b, dn, weight.shape[-1], device=x.device, dtype=accum_dtype(x.dtype))
    outs = []
    for i in range(t):
        y, state = causal_conv1d_step(x[:, :, i], weight, bias, state)
        outs.append(y)
    return torch.stack(outs, dim=-1), state
