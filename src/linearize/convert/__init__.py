"""Teacher + spec -> student: swap each layer's attention for a linear-cost mixer.

The mixer adopts the teacher's projection modules under their own names, so the student's state
dict uses the teacher's keys plus the new parameters (feature maps, window weights, GroupNorm).
The spec is recorded as ``config.linearize`` together with where the student came from (the
teacher, the date) and, once a recipe has trained it, how (``linearize.checkpoint.record_training``).
The student becomes its family's ``linearize_<base>`` model class (``linearize.hf``), so that
``save_pretrained`` writes a checkpoint that declares what it is and ``AutoModelForCausalLM`` (or
``linearize.load``) rebuilds it.

The conversion wing: this package is ``convert`` (``from linearize.convert import convert``, and
``linearize.convert`` is this function), ``layers`` places a spec's mixers and finds them (what the
``linearize_*`` classes and the fast decoder use as well), and ``xatl_transfer`` builds an XATL
student from the teacher's shared weights. Below it: ops, mixers, models, spec and kinds; how a
student trains (the LIT schedule among it) is the recipes'.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import logging

from torch import nn

from ..errors import LinearizeError
from ..kinds import mixer_class
from ..models import get_adapter
from ..spec import Spec
from ..version import __version__
from .layers import apply_spec, mixers

logger = logging.getLogger(__name__)

RECORD_FORMAT = 2  # 1: spec, keep_softmax, version only (before the teacher and training were recorded)


def teacher_source(model: nn.Module) -> str | None:
    """Where a teacher came from: what ``load_teacher`` resolved (a HF id, a folder, a .gguf file or
    the embedded model's name), else the config's ``_name_or_path``; None for a model built in memory."""
    source = getattr(model, "linearize_source", None) or getattr(model.config, "_name_or_path", None)
    return str(source) if source else None


def convert(teacher: nn.Module, spec: Spec | dict | str | None = None, keep_softmax=None,
            inplace: bool = False, **overrides) -> nn.Module:
    """Return a student whose attention layers (all but ``keep_softmax``) are linear-cost mixers.

    ``spec`` is a ``Spec``, a dict with its keys, a kind name (``"lolcats"``, ``"linear"``,
    ``"supra"``) or None (LoLCATs defaults); ``overrides`` set single keys. The teacher is left
    untouched unless ``inplace``.

    A teacher layer with its own sliding window that the mixer's window covers (``Mixer.covers``:
    a LoLCATs window at least Gemma 3's or Mistral's) keeps its softmax attention: it never looks
    further back, so it already decodes in constant memory, and a hybrid would add a linear term
    over tokens the teacher never saw. With ``keep_sliding`` every sliding-window layer is kept, whatever
    the window. Such layers join ``keep_softmax`` in the recorded spec.
    """
    if keep_softmax is not None:
        overrides["keep_softmax"] = keep_softmax
    spec = Spec.coerce(spec, **overrides)
    get_adapter(teacher.config)
    if getattr(teacher.config, "linearize", None):
        raise LinearizeError("this model is already linearized; convert a softmax teacher")
    n_layers = len(get_adapter(teacher.config).layers(teacher))
    bad = [i for i in spec.keep_softmax if not 0 <= i < n_layers]
    if bad:  # before the deep copy
        raise LinearizeError(f"keep_softmax {bad} out of range: the model has layers 0..{n_layers - 1}")

    adapter = get_adapter(teacher.config)
    layers = adapter.layers(teacher)
    mixer_cls = mixer_class(spec.kind)
    geometries = [adapter.geometry(adapter.attention(layer), teacher.config) for layer in layers]
    covered = [i for i, g in enumerate(geometries) if i not in spec.keep_softmax
               and (mixer_cls.covers(g, spec) or (spec.keep_sliding and g.sliding_window is not None))]
    if covered:
        why = "keep_sliding" if spec.keep_sliding else f"the {spec.kind} window ({spec.window}) covers it"
        logger.warning("layers %s keep the teacher's sliding-window attention: %s", covered, why)
        spec = dataclasses.replace(spec, keep_softmax=tuple(sorted({*spec.keep_softmax, *covered})))

    student = apply_spec(teacher if inplace else copy.deepcopy(teacher), spec)
    student.config.linearize = {
        "format": RECORD_FORMAT, "spec": spec.to_dict(), "keep_softmax": list(spec.keep_softmax),
        "version": __version__, "teacher": teacher_source(teacher),
        "converted": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "training": [],
    }
    from ..hf import as_linearized

    return as_linearized(student)


def spec_of(model: nn.Module) -> Spec | None:
    """The spec a student was converted with (None for a plain softmax model)."""
    info = getattr(model.config, "linearize", None)
    return Spec.coerce(info["spec"]) if info else None


# spec keys that add or drop no parameters
RUNTIME_KEYS = ("sparse_cache", "sparse_priority", "sparse_anchor", "sparse_linear", "backend", "chunk_size")
SPARSE_RULES = ("sparse_priority", "sparse_anchor", "sparse_linear")  # how a sparse cache works: nothing without one


def respec(model: nn.Module, **changes) -> nn.Module:
    """Change spec keys of a converted model that add no parameters (``RUNTIME_KEYS``), in place, and
    return it: ``respec(linearize.load(path)[0], sparse_cache=64)`` gives a converted LoLCATs
    checkpoint a sparse exact cache without training. The change is recorded in
    ``config.linearize`` (a save afterwards keeps it). A cache given to a model without one takes the
    default rules (``Spec``'s) for what ``changes`` leaves out: the rules its spec recorded did nothing."""
    info = getattr(model.config, "linearize", None)
    if not info:
        raise LinearizeError("respec changes a converted model's spec; this model is not linearized")
    bad = sorted(set(changes) - set(RUNTIME_KEYS))
    if bad:
        raise LinearizeError(f"respec changes only {', '.join(RUNTIME_KEYS)} (keys without parameters), "
                             f"not {', '.join(bad)}")
    old = dict(info["spec"])
    if not old.get("sparse_cache") and changes.get("sparse_cache"):
        for key in SPARSE_RULES:
            old.pop(key, None)
    spec = Spec.coerce(old, **changes)
    for m in mixers(model).values():
        m.spec = spec
    model.config.linearize = {**info, "spec": spec.to_dict()}
    return model
