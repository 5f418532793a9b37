"""GPT-NeoX / Pythia: one fused ``query_key_value`` projection, partial rotary, ``dense`` output.

The fused projection is laid out per head as [q | k | v]; RoPE covers the first ``rotary_ndims``
dimensions of each head (the family's ``apply_rotary_pos_emb`` reads that from ``cos``). The
parallel residual lives in the decoder layer and is untouched.
"""

from __future__ import annotations

from .base import Adapter, Geometry, family_function


class GPTNeoXAdapter(Adapter):
    model_types = ("gpt_neox",)
    attention_attr = "attention"
    part_names = ("query_key_value", "dense")

    def geometry(self, attn, config) -> Geometry:
        d = attn.head_size
        n = config.num_attention_heads
        return Geometry(n, n, d, float(attn.scaling), None, family_function(attn, "apply_rotary_pos_emb"))

    def qkv(self, m, x):
        b, t, _ = x.shape
        d = m.geometry.head_dim
        qkv = m.query_key_value(x).view(b, t, -1, 3 * d).transpose(1, 2)
        return qkv.chunk(3, dim=-1)

    def qkv_weights(self, attn, geometry):
        w = attn.query_key_value.weight  # per head [q | k | v], as qkv reads it
        return w.view(geometry.n_heads, 3, geometry.head_dim, w.shape[1]).unbind(1)

    def out(self, m, o):
        b, h, t, d = o.shape
        return m.dense(o.transpose(1, 2).reshape(b, t, h * d))
