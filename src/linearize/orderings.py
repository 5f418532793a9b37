"""The papers' orderings at this project's scale, one command per table, each under the paper's LM
loss and under distillation from the teacher, side by side.

==============  =========  ===================================================================
table           recipe     rows (what the paper orders)
==============  =========  ===================================================================
``supra-t3``    supra      SUPRA, T2R, SUPRA 2-step (SUPRA Table 3: SUPRA beats T2R; 2-step no gain;
                           its two stages together take the other rows' steps)
``xatl-t2``     xatl       scratch, E, E+FFN, E+FFN+W_O, hybrid, and E+FFN+QKV (XATL Table 2:
                           scratch < E < E+FFN; W_O transfer hurts RetNet; the hybrid best). The
                           last row is this project's: the retention's q/k/v from the teacher
                           (``xatl`` transfer item ``qkv``) against E+FFN's fresh ones
``xatl-t3``     xatl       frozen, unfrozen, LIT on E+FFN (XATL Table 3: frozen < unfrozen ~ LIT)
==============  =========  ===================================================================

Every run is an ordinary recipe run, ``linearize <recipe> --out DIR --loss L <row flags>`` plus the
budget, ``--config`` file and any other flags given here (passed to every run, before the row's and
the loss's own), so the runner knows no recipe internals: the recipes' YAML configs and flags
decide everything. ``--losses`` picks the objectives (``lm``: next-token, the papers'; ``kl``:
KL to the teacher; ``kl+lm``: both). A run whose folder already holds ``results.json`` is not run
again, so the same command continues an interrupted table.

Written under ``OUT/<table>/``: each run's folder ``<loss>/<row>/`` (its ``metrics.jsonl``,
``results.json``, ``run_config.yaml``), ``curves.png`` (validation next-token loss against training
tokens, one panel per loss), ``orderings.json`` (the curves and final figures) and ``README.md``
(the table). The validation curve is the next-token loss on the validation blocks: a run trained on
another objective logs it as ``eval_next_token``; where a run has only its objective's
``eval_loss``, the table says so.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LinearizeError

LOSSES = {"lm": "next_token", "kl": "kl", "kl+lm": "kl+next_token"}
TWO_STEP = "{two_step}"  # replaced by the 2-step variant's first-stage steps
REST = "{rest}"  # and by its second stage's: the two add up to the other rows' steps (equal tokens)


@dataclass(frozen=True)
class Row:
    label: str
    args: tuple[str, ...] = ()

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


@dataclass(frozen=True)
class Table:
    name: str
    recipe: str
    title: str
    paper: str  # the ordering the paper reports
    rows: tuple[Row, ...] = field(default_factory=tuple)


TABLES = {t.name: t for t in (
    Table("supra-t3", "supra", "SUPRA Table 3: SUPRA vs T2R vs the 2-step variant",
          "SUPRA below T2R; the 2-step variant no better than SUPRA",
          (Row("SUPRA"), Row("T2R", ("--variant", "t2r")),
           Row("SUPRA 2-step", ("--new-weights-first", TWO_STEP, "--steps", REST)))),
    Table("xatl-t2", "xatl", "XATL Table 2: what the RetNet student takes from the teacher",
          "scratch > E > E+FFN (loss); +W_O worse than E+FFN for RetNet; the hybrid lowest",
          (Row("scratch", ("--transfer", "scratch")),
           Row("E", ("--transfer", "embeddings")),
           Row("E+FFN", ("--transfer", "embeddings,ffn")),
           Row("E+FFN+W_O", ("--transfer", "embeddings,ffn,wo")),
           Row("hybrid", ("--transfer", "embeddings,ffn,attention", "--keep-softmax", "xatl")),
           Row("E+FFN+QKV", ("--transfer", "embeddings,ffn,qkv")))),
    Table("xatl-t3", "xatl", "XATL Table 3: the transferred weights frozen, unfrozen or LIT",
          "frozen worst; unfrozen and LIT about equal",
          tuple(Row(label, ("--transfer", "embeddings,ffn", "--freeze", mode))
                for label, mode in (("frozen", "frozen"), ("unfrozen", "unfrozen"), ("LIT", "lit")))),
)}
ALIASES = {"supra-table3": "supra-t3", "xatl-table2": "xatl-t2", "xatl-table3": "xatl-t3"}


@dataclass
class Run:
    table: str
    row: Row
    loss: str  # a key of LOSSES
    out: Path
    argv: list[str]

    @property
    def command(self) -> str:
        import shlex

        return "linearize " + " ".join(shlex.quote(a) for a in self.argv)


def table(name: str) -> Table:
    name = ALIASES.get(name, name)
    if name not in TABLES:
        raise LinearizeError(f"unknown table {name!r}; accepted: {', '.join(TABLES)}")
    return TABLES[name]


def _flag_value(args: list[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def planned_steps(recipe: str, budget: str | None, config: Path | None, extra: list[str]) -> int:
    """The runs' optimizer steps: ``--steps`` among the flags, else the ``--config`` file's, else the
    budget's YAML (the recipe's own resolution order)."""
    given = _flag_value(extra, "--steps")
    if given is not None:
        return int(given)
    from .recipes.config import budget_values, default_budget, read_yaml

    if config is not None:
        values = read_yaml(config)
        if "steps" in values:
            return int(values["steps"])
        budget = budget or values.get("budget")
    return int(budget_values(recipe, budget or default_budget()).get("steps", 1000))


def plan(name: str, out: Path, losses=("lm", "kl"), rows=None, budget: str | None = None,
         config: Path | None = None, extra=(), two_step_fraction: float = 0.25) -> list[Run]:
    """The runs of table ``name``: every row under every loss, as recipe command lines."""
    t = table(name)
    bad = [x for x in losses if x not in LOSSES]
    if bad:
        raise LinearizeError(f"unknown loss {', '.join(bad)}; accepted: {', '.join(LOSSES)}")
    chosen = list(t.rows)
    if rows:
        by_name = {r.slug: r for r in t.rows} | {r.label: r for r in t.rows}
        missing = [r for r in rows if r not in by_name]
        if missing:
            raise LinearizeError(f"table {t.name} has no row {', '.join(missing)}; rows: "
                                 f"{', '.join(r.slug for r in t.rows)}")
        chosen = [by_name[r] for r in rows]
    extra = list(extra)
    fill = {}
    if any(TWO_STEP in r.args for r in chosen):
        total = planned_steps(t.recipe, budget, config, extra)
        first = max(1, int(total * two_step_fraction))
        if first >= total:
            raise LinearizeError(f"the 2-step variant needs more than {total} steps to split")
        fill = {TWO_STEP: str(first), REST: str(total - first)}
    runs = []
    for loss in losses:
        for row in chosen:
            folder = Path(out) / t.name / loss.replace("+", "_") / row.slug
            argv = [t.recipe, "--out", str(folder)]
            argv += ["--budget", budget] if budget else []
            argv += ["--config", str(config)] if config else []
            argv += extra + ["--loss", LOSSES[loss]] + [fill.get(a, a) for a in row.args]
            runs.append(Run(t.name, row, loss, folder, argv))
    return runs


def execute(runs: list[Run], in_process: bool = False, log=print) -> None:
    """Run each run not finished yet (no ``results.json``), one after another; a failing run stops
    the table with its command line."""
    for i, run in enumerate(runs, 1):
        if (run.out / "results.json").exists():
            log(f"[{i}/{len(runs)}] done already: {run.out}")
            continue
        log(f"[{i}/{len(runs)}] {run.command}")
        if in_process:
            from .cli import main

            code = main(list(run.argv))
        else:
            code = subprocess.run([sys.executable, "-m", "linearize", *run.argv]).returncode
        if code != 0:
            raise LinearizeError(f"run {run.table}/{run.loss}/{run.row.slug} failed (exit {code}): {run.command}")


# --- reading the runs back -------------------------------------------------------------------------

def _tokens_per_step(run_dir: Path) -> int:
    config = {}
    if (run_dir / "run_config.yaml").exists():
        import yaml

        config = yaml.safe_load((run_dir / "run_config.yaml").read_text()) or {}
    elif (run_dir / "results.json").exists():
        config = json.loads((run_dir / "results.json").read_text()).get("config", {})
    return int(config.get("block_len", 1)) * int(config.get("batch_size", 1)) * int(config.get("grad_accum", 1))


def curve(run_dir: Path, objective_is_lm: bool) -> tuple[list[tuple[int, float]], str]:
    """Validation next-token loss against training tokens (``eval_next_token``, or ``eval_loss`` of an
    LM run), steps counted across the run's stages; and which metric it is."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], "none"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    key = "eval_next_token" if any("eval_next_token" in r for r in rows) else "eval_loss"
    scale = _tokens_per_step(run_dir)
    offset, last_stage, last_step, points = 0, None, 0, []
    for r in rows:
        if r.get("stage") != last_stage:  # a new stage counts its steps from 0 again
            offset += last_step if last_stage is not None else 0
            last_stage, last_step = r.get("stage"), 0
        last_step = max(last_step, int(r.get("step", 0)))
        if key in r:
            points.append(((offset + int(r["step"])) * scale, float(r[key])))
    metric = "next-token" if key == "eval_next_token" or objective_is_lm else "objective"
    return points, metric


def collect(runs: list[Run]) -> list[dict]:
    """Each run's curve and final figures (runs not finished are listed with ``finished: false``)."""
    records = []
    for run in runs:
        points, metric = curve(run.out, LOSSES[run.loss] == "next_token")
        res_path = run.out / "results.json"
        res = json.loads(res_path.read_text()) if res_path.exists() else {}
        ppl = res.get("perplexity", {})
        records.append({
            "row": run.row.label, "loss": run.loss, "dir": str(run.out), "finished": res_path.exists(),
            "metric": metric, "curve": points,
            "final": points[-1][1] if points else None, "best": min(v for _, v in points) if points else None,
            "tokens": res.get("train", {}).get("tokens"),
            "ppl": ppl.get("student, after training"), "teacher_ppl": ppl.get("teacher"),
            "command": run.command,
        })
    return records


def _fmt(x, digits=3) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def render(t: Table, records: list[dict], losses) -> str:
    rows = list(dict.fromkeys(r["row"] for r in records))
    by = {(r["row"], r["loss"]): r for r in records}
    teacher = next((r["teacher_ppl"] for r in records if r["teacher_ppl"]), None)
    lines = [f"# {t.title}", "", f"The paper: {t.paper}.", "",
             f"Validation next-token loss at the end of training (best in brackets) and held-out perplexity "
             f"after training; teacher perplexity {_fmt(teacher, 1)}. Curves: `curves.png`.", ""]
    head = ["row"] + [f"{loss}: val loss" for loss in losses] + [f"{loss}: ppl" for loss in losses]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row]
        for loss in losses:
            r = by.get((row, loss))
            if r is None or r["final"] is None:
                cells.append("–")
            else:
                mark = "" if r["metric"] == "next-token" else " (objective)"
                cells.append(f"{r['final']:.3f} ({r['best']:.3f}){mark}")
        cells += [_fmt(by.get((row, loss), {}).get("ppl"), 1) for loss in losses]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for loss in losses:
        done = [r for r in records if r["loss"] == loss and r["final"] is not None]
        if done:
            order = " < ".join(f"{r['row']} ({r['final']:.3f})" for r in sorted(done, key=lambda r: r["final"]))
            lines.append(f"- {loss}: final validation loss, lowest first: {order}")
    tokens = sorted({r["tokens"] for r in records if r["tokens"]})
    if tokens:
        lines.append(f"- training tokens per run: {', '.join(f'{x:,}' for x in tokens)}")
    lines += ["", "Commands:", "", "```"] + [r["command"] for r in records] + ["```", ""]
    return "\n".join(lines)


def report(t: Table, runs: list[Run], out: Path, losses) -> Path:
    """``OUT/<table>/{orderings.json, curves.png, README.md}`` from the runs' files."""
    records = collect(runs)
    folder = Path(out) / t.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "orderings.json").write_text(json.dumps({"table": t.name, "title": t.title, "paper": t.paper,
                                                       "runs": records}, indent=1))
    panels = {loss: {r["row"]: r["curve"] for r in records if r["loss"] == loss and r["curve"]} for loss in losses}
    if any(panels.values()):
        from .eval.plots import curve_panels

        curve_panels({f"loss: {loss}": series for loss, series in panels.items()}, folder / "curves.png",
                     title=t.title)
    (folder / "README.md").write_text(render(t, records, losses))
    return folder


# --- command line ------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="linearize orderings",
        description="Reproduce a paper table's ordering at this scale: every row under each loss, run through the "
                    "recipe's command line. Flags this command does not know (--steps 400, --teacher X, --data Y, "
                    "--dtype ...) are passed to every run.",
        epilog="tables: " + "; ".join(f"{t.name}: {', '.join(r.label for r in t.rows)}" for t in TABLES.values()))
    p.add_argument("table", help=f"one of {', '.join(TABLES)} (or supra-table3, xatl-table2, xatl-table3)")
    p.add_argument("--out", type=Path, default=Path("runs/orderings"), help="folder of the tables (default: %(default)s)")
    p.add_argument("--losses", default="lm,kl", help=f"comma-separated, of {', '.join(LOSSES)} (default: %(default)s)")
    p.add_argument("--rows", help="comma-separated row names (default: all; see the epilog)")
    p.add_argument("--budget", help="the recipe's budget (cpu, gpu, paper; default: the recipe's)")
    p.add_argument("--config", type=Path, help="a recipe YAML given to every run")
    p.add_argument("--two-step-fraction", type=float, default=0.25,
                   help="SUPRA 2-step: the share of the steps that trains the new weights alone (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands and stop")
    p.add_argument("--report-only", action="store_true", help="run nothing; write the table from the runs there are")
    p.add_argument("--in-process", action="store_true", help="run the recipes in this process (tests), not one "
                   "process each")
    return p


def main(argv=None) -> int:
    args, extra = parser().parse_known_args(argv)
    try:
        t = table(args.table)
        losses = [x for x in args.losses.replace(" ", "").split(",") if x]
        rows = [x for x in (args.rows or "").split(",") if x] or None
        if args.config is not None and not args.config.is_file():
            raise LinearizeError(f"no such config file: {args.config}")
        runs = plan(t.name, args.out, losses, rows, args.budget, args.config, extra, args.two_step_fraction)
        if args.dry_run:
            for run in runs:
                print(run.command)
            return 0
        if not args.report_only:
            execute(runs, in_process=args.in_process)
        folder = report(t, runs, args.out, losses)
    except LinearizeError as exc:
        print(f"linearize: error: {exc}", file=sys.stderr)
        return 2
    print(f"{t.title}: {folder / 'README.md'}, {folder / 'curves.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
