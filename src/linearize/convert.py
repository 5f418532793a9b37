"""Teacher + spec -> student: swap each layer's attention for a linear-cost mixer.

The mixer adopts the teacher's projection modules under their own names, so the student's state
dict uses the teacher's keys plus the new parameters (feature maps, window weights, GroupNorm).
The spec is recorded as ``config.linearize``; ``linearize.load`` rebuilds the model from it.
"""

from __future__ import annotations

import copy

from torch import nn

from . import __version__
from .errors import LinearizeError
from .kinds import mixer_class
from .mixers import Mixer
from .models import get_adapter
from .spec import Spec


def convert(teacher: nn.Module, spec: Spec | dict | str | None = None, keep_softmax=None,
            inplace: bool = False, **overrides) -> nn.Module:
    """Return a student whose attention layers (all but ``keep_softmax``) are linear-cost mixers.

    ``spec`` is a ``Spec``, a dict with its keys, a kind name (``"lolcats"``, ``"linear"``,
    ``"supra"``) or None (LoLCATs defaults); ``overrides`` set single keys. The teacher is left
    untouched unless ``inplace``.
    """
    if keep_softmax is not None:
        overrides["keep_softmax"] = keep_softmax
    spec = Spec.coerce(spec, **overrides)
    adapter = get_adapter(teacher.config)
    if getattr(teacher.config, "linearize", None):
        raise LinearizeError("this model is already linearized; convert a softmax teacher")
    layers = adapter.layers(teacher)
    n_layers = len(layers)
    bad = [i for i in spec.keep_softmax if not 0 <= i < n_layers]
    if bad:
        raise LinearizeError(f"keep_softmax {bad} out of range: the model has layers 0..{n_layers - 1}")

    student = teacher if inplace else copy.deepcopy(teacher)
    mixer_cls = mixer_class(spec.kind)
    for i, layer in enumerate(adapter.layers(student)):
        if i in spec.keep_softmax:
            continue
        attn = adapter.attention(layer)
        geometry = adapter.geometry(attn, student.config)
        adapter.set_attention(layer, mixer_cls(attn, adapter, geometry, spec, i, n_layers))
    student.config.linearize = {"spec": spec.to_dict(), "keep_softmax": list(spec.keep_softmax), "version": __version__}
    return student


def mixers(model: nn.Module) -> dict[int, Mixer]:
    """The converted layers of a student, by layer index."""
    adapter = get_adapter(model.config)
    # keyed by the mixer's own index: a model may run a slice of its layers (block-wise training)
    return {m.layer_idx: m for layer in adapter.layers(model) if isinstance(m := adapter.attention(layer), Mixer)}


def spec_of(model: nn.Module) -> Spec | None:
    """The spec a student was converted with (None for a plain softmax model)."""
    info = getattr(model.config, "linearize", None)
    return Spec.coerce(info["spec"]) if info else None
