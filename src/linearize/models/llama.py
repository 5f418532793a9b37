"""The Llama family: Llama 2/3, Mistral, Qwen2/Qwen3, SmolLM 2/3, Gemma 1/2/3.

All keep separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (with or without biases), grouped or
multi-query keys, RoPE from their own modeling file, and optionally per-head ``q_norm``/``k_norm``
(Qwen3, Gemma 3) applied before RoPE, a custom ``scaling`` (Gemma's query_pre_attn_scalar) and a
score soft-cap (Gemma 2). SmolLM3 skips RoPE on some layers (``use_rope`` False).
"""

from __future__ import annotations

from .base import Adapter, Geometry, family_function
from .fusion import FUSED_QKV, FusedGatedMLP, FusedLinear


class LlamaFamilyAdapter(Adapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma", "gemma2", "gemma3_text")
    attention_attr = "self_attn"
    part_names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")

    def geometry(self, attn, config) -> Geometry:
        head_dim = attn.head_dim
        n_heads = attn.q_proj.out_features // head_dim
        n_kv = attn.k_proj.out_features // head_dim
        rotary = family_function(attn, "apply_rotary_pos_emb") if getattr(attn, "use_rope", True) else None
        softcap = getattr(config, "attn_logit_softcapping", None)
        window = getattr(attn, "sliding_window", None)
        return Geometry(n_heads, n_kv, head_dim, float(attn.scaling), softcap, rotary, window)

    def qkv(self, m, x):
        b, t, _ = x.shape
        d = m.geometry.head_dim
        fused = m._modules.get(FUSED_QKV)  # one product for the three, while decoding (fuse_qkv)
        if fused is not None:
            q, k, v, *extra = fused(x)
            if extra:  # the mixer's own projections of this input, from the same product
                m.take_projections(extra)
        else:
            q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
        q, k, v = q.view(b, t, -1, d), k.view(b, t, -1, d), v.view(b, t, -1, d)
        if getattr(m, "q_norm", None) is not None:
            q, k = m.q_norm(q), m.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def qkv_weights(self, attn, geometry):
        d = geometry.head_dim
        return tuple(getattr(attn, n).weight.view(-1, d, getattr(attn, n).in_features)
                     for n in ("q_proj", "k_proj", "v_proj"))

    def out(self, m, o):
        b, h, t, d = o.shape
        return m.o_proj(o.transpose(1, 2).reshape(b, t, h * d))

    def fuse_qkv(self, m):
        qkv = [getattr(m, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        extra = m.input_projections()  # (kept apart where they would not fuse exactly)
        fused = FusedLinear.of(*qkv, *extra) if extra else None
        return fused if fused is not None else FusedLinear.of(*qkv)

    def fuse_mlp(self, layer, kernels=False):
        # every MLP of these families is gated, down_proj(act_fn(gate_proj(x)) * up_proj(x)); of()
        # checks that this one still has that structure (plain linears, its class's forward)
        mlp = self.mlp(layer)
        return None if mlp is None else FusedGatedMLP.of(mlp, kernels=kernels)
