"""Load what ``linearize eval`` evaluates: a linearize checkpoint or any teacher spec."""

from __future__ import annotations

from pathlib import Path


def load_model(model: str, dtype=None, device=None):
    """``(model, tokenizer)`` from a linearize checkpoint folder or any teacher spec (HF id, model
    folder, .gguf, ``default``)."""
    from linearize import load, load_teacher

    path = Path(model).expanduser()
    config = path / "config.json"
    if path.is_dir() and config.is_file() and '"linearize"' in config.read_text():
        loaded, tokenizer = load(path, dtype=dtype, device=device)
        loaded.linearize_source = str(path.resolve())
        return loaded, tokenizer
    return load_teacher(None if model == "default" else model, dtype=dtype, device=device)
