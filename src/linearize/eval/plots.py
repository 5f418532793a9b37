"""Pictures of a run: per-layer attention MSE (LoLCATs stage 1), loss curves against tokens, a
model's recall grids as heat maps, and perplexity against position in long blocks.

They read the files a recipe or ``linearize eval`` writes (``results.json``, ``metrics.jsonl``, the
results record), so a run made on a GPU can be drawn anywhere. Needs matplotlib (the ``eval`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LinearizeError
from ..paths import read_json_lines


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LinearizeError("plots need matplotlib: pip install 'linearize[eval]'") from None
    return plt


def _save(plt, fig, ax, out_png) -> Path:
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def layer_mse_plot(results_json: str | Path, out_png: str | Path) -> Path:
    """Bar chart of each layer's attention-output MSE to the teacher, before and after stage 1."""
    res = json.loads(Path(results_json).read_text())
    if "layer_mse_before" not in res:
        raise LinearizeError(f"{results_json} has no per-layer MSE (was stage 1 run?)")
    before = {int(k): v for k, v in res["layer_mse_before"].items()}
    after = {int(k): v for k, v in res["layer_mse_after"].items()}
    layers = sorted(before)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, len(layers) * 0.3), 3.5))
    width = 0.4
    ax.bar([i - width / 2 for i in layers], [before[i] for i in layers], width, label="converted (before stage 1)")
    ax.bar([i + width / 2 for i in layers], [after[i] for i in layers], width, label="after stage 1")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention output MSE to the teacher")
    return _save(plt, fig, ax, out_png)


def curve_points(metrics_jsonl: str | Path, stage: str | None = None, offset: int = 0) -> list[tuple[int, float]]:
    """``(step, validation next-token loss)`` of one run's ``metrics.jsonl``: ``eval_next_token`` where
    the run logged it (its training loss was another), else ``eval_loss``; only ``stage``'s rows when
    given; steps shifted by ``offset`` (an earlier stage's steps)."""
    rows = read_json_lines(metrics_jsonl)
    return [(offset + r["step"], r.get("eval_next_token", r["eval_loss"])) for r in rows
            if "eval_loss" in r and (stage is None or r.get("stage") == stage)]


def eval_curves(metrics: dict[str, str | Path], out_png: str | Path, tokens_per_step: dict[str, int] | int,
                stages: dict[str, str] | None = None, offsets: dict[str, int] | None = None) -> Path:
    """Validation next-token loss against training tokens for several runs (``label -> metrics.jsonl``);
    ``stages`` (label -> stage name) keeps one stage of a multi-stage run (e.g. LoLCATs' stage2);
    ``offsets`` (label -> steps) counts the steps of an earlier stage, e.g. an alignment stage, in the
    tokens. A run trained on another loss (KL to the teacher) logs its next-token loss as
    ``eval_next_token``: that is drawn, so the runs compare. A run with no evaluation of its stage is
    left out (a LoLCATs stage-1-only run evaluates attention MSE, not next-token loss); no run at all
    is an error."""
    series = {}
    for label, path in metrics.items():
        points = curve_points(path, (stages or {}).get(label), (offsets or {}).get(label, 0))
        if points:
            series[label] = points
    if not series:
        raise LinearizeError(f"{', '.join(map(str, metrics.values()))}: no eval_loss to draw (were evaluations enabled?)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        scale = tokens_per_step[label] if isinstance(tokens_per_step, dict) else tokens_per_step
        ax.plot([s * scale for s, _ in points], [v for _, v in points], marker="o", label=label)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation next-token loss")
    return _save(plt, fig, ax, out_png)


def curve_panels(panels: dict[str, dict[str, list[tuple[float, float]]]], out_png: str | Path,
                 title: str | None = None, ylabel: str = "validation next-token loss") -> Path:
    """Curves side by side, one panel per key of ``panels`` (e.g. per training loss), each holding
    ``label -> [(tokens, value), ...]``; the panels share their y axis, a label keeps its colour."""
    panels = {name: series for name, series in panels.items() if series}
    if not panels:
        raise LinearizeError("no curve to draw")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, squeeze=False)
    labels = list(dict.fromkeys(label for series in panels.values() for label in series))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, (name, series) in zip(axes[0], panels.items()):
        for label, points in series.items():
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=label,
                    color=colours[label])
        ax.set_title(name)
        ax.set_xlabel("training tokens")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def dial_plot(points: list[dict], out_png: str | Path) -> Path:
    """Two panels over state bytes per sequence at 8k (log x): recall in percent (passkey at 2k and 8k,
    mqar; a marker per metric, a label per model) and held-out perplexity (log y)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [p["state_bytes"] / 1e6 for p in points]
    for key, marker, label in (("passkey_2k", "o", "passkey 2k"), ("passkey_8k", "s", "passkey 8k"), ("mqar", "^", "mqar")):
        pts = [(x, 100 * p[key]) for x, p in zip(xs, points) if p.get(key) is not None]
        if pts:
            left.scatter([x for x, _ in pts], [y for _, y in pts], marker=marker, label=label)
    for x, p in zip(xs, points):
        left.annotate(p["name"], (x, 100 * max(v for v in (p.get("passkey_2k"), p.get("passkey_8k"), p.get("mqar"), 0)
                                               if v is not None)), fontsize=7, xytext=(3, 3), textcoords="offset points")
    left.set_xscale("log")
    left.set_xlabel("state per sequence at 8k tokens (MB)")
    left.set_ylabel("exact match (%)")
    left.set_ylim(-5, 105)
    left.legend(fontsize=8)
    with_ppl = [(x, p) for x, p in zip(xs, points) if p.get("ppl") is not None]
    if with_ppl:
        right.scatter([x for x, _ in with_ppl], [p["ppl"] for _, p in with_ppl])
        for x, p in with_ppl:
            right.annotate(p["name"], (x, p["ppl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        right.set_yscale("log")
    right.set_xscale("log")
    right.set_xlabel("state per sequence at 8k tokens (MB)")
    right.set_ylabel("held-out perplexity")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def position_x(start: int, end: int) -> float:
    """Where a position bucket ``[start, end)`` sits on a log axis: the geometric middle of its
    positions (position 0 predicts nothing: the first bucket runs from 1)."""
    return (max(start, 1) * end) ** 0.5


def position_plot(panels: dict[str, list[dict]], out_png: str | Path) -> Path:
    """Perplexity against position in the block, a panel per text (``report.position_curves``), as
    :func:`position_figure` draws it, saved to ``out_png``."""
    plt, fig, _ = position_figure(panels)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def position_figure(panels: dict[str, list[dict]]):
    """``(pyplot, figure, axes)``: a panel per text, a curve per record, softmax models (the
    teachers) dashed in black and grey, students in colour; log y, the buckets at their geometric
    middles on a log x axis labelled with their ranges; a dotted line where a teacher's context cut
    its blocks short."""
    panels = {text: curves for text, curves in panels.items() if curves}
    if not panels:
        raise LinearizeError("no perplexity by position to draw")
    plt = _pyplot()
    from matplotlib.ticker import LogFormatter, NullLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    students = list(dict.fromkeys(c["label"] for cs in panels.values() for c in cs if c["kind"] != "softmax"))
    teachers = list(dict.fromkeys(c["label"] for cs in panels.values() for c in cs if c["kind"] == "softmax"))
    colours = {label: f"C{i % 10}" for i, label in enumerate(students)}
    colours.update({label: ("black", "dimgrey", "darkgrey")[i % 3] for i, label in enumerate(teachers)})
    for ax, (text, curves) in zip(axes[0], panels.items()):
        ticks = {}
        for c in sorted(curves, key=lambda c: c["kind"] != "softmax"):  # teachers first: in the legend's top
            xs = [position_x(a, b) for a, b, _, _ in c["points"]]
            teacher = c["kind"] == "softmax"
            ax.plot(xs, [p for *_, p in c["points"]], marker="s" if teacher else "o", markersize=4,
                    linestyle="--" if teacher else "-", linewidth=2 if teacher else 1.5, color=colours[c["label"]],
                    label=c["label"] + (" (teacher)" if teacher else ""))
            for x, (_, _, name, _) in zip(xs, c["points"]):
                ticks.setdefault(name, x)
            if c.get("context"):
                ax.axvline(c["context"], color=colours[c["label"]], linestyle=":", linewidth=1)
                ax.annotate(f"{c['label']}: context {c['context']}", (c["context"], 0.02), rotation=90, fontsize=7,
                            xycoords=("data", "axes fraction"), ha="right", va="bottom")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ordered = sorted(ticks.items(), key=lambda item: item[1])
        ax.set_xticks([x for _, x in ordered], [name for name, _ in ordered], rotation=30, fontsize=8)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(LogFormatter())  # 30, 300: not 3 x 10^1
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))
        ax.set_xlabel("position in the block (tokens, bucket)")
        ax.set_ylabel("perplexity")
        ax.set_title(text)
        ax.legend(fontsize=8)
    return plt, fig, list(axes[0])


def recall_heatmaps(recall: dict, out_png: str | Path, title: str) -> Path:
    """One model's recall grids side by side: passkey and niah as length x depth, mqar as N x distance;
    each cell coloured and labelled with its accuracy (a cell with no query left blank)."""
    import numpy as np

    order = [n for n in ("passkey", "niah", "mqar") if n in recall] + sorted(set(recall) - {"passkey", "niah", "mqar"})
    if not order:
        raise LinearizeError("no recall results to draw")
    plt = _pyplot()
    widths = [max(3.0, 0.7 * len(_columns(recall[n])) + 1.5) for n in order]
    fig, axes = plt.subplots(1, len(order), figsize=(sum(widths) + 1.5, 3.8), squeeze=False, layout="constrained",
                             gridspec_kw={"width_ratios": widths})
    for ax, name in zip(axes[0], order):
        task = recall[name]
        grid = np.array([[np.nan if v is None else 100 * v for v in row] for row in task["grid"]], dtype=float)
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        rows, cols = _rows(task), _columns(task)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), rows)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
        if "pairs" in task:
            ax.set_xlabel("distance (tokens)")
            ax.set_ylabel("pairs N")
        else:
            ax.set_xlabel("depth (%)")
            ax.set_ylabel("length (tokens)")
        ax.set_title(f"{name} ({100 * task['value']:.0f} %)")
    fig.colorbar(image, ax=axes[0].tolist(), label="exact match (%)", shrink=0.9)
    fig.suptitle(title)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def _rows(task: dict) -> list[str]:
    return [str(n) for n in task["pairs"]] if "pairs" in task else [str(n) for n in task["lengths"]]


def _columns(task: dict) -> list[str]:
    return list(task["distance_buckets"]) if "pairs" in task else [str(d) for d in task["depths"]]
