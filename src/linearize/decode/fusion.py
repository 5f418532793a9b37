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
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..convert import mixers
from ..errors import LinearizeError
from ..models import get_adapter
from ..models.fusion import FUSED_QKV


@contextlib.contextmanager
def fused_projections(model: nn.Module, enabled: bool = True):
    """Within the block, converted layers compute q/k/v and gated MLPs gate/up with one product
    each; on exit every module is as it was. Yields the number of modules fused."""
    undo = []
    try:
        if enabled:
            _fuse(model, undo)
        yield len(undo)
    finally:
        for restore in reversed(undo):
            restore()


def _fuse(model: nn.Module, undo: list) -> None:
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
        mlp, fused = adapter.mlp(layer), adapter.fuse_mlp(layer)
        if fused is not None:
            adapter.set_mlp(layer, fused)
            undo.append(lambda layer=layer, mlp=mlp: adapter.set_mlp(layer, mlp))
