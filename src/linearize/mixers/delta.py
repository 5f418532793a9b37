"""A gated delta-rule memory beside the LoLCATs sliding window (``kind: delta``).

Softmax over the last ``window`` tokens with the teacher's own q/k/v (RoPE, scale, soft-cap) and,
for older tokens, Gated DeltaNet's memory (Yang et al. 2024; ``ops/delta/``): a token is
written when it leaves the window,

    S <- a_t (I - b_t k^_t k^_t^T) S + b_t k^_t v_t^T,      read: S^T q^_t

and the two are mixed convexly, ``y_t = (1 - m_t) softmax_window + m_t S^T q^_t`` with ``m_t =
lambda_t`` once some token is older than the window (0 before: a window covering the sequence is
exactly the teacher). The docstring of ``ops/delta/window.py`` says why this form.

Adopted from the teacher: q/k/v/o (and QK-norms). New, small parameters:

* ``feature_map_q`` / ``feature_map_k``: per-head square maps (identity at start) followed by an L2
  norm, on the queries and keys after RoPE (``feature_rope: false``: before it, so that the memory
  does not depend on absolute positions): q^ and k^ (the delta rule needs unit keys).
* the forget gate ``a_t = exp(g_t)``, ``g_t = -exp(A_log) softplus(x W_a + dt_bias)`` per key head
  (Mamba-2 / Gated DeltaNet's parametrisation; ``A`` spread over [1, 16] and ``dt`` geometrically
  over [0.001, 0.1] across heads, so heads start with memories from a few to hundreds of tokens);
* the write strength ``b_t = sigmoid(x W_b)`` per key head;
* the mix ``lambda_t = sigmoid(x W_l + c)`` per query head, starting near 0.1 (as the LoLCATs
  window weight) so that the untrained memory starts as a small correction.

``x`` is the layer's input (the normalised hidden state), as in Gated DeltaNet. Training (attention
transfer, distillation) is the recipes' business: every parameter outside the teacher's projections
is new.
"""

from __future__ import annotations

import contextlib

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..models.base import rotates_half
from ..ops.availability import triton_available
from .base import Mixer
from .feature_maps import _Projected
from .fresh import output_projection_name

INIT_MIX = 0.1
A_RANGE = (1.0, 16.0)
DT_RANGE = (0.001, 0.1)


class UnitFeatures(_Projected):
    """``normalize(x W)`` per head, ``W`` square and the identity at start."""

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__(n_heads, head_dim, head_dim, bias=False)
        self.out_dim = head_dim

    def forward(self, x):
        return F.normalize(self.project(x), dim=-1)


class GatedDeltaAttention(Mixer):
    kind = "delta"

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        g = geometry
        hidden = getattr(attn, output_projection_name(adapter)).out_features
        self.feature_map_q = self.new_parameters_like(UnitFeatures(g.n_heads, g.head_dim))
        self.feature_map_k = self.new_parameters_like(UnitFeatures(g.n_kv_heads, g.head_dim))
        std = float(getattr(self.config, "initializer_range", None) or 0.02)
        self.decay_proj = self._linear(hidden, g.n_kv_heads, std, bias=False)
        self.beta_proj = self._linear(hidden, g.n_kv_heads, std, bias=False)
        self.mix_proj = self._linear(hidden, g.n_heads, std, bias=True)
        with torch.no_grad():
            self.mix_proj.bias.fill_(math.log(INIT_MIX / (1 - INIT_MIX)))
        n = g.n_kv_heads
        spread = torch.linspace(0, 1, n) if n > 1 else torch.zeros(1)
        a = A_RANGE[0] + (A_RANGE[1] - A_RANGE[0]) * spread
        dt = torch.exp(math.log(DT_RANGE[0]) + (math.log(DT_RANGE[1]) - math.log(DT_RANGE[0])) * spread.flip(0))
        inv_softplus = dt + torch.log(-torch.expm1(-dt))
        self.A_log = nn.Parameter(torch.log(a).to(self.teacher_device))
        self.dt_bias = nn.Parameter(inv_softplus.to(self.teacher_device))
        self._hidden = self._taken = None

    def _linear(self, n_in, n_out, std, bias):
        lin = nn.Linear(n_in, n_out, bias=bias)
        with torch.no_grad():
            lin.weight.normal_(0.0, std)
            if bias:
                lin.bias.zero_()
        return self.new_parameters_like(lin)

    def forward(self, hidden_states, *args, **kwargs):
        with self.reading(hidden_states):
            return super().forward(hidden_states, *args, **kwargs)

    @contextlib.contextmanager
    def reading(self, hidden_states):
        self._hidden = hidden_states  # the gates read the layer's input
        try:
            yield
        finally:
            self._hidden = self._taken = None

    def input_projections(self):
        """The gates' projections, joining the decoder's q/k/v product: the mix's without its bias (a
        product of q/k/v without biases takes none), added back in ``gate_inputs``."""
        unbiased = nn.Linear(self.mix_proj.in_features, self.mix_proj.out_features, bias=False, device="meta")
        unbiased.weight = self.mix_proj.weight
        return self.decay_proj, self.beta_proj, unbiased

    def take_projections(self, outputs) -> None:
        self._taken = tuple(outputs)

    def gate_inputs(self):
        """``(x_a, x_b [B, T, Hk], x_l [B, T, H])``: the gates' projections of the current input before
        their biases, from the decoder's fused product where it computed them, else here."""
        if self._taken is not None:
            return self._taken
        x = self._hidden
        if x is None:
            raise RuntimeError("the delta gates read the layer input: call the mixer, or run sequence/step inside "
                               "reading()")
        return self.decay_proj(x), self.beta_proj(x), F.linear(x, self.mix_proj.weight)

    def gates(self):
        """``(g, beta [B, Hk, T], lambda [B, H, T])`` of the current input, in the states' precision
        (fp32, float64 for float64 inputs)."""
        xa, xb, xl = self.gate_inputs()
        acc = ops.accum_dtype(xa.dtype)
        g = -torch.exp(self.A_log.to(acc)) * F.softplus(xa.to(acc) + self.dt_bias.to(acc))
        beta = torch.sigmoid(xb.to(acc))
        lam = torch.sigmoid(xl.to(acc) + self.mix_proj.bias.to(acc))
        return g.transpose(1, 2), beta.transpose(1, 2), lam.transpose(1, 2)

    def _inputs(self, q, k, position_embeddings):
        qr, kr = self.adapter.rope(self, q, k, position_embeddings)
        if self.spec.feature_rope:
            q, k = qr, kr
        return qr, kr, self.feature_map_q(q), self.feature_map_k(k), *self.gates()

    def _kw(self):
        g = self.geometry
        return dict(window=self.spec.window, scale=g.scaling, softcap=g.softcap)

    def sequence(self, q, k, v, position_embeddings, state, want_state):
        q, k, qd, kd, g, beta, lam = self._inputs(q, k, position_embeddings)
        if state is None:
            return ops.delta_window_chunked(q, k, qd, kd, v, g, beta, lam, **self._kw(), key_mask=self.key_mask,
                                            output_final_state=want_state, chunk_size=self.spec.chunk_size,
                                            backend=self.spec.backend)
        return ops.delta_window_recurrent(q, k, qd, kd, v, g, beta, lam, **self._kw(), initial_state=state,
                                          key_mask=self.key_mask)

    def step(self, q, k, v, position_embeddings, state):
        geo = self.geometry
        if isinstance(state, ops.FusedRingDeltaState):  # RoPE to the output in one launch (CUDA)
            from ..ops.delta.step_triton import delta_step_fused_triton

            xa, xb, xl = self.gate_inputs()
            return delta_step_fused_triton(q, k, v, position_embeddings if geo.rotary is not None else None,
                                           self.feature_map_q.weight, self.feature_map_k.weight, xa, xb, xl,
                                           self.dt_bias, self.A_log, self.mix_proj.bias, state, scale=geo.scaling,
                                           softcap=geo.softcap, feature_rope=self.spec.feature_rope)
        q, k, qd, kd, g, beta, lam = self._inputs(q, k, position_embeddings)
        if isinstance(state, ops.RingDeltaState):  # the fast decoder's fixed-shape, in-place window
            return ops.delta_window_step_ring(q, k, qd, kd, v, g, beta, lam, state, scale=geo.scaling,
                                              softcap=geo.softcap)
        return ops.delta_window_step(q, k, qd, kd, v, g, beta, lam, state, **self._kw(), key_mask=self.key_mask)

    def fused_decoding(self) -> bool:
        """Whether the fast decoder's ring steps run as one Triton kernel (``ops/delta/step_triton.py``): on
        CUDA with Triton, RoPE by rotating halves (or none), head widths up to the kernel's 128."""
        g = self.geometry
        return (self.A_log.is_cuda and triton_available() and g.head_dim <= 128
                and rotates_half(g.rotary, g.head_dim))

    def ring_state(self, state: ops.DeltaWindowState, keep_key_features: bool = False) -> ops.DeltaWindowState:
        """The fast decoder's fixed-shape state from a prefill's ``state`` (its memory taken over): the
        window as a ring of ``window`` slots, laid out for the fused step where that runs. (``keep_key_features``
        is LoLCATs'; the delta keys are always kept: a token's gates and key are written when it leaves.)"""
        ring = ops.RingDeltaState.from_state(state, self.spec.window)
        return ops.FusedRingDeltaState.from_ring(ring) if self.fused_decoding() else ring

    def state_bytes(self, dtype):
        g = self.geometry
        elem = torch.tensor([], dtype=dtype).element_size()
        acc = torch.tensor([], dtype=ops.accum_dtype(dtype)).element_size()
        window = self.spec.window * g.n_kv_heads * (3 * g.head_dim * elem + 2 * acc)  # keys, values, delta keys, g, b
        return window + g.n_kv_heads * g.head_dim * g.head_dim * acc + 1
