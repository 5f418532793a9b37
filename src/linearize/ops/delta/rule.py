"""The gated delta rule (Gated DeltaNet, Yang et al. 2024), its forms.

Per key head, a ``[K, V]`` memory ``S`` is overwritten rather than only added to:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T          a_t = exp(g_t), g_t <= 0; b_t in [0, 1]
    o_t = S_t^T q_t

the form of fla's ``naive_recurrent_gated_delta_rule`` (decay first, then the delta step
``S += b_t k_t (v_t - S^T k_t)^T``). Keys and queries are expected L2-normalised (the mixer's feature
maps end in an L2 norm), so ``I - b k k^T`` is a contraction and ``S^T k`` reads back what was
written under ``k``; no extra scale is applied to ``q``.

Shapes: ``q`` ``[B, H, T, K]``, ``k`` ``[B, Hk, T, K]``, ``v`` ``[B, Hk, T, V]``, ``g`` and ``beta``
``[B, Hk, T]``: one memory per key head, read by the ``G = H / Hk`` query heads of its group. The
memory is fp32 (or float64) whatever the inputs. A padding token has ``g = b = 0``: it neither
decays nor writes.

Forms, equal in float64 (tests): ``gated_delta_rule_naive`` (token by token), ``gated_delta_rule_chunked``
(the WY / UT-transform form: within a chunk of ``C`` tokens the writes ``delta_i = b_i (v_i - a..S^T k_i)``
solve one unit lower-triangular system, ``(I + A) delta = U - W S_0``, with ``A_ij = b_i
exp(G_i - G_j) k_i . k_j`` for ``j < i`` and ``G`` the in-chunk cumulative log decay; a short loop
carries ``S`` between chunks), ``gated_delta_rule_step`` (one token), and on CUDA
``gated_delta_rule_fla`` (fla's ``chunk_gated_delta_rule``).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..linear_attention import _group, accum_dtype

logger = logging.getLogger(__name__)


# --- the gated delta rule -------------------------------------------------------------------------

def _readout(q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``S^T q`` for the query heads of each group: q ``[B, H, T, K]``, state ``[B, Hk, K, V]`` -> ``[B, H, T, V]``."""
    n_kv = state.shape[1]
    o = _group(q, n_kv).to(state.dtype) @ state.unsqueeze(2)
    return o.flatten(1, 2)


def _write(state, k, v, g, beta):
    """One write: ``S <- a S; S <- S + b k (v - S^T k)^T`` with ``k`` ``[B, Hk, K]``, ``v`` ``[B, Hk, V]``,
    ``g``/``beta`` ``[B, Hk]`` (out of place)."""
    acc = state.dtype
    k, v = k.to(acc), v.to(acc)
    state = state * torch.exp(g.to(acc))[..., None, None]
    read = (k[..., None] * state).sum(-2)  # S^T k
    return state + k[..., None] * (beta.to(acc)[..., None] * (v - read))[..., None, :]


def gated_delta_rule_step(q, k, v, g, beta, state):
    """One token: ``q`` ``[B, H, 1, K]``, ``k`` ``[B, Hk, 1, K]``, ``v`` ``[B, Hk, 1, V]``, ``g``/``beta``
    ``[B, Hk, 1]``, ``state`` ``[B, Hk, K, V]``. Returns ``(o [B, H, 1, V], new_state)`` (out of place)."""
    state = _write(state, k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0])
    return _readout(q, state).to(v.dtype), state


def empty_delta_state(batch, n_kv, key_dim, value_dim, *, device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(batch, n_kv, key_dim, value_dim, device=device, dtype=accum_dtype(dtype))


def gated_delta_rule_naive(q, k, v, g, beta, *, initial_state=None):
    """Token by token (the reference). Returns ``(o [B, H, T, V], final_state)``."""
    b, n_kv, t, kd = k.shape
    acc = accum_dtype(q.dtype)
    state = initial_state.to(acc) if initial_state is not None else empty_delta_state(
        b, n_kv, kd, v.shape[-1], device=q.device, dtype=q.dtype)
    outs = []
    for i in range(t):
        state = _write(state, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
        outs.append(_readout(q[:, :, i : i + 1], state))
    return torch.cat(outs, dim=2).to(q.dtype), state


def gated_delta_rule_chunked(q, k, v, g, beta, *, chunk_size: int = 64, initial_state=None,
                             output_final_state: bool = False):
    """The WY / UT-transform form (see the module docstring). Returns ``(o, final_state or None)``."""
    acc = accum_dtype(q.dtype)
    b, n_kv, t, kd = k.shape
    vd = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t  # padding at the end: g = beta = 0, no effect on anything before it
    chunks = lambda x: F.pad(x.to(acc), (0, 0, 0, pad)).unflatten(-2, (n, c))  # noqa: E731
    qc = chunks(_group(q, n_kv))  # [B, Hk, G, N, C, K]
    kc, vc = chunks(k), chunks(v)  # [B, Hk, N, C, *]
    gc = F.pad(g.to(acc), (0, pad)).unflatten(-1, (n, c))  # [B, Hk, N, C]
    bc = F.pad(beta.to(acc), (0, pad)).unflatten(-1, (n, c))
    cum = gc.cumsum(-1)  # G_i: in-chunk cumulative log decay
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = cum[..., :, None] - cum[..., None, :]
    decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # exp(G_i - G_j), j <= i
    eye = torch.eye(c, dtype=acc, device=q.device)
    a = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay) * (1 - eye)  # strictly lower
    system = eye + a
    u = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)  # [B, Hk, N, C, V]
    w = torch.linalg.solve_triangular(system, (bc * cum.exp())[..., None] * kc, upper=False, unitriangular=True)
    attn = (qc @ kc.unsqueeze(2).transpose(-1, -2)) * decay.unsqueeze(2)  # [B, Hk, G, N, C, C]
    q_decayed = qc * cum.exp().unsqueeze(2)[..., None]
    to_end = (cum[..., -1:] - cum).exp()[..., None] * kc  # k_j exp(G_C - G_j)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, Hk, N, 1, 1]
    state = initial_state.to(acc) if initial_state is not None else torch.zeros(b, n_kv, kd, vd, dtype=acc,
                                                                                device=q.device)
    outs = []
    for j in range(n):
        delta = u[:, :, j] - w[:, :, j] @ state  # [B, Hk, C, V]
        outs.append(q_decayed[:, :, :, j] @ state.unsqueeze(2) + attn[:, :, :, j] @ delta.unsqueeze(2))
        state = state * chunk_decay[:, :, j] + to_end[:, :, j].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=3).flatten(3, 4)[..., :t, :].flatten(1, 2)
    return o.to(q.dtype), (state if output_final_state else None)


def gated_delta_rule_fla(q, k, v, g, beta, *, initial_state=None, output_final_state=False):
    """fla's ``chunk_gated_delta_rule`` (CUDA) for the same contract. fla takes as many key heads as
    query heads, so grouped keys, values and gates are repeated (the G memories of a group are then
    equal; one of them is returned)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    b, h, t, _ = q.shape
    n_kv = k.shape[1]
    grp = h // n_kv
    acc = accum_dtype(q.dtype)
    rep = lambda x: x.repeat_interleave(grp, dim=2) if grp > 1 else x  # noqa: E731  on [B, T, Hk, *]
    qh, kh, vh = q.transpose(1, 2).contiguous(), rep(k.transpose(1, 2)), rep(v.transpose(1, 2))
    gh, bh = rep(g.transpose(1, 2).to(acc)), rep(beta.transpose(1, 2).to(q.dtype))  # log decays in fp32
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(acc).repeat_interleave(grp, dim=1).contiguous()
    o, ht = chunk_gated_delta_rule(qh, kh.contiguous(), vh.contiguous(), gh.contiguous(), bh.contiguous(),
                                   scale=1.0, initial_state=h0, output_final_state=output_final_state)
    state = ht.view(b, n_kv, grp, *ht.shape[2:])[:, :, 0].to(acc) if ht is not None else None
    return o.transpose(1, 2).to(q.dtype), state


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False, chunk_size=64,
                     backend="auto"):
    """The sequence form: fla's kernel where ``use_fla`` says so (CUDA, half precision or backend
    "fla"; under autocast fp32 inputs go in the autocast dtype, as for ``linear_attention``), the
    PyTorch chunked form otherwise.

    "auto" also keeps a call that needs gradients off fla where fla's backward would refuse it
    (``fla_gated_backward_refused``: Hopper with Triton in [3.4.0, 3.7.1), no TileLang), and says
    so once; forward-only calls still take fla. Backend "fla" keeps fla, whose backward then raises
    with its own advice (upgrade Triton or install tilelang)."""
    from ..fla_backend import fla_gated_backward_refused_on, kernel_inputs, use_fla

    qk, kk, vk = kernel_inputs(q, k, v, backend)
    if use_fla(qk, backend):
        if not (backend == "auto" and _needs_grad(q, k, v, g, beta, initial_state)
                and fla_gated_backward_refused_on(q.device)):
            return gated_delta_rule_fla(qk, kk, vk, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state)
        _say_fla_backward_refused()
    return gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                                    output_final_state=output_final_state)


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


@functools.cache
def _say_fla_backward_refused():
    logger.warning("the gated delta rule trains through its PyTorch chunked form, not fla: fla's gated "
                   "backward (chunk_bwd_dqkwg) refuses Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs (fla #640); "
                   "upgrade Triton to >= 3.7.1 or install tilelang to train through fla")
