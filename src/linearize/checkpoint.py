"""Standalone checkpoints: a Hugging Face folder (config.json with the ``linearize`` record,
safetensors, tokenizer, ``modeling_linearize.py``) that ``load`` rebuilds without the teacher, and
that ``AutoModelForCausalLM.from_pretrained`` loads as what it is (``linearize.hf``).

``load`` checks the folder first (config, the record's spec, weights files, tokenizer files, the
weights' sha256), then builds the student through its ``linearize_<base>`` class, whose
``from_pretrained`` loads every tensor by name and refuses missing or extra ones. Checkpoints
written before the student had its own model type (the base type plus a ``linearize`` entry) load
the same way and are written in the new form when saved again.

The record (``config.linearize``) says what the student is and where it came from: the spec, the
teacher, when it was converted, and a list of training runs that ``record_training`` appends to
(the recipes call it before saving their final checkpoint). An empty list marks an untrained
conversion; a record without ``format`` was written before any of this was kept.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

import torch

from .errors import LinearizeError
from .quiet import transient_bars, without_bpe_cleanup

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def save(model, tokenizer, directory: str | os.PathLike) -> Path:
    """Write ``model`` (a student or a teacher) and ``tokenizer`` to ``directory`` as safetensors."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise LinearizeError(f"cannot save to {directory}: it is a file, not a folder")
    directory.mkdir(parents=True, exist_ok=True)
    with transient_bars():
        model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _read_config(directory: Path) -> dict:
    try:
        values = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LinearizeError(f"could not read {directory / 'config.json'}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(values, dict):
        raise LinearizeError(f"{directory / 'config.json'} does not hold a mapping of settings")
    return values


def _resolve_dtype(dtype, config: dict) -> torch.dtype:
    """A torch dtype from a name (``bf16``, ``bfloat16`` ...) or dtype; None: the checkpoint's, else float32."""
    if dtype is None:
        dtype = config.get("dtype") or config.get("torch_dtype") or torch.float32
    if isinstance(dtype, str):
        name = DTYPE_NAMES.get(dtype, dtype)
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise LinearizeError(f"unknown dtype '{dtype}'; accepted: float32, bfloat16, float16 (or fp32, bf16, fp16)")
        dtype = getattr(torch, name)
    return dtype


def load(directory: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None,
         with_tokenizer: bool = True):
    """Rebuild a saved student (or plain model) and its tokenizer: ``(model, tokenizer)``.

    ``dtype``: None keeps the checkpoint's; ``device``: CUDA when available. The weights' sha256
    recorded at save time is checked first. ``with_tokenizer=False`` returns ``(model, None)`` for
    folders without tokenizer files (e.g. training checkpoints).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import hf
    from .models import base_model_type

    directory = Path(directory)
    if not directory.is_dir():
        raise LinearizeError(f"no checkpoint folder at {directory} (give a folder written by linearize convert/save)")
    if not (directory / "config.json").exists():
        raise LinearizeError(f"{directory} has no config.json: not a checkpoint written by linearize save")
    values = _read_config(directory)
    record = values.get("linearize")
    model_type = values.get("model_type")
    if record is not None:
        hf.checked_record(record, str(directory / "config.json"))
    elif base_model_type(model_type) != model_type:
        raise LinearizeError(f"{directory / 'config.json'} declares model type {model_type} but has no linearize entry "
                             "(the spec the student was converted with): it cannot be rebuilt")
    if not hf.weight_files(directory):
        raise LinearizeError(f"{directory} has no model.safetensors: the checkpoint is incomplete")
    if with_tokenizer and not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise LinearizeError(f"{directory} has no tokenizer files ({' / '.join(TOKENIZER_FILES[:2])}): save the "
                             "tokenizer there too (linearize.save(model, tokenizer, folder) does both)")
    dtype = _resolve_dtype(dtype, values)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    try:
        with transient_bars():
            if record is not None:  # its from_pretrained checks the weights' sha256 first
                model = hf.model_class(base_model_type(model_type)).from_pretrained(
                    directory, config=hf.config_from_dict(values), dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except LinearizeError:
        raise
    except Exception as exc:  # corrupt safetensors, mismatched shapes ...
        raise LinearizeError(f"could not load checkpoint {directory}: {_first_line(exc)}") from None
    model.to(device=device).eval()
    if not with_tokenizer:
        return model, None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:
        raise LinearizeError(f"could not load the tokenizer in {directory}: {_first_line(exc)}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, without_bpe_cleanup(tokenizer)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# --- what the record says about training -----------------------------------------------------------

def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def record_training(model, recipe: str, tokens: int, **info) -> dict:
    """Append a training run to a student's record (``config.linearize["training"]``), before it is
    saved: the recipe, the tokens it trained on, the date, and any other JSON-able facts (steps,
    seconds, data, stages ...). Returns the entry."""
    config = getattr(model, "config", None)
    record = getattr(config, "linearize", None)
    if not record:
        raise LinearizeError("record_training: this model is not a linearize student (no linearize record)")
    entry = json.loads(json.dumps({"recipe": recipe, "tokens": int(tokens), "date": _now(), **info}, default=str))
    config.linearize = {**record, "training": [*record.get("training", []), entry]}
    return entry


def training_runs(model_or_config) -> list[dict] | None:
    """The recorded training runs of a student ([] for an untrained conversion), or None where the
    record predates training records (or the model is not a student)."""
    config = getattr(model_or_config, "config", model_or_config)
    record = getattr(config, "linearize", None)
    if not isinstance(record, dict) or "format" not in record:
        return None
    return list(record.get("training", []))


def is_untrained(model_or_config) -> bool:
    """Whether a student is known to be a conversion no recipe has trained."""
    return training_runs(model_or_config) == []


def describe_training(model_or_config) -> str:
    """One line: how a student was trained, 'untrained conversion', or that it is not recorded."""
    runs = training_runs(model_or_config)
    if runs is None:
        return "not recorded (checkpoint written before linearize kept training records)"
    if not runs:
        return "none: untrained conversion (the new layers are as convert initialised them)"
    return "; ".join(f"{r.get('recipe', '?')}, {r.get('tokens', 0):,} tokens, {str(r.get('date', '?'))[:10]}" for r in runs)
