"""A readable summary of a model: base architecture, mixer per layer, parameters, decoding state."""

from __future__ import annotations

import torch

from .convert import mixers, spec_of
from .models import get_adapter


def _runs(labels: list[str]) -> str:
    """Group consecutive equal labels: 'lolcats x29 (0-28), softmax (29)'."""
    parts, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            span = f"{start}" if i - start == 1 else f"{start}-{i - 1}"
            parts.append(f"{labels[start]} [{span}]")
            start = i
    return ", ".join(parts)


def state_bytes(model) -> dict[str, int]:
    """Decoding memory per sequence: fixed bytes of the linear layers and of sliding-window softmax
    layers (``fast_fixed``: under ``linearize.fast``), bytes per token of the other softmax layers."""
    dtype = next(model.parameters()).dtype
    adapter = get_adapter(model.config)
    converted = mixers(model)
    fixed = sum(m.state_bytes(dtype) for m in converted.values())
    fast = sum(m.fast_state_bytes(dtype) for m in converted.values())
    per_token = 0
    for i, layer in enumerate(adapter.layers(model)):
        if i not in converted:
            attn = adapter.attention(layer)
            g = adapter.geometry(attn, model.config)
            token = 2 * g.n_kv_heads * g.head_dim * torch.tensor([], dtype=dtype).element_size()
            if g.sliding_window:  # transformers' sliding cache layer keeps the last sliding_window - 1 tokens
                fixed += (g.sliding_window - 1) * token
                fast += (g.sliding_window - 1) * token
            else:
                per_token += token
    return {"fixed": fixed, "per_token": per_token, "fast_fixed": fast}


def describe(model) -> str:
    cfg = model.config
    adapter = get_adapter(cfg)
    converted = mixers(model)
    n = len(adapter.layers(model))
    labels = [converted[i].kind if i in converted else "softmax" for i in range(n)]
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    new = sum(p.numel() for m in converted.values() for name, p in m.named_parameters()
              if not name.split(".")[0] in adapter.part_names)
    spec = spec_of(model)
    mem = state_bytes(model)
    lines = [
        f"base model:   {cfg.model_type} ({getattr(cfg, '_name_or_path', '') or 'unnamed'}), {n} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
        f"mixers:       {_runs(labels)}",
        f"spec:         {spec.to_dict() if spec else 'none (softmax teacher)'}",
        f"parameters:   {total:,} total, {trainable:,} trainable, {new:,} added by the mixers",
        f"decode state: {mem['fixed']:,} bytes per sequence fixed"
        + (f" + {mem['per_token']:,} bytes per token (softmax layers)" if mem["per_token"] else " (constant in length)"),
    ]
    if mem["fast_fixed"] != mem["fixed"]:
        lines.append(f"              {mem['fast_fixed']:,} bytes fixed under linearize.fast (window key features recomputed)")
    return "\n".join(lines)
