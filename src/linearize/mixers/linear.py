"""Normalised linear attention with learned per-head feature maps, applied after RoPE.

    o_t = phi_q(q_t) . sum_{s<=t} phi_k(k_s) v_s^T / (phi_q(q_t) . sum_{s<=t} phi_k(k_s) + eps)

The query map has one set of weights per query head, the key map one per key head (keys are not
repeated for grouped-query teachers, so the state is per key head).
"""

from __future__ import annotations

import torch

from .. import ops
from .base import Mixer, drop_padding
from .decay import log_decay
from .feature_maps import build_feature_map


class LinearAttention(Mixer):
    kind = "linear"

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        g = geometry
        self.feature_map_q = self.new_parameters_like(build_feature_map(spec.feature_map, g.n_heads, g.head_dim, spec.feature_dim))
        self.feature_map_k = self.new_parameters_like(build_feature_map(spec.feature_map, g.n_kv_heads, g.head_dim, spec.feature_dim))
        self.register_fixed_buffers()

    def fixed_buffers(self):
        return {"log_decay": log_decay(self.spec.decay, self.geometry.n_heads, self.layer_idx, self.n_layers,
                                       horizon=self.spec.decay_horizon)}

    def features(self, q, k, position_embeddings):
        q, k = self.adapter.rope(self, q, k, position_embeddings)
        return self.feature_map_q(q), self.feature_map_k(k)

    def sequence(self, q, k, v, position_embeddings, state, want_state):
        qf, kf = self.features(q, k, position_embeddings)
        kf, v = drop_padding(self.key_mask, kf, v)
        return ops.linear_attention(
            qf, kf, v, log_decay=self.log_decay, normalize=True, eps=self.spec.eps,
            initial_state=state, output_final_state=want_state, chunk_size=self.spec.chunk_size,
            backend=self.spec.backend,
        )

    def attention_weights(self, q, k, position_embeddings):
        if self.log_decay is not None:
            return super().attention_weights(q, k, position_embeddings)
        qf, kf = self.features(q, k, position_embeddings)
        ones = torch.ones(self.geometry.n_heads, device=q.device)
        return ops.hybrid_attention_weights(q, k, qf, kf, ones, window=0, scale=1.0)  # window 0: all linear

    def step(self, q, k, v, position_embeddings, state):
        qf, kf = self.features(q, k, position_embeddings)
        return ops.linear_attention_step(qf, kf, v, state, log_decay=self.log_decay, normalize=True, eps=self.spec.eps,
                                         backend=self.spec.backend)

    def state_bytes(self, dtype):
        g = self.geometry
        groups = g.n_heads // g.n_kv_heads if self.log_decay is not None else 1
        return g.n_kv_heads * groups * self.feature_map_k.out_dim * (g.head_dim + 1) * 4
