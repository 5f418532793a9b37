"""The LoLCATs hybrid: softmax over the last ``w`` tokens, linear attention over all older ones, and
optionally a sparse exact cache of older tokens beside the window (``sparse_hybrid_attention_*``, below).

For query t (LoLCATs eq. 7), with one shared normaliser:

    a_ts = gamma * exp(s_ts - c_t)      for t - w < s <= t   (s_ts = scale * q_t . k_s, softcapped)
    a_ts = phi_q(q_t) . phi_k(k_s)      for s <= t - w
    y_t  = sum_s a_ts v_s / sum_s a_ts

where ``c_t`` is the largest window score of query t (log-sum-exp stabilisation) and ``gamma`` a
per-head weight. The window always holds token t itself, so the denominator is at least
``gamma`` and needs no eps; when the window covers the whole sequence this is exactly softmax.

Shapes: ``q`` ``[B, H, T, D]`` and ``k`` ``[B, Hk, T, D]`` (after RoPE), ``qf`` ``[B, H, T, F]`` and
``kf`` ``[B, Hk, T, F]`` (their features), ``v`` ``[B, Hk, T, D]``; ``gamma`` ``[H]``. Keys are shared
by ``G = H / Hk`` query heads without being repeated.

Whole sequences: ``hybrid_attention`` runs the Triton kernels (``chunk_triton.py``, gates included)
where ``use_hybrid_kernel`` allows and ``hybrid_attention_chunked`` (PyTorch) elsewhere.

Decoding state (``HybridState``): the last ``w`` keys, key features and values, plus the linear
state ``sum phi_k(k_s) [v_s, 1]`` over tokens that have left the window: constant in size.

Gates (``log_gate``, optional, ``[B, Hk, T]`` of ``log g_t <= 0``): the linear state fades. A key
``s`` that has left the window weighs ``prod_{s + w < u <= t} g_u`` in query ``t``'s linear term, so
the state after token ``t`` is ``S_t = g_t S_{t-1} + phi_k(k_{t-w}) [v_{t-w}, 1]``: a key starts
to fade when it leaves the window, and a constant ``g`` is a fixed decay with horizon ``1 / (1 - g)``.
Without gates the linear mass grows with the length against the window's; with them it stays
bounded. ``None`` is ``g = 1`` (LoLCATs), in every form exactly as before.

**Sparse cache** (after LoLA, McDermott et al. 2025; ``sparse_hybrid_attention_*``, the decoding state
``SparseHybridState``): softmax over the last ``w`` tokens and over ``S`` older tokens kept exactly,
linear attention over all the rest.

Tokens leaving the sliding window go either into the linear state or into a cache of at most ``S``
tokens (raw keys, key features, values), chosen by how badly the linear state recalls them (or, with
``priority="novelty"``, by how unlike the other candidates' their values are; with ``"first"``, the
sequence's first tokens); a cached token pushed out later is folded into the linear state. Memory
stays constant: window + ``S`` tokens + the linear state. With ``S = 0`` this is exactly the hybrid
above.

Output for query t (one shared normaliser, ``gamma`` a per-query-head weight, as in LoLCATs eq. 7):

    a_ts = gamma * exp(s_ts - c_t)      for s in window(t) or cache(t)
    a_ts = phi_q(q_t) . phi_k(k_s)      for every other real s <= t (folded into the linear state)
    y_t  = sum_s a_ts v_s / sum_s a_ts

where ``c_t`` is the largest score over window and cache (``anchor="joint"``, the default). With
``anchor="window"`` the linear terms are scaled by ``exp(c_w - c_t)``, ``c_w`` the largest score over the
window alone: the softmax terms stand against the linear ones as in the hybrid the student was trained
as (whose ``c`` is the window's), and a cached token weighs what it would in the window. Under
``"joint"`` a cached token scoring above the window lowers every softmax term against the linear
terms, the needle's own included.

**Gates** (``log_gate`` ``[B, Hk, T]`` of ``log g_t <= 0``, a fading linear state as in
the hybrid above: data-dependent, or a per-head constant for a fixed or learned decay; None is
no fade, every form bit for bit as without). With ``L`` the log gates' cumulative sum, a folded token
``s`` weighs ``exp(L_t - L_{s+w})`` in query t's linear term: its fade starts when it leaves the
window (at time ``s + w``, whose own gate it does not get), as the hybrid's keys' does, whether it is
folded then or later. A cached token does not fade while it is cached (it is a softmax term, like the
window's); pushed out at time ``f``, it is folded with the fade it would have gathered in the linear
state since it left the window, ``exp(L_f - L_{s+w})``. So the state after time t is ``g_t`` times the
one before plus the tokens folded at t, each times ``exp(L_t - L_{s+w})``, and with ``S = 0`` (every
token folded at ``s + w``) this is exactly the gated hybrid. The decoding state holds, per cached
token, the log fade it has gathered since it left the window (``cache_fade``: 0 on arrival, each step
adds its log gate; a short sum rather than the difference of two long cumulative sums). The recall
priority reads the faded state (at a boundary ``b``, the state after time ``b - 1``).

**Features** ``qf``, ``kf`` are the caller's: computed from the rotated q/k or, with ``feature_rope:
false``, from the q/k before RoPE while the scores use the rotated ones. No form recomputes a
feature from a stored key: the window and the cache keep each token's key features beside its key.

Which tokens are cached, and when: ``sparse_select.py``. Shapes as above.

Files, one form each (the forms equal in float64, tests):

* ``naive.py``: the quadratic references, ``hybrid_attention_naive`` (its weights,
  ``hybrid_attention_weights``) and ``sparse_hybrid_attention_naive`` (a literal simulation with sets
  of positions, explicit sums);
* ``chunk.py``: the PyTorch sequence forms in chunks of ``w`` tokens, ``hybrid_attention_chunked`` and
  ``sparse_hybrid_attention_chunked`` (one selection epoch a chunk);
* ``recurrent.py``: one token (``hybrid_attention_step``, ``sparse_hybrid_attention_step``: the decoding
  forms), the same on a ring window in place (``*_step_ring``, the fast decoder's), and token by token
  (``*_recurrent``);
* ``state.py``: every recurrent state and how it is built (``HybridState``, ``SparseHybridState``, their
  rings, the fused decode step's ``FusedRingState`` and ``FusedSinkState``, ``empty_*``,
  ``hybrid_final_state``);
* ``sparse_select.py``: the sparse cache's selection (priorities, the chunked form's decisions);
* ``shared.py``: small helpers of the PyTorch forms (the normaliser, the scores, padding keys);
* ``chunk_triton.py``: whole sequences as Triton kernels (training, prefill, scoring), with
  ``prelude_triton.py`` (its backward's RoPE + Hedgehog maps) and ``triton_tiles.py`` (their tile helpers);
* ``step_triton.py``: the fused Triton decode steps.

This package imports no Triton module: they are imported on first use (Triton is optional).
"""

from __future__ import annotations

import torch

from ..fla_backend import triton_available
from .chunk import hybrid_attention_chunked, sparse_hybrid_attention_chunked
from .naive import hybrid_attention_naive, hybrid_attention_weights, sparse_hybrid_attention_naive
from .recurrent import (hybrid_attention_recurrent, hybrid_attention_step, hybrid_attention_step_ring,
                        sparse_hybrid_attention_recurrent, sparse_hybrid_attention_step,
                        sparse_hybrid_attention_step_ring)
from .sparse_select import ANCHORS, PRIORITIES
from .state import (FusedRingState, FusedSinkState, HybridState, RingHybridState, RingSparseState, SparseHybridState,
                    empty_hybrid_state, empty_sparse_hybrid_state, hybrid_final_state)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_MAX_WINDOW = 128  # a query chunk's two window tiles are [w, w] each
KERNEL_MAX_WIDTH = 128  # head dim and feature width the tiles hold (256, Gemma 3's head dim, needs
# 268 KiB of shared memory, more than an H100's 227 KiB)


def use_hybrid_kernel(q: torch.Tensor, backend: str = "auto", *, window: int, head_dim: int,
                      feature_width: int, dtype: torch.dtype | None = None) -> bool:
    """Whether whole sequences go through the Triton kernels (``chunk_triton.py``).

    ``backend`` (the spec's): "torch" never; "auto" on CUDA for bf16 and fp16 inputs (fp32 ones
    under autocast are cast to its dtype first, ``kernel_dtype``) when Triton is installed, the
    window is at most ``KERNEL_MAX_WINDOW`` and the head dim and feature width (a Hedgehog map's
    half) at most ``KERNEL_MAX_WIDTH``, and not while ``torch.compile`` traces (the compiler fuses
    the PyTorch form itself); "fla" (CUDA kernels required) the same and fp32 too, in full-precision
    products, raising where the kernels cannot run. fp32 stays on the PyTorch form under "auto"
    (as the linear mixers' fla rule does): full-precision Triton products spill registers and
    compile slowly, TF32 ones would lose precision. float64 and the CPU take the PyTorch form.
    ``dtype``: decide as if ``q`` had it."""
    if backend == "torch":
        return False
    dtype = dtype or q.dtype
    ok = (q.is_cuda and dtype in KERNEL_DTYPES and triton_available() and window <= KERNEL_MAX_WINDOW
          and head_dim <= KERNEL_MAX_WIDTH and feature_width <= KERNEL_MAX_WIDTH)
    if backend == "fla" and not ok:
        raise RuntimeError(f"backend='fla' needs CUDA tensors in {', '.join(map(str, KERNEL_DTYPES))}, Triton, a "
                           f"window <= {KERNEL_MAX_WINDOW} and widths <= {KERNEL_MAX_WIDTH} for the hybrid's kernels")
    return ok and (backend == "fla" or dtype != torch.float32) and not torch.compiler.is_compiling()


def kernel_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The one dtype the kernels take for these inputs: under autocast on their device, its half
    dtype when any is fp32 (RoPE with fp32 cos/sin leaves q/k in fp32 there); else the promotion."""
    dtype = tensors[0].dtype
    for x in tensors[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    dev = tensors[0].device.type
    if dtype == torch.float32 and torch.is_autocast_enabled(dev):
        half = torch.get_autocast_dtype(dev)
        if half in (torch.bfloat16, torch.float16):
            return half
    return dtype


def hybrid_attention(
    q, k, qf, kf, v, gamma, *, window: int, scale: float, softcap: float | None = None,
    output_final_state: bool = False, key_mask: torch.Tensor | None = None, backend: str = "auto",
    log_gate: torch.Tensor | None = None, mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HybridState | None]:
    """Whole sequences, as ``hybrid_attention_chunked``: through the Triton kernels where
    ``use_hybrid_kernel`` allows (inputs cast to ``kernel_dtype``; the log gates stay as given), else
    the PyTorch form."""
    if mix is not None:  # the kernels have no apart-normalised terms: the PyTorch form
        return hybrid_attention_chunked(q, k, qf, kf, v, gamma, window=window, scale=scale, softcap=softcap,
                                        output_final_state=output_final_state, key_mask=key_mask, log_gate=log_gate,
                                        mix=mix)
    dtype = kernel_dtype(q, k, v, qf, kf)
    if use_hybrid_kernel(q, backend, window=window, head_dim=q.shape[-1], feature_width=qf.shape[-1], dtype=dtype):
        from .chunk_triton import hybrid_triton

        q, k, v, qf, kf = (x.to(dtype) for x in (q, k, v, qf, kf))
        return hybrid_triton(q, k, v, gamma, qf=qf, kf=kf, window=window, scale=scale, softcap=softcap,
                             key_mask=key_mask, output_final_state=output_final_state, log_gate=log_gate)
    return hybrid_attention_chunked(q, k, qf, kf, v, gamma, window=window, scale=scale, softcap=softcap,
                                    output_final_state=output_final_state, key_mask=key_mask, log_gate=log_gate)


__all__ = [
    "ANCHORS", "FusedRingState", "FusedSinkState", "HybridState", "KERNEL_DTYPES", "KERNEL_MAX_WIDTH",
    "KERNEL_MAX_WINDOW", "PRIORITIES", "RingHybridState", "RingSparseState", "SparseHybridState",
    "empty_hybrid_state", "empty_sparse_hybrid_state", "hybrid_attention", "hybrid_attention_chunked",
    "hybrid_attention_naive", "hybrid_attention_recurrent", "hybrid_attention_step", "hybrid_attention_step_ring",
    "hybrid_attention_weights", "hybrid_final_state", "kernel_dtype", "sparse_hybrid_attention_chunked",
    "sparse_hybrid_attention_naive", "sparse_hybrid_attention_recurrent", "sparse_hybrid_attention_step",
    "sparse_hybrid_attention_step_ring", "use_hybrid_kernel",
]
