"""Fewer matrix products per layer while decoding: q/k/v as one product, an MLP's gate/up as one.

At batch 1 a decode step is bound by kernel launches, not arithmetic (each small product costs
about the same few microseconds whatever its width), so computing a converted layer's q, k and v
from one weight ``[Wq; Wk; Wv]`` and a gated MLP's gate and up from ``[Wg; Wu]`` saves three
launches per layer. ``fused_projections(model)`` sets this up for the length of a ``with`` block
(``FastDecoder.generate`` wraps each call in it) and undoes it on the way out, exceptions included:

* each converted Llama-family layer (a ``Mixer``) gets ``_fused_qkv = (weight, bias, sizes)``,
  which the adapter's ``qkv`` uses in place of the three projections;
* each gated MLP of a known class gets an instance-level ``forward`` computing
  ``down_proj(act_fn(gate) * up)`` from one product, reading ``_fused_gate_up``.

The concatenated weights are built on entry from the current parameters (a snapshot: they are
for inference, and a change to the weights inside the block is not seen), and cost extra memory of
the size of the fused weights while the block runs. Fusion happens only where it is exactly the
same function: the projections are plain ``nn.Linear`` (not LoRA wrappers, quantized or
parametrized layers), with no hooks or patched ``forward``, on one device and dtype, with biases
all present or all absent. Kept softmax layers (the teacher's own attention) and GPT-NeoX (whose
q/k/v already come from one product) are left alone.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.nn import functional as F

# transformers' gated MLPs whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "SmolLM3MLP",
                        "GemmaMLP", "Gemma2MLP", "Gemma3MLP"})


def fusable(*linears) -> bool:
    """Whether one product with the concatenated weights computes exactly what ``linears`` do."""
    if not all(type(m) is nn.Linear for m in linears):  # exact type: no LoRA, quantized, parametrized
        return False
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in linears):
        return False
    if len({m.in_features for m in linears}) != 1 or any(m.weight.is_meta for m in linears):
        return False
    if len({m.bias is None for m in linears}) != 1:
        return False
    tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]
    return len({(t.device, t.dtype) for t in tensors}) == 1


def _concat(linears) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return weight, bias, tuple(m.out_features for m in linears)


def _gate_up_forward(self, x):
    """A gated MLP's forward with gate and up from one product (set on the instance)."""
    weight, bias, sizes = self._fused_gate_up
    gate, up = F.linear(x, weight, bias).split(sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _mixers_to_fuse(model: nn.Module):
    from .mixers import Mixer
    from .models.llama import LlamaFamilyAdapter

    for m in model.modules():
        if isinstance(m, Mixer) and isinstance(m.adapter, LlamaFamilyAdapter) and "_fused_qkv" not in vars(m):
            parts = [getattr(m, name, None) for name in ("q_proj", "k_proj", "v_proj")]
            if fusable(*parts):
                yield m, parts


def _mlps_to_fuse(model: nn.Module):
    for m in model.modules():
        if type(m).__name__ in GATED_MLPS and "forward" not in vars(m):
            parts = [getattr(m, name, None) for name in ("gate_proj", "up_proj")]
            if fusable(*parts) and callable(getattr(m, "act_fn", None)) and callable(getattr(m, "down_proj", None)):
                yield m, parts


@contextlib.contextmanager
def fused_projections(model: nn.Module, enabled: bool = True):
    """Within the block, converted layers compute q/k/v and gated MLPs gate/up with one product
    each; on exit every module is as it was. Yields the number of modules fused."""
    fused = []
    try:
        if enabled:
            for m, parts in list(_mixers_to_fuse(model)):
                fused.append((m, ("_fused_qkv",)))
                m._fused_qkv = _concat(parts)
            for m, parts in list(_mlps_to_fuse(model)):
                fused.append((m, ("_fused_gate_up", "forward")))
                m._fused_gate_up = _concat(parts)
                m.forward = types.MethodType(_gate_up_forward, m)
        yield len(fused)
    finally:
        for m, names in fused:
            for name in names:
                vars(m).pop(name, None)
