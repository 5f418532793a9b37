"""What a mixer needs to know about a family's attention: where q/k/v/o live and how RoPE is applied.

An adapter reads the teacher's attention module once (``geometry``), names the submodules the mixer
adopts (``parts``: they keep their names, so checkpoints and LoRA targets match the teacher's), and
then works on any module holding those parts: ``qkv`` (projections and QK-norm, before RoPE),
``rope`` and ``out``.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .fusion import FusedLinear, ask_rope


@dataclass
class Geometry:
    """The shape and scoring rules of one attention layer."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float  # multiplies q.k in the softmax
    softcap: float | None  # Gemma 2 style tanh cap on softmax scores, or None
    rotary: Callable | None  # (q, k, cos, sin) -> (q, k) from the family's modeling file; None: no RoPE
    sliding_window: int | None = None  # the teacher layer's own softmax window (Mistral, Gemma 2/3), if any


class Adapter:
    """Base adapter; subclasses set ``model_types`` and ``attention_attr`` and the three projections."""

    model_types: tuple[str, ...] = ()
    attention_attr: str = "self_attn"
    mlp_attr: str = "mlp"
    part_names: tuple[str, ...] = ()

    @property
    def lora_targets(self) -> list[str]:
        """Module names LoRA adapts by default: the attention projections (not the QK-norms)."""
        return [n for n in self.part_names if not n.endswith("_norm")]

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.base_model.layers

    def attention(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attention_attr)

    def set_attention(self, layer: nn.Module, module: nn.Module) -> None:
        setattr(layer, self.attention_attr, module)

    def parts(self, attn: nn.Module) -> dict[str, nn.Module]:
        return {name: getattr(attn, name) for name in self.part_names if getattr(attn, name, None) is not None}

    def geometry(self, attn: nn.Module, config) -> Geometry:
        raise NotImplementedError

    def qkv(self, m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> q [B, H, T, D], k and v [B, Hk, T, D], before RoPE."""
        raise NotImplementedError

    def qkv_weights(self, attn: nn.Module, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The teacher attention's projection weights per head: W_Q ``[H, D, hidden]``, W_K and W_V
        ``[Hk, D, hidden]`` (views of ``attn``'s weights; biases and QK-norms are not included)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its q/k/v weights")

    def rope_tables(self, model: nn.Module, layer_idx: int) -> Callable | None:
        """``position_ids [B, T] -> (cos, sin) [B, T, R]``: the RoPE tables layer ``layer_idx`` of ``model`` rotates by,
        from the model's own rotary embedding (its base model's ``rotary_emb``; a family whose one module serves
        several layer types is asked for this layer's); None without one."""
        rotary = getattr(model.base_model, "rotary_emb", None)
        if not isinstance(rotary, nn.Module):
            return None
        types = getattr(model.config, "layer_types", None)
        wants_type = _parameters(rotary.forward).get("layer_type")
        if wants_type is not None and types:
            return RopeTables(rotary, types[layer_idx])
        if wants_type is not None and wants_type.default is wants_type.empty:
            return None  # a layer type it cannot be told
        return RopeTables(rotary)

    def rope(self, m: nn.Module, q, k, position_embeddings):
        if m.geometry.rotary is None or position_embeddings is None:
            return q, k
        cos, sin = position_embeddings
        return m.geometry.rotary(q, k, cos, sin)

    def out(self, m: nn.Module, o: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] -> [B, T, hidden]."""
        raise NotImplementedError

    # -- fewer products while decoding (``models.fusion``; ``linearize.decode.fused`` applies them)
    def fuse_qkv(self, m: nn.Module) -> FusedLinear | None:
        """A module computing a converted layer's q, k and v projections with one product, which
        ``qkv`` uses while it is ``m``'s ``fused_qkv`` submodule; None where the family's q/k/v are one
        product already or one product would not be exactly the same function (LoRA, mixed biases...).
        The mixer's own projections of the same input (``m.input_projections()``: a gated state's gate)
        join the product where they can, and ``qkv`` hands their outputs to ``m.take_projections``."""
        return None

    def mlp(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer, self.mlp_attr, None)

    def set_mlp(self, layer: nn.Module, module: nn.Module) -> None:
        setattr(layer, self.mlp_attr, module)

    def fuse_mlp(self, layer: nn.Module, kernels: bool = False) -> nn.Module | None:
        """A stand-in for ``layer``'s MLP computing the same function with fewer products (the gated
        MLP's gate and up as one), or None where the family's MLP has nothing to fuse. ``kernels``:
        also fewer elementwise kernels where the stand-in has them (the gated activation as one
        Triton launch, ``models.fusion.FusedGatedMLP``; CUDA only)."""
        return None


def family_function(module: nn.Module, name: str) -> Callable | None:
    """A function (e.g. ``apply_rotary_pos_emb``) from the modeling file that defines ``module``."""
    return getattr(sys.modules[type(module).__module__], name, None)


@functools.cache
def rotates_half(rotary: Callable | None, head_dim: int) -> bool:
    """Whether ``rotary`` (a family's ``apply_rotary_pos_emb``, see ``Geometry``) is RoPE by rotating
    halves over the first ``cos.shape[-1]`` dims of each head, ``x * cos + [-x2, x1] * sin`` and the
    rest unchanged (what fused kernels compute). No RoPE (None) qualifies. Checked on random
    inputs with full and half rotary dims (a function that refuses half dims never meets them).
    Runs on the CPU whatever the default device (a model built on the meta device asks too)."""
    if rotary is None:
        return True
    with torch.device("cpu"):
        return _rotates_half(rotary, head_dim)


def _rotates_half(rotary: Callable, head_dim: int) -> bool:
    g = torch.Generator().manual_seed(0)
    for r in (head_dim, head_dim // 4 * 2):
        x = torch.randn(2, 1, 1, head_dim, generator=g, dtype=torch.float64)
        cos, sin = (torch.randn(2, 1, r, generator=g, dtype=torch.float64) for _ in range(2))
        half = r // 2
        turned = torch.cat([-x[..., half:r], x[..., :half]], dim=-1)
        want = torch.cat([x[..., :r] * cos[:, None] + turned * sin[:, None], x[..., r:]], dim=-1)
        try:
            got = rotary(x, x.clone(), cos, sin)[0]
        except Exception:
            if r == head_dim:
                return False
            continue
        if got.shape != want.shape or not torch.allclose(got, want):
            return False
    return True


class RopeTables:
    """``position_ids [B, T] -> (cos, sin) [B, T, R]`` (fp32) from a model's rotary embedding module (for one layer
    type where it serves several); picklable, unlike a closure."""

    def __init__(self, rotary: nn.Module, layer_type: str | None = None):
        self.rotary, self.layer_type = rotary, layer_type

    def __call__(self, ids: torch.Tensor):
        return ask_rope(self.rotary, torch.zeros((), device=ids.device), ids, self.layer_type)


def _parameters(fn: Callable) -> dict:
    """``fn``'s parameters by name (``inspect.Parameter``s); empty where it has no signature to read."""
    import inspect

    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """RoPE as ``rotates_half`` describes it, on one tensor (queries and keys together, say): ``x``
    ``[B, H, T, D]`` and ``cos``/``sin`` ``[B, T, R]``, ``R <= D`` (``unsqueeze_dim=2`` for ``[B, T, H, D]``).

    Bit for bit the families' ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) * sin``
    computed as ``roll(x) * [-sin1, sin2]``: the sign moves to ``sin``, which needs no gradient, and
    a roll is one operation forward and backward where splitting, negating and concatenating
    ``x``'s halves are several (most of them in the backward).
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    half = r // 2
    rot = x[..., :r] if r < x.shape[-1] else x
    out = rot * cos + rot.roll(half, dims=-1) * torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return out if rot is x else torch.cat([out, x[..., r:]], dim=-1)
