"""The LoLCATs hybrid (LoLCATs eq. 7): softmax over the last ``window`` tokens, linear attention
over older ones, one shared normaliser and a learnable per-head weight gamma = sigmoid(w) on the
softmax terms (initialised to 0.1 as in LoLCATs). With a window covering the whole sequence it is
exactly the teacher's softmax attention.

With ``spec.sparse_cache = S > 0`` each key head also keeps ``S`` older tokens exactly beside the window
(``ops/hybrid/sparse_select.py``; ``spec.sparse_priority``: by default, ``"novelty"``, those whose
values are least like the other candidates', with ``"recall"`` those its linear state recalls worst
(LoLA), with ``"first"`` the sequence's first ``S`` tokens, StreamingLLM's attention sinks;
``spec.sparse_anchor`` sets how they weigh against the linear terms, ``spec.sparse_linear`` < 1 scales
the linear terms down beside them): the softmax runs over window and cache, the linear state over the rest. It adds
no parameters (any converted checkpoint takes it as is) and trains through the softmax over window
and cache.

Whole sequences (prefill, training, evaluation) run the Triton kernels on CUDA where
``ops.use_hybrid_kernel`` allows it (the spec's ``backend``: "auto" or "fla"; "torch" keeps the
PyTorch chunked form). With Hedgehog maps on both sides the kernels compute the features, and RoPE
when the family rotates halves, themselves from the projections' q/k; other maps are applied
in PyTorch first. A sparse cache runs the PyTorch chunked form, but for the first tokens
(``sparse_priority: "first"``) with Hedgehog maps where no gradient is needed (prefill, scoring):
the forward kernels take them (``hybrid_triton_sinks``), and a prefill whose first tokens have
all left the window gets its state from there too (without a decay: the sinks' kernels take no gates).
With a decay the cache's tokens fade once folded into the linear state, from the time they left the
window; with ``feature_rope: False`` the cache keeps its tokens' features as the window does.

Length: ``spec.decay`` (``span``, ``learned``, ``gated``) fades the linear state per key head from
the moment a key leaves the window (``ops.hybrid``'s gates), so its mass stays bounded
however long the sequence; ``spec.feature_rope = False`` computes the features from the q/k before
RoPE, so the linear terms never see an absolute position the maps were not trained on. Both run in
the whole-sequence kernels (the gates and, with Hedgehog maps and RoPE by halves, the features of the
unrotated q/k inside them) and the fused decode step; decoding keeps the ring's key features when the
stored (rotated) keys cannot give them back.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops
from ..models.base import rotates_half
from ..ops.fla_backend import triton_available
from .feature_maps import Hedgehog
from .fresh import output_projection_name
from .linear import LinearAttention

INIT_WINDOW_WEIGHT = 0.1
HORIZON_PER_WINDOW = 16  # the longest starting horizon of a decay: 16 windows (1,024 tokens for 64)


def start_horizons(n_kv: int, window: int, longest: int | None) -> torch.Tensor:
    """Starting horizons ``1 / -log g`` per key head, geometric from ``window`` to ``longest`` (one head:
    ``longest``)."""
    longest = float(longest or HORIZON_PER_WINDOW * window)
    if n_kv == 1:
        return torch.tensor([longest], dtype=torch.float64)
    lo = min(float(window), longest)
    return torch.exp(torch.linspace(math.log(lo), math.log(longest), n_kv, dtype=torch.float64))


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class LolcatsAttention(LinearAttention):
    kind = "lolcats"

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        logit = math.log(INIT_WINDOW_WEIGHT / (1 - INIT_WINDOW_WEIGHT))
        self.window_logit = nn.Parameter(torch.full((geometry.n_heads,), logit, device=self.teacher_device))
        self._hidden = None
        self._gate_input = None  # the gate's projection of the current input, where the decoder fused it with q/k/v
        if spec.norm == "separate":  # the linear terms' weight against the window's, per head (0.5 at start)
            self.mix_logit = nn.Parameter(torch.zeros(geometry.n_heads, device=self.teacher_device))
        if spec.decay in ("learned", "gated"):
            rate = 1 / start_horizons(geometry.n_kv_heads, spec.window, spec.decay_horizon)
            self.gate_bias = nn.Parameter(_inverse_softplus(rate).float().to(self.teacher_device))
        if spec.decay == "gated":
            hidden = getattr(attn, output_projection_name(adapter)).out_features
            self.gate_proj = self.new_parameters_like(nn.Linear(hidden, geometry.n_kv_heads, bias=False))
            with torch.no_grad():
                self.gate_proj.weight.zero_()  # starts as the learned decay

    def fixed_buffers(self):
        g, spec = self.geometry, self.spec
        span = None
        if spec.decay == "span":
            span = -1 / start_horizons(g.n_kv_heads, spec.window, spec.decay_horizon).float()
        return {"log_decay": None, "span_log_gate": span}

    @property
    def fades(self) -> bool:
        """Whether the linear state fades (``spec.decay`` span, learned or gated)."""
        return self.spec.decay not in (None, "none")

    @property
    def gated(self) -> bool:
        """Whether the linear state fades (``spec.decay`` other than none) or the terms are normalised apart
        (``spec.norm`` separate): steps outside the fused kernel then run the PyTorch forms (the kernels
        take gates; apart-normalised terms stay on PyTorch everywhere)."""
        return self.fades or self.spec.norm == "separate"

    def mix(self) -> torch.Tensor | None:
        """The linear terms' weight per head where they are normalised apart, else None."""
        return torch.sigmoid(self.mix_logit.float()) if self.spec.norm == "separate" else None

    def forward(self, hidden_states, *args, **kwargs):
        with self.reading(hidden_states):
            return super().forward(hidden_states, *args, **kwargs)

    @contextlib.contextmanager
    def reading(self, hidden_states):
        self._hidden = hidden_states if self.spec.decay == "gated" else None  # the gates read the layer's input
        try:
            yield
        finally:
            self._hidden = self._gate_input = None

    def input_projections(self):
        return (self.gate_proj,) if self.spec.decay == "gated" else ()

    def take_projections(self, outputs) -> None:
        self._gate_input, = outputs

    def gate_input(self) -> torch.Tensor:
        """``[B, T, Hk]``: the gate's projection of the current input (before its bias), from the product
        the decoder fused with q/k/v where it did, else computed here."""
        if self._gate_input is not None:
            return self._gate_input
        if self._hidden is None:
            raise RuntimeError("gated decay reads the layer input: call the mixer, or run sequence/step inside reading()")
        return self.gate_proj(self._hidden)

    def log_gate(self, batch: int, length: int, device) -> torch.Tensor | None:
        """``[B, Hk, T]`` log gates of the current tokens (fp32, float64 for a float64 model), or None
        (LoLCATs: no fade)."""
        decay = self.spec.decay
        if decay in (None, "none"):
            return None
        if decay == "span":
            return self.span_log_gate.to(device)[None, :, None].expand(batch, -1, length)
        if decay == "learned":
            return (-F.softplus(self.gate_bias.float()))[None, :, None].expand(batch, -1, length)
        x = self.gate_input()
        acc = ops.accum_dtype(x.dtype)
        a = x.to(acc) + self.gate_bias.to(acc)  # [B, T, Hk]
        return -F.softplus(a).transpose(1, 2)

    @classmethod
    def covers(cls, geometry, spec) -> bool:
        # the hybrid's softmax covers the last ``window`` tokens, a sliding teacher layer the last
        # ``sliding_window`` (both counting the query itself)
        return geometry.sliding_window is not None and spec.window >= geometry.sliding_window

    def window_weight(self) -> torch.Tensor:
        return torch.sigmoid(self.window_logit.float())

    def _inputs(self, q, k, position_embeddings):
        if not self.spec.feature_rope:  # features of the q/k before RoPE
            qf, kf = self.feature_map_q(q), self.feature_map_k(k)
            q, k = self.adapter.rope(self, q, k, position_embeddings)
        else:
            q, k = self.adapter.rope(self, q, k, position_embeddings)
            qf, kf = self.feature_map_q(q), self.feature_map_k(k)
        if self._linear_weighted():  # every phi(q) . phi(k) term times the weight (the cache's choices read kf)
            qf = qf * self.spec.sparse_linear
        return q, k, qf, kf

    def _linear_weighted(self) -> bool:
        """Whether the linear terms weigh less than as trained (``spec.sparse_linear`` < 1 beside a sparse
        cache): the query features are scaled in PyTorch, so no kernel computing its own features runs."""
        return bool(self.spec.sparse_cache) and self.spec.sparse_linear != 1

    def _kw(self):
        g = self.geometry
        return dict(window=self.spec.window, scale=g.scaling, softcap=g.softcap)

    def _sparse_rule(self):
        """The sparse cache's rule, as every form of the op takes it."""
        return dict(key_mask=self.key_mask, priority=self.spec.sparse_priority, anchor=self.spec.sparse_anchor)

    def sequence(self, q, k, v, position_embeddings, state, want_state):
        if state is None:
            fused = self._kernel_sequence(q, k, v, position_embeddings, want_state)
            if fused is not None:
                return fused
        q, k, qf, kf = self._inputs(q, k, position_embeddings)
        if self.spec.sparse_cache:  # (a fading state: the cached tokens fade once folded, as the hybrid's keys)
            kw = dict(**self._kw(), cache_size=self.spec.sparse_cache, **self._sparse_rule(),
                      log_gate=self.log_gate(q.shape[0], q.shape[2], q.device))
            if state is None:
                return ops.sparse_hybrid_attention_chunked(q, k, qf, kf, v, self.window_weight(), **kw,
                                                           output_final_state=want_state)
            return ops.sparse_hybrid_attention_recurrent(q, k, qf, kf, v, self.window_weight(), **kw,
                                                         initial_state=state)
        lg = self.log_gate(q.shape[0], q.shape[2], q.device)
        if state is None:
            return ops.hybrid_attention_chunked(q, k, qf, kf, v, self.window_weight(), **self._kw(),
                                                output_final_state=want_state, key_mask=self.key_mask, log_gate=lg,
                                                mix=self.mix())
        # continuing a sequence with several tokens at once: token by token from the state
        return ops.hybrid_attention_recurrent(q, k, qf, kf, v, self.window_weight(), **self._kw(), initial_state=state,
                                              key_mask=self.key_mask, log_gate=lg, mix=self.mix())

    def _kernel_sequence(self, q, k, v, position_embeddings, want_state):
        """``sequence`` from no state through the Triton kernels, or None where they do not apply."""
        g, fq, fk = self.geometry, self.feature_map_q, self.feature_map_k
        if self.spec.norm == "separate":  # the kernels have no apart-normalised terms
            return None
        # Hedgehog maps inside the kernels, of the rotated q/k or (``feature_rope: false``) of those before
        # RoPE; the latter only where the kernels rotate too (by halves), else the features in PyTorch
        nope = not self.spec.feature_rope
        hedgehog = type(fq) is Hedgehog and type(fk) is Hedgehog and (
            not nope or g.rotary is None or position_embeddings is None or rotates_half(g.rotary, g.head_dim))
        width = fq.weight.shape[-1] if hedgehog else fq.out_dim
        dtype = ops.hybrid_attention_kernel_dtype(q, k, v)
        if not ops.use_hybrid_kernel(q, self.spec.backend, window=self.spec.window, head_dim=g.head_dim,
                                     feature_width=width, dtype=dtype):
            return None
        plan = self._sink_plan(hedgehog, q, k, v, want_state) if self.spec.sparse_cache else None
        if self.spec.sparse_cache and plan is None:
            return None
        # a fading state: the gates (fp32, with their gradient) go to the kernels as they are
        log_gate = self.log_gate(q.shape[0], q.shape[2], q.device)
        if not hedgehog:  # features in PyTorch, the hybrid in the kernels
            q, k, qf, kf = self._inputs(q, k, position_embeddings)
            return ops.hybrid_attention(q, k, qf, kf, v, self.window_weight(), **self._kw(),
                                        output_final_state=want_state, key_mask=self.key_mask, backend=self.spec.backend,
                                        log_gate=log_gate)
        from ..ops.hybrid.chunk_triton import hybrid_triton

        rope = None
        if g.rotary is not None and position_embeddings is not None:
            if rotates_half(g.rotary, g.head_dim):
                rope = position_embeddings  # rotated inside the kernels
            else:
                q, k = self.adapter.rope(self, q, k, position_embeddings)
                dtype = ops.hybrid_attention_kernel_dtype(q, k, v)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        # gamma = sigmoid(window_logit) inside the kernels
        if self.spec.sparse_cache:
            from ..ops.hybrid.chunk_triton import hybrid_triton_sinks

            return hybrid_triton_sinks(q, k, v, self.window_logit, hedgehog=(fq.weight, fk.weight), rope=rope,
                                       **self._kw(), cache_size=self.spec.sparse_cache, key_mask=self.key_mask,
                                       logit=True, anchor=self.spec.sparse_anchor, output_final_state=want_state,
                                       plan=plan)
        return hybrid_triton(q, k, v, self.window_logit, hedgehog=(fq.weight, fk.weight), rope=rope, **self._kw(),
                             key_mask=self.key_mask, output_final_state=want_state, logit=True, log_gate=log_gate,
                             nope=nope)

    def _sink_plan(self, hedgehog: bool, q, k, v, want_state: bool):
        """The first tokens' ``SinkPlan`` where this sparse cache's sequence runs the forward kernels, else
        None: the first tokens (``sparse_priority: "first"``), Hedgehog maps, no gradient wanted (training
        takes the PyTorch form), and for a prefill's state a cache that is settled (its first tokens out of
        the window)."""
        spec = self.spec
        if (spec.sparse_priority != "first" or not hedgehog or self.fades or not spec.feature_rope
                or self._linear_weighted()):
            return None  # (the sinks' kernels take no gates nor features before RoPE: the PyTorch form)
        weights = (q, k, v, self.window_logit, self.feature_map_q.weight, self.feature_map_k.weight)
        if torch.is_grad_enabled() and any(x.requires_grad for x in weights):
            return None
        from ..ops.hybrid.chunk_triton import sink_plan

        plan = sink_plan(self.key_mask, q.shape[0], q.shape[2], spec.window, spec.sparse_cache, q.device)
        return plan if plan.settled or not want_state else None

    def attention_weights(self, q, k, position_embeddings):
        if self.spec.sparse_cache:
            return super().attention_weights(q, k, position_embeddings)
        q, k, qf, kf = self._inputs(q, k, position_embeddings)
        return ops.hybrid_attention_weights(q, k, qf, kf, self.window_weight(), **self._kw(),
                                            log_gate=self.log_gate(q.shape[0], q.shape[2], q.device), mix=self.mix())

    def fused_decoding(self) -> bool:
        """Whether the fast decoder runs this layer's steps as one Triton kernel
        (``hybrid_step_fused_triton``): on CUDA, with Hedgehog maps and RoPE by rotating halves, and
        no sparse cache or one of the first tokens (attention sinks; once it is full it stays as it is),
        without a decay and with features after RoPE (the sinks' fused step takes neither)."""
        g, spec = self.geometry, self.spec
        sparse = spec.sparse_cache and (spec.sparse_priority != "first" or self.fades or not spec.feature_rope
                                        or self._linear_weighted())
        return (not sparse and self.spec.norm != "separate" and self.window_logit.is_cuda and triton_available()
                and type(self.feature_map_q) is Hedgehog
                and type(self.feature_map_k) is Hedgehog and rotates_half(g.rotary, g.head_dim))

    def ring_state(self, state: ops.HybridState, keep_key_features: bool = False) -> ops.HybridState:
        """The fast decoder's fixed-shape state from a prefill's ``state`` (whose buffers it takes
        over): a ring of ``window`` slots, laid out for the fused kernel where that runs; with a sparse
        cache, the ring and the cache updated in place (``ops.RingSparseState``), or for the fused
        kernel where the cache will not change again (``ops.FusedSinkState``: the first tokens, all cached)."""
        g = self.geometry
        if isinstance(state, ops.SparseHybridState):
            if (not keep_key_features and self.fused_decoding()
                    and ops.FusedSinkState.settled(state, self.spec.sparse_priority)):
                return ops.FusedSinkState.from_sparse(state, self.spec.window, self.feature_map_k, g.n_heads,
                                                      self._value_splits(state.keys.shape[0]))
            return ops.RingSparseState.from_state(state, self.spec.window)
        # without RoPE in the features, a stored (rotated) key cannot give its features back: keep them
        nope = not self.spec.feature_rope
        ring = ops.RingHybridState.from_state(state, self.spec.window, keep_key_features=keep_key_features or nope,
                                              copy=False)
        if (keep_key_features and not nope) or not self.fused_decoding():
            return ring
        return ops.FusedRingState.from_ring(ring, self.feature_map_k, g.n_heads, self._value_splits(ring.keys.shape[0]),
                                            gated=self.fades)

    def _value_splits(self, batch: int) -> int:
        """Parts of each head's value columns for the fused step's programs at this batch."""
        from ..ops.hybrid.step_triton import value_splits  # (Triton: imported on first use)

        return value_splits(batch, self.geometry.n_heads, self.geometry.head_dim)

    def fast_decodable(self) -> bool:
        return True

    def step(self, q, k, v, position_embeddings, state):
        if isinstance(state, ops.RingSparseState):  # the fast decoder's fixed buffers
            q, k, qf, kf = self._inputs(q, k, position_embeddings)
            g = self.geometry
            return ops.sparse_hybrid_attention_step_ring(q, k, qf, kf, v, self.window_weight(), state, scale=g.scaling,
                                                         softcap=g.softcap, **self._sparse_rule(),
                                                         log_gate=self.log_gate(q.shape[0], 1, q.device))
        if isinstance(state, ops.SparseHybridState):
            q, k, qf, kf = self._inputs(q, k, position_embeddings)
            lg = self.log_gate(q.shape[0], 1, q.device)
            return ops.sparse_hybrid_attention_step(q, k, qf, kf, v, self.window_weight(), state, **self._kw(),
                                                    **self._sparse_rule(), log_gate=lg)
        if isinstance(state, ops.FusedRingState):  # everything from RoPE to the output in one launch
            from ..ops.hybrid.step_triton import hybrid_step_fused_triton

            g = self.geometry
            # a data-dependent gate goes in before its activation (the kernel takes it: no launches for it)
            gate = dict(gate_input=self.gate_input(), gate_bias=self.gate_bias) if self.spec.decay == "gated" else \
                dict(log_gate=self.log_gate(q.shape[0], 1, q.device))
            y = hybrid_step_fused_triton(q, k, v, position_embeddings if g.rotary is not None else None,
                                         self.feature_map_q.weight, self.feature_map_k.weight, self.window_logit,
                                         state, scale=g.scaling, softcap=g.softcap, anchor=self.spec.sparse_anchor,
                                         feature_rope=self.spec.feature_rope, **gate)
            return y, state
        if self.gated or not self.spec.feature_rope:
            return self._faded_step(q, k, v, position_embeddings, state)
        q, k = self.adapter.rope(self, q, k, position_embeddings)
        qf = self.feature_map_q(q)
        if isinstance(state, ops.RingHybridState):  # the fast decoder's fixed-shape, in-place window
            g = self.geometry
            if q.is_cuda and state.key_features.shape[2] == 0 and triton_available():
                from ..ops.hybrid.step_triton import hybrid_step_ring_triton

                # the new key's features are not needed until it leaves the window: only the
                # evicted key's are computed (a decode step is launch-bound: every kernel counts)
                evicted = self.feature_map_k(state.keys.index_select(2, state.slot.view(1)))
                y = hybrid_step_ring_triton(q, k, qf, v, self.window_weight(), evicted, state,
                                            scale=g.scaling, softcap=g.softcap)
                return y, state
            kf = self.feature_map_k(k) if state.key_features.shape[2] > 0 else None  # kept only when stored
            return ops.hybrid_attention_step_ring(q, k, qf, kf, v, self.window_weight(), state,
                                                  scale=g.scaling, softcap=g.softcap,
                                                  key_feature_map=self.feature_map_k)
        return ops.hybrid_attention_step(q, k, qf, self.feature_map_k(k), v, self.window_weight(), state,
                                         **self._kw(), key_mask=self.key_mask)

    def _faded_step(self, q, k, v, position_embeddings, state):
        """One token with a fading linear state, apart-normalised terms or features before RoPE: the
        PyTorch steps."""
        q, k, qf, kf = self._inputs(q, k, position_embeddings)
        lg = self.log_gate(q.shape[0], 1, q.device)
        if isinstance(state, ops.RingHybridState):
            g = self.geometry
            kf = kf if state.key_features.shape[2] > 0 else None
            return ops.hybrid_attention_step_ring(q, k, qf, kf, v, self.window_weight(), state, scale=g.scaling,
                                                  softcap=g.softcap, key_feature_map=self.feature_map_k, log_gate=lg,
                                                  mix=self.mix())
        return ops.hybrid_attention_step(q, k, qf, kf, v, self.window_weight(), state, **self._kw(),
                                         key_mask=self.key_mask, log_gate=lg, mix=self.mix())

    def state_bytes(self, dtype, key_features: bool = True, linear_states: int = 1, sparse: bool = True):
        g = self.geometry
        elem = torch.tensor([], dtype=dtype).element_size()
        per_token = 2 * g.head_dim + (self.feature_map_k.out_dim if key_features else 0)
        window = self.spec.window * g.n_kv_heads * per_token * elem
        total = window + linear_states * g.n_kv_heads * self.feature_map_k.out_dim * (g.head_dim + 1) * 4
        cache = self.spec.sparse_cache if sparse else 0
        if cache:  # SparseHybridState: cached tokens (+ priority, position, slot flag; with gates their fades),
            # window priorities, count
            acc = torch.tensor([], dtype=ops.accum_dtype(dtype)).element_size()
            cached = 2 * g.head_dim + self.feature_map_k.out_dim
            fade = acc if self.fades else 0
            total += g.n_kv_heads * (cache * (cached * elem + acc + fade + 8 + 1) + self.spec.window * acc) + 8
        return total

    def fast_state_bytes(self, dtype):
        fused = self.fused_decoding()
        if self.spec.sparse_cache and not fused:  # the ring keeps its key features (the cache's priorities need them)
            return self.state_bytes(dtype)
        # the fast path recomputes key features on eviction (but of keys before RoPE, which the ring keeps);
        # its fused kernel keeps two linear states, and with gates the evicted token's features and values apart
        g = self.geometry
        total = self.state_bytes(dtype, key_features=not self.spec.feature_rope, linear_states=2 if fused else 1,
                                 sparse=False)
        if fused and self.fades:
            total += g.n_kv_heads * 2 * (self.feature_map_k.out_dim + g.head_dim) * 4
        if self.spec.sparse_cache:  # the first tokens, all cached (FusedSinkState): keys, values, flags
            elem = torch.tensor([], dtype=dtype).element_size()
            total += self.geometry.n_kv_heads * self.spec.sparse_cache * (2 * self.geometry.head_dim * elem + 1)
        return total
