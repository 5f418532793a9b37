"""RetNet multi-scale retention (Sun et al. 2023) as a mixer inside the teacher's decoder layer (XATL).

    Q = rot(X W_Q),  K = rot(X W_K) d_k^-1/2,  V = X W_V
    Y_h = sum_{s<=t} gamma_h^(t-s) (q_t . k_s) v_s            gamma_h = 1 - 2^(-5-h)
    out = (GroupNorm_heads(Y) * swish(X W_G)) W_O

Heads follow the teacher (``n_heads`` query heads); as in the paper the value width is twice the
query/key width: each head reads values of the teacher's head width (so ``W_O`` has the teacher's
shape and can be transferred) and queries/keys of half of it. ``rot`` is RetNet's relative
position (xPos without the length extrapolation scale: a rotation by position x theta,
theta_i = 10000^(-2i/d_k)), applied from the number of tokens the layer's cache has absorbed.

W_Q, W_K, W_V, W_G and the GroupNorm are new (``wq``/``wk``/``wv``/``wg``/``group_norm``, names that
never collide with the teacher's); W_O is the teacher's ``o_proj`` (``dense`` for GPT-NeoX).
The parallel/chunked and recurrent forms are ``ops.linear_attention`` with ``log_decay`` and
``normalize=False`` (fla's chunk_simple_gla on CUDA); the state is ``[B, H, 1, d_k, d_v]`` fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops
from ..errors import LinearizeError
from .base import drop_padding, head_group_norm
from .decay import log_decay
from .fresh import FreshMixer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RetNetRetention(FreshMixer):
    kind = "retnet"
    keeps_output = True

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        if spec.norm != "group":
            raise LinearizeError("retnet normalises each head with GroupNorm: use norm group (the default)")
        h = geometry.n_heads
        if self.out_width % h:
            raise LinearizeError(f"the output projection reads {self.out_width} features, not a multiple of {h} heads")
        self.n_heads = h
        self.value_dim = self.out_width // h
        self.key_dim = max(2, self.value_dim // 4 * 2)  # half the value width, even for the rotation
        d = self.hidden_size
        self.wq = self.fresh_linear(d, h * self.key_dim)
        self.wk = self.fresh_linear(d, h * self.key_dim)
        self.wv = self.fresh_linear(d, h * self.value_dim)
        self.wg = self.fresh_linear(d, h * self.value_dim)
        self.group_norm = self.new_parameters_like(nn.GroupNorm(h, h * self.value_dim, eps=1e-6))
        decay = log_decay(spec.decay, h, layer_idx, n_layers)
        self.register_buffer("log_decay", None if decay is None else decay.to(self.teacher_device), persistent=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.key_dim, 2, dtype=torch.float64) / self.key_dim)
        self.register_buffer("inv_freq", inv_freq.float().to(self.teacher_device), persistent=False)

    def rotate(self, q, k, offset: int):
        """RetNet's relative position: rotate q_t and k_t by t * theta (t counted from the cache)."""
        t = q.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        pos = torch.arange(t, device=q.device, dtype=acc) + offset  # offset: int or 0-d tensor
        angles = pos[:, None] * self.inv_freq.to(acc)[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _heads(self, x, proj, width):
        b, t, _ = x.shape
        return proj(x).view(b, t, self.n_heads, width).transpose(1, 2)

    def mix(self, x, state, offset, want_state):
        q = self._heads(x, self.wq, self.key_dim)
        k = self._heads(x, self.wk, self.key_dim)
        v = self._heads(x, self.wv, self.value_dim)
        q, k = self.rotate(q, k, offset)
        k = k * self.key_dim ** -0.5
        k, v = drop_padding(self.key_mask, k, v)  # left padding: the state stays zero until the first real token
        if state is not None and x.shape[1] == 1:
            o, state = ops.linear_attention_step(q, k, v, state, log_decay=self.log_decay, normalize=False,
                                                 backend=self.spec.backend)
        else:
            o, state = ops.linear_attention(
                q, k, v, log_decay=self.log_decay, normalize=False, initial_state=state,
                output_final_state=want_state, chunk_size=self.spec.chunk_size, backend=self.spec.backend,
            )
        gate = F.silu(self._heads(x, self.wg, self.value_dim))
        return self.adapter.out(self, head_group_norm(o, self.group_norm) * gate), state

    def state_bytes(self, dtype):
        return self.n_heads * self.key_dim * self.value_dim * 4

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.n_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, decay={self.spec.decay}")
