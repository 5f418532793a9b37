"""A readable summary of a model: base architecture, mixer per layer, parameters, decoding state, and
for a student where it came from (teacher, conversion, training runs: ``config.linearize``)."""

from __future__ import annotations

import torch

from .checkpoint import describe_training, is_untrained
from .convert import mixers, spec_of
from .models import base_model_type, get_adapter


def _runs(labels: list[str]) -> str:
    """Group consecutive equal labels: 'lolcats x29 (0-28), softmax (29)'."""
    parts, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            span = f"{start}" if i - start == 1 else f"{start}-{i - 1}"
            parts.append(f"{labels[start]} [{span}]")
            start = i
    return ", ".join(parts)


def _label(mixer) -> str:
    """A converted layer's kind; a window-softmax layer's with its window (sinks, float8 rings): 'window 1280+4 float8'."""
    if mixer.kind != "window":
        return mixer.kind
    return f"window {mixer.window}" + (f"+{mixer.sinks}" if mixer.sinks else "") + (" float8" if mixer.float8 else "")


def state_bytes(model, length: int | None = None, batch: int = 1, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Decoding memory: fixed bytes per sequence of the converted layers (``fixed``; ``fast_fixed``
    under ``linearize.fast``) and bytes per token of the kept softmax layers (``per_token``), their
    keys and values in ``dtype`` (default: the model's). Converted layers' states are counted at
    their full size (a window is full once ``window`` tokens have passed; recurrent states are
    fp32 whatever ``dtype``).

    With ``length``: also what ``batch`` sequences hold after ``length`` tokens, ``total`` bytes (and
    its growing part ``softmax``): the fixed state plus every kept softmax layer's KV cache at that
    length (a teacher layer with its own sliding window holds a fixed window, counted in ``fixed``).
    """
    dtype = dtype or next(model.parameters()).dtype
    elem = torch.tensor([], dtype=dtype).element_size()
    adapter = get_adapter(model.config)
    converted = mixers(model)
    fixed = sum(m.state_bytes(dtype) for m in converted.values())
    fast = sum(m.fast_state_bytes(dtype) for m in converted.values())
    per_token, grown = 0, 0
    for i, layer in enumerate(adapter.layers(model)):
        if i not in converted:
            attn = adapter.attention(layer)
            g = adapter.geometry(attn, model.config)
            kv = 2 * g.n_kv_heads * g.head_dim * elem
            if g.sliding_window:  # transformers' sliding cache layer keeps the last sliding_window - 1 tokens
                fixed += (g.sliding_window - 1) * kv
                fast += (g.sliding_window - 1) * kv
            else:
                per_token += kv
                if length is not None:
                    grown += kv * length
    out = {"fixed": fixed, "per_token": per_token, "fast_fixed": fast}
    if length is not None:
        out.update(length=length, batch=batch, softmax=batch * grown, total=batch * (fixed + grown))
    return out


def describe(model, length: int | None = None) -> str:
    """The summary ``linearize info`` prints; with ``length``, the decoding state at that many tokens too."""
    cfg = model.config
    adapter = get_adapter(cfg)
    converted = mixers(model)
    n = len(adapter.layers(model))
    labels = [_label(converted[i]) if i in converted else "softmax" for i in range(n)]
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    new = sum(p.numel() for m in converted.values() for name, p in m.named_parameters()
              if not name.split(".")[0] in adapter.part_names)
    spec = spec_of(model)
    mem = state_bytes(model, length)
    lines = [
        f"base model:   {base_model_type(cfg.model_type)} ({getattr(cfg, '_name_or_path', '') or 'unnamed'}), "
        f"{n} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
        *_provenance(model),
        f"mixers:       {_runs(labels)}",
        f"spec:         {spec.to_dict() if spec else 'none (softmax teacher)'}",
        f"parameters:   {total:,} total, {trainable:,} trainable, {new:,} added by the mixers",
        f"decode state: {mem['fixed']:,} bytes per sequence fixed"
        + (f" + {mem['per_token']:,} bytes per token (softmax layers)" if mem["per_token"] else " (constant in length)"),
    ]
    if mem["fast_fixed"] != mem["fixed"]:
        lines.append(f"              {mem['fast_fixed']:,} bytes fixed under linearize.fast (window key features recomputed)")
    if length is not None:
        lines.append(f"              {mem['total']:,} bytes per sequence at {length:,} tokens")
    return "\n".join(lines)


def _provenance(model) -> list[str]:
    """A student's model type, teacher, conversion and training lines (none for a softmax model)."""
    record = getattr(model.config, "linearize", None)
    if not isinstance(record, dict):
        return []
    cls = type(model).__name__
    lines = [f"model type:   {model.config.model_type} ({cls})"]
    if "format" not in record:
        lines.append(f"teacher:      not recorded (written by linearize {record.get('version', '?')} before teachers were)")
    else:
        lines.append(f"teacher:      {record.get('teacher') or 'unknown (converted from a model built in memory)'}")
        lines.append(f"converted:    {record.get('converted', '?')} by linearize {record.get('version', '?')}")
    lines.append(f"training:     {describe_training(model)}")
    return lines


def provenance_line(model) -> str | None:
    """One line on where a student came from and how it was trained (None for a softmax model)."""
    record = getattr(model.config, "linearize", None)
    if not isinstance(record, dict):
        return None
    teacher = record.get("teacher") or "an unrecorded teacher"
    if is_untrained(model):  # untrained_warning says so
        return f"{model.config.model_type} from {teacher}"
    return f"{model.config.model_type} from {teacher}; training: {describe_training(model)}"


def untrained_warning(model, name: str) -> str | None:
    """The warning for a student that no recipe has trained (None otherwise)."""
    if not is_untrained(model):
        return None
    return (f"{name} is an untrained conversion: no recipe has trained its new layers, so its text says little "
            "about the method (train it with linearize lolcats, supra or xatl)")
