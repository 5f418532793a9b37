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
XATL's ``qkv`` transfer item starts W_Q, W_K and W_V from the teacher's attention of the same layer
instead (``retention_from_attention``; W_O is the ``wo`` item, W_G and the GroupNorm stay fresh):

- W_V: exact. Each retention head reads the values of the teacher's key/value head it shares
  (grouped-query teachers: key/value head ``i // (H / Hk)``, as the teacher's own ``repeat_kv``),
  at the teacher's head width, so ``X W_V`` is the teacher's repeated value projection.
- W_Q, W_K: the retention keys are half the teacher's head width, so each head keeps d_k of the
  teacher's D rows (keys repeated per query head as values are): whole rotation pairs of RoPE's
  rotate-half layout, evenly spaced in frequency. Retention pair j (features j and j + d_k/2) takes
  the teacher's pair ``p_j = j * (D/2) // (d_k/2)`` (features p_j and p_j + D/2), so with d_k = D/2
  every other pair, and the angles ``t * theta`` coincide when the teacher's RoPE base is RetNet's
  10000. The rows are copied exactly; what differs from the teacher is the score (decay in place of
  softmax, d_k^-1/2 scaling) and what is dropped: q/k/v biases (Qwen2) and per-head QK-norms (Qwen3,
  Gemma 3), which the retention does not have, and for partial-rotary teachers (GPT-NeoX) the pairs
  are the same row selection without being rotation pairs beyond the rotary dims.

The parallel/chunked and recurrent forms are ``ops.linear_attention`` with ``log_decay`` and
``normalize=False`` (fla's chunk_simple_gla on CUDA); the state is ``[B, H, 1, d_k, d_v]`` fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops
from ..errors import LinearizeError
from ..models.fusion import fusable
from .base import drop_padding, head_group_norm
from .decay import log_decay
from .fresh import FreshMixer


def rotary_pairs(head_dim: int, key_dim: int) -> torch.Tensor:
    """The teacher's per-head features a ``key_dim``-wide retention query/key keeps: whole RoPE pairs
    (rotate-half layout), evenly spaced; ``[key_dim]`` indices into ``0..head_dim-1``."""
    half, k_half = head_dim // 2, key_dim // 2
    if not 0 < k_half <= half:
        raise LinearizeError(f"a retention key of width {key_dim} cannot take pairs of a head of width {head_dim}")
    first = torch.arange(k_half) * half // k_half
    return torch.cat([first, first + half])


def retention_from_attention(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, key_dim: int):
    """RetNet's W_Q ``[H * d_k, hidden]``, W_K ``[H * d_k, hidden]`` and W_V ``[H * D, hidden]`` from a
    teacher's per-head W_Q ``[H, D, hidden]`` and W_K, W_V ``[Hk, D, hidden]`` (see the module docstring)."""
    h, d, hidden = wq.shape
    hk = wk.shape[0]
    if hk < 1 or h % hk or wv.shape[0] != hk:
        raise LinearizeError(f"{h} query heads cannot share {hk} key/value heads evenly")
    wk, wv = wk.repeat_interleave(h // hk, dim=0), wv.repeat_interleave(h // hk, dim=0)
    keep = rotary_pairs(d, key_dim).to(wq.device)
    return (wq[:, keep].reshape(h * key_dim, hidden), wk[:, keep].reshape(h * key_dim, hidden),
            wv.reshape(h * d, hidden))


class RetNetRetention(FreshMixer):
    kind = "retnet"
    keeps_output = True
    teacher_qkv = ("wq", "wk", "wv")

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
        self.register_fixed_buffers()

    def load_teacher_qkv(self, attn) -> None:
        """W_Q, W_K, W_V from the teacher's attention ``attn`` of this layer (``retention_from_attention``)."""
        wq, wk, wv = self.adapter.qkv_weights(attn, self.geometry)
        if wq.shape[1] != self.value_dim:
            raise LinearizeError(f"the teacher's heads are {wq.shape[1]} wide, the retention's values {self.value_dim}")
        with torch.no_grad():
            for name, weight in zip(self.teacher_qkv, retention_from_attention(wq, wk, wv, self.key_dim)):
                getattr(self, name).weight.copy_(weight)

    def fixed_buffers(self):
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.key_dim, 2, dtype=torch.float64) / self.key_dim)
        inv_freq = inv_freq.repeat(2)  # theta_i for each of the d_k features: the two halves repeat
        return {"log_decay": log_decay(self.spec.decay, self.n_heads, self.layer_idx, self.n_layers,
                                    horizon=self.spec.decay_horizon),
                "inv_freq": inv_freq.float()}

    def rotation(self, t: int, offset, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of RetNet's angles t * theta for the positions offset .. offset + t - 1 (offset: an
        int, or a 0-d tensor), as ``[2, 1, T, 1, d_k]`` tables in ``dtype``: row 0 rotates queries, row 1
        keys with their d_k^-1/2 folded in; sin carries rotate_half's sign (``[-sin, sin]`` over the
        halves), so that ``x cos + [x2, x1] sin`` is the rotation."""
        acc = torch.promote_types(dtype, torch.float32)
        pos = torch.arange(t, device=device, dtype=acc) + offset
        angles = pos[:, None] * self.inv_freq.to(acc)
        cos, sin = angles.cos(), angles.sin()
        half = self.key_dim // 2
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        scale = self.key_dim ** -0.5
        return torch.stack([cos, cos * scale, sin, sin * scale]).to(dtype).view(2, 2, 1, t, 1, self.key_dim).unbind(0)

    def rotate(self, qk, offset):
        """RetNet's relative position on ``qk`` ``[2, B, T, H, d_k]`` (queries, keys): rotate q_t and k_t
        by t * theta (t counted from the cache) and scale the keys by d_k^-1/2. Returns ``(q, k)``,
        ``[B, H, T, d_k]`` views of ``[B, T, H, d_k]`` storage each (fla's layout: no copy there)."""
        cos, sin = self.rotation(qk.shape[2], offset, qk.dtype, qk.device)
        a, b = qk.chunk(2, dim=-1)
        # the rotated halves first: the cat writes [2, B, T, H, d_k] contiguously, and the sum keeps
        # its first operand's layout, whatever layout qk has
        out = torch.cat([b, a], dim=-1) * sin + qk * cos
        q, k = out.unbind(0)
        return q.transpose(1, 2), k.transpose(1, 2)

    def project(self, x):
        """``x [W_Q; W_K; W_V; W_G]``: queries and keys ``[2, B, T, H, d_k]``, values and gate ``[B, H, T, d_v]``.

        Over a sequence (training, prefill) one product with the concatenated weights, where that is
        the same function (``models.fusion.fusable``): one launch and one cast of ``x`` each way instead of four,
        for one copy of the small weights; a decode step reads the four weights in place.
        """
        b, t, _ = x.shape
        h, dk, dv = self.n_heads, self.key_dim, self.value_dim
        linears = (self.wq, self.wk, self.wv, self.wg)
        if t > 1 and fusable(*linears):
            weight = torch.cat([m.weight for m in linears])
            bias = None if self.wq.bias is None else torch.cat([m.bias for m in linears])
            qk, v, gate = F.linear(x, weight, bias).split([2 * h * dk, h * dv, h * dv], dim=-1)
        else:
            qk, v, gate = torch.cat([self.wq(x), self.wk(x)], dim=-1), self.wv(x), self.wg(x)
        qk = qk.view(b, t, 2, h, dk).permute(2, 0, 1, 3, 4)
        return qk, v.view(b, t, h, dv).transpose(1, 2), gate.view(b, t, h, dv).transpose(1, 2)

    def mix(self, x, state, offset, want_state):
        qk, v, gate = self.project(x)
        q, k = self.rotate(qk, offset)
        k, v = drop_padding(self.key_mask, k, v)  # left padding: the state stays zero until the first real token
        if state is not None and x.shape[1] == 1:
            o, state = ops.linear_attention_step(q, k, v, state, log_decay=self.log_decay, normalize=False,
                                                 backend=self.spec.backend)
        else:
            o, state = ops.linear_attention(
                q, k, v, log_decay=self.log_decay, normalize=False, initial_state=state,
                output_final_state=want_state, chunk_size=self.spec.chunk_size, backend=self.spec.backend,
            )
        return self.adapter.out(self, head_group_norm(o, self.group_norm, gate)), state

    def state_bytes(self, dtype):
        return self.n_heads * self.key_dim * self.value_dim * 4

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.n_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, decay={self.spec.decay}")
