"""Which layers of a model are converted: placing a spec's mixers (``apply_spec``) and finding them
(``mixers``). A module of the conversion wing apart from ``convert`` itself: ``hf`` (a
``linearize_*`` model class converts its layers as its recorded spec says) and ``decode`` use it too."""

from __future__ import annotations

from torch import nn

from ..errors import LinearizeError
from ..kinds import mixer_class
from ..mixers import Mixer
from ..mixers.window import WindowSoftmax
from ..models import get_adapter
from ..spec import Spec


def apply_spec(model: nn.Module, spec: Spec) -> nn.Module:
    """Replace ``model``'s attention layers (all but ``spec.keep_softmax``) by ``spec``'s mixers, in
    place; with ``spec.softmax_window`` (or a layer's own in ``spec.softmax_windows``), a kept layer without a
    sliding window of its own by its softmax over that many tokens (``mixers/window.py``). Writes nothing to the
    config: ``convert`` records the spec, and the ``linearize_*`` model classes call this on a model their
    recorded spec describes."""
    adapter = get_adapter(model.config)
    layers = adapter.layers(model)
    n_layers = len(layers)
    bad = [i for i in spec.keep_softmax if not 0 <= i < n_layers]
    if bad:
        raise LinearizeError(f"keep_softmax {bad} out of range: the model has layers 0..{n_layers - 1}")
    # a layer's own window names a kept layer (a student converting every layer, as before auto:K chooses, has none)
    stray = [i for i, _ in spec.softmax_windows
             if not 0 <= i < n_layers or (spec.keep_softmax and i not in spec.keep_softmax)]
    if stray:
        raise LinearizeError(f"softmax_window gives layers {stray} windows of their own, but they keep no softmax "
                             f"(keep_softmax: {list(spec.keep_softmax)}; the model has layers 0..{n_layers - 1})")
    mixer_cls = mixer_class(spec.kind)
    for i, layer in enumerate(layers):
        attn = adapter.attention(layer)
        if i in spec.keep_softmax:
            if spec.window_for(i) and not isinstance(attn, Mixer):
                geometry = adapter.geometry(attn, model.config)
                if geometry.sliding_window is None:
                    window = WindowSoftmax(attn, adapter, geometry, spec, i, n_layers)
                    if spec.softmax_window_sinks:  # past the teacher's context, the sinks at its last position
                        window.set_reach(sink_reach(model.config), adapter.rope_tables(model, i))
                    adapter.set_attention(layer, window)
            continue
        geometry = adapter.geometry(attn, model.config)
        adapter.set_attention(layer, mixer_cls(attn, adapter, geometry, spec, i, n_layers))
    return model


def sink_reach(config) -> int | None:
    """The farthest position from which a window layer scores its sinks as they are: the teacher's context
    (``max_position_embeddings``) less one; None where the config names none."""
    n = getattr(config, "max_position_embeddings", None)
    return n - 1 if isinstance(n, int) and n > 1 else None


def mixers(model: nn.Module) -> dict[int, Mixer]:
    """The converted layers of a student, by layer index."""
    adapter = get_adapter(model.config)
    # keyed by the mixer's own index: a model may run a slice of its layers (block-wise training)
    return {m.layer_idx: m for layer in adapter.layers(model) if isinstance(m := adapter.attention(layer), Mixer)}
