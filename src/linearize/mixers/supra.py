"""SUPRA attention (SUPRA eq. 10): a shared kernel phi(x) = ReLU(xW + b), W square (head_dim) and
shared by queries, keys and heads; RoPE after phi; a fixed per-head decay; GroupNorm per head in
place of the normaliser.

    o_t = GroupNorm( sum_{s<=t} g_h^(t-s) RoPE(phi(q_t)) . RoPE(phi(k_s)) v_s )

With ``norm="sum"`` the GroupNorm is replaced by the usual normaliser (with ``decay="none"`` this is
the T2R baseline SUPRA compares against).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..models.base import rope_rotate_half, rotates_half
from .base import Mixer, drop_padding, head_group_norm
from .decay import log_decay
from .feature_maps import T2R


class SupraAttention(Mixer):
    kind = "supra"

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        g = geometry
        self.feature_map = self.new_parameters_like(T2R(1, g.head_dim, g.head_dim))
        self.rope_rotates_half = rotates_half(g.rotary, g.head_dim)
        self.register_fixed_buffers()
        self.normalize = spec.norm == "sum"
        if not self.normalize:
            self.group_norm = self.new_parameters_like(nn.GroupNorm(g.n_heads, g.n_heads * g.head_dim, eps=1e-5))

    def fixed_buffers(self):
        return {"log_decay": log_decay(self.spec.decay, self.geometry.n_heads, self.layer_idx, self.n_layers,
                                       horizon=self.spec.decay_horizon)}

    def features(self, q, k, position_embeddings):
        """RoPE(phi(q)) * scaling and RoPE(phi(k)). Queries and keys go through the shared kernel (and
        RoPE, where the family's is the rotate-half kind) as one tensor of H + Hk heads laid out
        [B, T, H + Hk, D], the layout of the projections' output and of fla's inputs: one set of
        launches for both, and no layout copies."""
        g = self.geometry
        x = torch.cat([q.transpose(1, 2), k.transpose(1, 2)], dim=2)
        x = self.feature_map(x.transpose(1, 2)).transpose(1, 2)
        joint_rope = position_embeddings is not None and g.rotary is not None and self.rope_rotates_half
        if joint_rope:
            x = rope_rotate_half(x, *position_embeddings, unsqueeze_dim=2)
        qf, kf = (y.transpose(1, 2) for y in x.split([q.shape[1], k.shape[1]], dim=2))
        if not joint_rope:
            qf, kf = self.adapter.rope(self, qf, kf, position_embeddings)
        return qf * g.scaling, kf

    def _norm(self, o):
        if self.normalize:
            return o
        return head_group_norm(o, self.group_norm)

    def sequence(self, q, k, v, position_embeddings, state, want_state):
        qf, kf = self.features(q, k, position_embeddings)
        kf, v = drop_padding(self.key_mask, kf, v)
        o, state = ops.linear_attention(
            qf, kf, v, log_decay=self.log_decay, normalize=self.normalize, eps=self.spec.eps,
            initial_state=state, output_final_state=want_state, chunk_size=self.spec.chunk_size,
            backend=self.spec.backend,
        )
        return self._norm(o), state

    def step(self, q, k, v, position_embeddings, state):
        qf, kf = self.features(q, k, position_embeddings)
        o, state = ops.linear_attention_step(qf, kf, v, state, log_decay=self.log_decay,
                                             normalize=self.normalize, eps=self.spec.eps, backend=self.spec.backend)
        return self._norm(o), state

    def state_bytes(self, dtype):
        g = self.geometry
        groups = g.n_heads // g.n_kv_heads if self.log_decay is not None else 1
        return g.n_kv_heads * groups * g.head_dim * (g.head_dim + int(self.normalize)) * 4
