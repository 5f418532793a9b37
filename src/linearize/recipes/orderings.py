"""The papers' comparison tables at this project's scale, each one command (``linearize orderings``).

A table is a set of rows of one recipe that differ in one setting, trained at the same token budget,
under the paper's next-token loss and, side by side, from the teacher (``losses``). It writes each
row's run to ``OUT/<loss>/<row>``, their validation next-token loss against training tokens (one
panel per loss) to ``OUT/curves.png`` and the final figures to ``OUT/orderings.md`` and
``OUT/orderings.json``. Rows already finished are kept; an unfinished one resumes.

=============  ====================================================================================
supra-table3   SUPRA (Mercat et al., 2024, Table 3): supra, t2r, supra-2step. The paper: SUPRA beats
               T2R; the 2-step variant (the new weights alone first) gives no gain.
xatl-table2    XATL (Chen et al., 2024, Table 2), RetNet: scratch, E, E+FFN, E+FFN+W_O, hybrid. The
               paper: scratch < E < E+FFN; transferring W_O hurts RetNet; the hybrid is best.
xatl-table3    XATL Table 3 (E+FFN transferred): frozen, unfrozen, lit. The paper: frozen is worst,
               unfrozen and LIT are close.
=============  ====================================================================================
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import LinearizeError
from ..paths import read_json_lines
from . import uptrain

TABLES: dict[str, tuple[str, dict[str, dict]]] = {
    "supra-table3": ("supra", {
        "supra": {},
        "t2r": {"spec": {"kind": "supra", "norm": "sum", "decay": "none"}},
        "supra-2step": {"new_weights_first": 0.1},  # a tenth of the steps on the new weights alone
    }),
    "xatl-table2": ("xatl", {
        "scratch": {"transfer": "scratch"},
        "E": {"transfer": "embeddings"},
        "E+FFN": {"transfer": "embeddings,ffn"},
        "E+FFN+WO": {"transfer": "embeddings,ffn,wo"},
        "hybrid": {"transfer": "embeddings,ffn,wo,attention", "keep_softmax": "xatl"},
    }),
    "xatl-table3": ("xatl", {
        "frozen": {"transfer": "embeddings,ffn", "freeze": "frozen"},
        "unfrozen": {"transfer": "embeddings,ffn", "freeze": "unfrozen"},
        "lit": {"transfer": "embeddings,ffn", "freeze": "lit"},
    }),
}


def method_of(table: str) -> str:
    if table not in TABLES:
        raise LinearizeError(f"unknown table {table!r}; choose from {', '.join(TABLES)}")
    return TABLES[table][0]


def row_configs(table: str, base: uptrain.UptrainConfig, losses: list[str]) -> dict[tuple[str, str], uptrain.UptrainConfig]:
    """``(loss, row) -> config`` of every run of ``table``, each at ``base``'s token budget."""
    method = method_of(table)
    if base.method != method:
        raise LinearizeError(f"{table} compares {method} runs, not {base.method}")
    if not losses:
        raise LinearizeError("name at least one loss (e.g. lm,kl+lm)")
    configs = {}
    for loss in losses:
        for row, changes in TABLES[table][1].items():
            changes = dict(changes)
            if "new_weights_first" in changes:  # the same total steps: some move to the first stage
                first = max(1, int(base.steps * changes["new_weights_first"]))
                changes.update(new_weights_first=first, steps=base.steps - first)
            if "spec" in changes:
                changes["spec"] = {**base.spec, **changes["spec"]}
            if uptrain.learns_from_lm(loss):  # the paper's recipe as written: no alignment stage
                changes["align_steps"] = 0
            cfg = replace(base, **changes, loss=loss, out=str(Path(base.out) / _tag(loss) / row))
            uptrain.check_distillation(cfg)
            configs[(loss, row)] = cfg
    return configs


def _tag(loss: str) -> str:
    return loss.replace(" ", "").replace("+", "_plus_").replace("*", "x")


def run(table: str, base: uptrain.UptrainConfig, losses: list[str]) -> dict:
    """Train every row (skipping finished ones), then write the curves and the table; returns the record."""
    configs = row_configs(table, base, losses)  # every row checked before any trains
    for cfg in configs.values():
        if not (Path(cfg.out) / "results.json").exists():
            uptrain.run(replace(cfg, resume=(Path(cfg.out) / "run_config.json").exists()))
    return summarise(table, configs, Path(base.out))


def _curve(cfg: uptrain.UptrainConfig) -> list[tuple[float, float]]:
    """Validation next-token loss against training tokens (every stage of the run, in order)."""
    rows = read_json_lines(Path(cfg.out) / "metrics.jsonl")
    per_step = cfg.batch_size * cfg.grad_accum * cfg.block_len
    points, offset, last = [], 0, {}
    for stage in ("align", "new-weights", "uptrain"):
        evals = {}
        for r in rows:
            if r.get("stage") == stage:
                value = r.get("eval_next_token", r.get("eval_loss") if stage == "uptrain" and cfg.loss == "lm" else None)
                if stage == "new-weights" and "eval_loss" in r:
                    value = r["eval_loss"]  # next-token loss on the new weights alone
                if value is not None:
                    evals[r["step"]] = value
                last[stage] = max(last.get(stage, 0), r["step"])
        points += [((offset + s) * per_step, v) for s, v in sorted(evals.items())]
        offset += last.get(stage, 0)
    return points


def summarise(table: str, configs: dict, out: Path) -> dict:
    record = {"table": table, "rows": []}
    panels: dict[str, dict[str, list]] = {}
    for (loss, row), cfg in configs.items():
        res = json.loads((Path(cfg.out) / "results.json").read_text())
        curve = _curve(cfg)
        panels.setdefault(f"loss: {loss}", {})[row] = curve
        record["rows"].append({"row": row, "loss": loss, "tokens": res["train"]["tokens"],
                               "ppl": res["perplexity"]["student, after training"],
                               "val_next_token": curve[-1][1] if curve else None, "out": cfg.out})
    out.mkdir(parents=True, exist_ok=True)
    (out / "orderings.json").write_text(json.dumps(record, indent=1))
    lines = [f"# {table}", "", "| row | loss | training tokens | held-out ppl | validation next-token loss |",
             "|---|---|---|---|---|"]
    for r in record["rows"]:
        val = f"{r['val_next_token']:.4f}" if r["val_next_token"] is not None else "–"
        lines.append(f"| {r['row']} | {r['loss']} | {r['tokens']:,} | {r['ppl']:.2f} | {val} |")
    try:
        from ..eval.plots import curve_panels

        curve_panels(panels, out / "curves.png", title=table)
        lines += ["", "![validation curves](curves.png)"]
    except LinearizeError:
        pass  # matplotlib absent, or no evaluation logged: the table stands alone
    (out / "orderings.md").write_text("\n".join(lines) + "\n")
    record["markdown"] = "\n".join(lines)
    return record
