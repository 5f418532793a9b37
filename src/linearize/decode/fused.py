"""Fewer matrix products per layer while decoding: q/k/v as one product, a gated MLP's gate/up as one.

``fused_projections(model)`` puts the adapter's fused modules (``models.fusion``) in place for the
length of a ``with`` block (``FastDecoder.generate`` wraps each call in it) and takes them out on
the way out, exceptions included:

* each converted layer gets the ``FusedLinear`` its adapter builds (``Adapter.fuse_qkv``) as its
  ``fused_qkv`` submodule, which the adapter's ``qkv`` then uses in place of the three projections;
* each decoder layer's MLP is replaced by the stand-in its adapter builds (``Adapter.fuse_mlp``: a
  ``FusedGatedMLP`` for the gated MLPs of the Llama family), and put back afterwards.

The adapters fuse only where it is exactly the same function (``models.fusion.fusable``): plain
``nn.Linear`` projections (not LoRA wrappers, quantized or parametrized layers), no hooks or
patched ``forward``, one device and dtype, biases all present or all absent. Kept softmax layers
(the teacher's own attention) and GPT-NeoX (whose q/k/v already come from one product) are left
alone. The fused weights are built on entry from the current parameters: a snapshot for inference.

With ``kernels`` (``FastDecoder``'s default on CUDA with Triton, unless the step is compiled), two
elementwise parts of each layer become one Triton launch each (``models.fusion``), where the module
computes exactly the kernel's PyTorch twin (``ops.norm_act``):

* every RMSNorm module of a transformers family (hidden states, the final norm, Qwen3's and Gemma 3's
  per-head q/k norms) is replaced by a ``FusedRMSNorm`` (about eight launches become one);
* the fused gated MLPs compute ``act(gate) * up`` in one launch (two before).

* the residual adds of the pre-norm decoder layers (Llama, Mistral, Qwen2/3, SmolLM3: ``models.fusion.PRE_NORM_LAYERS``)
  run with the norm after each (``ResidualFusion`` as the layer's forward): the attention's add with the
  layer's second norm, the MLP's with the next layer's input norm or the model's final one (two launches a layer
  fewer). Gemma's layers (norms after the attention and the MLP too) keep their own forward.
``rope_table(model, length)`` (``FastDecoder.generate`` wraps each call in it too) has the model's rotary embedding
read tables of the call's positions, built once by the module (``models.fusion.RopeTable``): a gather each instead of
its eight launches a step, the same bits; ``ROPE_TABLE = False`` turns it off.
``KERNELS = False`` turns the kernels off for every decoder that is not told otherwise (a
before-and-after switch for benchmarks: ``dev/gpu_hybrid.sh decode-default``).
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..convert.layers import mixers
from ..errors import LinearizeError
from ..models import get_adapter
from ..models.fusion import FUSED_QKV, FusedGatedMLP, FusedRMSNorm, ResidualFusion, RopeTable, residual_fusable

KERNELS = True  # the Triton norm and activation kernels by default where they can run (kernels_default)
ROPE_TABLE = True  # the rotary embedding read from tables for a decoding call (rope_table)


def kernels_default(model: nn.Module) -> bool:
    """Whether a decoder not told otherwise uses the norm and activation kernels: ``KERNELS``, the
    model's parameters on CUDA and Triton importable."""
    from ..ops.availability import triton_available

    param = next(model.parameters(), None)
    return KERNELS and param is not None and param.device.type == "cuda" and triton_available()


@contextlib.contextmanager
def fused_projections(model: nn.Module, enabled: bool = True, kernels: bool = False):
    """Within the block, converted layers compute q/k/v and gated MLPs gate/up with one product
    each (``enabled``), and with ``kernels`` RMSNorms and gated activations run as one Triton
    kernel each (CUDA, or Triton's interpreter); on exit every module is as it was, exceptions
    included. Yields the number of modules fused or replaced."""
    undo = []
    try:
        if kernels:
            _fuse_norms(model, undo)
        if enabled:
            _fuse(model, undo, kernels)
        if kernels:
            _fuse_residuals(model, undo)
        yield len(undo)
    finally:
        for restore in reversed(undo):
            restore()


def _fuse(model: nn.Module, undo: list, kernels: bool) -> None:
    try:
        adapter = get_adapter(model.config)
    except LinearizeError:  # a family linearize has no adapter for: nothing it knows how to fuse
        return
    for m in mixers(model).values():
        if FUSED_QKV in m._modules:  # fused by an enclosing block already
            continue
        fused = m.adapter.fuse_qkv(m)
        if fused is not None:
            m.add_module(FUSED_QKV, fused)
            undo.append(lambda m=m: delattr(m, FUSED_QKV))
    for layer in adapter.layers(model):
        mlp = adapter.mlp(layer)
        if isinstance(mlp, FusedGatedMLP):  # fused by an enclosing block already
            continue
        fused = adapter.fuse_mlp(layer, kernels=kernels)
        if fused is not None:
            adapter.set_mlp(layer, fused)
            undo.append(lambda layer=layer, mlp=mlp: adapter.set_mlp(layer, mlp))


def _fuse_residuals(model: nn.Module, undo: list) -> None:
    """Each pre-norm decoder layer ``residual_fusable`` says may, with ``ResidualFusion`` as its forward: its residual
    adds computed with the norms after them (the last layer's with the model's final norm)."""
    try:
        layers = list(get_adapter(model.config).layers(model))
    except LinearizeError:
        return
    final = getattr(model.base_model, "norm", None)
    for i, layer in enumerate(layers):
        if not residual_fusable(layer):
            continue
        after = getattr(layers[i + 1], "input_layernorm", None) if i + 1 < len(layers) else final
        layer.forward = ResidualFusion(layer, after if isinstance(after, FusedRMSNorm) else None)
        undo.append(lambda layer=layer: vars(layer).pop("forward", None))


def _fuse_norms(model: nn.Module, undo: list) -> None:
    """Every RMSNorm module ``FusedRMSNorm.of`` knows, wherever it sits, replaced in its parent."""
    for parent in list(model.modules()):
        if isinstance(parent, FusedRMSNorm):  # replaced by an enclosing block already
            continue
        for name, child in list(parent._modules.items()):
            fused = FusedRMSNorm.of(child) if child is not None else None
            if fused is not None:
                setattr(parent, name, fused)
                undo.append(lambda parent=parent, name=name, child=child: setattr(parent, name, child))


@contextlib.contextmanager
def rope_table(model: nn.Module, length: int):
    """Within the block, ``model``'s rotary embedding (its base model's ``rotary_emb``) reads tables of the positions
    below ``length`` (``models.fusion.RopeTable``: one gather each a call, the same bits) where its RoPE type allows
    (``ROPE_TABLE``; ``FastDecoder.generate``: the prompt and its new tokens stay below their total); on exit the
    module is back, exceptions included. Yields whether the tables are in place."""
    base = getattr(model, "base_model", None)
    rotary = getattr(base, "rotary_emb", None)
    table = None
    if ROPE_TABLE and isinstance(rotary, nn.Module) and not isinstance(rotary, RopeTable):
        weight = model.get_input_embeddings().weight
        types = getattr(model.config.get_text_config(), "layer_types", None) or ()
        table = RopeTable.of(rotary, length, weight.dtype, weight.device, types)
    if table is None:
        yield False
        return
    base.rotary_emb = table
    try:
        yield True
    finally:
        base.rotary_emb = rotary
