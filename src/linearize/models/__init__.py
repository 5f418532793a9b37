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
LINEARIZED_PREFIX = "linearize_"  # a student's model type is its base family's, prefixed (linearize.hf)


def base_model_type(model_type: str | None) -> str | None:
    """The base family of a model type: ``linearize_llama`` -> ``llama``; others unchanged."""
    if isinstance(model_type, str) and model_type.startswith(LINEARIZED_PREFIX):
        return model_type[len(LINEARIZED_PREFIX):]
    return model_type


def get_adapter(config) -> Adapter:
    """The adapter for ``config.model_type`` (a student's: its base family's); a one-line error
    listing the supported ones otherwise."""
    model_type = base_model_type(getattr(config, "model_type", None))
    if model_type not in ADAPTERS:
        raise LinearizeError(
            f"unsupported architecture '{model_type}': linearize supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "Adapter", "Geometry", "LINEARIZED_PREFIX", "SUPPORTED_MODEL_TYPES", "base_model_type", "get_adapter"]
