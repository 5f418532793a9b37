"""Standalone checkpoints: a Hugging Face folder (config.json with ``linearize``, safetensors,
tokenizer) that ``load`` rebuilds without the teacher.

``load`` lets transformers build the base architecture from the config and load every tensor whose
name it knows (the adopted projections keep the teacher's names), converts the layers the spec
names, then loads the mixers' own tensors and checks that nothing is missing or left over.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.utils import logging as hf_logging

from .convert import convert
from .errors import LinearizeError
from .spec import Spec


def save(model, tokenizer, directory: str | os.PathLike) -> Path:
    """Write ``model`` (a student or a teacher) and ``tokenizer`` to ``directory`` as safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    return [single] if single.exists() else []


def load(directory: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None):
    """Rebuild a saved student (or plain model) and its tokenizer: ``(model, tokenizer)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise LinearizeError(f"no checkpoint folder at {directory} (give a folder written by linearize convert/save)")
    if not (directory / "config.json").exists():
        raise LinearizeError(f"{directory} has no config.json: not a checkpoint written by linearize save")
    files = _weight_files(directory)
    if not files:
        raise LinearizeError(f"{directory} has no model.safetensors: the checkpoint is incomplete")
    config = AutoConfig.from_pretrained(directory)
    info = getattr(config, "linearize", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype))
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    # The mixers' own tensors are unknown to transformers: quiet its "unused weights" report.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if info:
            del config.linearize  # the base architecture alone; the spec is applied below
        model, loading = AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype, output_loading_info=True)
    except Exception as exc:  # corrupt safetensors, mismatched shapes ...
        raise LinearizeError(f"could not load checkpoint {directory}: {str(exc).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = set(loading.get("missing_keys", ()))
    if info:
        base_keys = set(model.state_dict())
        model = convert(model, Spec.coerce(info["spec"]), inplace=True)
        # XATL mixers drop the teacher's q/k/v (and Mamba its o_proj): only what the student still has counts
        missing &= set(model.state_dict())
        model.config.linearize = info  # the whole saved record (the XATL transfer map rides along)
    if missing:
        raise LinearizeError(f"checkpoint {directory} lacks tensors {sorted(missing)[:3]}: it is incomplete or corrupt")

    if info:
        new_keys = [k for k in model.state_dict() if k not in base_keys]  # feature maps, window weights ...
        wanted, saved = set(new_keys), {}
        for f in files:  # read only the mixers' tensors; transformers has loaded the rest
            with safe_open(f, framework="pt") as handle:
                saved.update({k: handle.get_tensor(k) for k in handle.keys() if k in wanted})
        lacking = [k for k in new_keys if k not in saved]
        if lacking:
            raise LinearizeError(f"checkpoint {directory} does not match its spec: it lacks {lacking[:3]}")
        model.load_state_dict({k: saved[k] for k in new_keys}, strict=False)
    model.to(device=device, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
