"""Architecture adapters: one per family; a new family is one file plus a line in ``ADAPTERS``."""

from __future__ import annotations

from ..errors import LinearizeError
from .base import Adapter, Geometry
from .gpt_neox import GPTNeoXAdapter
from .llama import LlamaFamilyAdapter

ADAPTERS: dict[str, Adapter] = {}
for _adapter in (LlamaFamilyAdapter(), GPTNeoXAdapter()):
    for _model_type in _adapter.model_types:
        ADAPTERS[_model_type] = _adapter

SUPPORTED_MODEL_TYPES = tuple(sorted(ADAPTERS))


def get_adapter(config) -> Adapter:
    """The adapter for ``config.model_type``; a one-line error listing the supported ones otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise LinearizeError(
            f"unsupported architecture '{model_type}': linearize supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "Adapter", "Geometry", "SUPPORTED_MODEL_TYPES", "get_adapter"]
