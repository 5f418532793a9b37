"""The papers' comparison tables at this project's scale, each one command (``linearize orderings``).

A table is a set of rows of one recipe that differ in one setting, trained at the same token budget,
seed and data order, under the paper's next-token loss and, side by side, from the teacher
(``losses``). It writes each row's run to ``OUT/<loss>/<row>``, their validation next-token loss
against training tokens (one panel per loss; LIT's unfreezing and the tokens-to-match points marked)
to ``OUT/curves.png`` and the page ``OUT/orderings.md`` (with ``OUT/orderings.json``): each row's
figures, whether the paper's ordering holds (``CLAIMS``), LIT's schedule and, for XATL's transfer
table, the tokens a transferred row needs to reach scratch's final validation loss. Rows already
finished are kept; an unfinished one resumes.

``second_seed``: the two rows of each loss whose held-out losses are closest are trained again under
another seed (``OUT/<loss>/seed<N>/<row>``: only the seed, and with it the initialisation and the
data order, differs); the larger change of either row's held-out loss between the seeds is the
run-to-run noise each of the paper's claims is measured against. A ``linearize eval --out
OUT/<loss>/<row>/eval.json`` record of a row's final checkpoint adds its zero-shot average to the page
(run the command again: nothing trains, the page is rewritten).

=============  ====================================================================================
supra-table3   SUPRA (Mercat et al., 2024, Table 3): supra, t2r, supra-2step. The paper: SUPRA beats
               T2R; the 2-step variant (the new weights alone first) gives no gain.
xatl-table2    XATL (Chen et al., 2024, Table 2): scratch, E, E+FFN, E+FFN+W_O, hybrid, for ``arch``
               retnet or striped_mamba (which has no E+FFN+W_O row: Mamba cannot take W_O; its hybrid
               transfers E, FFN and the kept softmax layers). The paper: scratch < E < E+FFN;
               transferring W_O hurts RetNet; the hybrid is best; E+FFN needs fewer tokens.
xatl-table3    XATL Table 3 (E+FFN transferred): frozen, unfrozen, lit. The paper: frozen is worst,
               unfrozen and LIT are close (LIT marginally best).
=============  ====================================================================================

``python -m linearize.recipes.orderings match A/orderings.json B/orderings.json --out DIR`` puts the
tokens-to-match figures of several xatl-table2 runs (e.g. RetNet and StripedMamba) side by side.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LinearizeError
from ..paths import read_json_lines

if TYPE_CHECKING:
    from .uptrain import UptrainConfig

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

# The papers' orderings, on each row's held-out loss (ln of its held-out perplexity; lower is better):
# (a, relation, b, what the paper says). "<": a below b; "<=": a no worse than b; ">=": a no better than
# b. A claim naming a row the run lacks is left out.
CLAIMS: dict[str, list[tuple[str, str, str, str]]] = {
    "supra-table3": [("supra", "<", "t2r", "SUPRA beats T2R"),
                     ("supra-2step", ">=", "supra", "the 2-step variant gives no gain over 1-step")],
    "xatl-table2": [("E", "<", "scratch", "transferring the embeddings beats scratch"),
                    ("E+FFN", "<", "E", "transferring the FFNs too does better"),
                    ("E+FFN", "<", "E+FFN+WO", "transferring W_O hurts RetNet"),
                    ("hybrid", "<", "E+FFN", "the hybrid is best"),
                    ("E+FFN", "<", "scratch", "E+FFN beats scratch")],
    "xatl-table3": [("unfrozen", "<", "frozen", "freezing the transferred weights hurts"),
                    ("lit", "<", "frozen", "LIT beats freezing"),
                    ("lit", "<=", "unfrozen", "LIT is close to unfrozen, marginally best")],
}
MATCH_TARGET = 1.5  # XATL transfer (issue 45): E+FFN reaches scratch's final loss with >= 1.5x fewer tokens
RELATIONS = {"<": "below", "<=": "no worse than", ">=": "no better than"}  # in held-out loss


def method_of(table: str) -> str:
    if table not in TABLES:
        raise LinearizeError(f"unknown table {table!r}; choose from {', '.join(TABLES)}")
    return TABLES[table][0]


def table_rows(table: str, base: UptrainConfig, rows: list[str] | None = None) -> dict[str, dict]:
    """``row -> changes`` of ``table`` for ``base``'s architecture (XATL: a mixer that cannot take the
    teacher's W_O has no E+FFN+WO row and a hybrid without W_O), narrowed to ``rows`` (table order)."""
    defined, skipped = dict(TABLES[table][1]), {}
    if method_of(table) == "xatl":
        defined, skipped = _for_arch(defined, base.arch)
    if rows is not None:
        unknown = [r for r in rows if r not in TABLES[table][1]]
        if unknown:
            raise LinearizeError(f"{table} has no row {', '.join(unknown)}; its rows: {', '.join(TABLES[table][1])}")
        if len(set(rows)) != len(rows) or not rows:
            raise LinearizeError(f"name each row of {table} once (got {', '.join(rows) or 'none'})")
        for r in rows:
            if r in skipped:
                raise LinearizeError(f"{table} row {r} {skipped[r]}")
        defined = {r: changes for r, changes in defined.items() if r in rows}
    return defined


def _for_arch(rows: dict[str, dict], arch: str) -> tuple[dict[str, dict], dict[str, str]]:
    from ..convert.xatl_transfer import ARCHITECTURES, keeps_teacher_output

    kind = ARCHITECTURES.get(arch, arch)
    if keeps_teacher_output(kind):
        return rows, {}
    kept, skipped = {}, {}
    for name, changes in rows.items():
        items = [i for i in str(changes.get("transfer") or "").split(",") if i]
        if "wo" not in items:
            kept[name] = changes
        elif "attention" in items:  # the hybrid: the kept softmax layers come whole; the mixers' W_O cannot
            kept[name] = {**changes, "transfer": ",".join(i for i in items if i != "wo")}
        else:
            skipped[name] = f"transfers W_O, which {arch} cannot take (its output projection reads other features)"
    return kept, skipped


def row_configs(table: str, base: UptrainConfig, losses: list[str],
                rows: list[str] | None = None) -> dict[tuple[str, str], UptrainConfig]:
    """``(loss, row) -> config`` of every run of ``table``, each at ``base``'s token budget and seed: a
    row's config is ``base`` with its own setting (and, under the lm loss, no alignment stage)."""
    from . import uptrain

    method = method_of(table)
    if base.method != method:
        raise LinearizeError(f"{table} compares {method} runs, not {base.method}")
    if not losses:
        raise LinearizeError("name at least one loss (e.g. lm,kl+lm)")
    if len(set(losses)) != len(losses):
        raise LinearizeError(f"name each loss once (got {','.join(losses)})")
    configs = {}
    for loss in losses:
        for row, changes in table_rows(table, base, rows).items():
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


def check_second_seed(base: UptrainConfig, configs: dict, seed: int | None) -> None:
    """A second seed must differ from the rows' and have a pair to rerun under every loss."""
    if seed is None:
        return
    if seed < 0 or seed == base.seed:
        raise LinearizeError(f"--second-seed must be a seed other than the rows' ({base.seed}), got {seed}")
    per_loss: dict[str, int] = {}
    for loss, _ in configs:
        per_loss[loss] = per_loss.get(loss, 0) + 1
    if any(n < 2 for n in per_loss.values()):
        raise LinearizeError("--second-seed reruns the closest pair of rows: the table needs at least two rows")


def _tag(loss: str) -> str:
    return loss.replace(" ", "").replace("+", "_plus_").replace("*", "x")


def _results(cfg) -> dict:
    return json.loads((Path(cfg.out) / "results.json").read_text())


def held_out_loss(results: dict) -> float:
    """ln of the held-out perplexity after training: every row's, measured at its last step."""
    return math.log(results["perplexity"]["student, after training"])


def closest(values: dict[str, float]) -> tuple[str, str, float] | None:
    """The two rows of ``row -> held-out loss`` whose losses are closest: ``(lower, higher, gap)`` (None
    for fewer than two rows)."""
    ranked = sorted((v, row) for row, v in values.items())
    gaps = [(b[0] - a[0], a[1], b[1]) for a, b in zip(ranked, ranked[1:])]
    if not gaps:
        return None
    gap, a, b = min(gaps)
    return a, b, gap


def closest_pairs(configs: dict) -> dict[str, tuple[str, str, float]]:
    """Per loss, the two rows (finished) whose held-out losses are closest: ``(lower, higher, gap)``."""
    by_loss: dict[str, dict[str, float]] = {}
    for (loss, row), cfg in configs.items():
        by_loss.setdefault(loss, {})[row] = held_out_loss(_results(cfg))
    return {loss: pair for loss, values in by_loss.items() if (pair := closest(values)) is not None}


def seed_configs(configs: dict, seed: int) -> dict[tuple[str, str], UptrainConfig]:
    """The closest pair of each loss (``closest_pairs``) under ``seed``: the same configs but for the seed
    (the initialisation and the data order) and the folder ``OUT/<loss>/seed<N>/<row>``."""
    out = {}
    for loss, (a, b, _) in closest_pairs(configs).items():
        for row in (a, b):
            cfg = configs[(loss, row)]
            out[(loss, row)] = replace(cfg, seed=seed, out=str(Path(cfg.out).parent / f"seed{seed}" / row))
    return out


def _train(configs) -> None:
    from . import uptrain

    for cfg in configs:
        if not (Path(cfg.out) / "results.json").exists():
            uptrain.run(replace(cfg, resume=(Path(cfg.out) / "run_config.json").exists()))


def run(table: str, base: UptrainConfig, losses: list[str], rows: list[str] | None = None,
        second_seed: int | None = None) -> dict:
    """Train every row (skipping finished ones), then, with ``second_seed``, the closest pair of each loss
    again under that seed; write the curves and the page; returns the record."""
    configs = row_configs(table, base, losses, rows)  # every row checked before any trains
    check_second_seed(base, configs, second_seed)
    _train(configs.values())
    seeds = seed_configs(configs, second_seed) if second_seed is not None else {}
    _train(seeds.values())
    return summarise(table, configs, Path(base.out), seeds=seeds)


def _per_step(cfg) -> int:
    return cfg.batch_size * cfg.grad_accum * cfg.block_len


def _curve(cfg: UptrainConfig) -> tuple[list[tuple[float, float]], int]:
    """Validation next-token loss against training tokens (every stage of the run, in order), and the
    steps before the training stage (alignment, the new weights alone)."""
    rows = read_json_lines(Path(cfg.out) / "metrics.jsonl")
    per_step = _per_step(cfg)
    points, offset, last = [], 0, {}
    for stage in ("align", "new-weights", "uptrain"):
        if stage == "uptrain":
            before = offset
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
    return points, before


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Training tokens at which ``curve`` first reaches ``target`` (linear between evaluations; the
    first evaluation's tokens if it is already there), or None if it never does."""
    previous = None
    for tokens, value in curve:
        if value <= target:
            if previous is None or previous[1] == value:
                return float(tokens)
            (t0, v0) = previous
            return t0 + (tokens - t0) * (v0 - target) / (v0 - value)
        previous = (tokens, value)
    return None


def _zero_shot(cfg) -> dict | None:
    """The ``linearize eval`` record beside the run (``eval.json``): its average and tasks."""
    path = Path(cfg.out) / "eval.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec.get("average") is None:
        return None
    return {"average": rec["average"], "tasks": list(rec.get("tasks", {})),
            "limit": rec.get("settings", {}).get("limit")}


def _lit(results: dict, before: int, per_step: int) -> dict | None:
    """The LIT record of a run (``results['freeze']``) with the tokens of its unfreezing."""
    rec = results.get("freeze")
    if not rec or rec.get("mode") != "lit":
        return None
    rec = dict(rec)
    if rec.get("unfrozen_at_step") is not None:
        rec["unfrozen_at_tokens"] = (before + rec["unfrozen_at_step"]) * per_step
    return rec


def _row_record(loss: str, row: str, seed: int, cfg) -> tuple[dict, list]:
    res = _results(cfg)
    curve, before = _curve(cfg)
    ppl = res["perplexity"]["student, after training"]
    return {"row": row, "loss": loss, "seed": seed, "tokens": res["train"]["tokens"], "steps": res["train"]["steps"],
            "seconds": res["train"].get("seconds"), "ppl": ppl, "held_out_loss": math.log(ppl),
            "val_next_token": curve[-1][1] if curve else None, "zero_shot": _zero_shot(cfg),
            "lit": _lit(res, before, _per_step(cfg)), "out": cfg.out}, curve


def judge(relation: str, margin: float, noise: float | None) -> tuple[str, str]:
    """``(verdict, reason)`` of one claim: ``margin`` is b's held-out loss minus a's (positive: a is
    better), ``noise`` the seed-to-seed difference (None: one seed). Verdicts: holds, reversed (each
    "(one seed)" without a noise to weigh), or within noise: the margin, either way, no larger than the
    noise (for "<"; a "no worse / no better" claim reversed within the noise holds)."""
    beyond = noise is not None and abs(margin) > noise
    vs = f"the seed-to-seed difference {noise:.4f}" if noise is not None else "no second seed to weigh it"
    cmp = ">" if beyond else "<="
    if relation == "<":  # a below b
        if noise is None:
            return ("holds (one seed)" if margin > 0 else "reversed (one seed)"), f"margin {margin:+.4f}; {vs}"
        if beyond:
            return ("holds" if margin > 0 else "reversed"), f"|margin {margin:+.4f}| > {vs}"
        return "within noise", (f"{'the order holds' if margin > 0 else 'reversed'} at this seed, but |margin "
                                f"{margin:+.4f}| <= {vs}")
    if relation in ("<=", ">="):  # a no worse than b / a no better than b
        along = margin if relation == "<=" else -margin  # positive: the claim's direction
        if along >= 0:
            return "holds", f"margin {margin:+.4f}" + (f"; {vs}" if noise is None else "")
        if noise is None:
            return "reversed (one seed)", f"margin {margin:+.4f}; {vs}"
        return ("reversed" if beyond else "holds (within noise)"), f"|margin {margin:+.4f}| {cmp} {vs}"
    raise LinearizeError(f"unknown relation {relation!r}")


def orderings(table: str, rows: list[dict]) -> dict[str, dict]:
    """Per loss: the closest pair and its second seed (the noise), and each of the paper's claims judged."""
    out = {}
    for loss in dict.fromkeys(r["loss"] for r in rows):
        first = {r["row"]: r for r in rows if r["loss"] == loss and not r.get("second_seed")}
        second = {r["row"]: r for r in rows if r["loss"] == loss and r.get("second_seed")}
        entry: dict = {"noise": None, "closest_pair": None, "claims": []}
        found = closest({row: r["held_out_loss"] for row, r in first.items()})
        if found is not None:
            a, b = first[found[0]], first[found[1]]
            pair = {"rows": [a["row"], b["row"]], "gap": found[2]}
            if a["row"] in second and b["row"] in second:
                sa, sb = second[a["row"]], second[b["row"]]
                changes = {x["row"]: abs(y["held_out_loss"] - x["held_out_loss"]) for x, y in ((a, sa), (b, sb))}
                pair.update(seed=sa["seed"], gap_second_seed=sb["held_out_loss"] - sa["held_out_loss"],
                            changes=changes)
                entry["noise"] = max(changes.values())
            entry["closest_pair"] = pair
        for x, rel, y, says in CLAIMS.get(table, []):
            if x in first and y in first:
                margin = first[y]["held_out_loss"] - first[x]["held_out_loss"]
                verdict, sentence = judge(rel, margin, entry["noise"])
                entry["claims"].append({"a": x, "relation": rel, "b": y, "says": says, "margin": margin,
                                        "verdict": verdict, "sentence": sentence})
        counts = {}
        for c in entry["claims"]:
            counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
        entry["summary"] = ", ".join(f"{n} {v}" for v, n in counts.items())
        out[loss] = entry
    return out


def tokens_to_match(rows: list[dict], curves: dict) -> list[dict]:
    """XATL's transfer figure: per loss and seed, the tokens each row needs to reach scratch's final
    validation next-token loss, and how many times fewer than scratch spent."""
    found = []
    for r in rows:
        if r["row"] != "scratch" or not curves.get(_key(r)):
            continue
        target_tokens, target = curves[_key(r)][-1]
        for other in rows:
            if other["loss"] != r["loss"] or other["seed"] != r["seed"] or other["row"] == "scratch":
                continue
            curve = curves.get(_key(other), [])
            reach = tokens_to_reach(curve, target)
            found.append({"loss": r["loss"], "seed": r["seed"], "row": other["row"], "scratch_final": target,
                          "scratch_tokens": target_tokens, "tokens": reach,
                          "fewer": target_tokens / reach if reach else None,
                          # there at its first evaluation: the tokens an upper bound, "fewer" a lower one
                          "bound": bool(curve) and reach is not None and reach == curve[0][0]})
    return found


def _key(r: dict) -> tuple:
    return (r["loss"], r["row"], r["seed"])


def summarise(table: str, configs: dict, out: Path, seeds: dict | None = None) -> dict:
    """Write ``out/orderings.json``, ``out/orderings.md`` and ``out/curves.png`` from the finished runs."""
    seeds = seeds or {}
    any_cfg = next(iter(configs.values()))
    record: dict = {"table": table, "method": method_of(table), "arch": getattr(any_cfg, "arch", None),
                    "seed": any_cfg.seed, "second_seed": next(iter(seeds.values())).seed if seeds else None,
                    "steps": any_cfg.steps, "tokens_per_step": _per_step(any_cfg), "rows": []}
    curves: dict[tuple, list] = {}
    for group, second in ((configs, False), (seeds, True)):
        for (loss, row), cfg in group.items():
            r, curve = _row_record(loss, row, cfg.seed, cfg)
            r["second_seed"] = second
            record["rows"].append(r)
            curves[_key(r)] = curve
    record["orderings"] = orderings(table, record["rows"])
    if table == "xatl-table2":
        record["tokens_to_match"] = tokens_to_match(record["rows"], curves)
    out.mkdir(parents=True, exist_ok=True)
    lines = page(record)
    try:
        plot_curves(record, curves, out / "curves.png")
        lines += ["", "![validation curves](curves.png)"]
    except LinearizeError:
        pass  # matplotlib absent, or no evaluation logged: the table stands alone
    (out / "orderings.json").write_text(json.dumps(record, indent=1))
    (out / "orderings.md").write_text("\n".join(lines) + "\n")
    record["markdown"] = "\n".join(lines)
    return record


def _f(x, fmt: str = ".4f") -> str:
    return "–" if x is None else format(x, fmt)


def page(record: dict) -> list[str]:
    """The table's page (Markdown lines): the rows, the paper's ordering per loss, LIT, tokens to match."""
    table, rows = record["table"], record["rows"]
    arch = f", {record['arch']}" if record.get("arch") else ""
    first = [r for r in rows if not r["second_seed"]]
    tokens = sorted({r["tokens"] for r in first})
    lines = [f"# {table} ({record['method']}{arch})", "",
             f"Every row: {_tokens(tokens)} training tokens ({record['tokens_per_step']:,} per step), seed "
             f"{record['seed']}, the same data order" + (f"; the closest pair of each loss again at seed "
                                                          f"{record['second_seed']}" if record["second_seed"] is not None
                                                          else "") + ".", "",
             "| row | loss | seed | training tokens | held-out ppl | held-out loss | validation next-token loss "
             "| zero-shot avg |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        zs = r["zero_shot"]
        zs_text = f"{100 * zs['average']:.1f} ({len(zs['tasks'])} tasks)" if zs else "–"
        lines.append(f"| {r['row']} | {r['loss']} | {r['seed']} | {r['tokens']:,} | {r['ppl']:.2f} | "
                     f"{r['held_out_loss']:.4f} | {_f(r['val_next_token'])} | {zs_text} |")
    limits = {r["zero_shot"]["limit"] for r in rows if r["zero_shot"]}
    lines += ["", "Held-out loss: ln of the held-out perplexity after training (the validation blocks, every row at "
              "its last step); the validation next-token loss is the curves' last evaluation. Zero-shot: the "
              "average of `linearize eval`'s tasks on the row's final checkpoint (`eval.json` beside the run"
              + (f", {', '.join(str(x) for x in sorted(limits, key=str))} documents per task" if limits else "")
              + ")."]
    lines += ["", "## The paper's ordering", ""]
    for loss, entry in record["orderings"].items():
        lines += [f"### loss: {loss}", ""]
        pair = entry["closest_pair"]
        if pair:
            a, b = pair["rows"]
            text = f"Closest pair: {a} and {b}, {pair['gap']:.4f} apart in held-out loss at seed {record['seed']}"
            if "seed" in pair:
                same = (pair["gap_second_seed"] > 0) == (pair["gap"] > 0) or pair["gap"] == 0
                text += (f"; at seed {pair['seed']} {b} minus {a} is {pair['gap_second_seed']:+.4f} ("
                         + ("the same order" if same else "the order flips") + f"). Seed-to-seed difference "
                         f"(run-to-run noise): **{entry['noise']:.4f}** (" + ", ".join(
                             f"{k} {v:.4f}" for k, v in pair["changes"].items()) + ").")
            else:
                text += "; no second seed, so no run-to-run noise to weigh the margins against."
            lines += [text, ""]
        if entry["claims"]:
            lines += [f"The paper's ordering under {loss}: {entry['summary']} (of {len(entry['claims'])} claims).", "",
                      "| the paper | a | b | held-out loss a / b | margin (b − a) | verdict |", "|---|---|---|---|---|---|"]
            by_row = {r["row"]: r for r in first if r["loss"] == loss}
            for c in entry["claims"]:
                la, lb = by_row[c["a"]]["held_out_loss"], by_row[c["b"]]["held_out_loss"]
                lines.append(f"| {c['says']}: {c['a']} {RELATIONS[c['relation']]} {c['b']} | {c['a']} | {c['b']} | "
                             f"{la:.4f} / {lb:.4f} | {c['margin']:+.4f} | **{c['verdict']}** ({c['sentence']}) |")
            lines.append("")
        else:
            lines += ["No claim of the paper compares these rows.", ""]
    lit = [r for r in rows if r["lit"]]
    if lit:
        lines += ["## LIT's unfreezing", ""]
        for r in lit:
            lines.append(f"- {r['loss']}, seed {r['seed']}: " + lit_sentence(r["lit"], record["tokens_per_step"]))
        lines.append("")
    if record.get("tokens_to_match") is not None:
        lines += ["## Tokens to reach scratch's final validation loss", ""]
        lines += match_lines(record)
    return lines


def lit_sentence(rec: dict, per_step: int) -> str:
    evals = rec.get("evaluations", [])
    shown = "; ".join(f"step {e['step']}: {e['value']:.4f}"
                      + (f" ({100 * e['improvement']:+.2f} %)" if e.get("improvement") is not None else "")
                      for e in evals)
    rule = (f"{rec['metric']} improving by less than {100 * rec['threshold']:.2f} % for {rec['patience']} "
            f"evaluation(s)")
    if rec.get("unfrozen_at_step") is not None:
        t = rec["trigger"]
        imps = ", ".join(f"{100 * i:.2f} %" if i is not None else "not finite" for i in t["improvements"])
        head = (f"unfroze the transferred weights at **step {rec['unfrozen_at_step']}** "
                f"({rec.get('unfrozen_at_tokens', rec['unfrozen_at_step'] * per_step):,} tokens): {rec['metric']} "
                f"{t['previous']:.4f} -> {t['value']:.4f}, improvement {imps} < {100 * rec['threshold']:.2f} % "
                f"(rule: {rule})")
    else:
        imps = [e["improvement"] for e in evals if e.get("improvement") is not None]
        head = (f"**never unfroze** (rule: {rule}; the smallest improvement was "
                f"{100 * min(imps):.2f} %)" if imps else f"**never unfroze** (rule: {rule}; too few evaluations)")
        head += ": the row trained frozen throughout, as the frozen row"
    return head + (f". Evaluations: {shown}." if shown else ".")


def match_lines(record: dict) -> list[str]:
    found = record["tokens_to_match"]
    if not found:
        return ["No scratch row: nothing to match.", ""]
    arch = record.get("arch") or "?"
    lines = ["| arch | loss | seed | row | scratch's final loss | scratch's tokens | tokens to reach it | fewer tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for m in found:
        lines.append(f"| {arch} | {m['loss']} | {m['seed']} | {m['row']} | {m['scratch_final']:.4f} | "
                     f"{m['scratch_tokens']:,} | {_tokens_or(m)} | {_fewer(m)} |")
    lines.append("")
    for m in found:
        if m["row"] == "E+FFN" and m["seed"] == record["seed"]:
            met = m["fewer"] is not None and m["fewer"] >= MATCH_TARGET
            lines.append(f"- {m['loss']}: E+FFN " + (f"reaches scratch's final loss after {_tokens_or(m)} tokens, "
                                                      f"{_fewer(m)} fewer" if m["fewer"] else
                                                      "never reaches scratch's final loss")
                         + f": the target (>= {MATCH_TARGET}x fewer) is **{'met' if met else 'not met'}**.")
    lines += ["", "Linear between evaluations; a row already at the target at its first evaluation is given that "
              "evaluation's tokens (\"<=\": an upper bound, the ratio a lower one).", ""]
    return lines


def _tokens(values: list[int]) -> str:
    return " / ".join(f"{v:,}" for v in values) if values else "–"


def _tokens_or(m: dict) -> str:
    return "not reached" if m["tokens"] is None else ("<= " if m.get("bound") else "") + f"{m['tokens']:,.0f}"


def _fewer(m: dict) -> str:
    return "not reached" if m["fewer"] is None else (">= " if m.get("bound") else "") + f"{m['fewer']:.2f}x"


def plot_curves(record: dict, curves: dict, out_png: Path) -> Path:
    """The validation curves, one panel per loss; second-seed rows dashed in their row's colour; LIT's
    unfreezing a dotted line and a star on its curve; tokens-to-match a cross on scratch's final level."""
    from ..eval.plots import _pyplot

    losses = list(dict.fromkeys(r["loss"] for r in record["rows"]))
    if not any(curves.values()):
        raise LinearizeError("no curve to draw")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(losses), figsize=(6 * len(losses), 4.2), sharey=True, squeeze=False)
    names = list(dict.fromkeys(r["row"] for r in record["rows"]))
    colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for ax, loss in zip(axes[0], losses):
        stacked = 0  # LIT notes of one panel, stacked upwards so that two unfreezings at one step stay readable
        for r in (r for r in record["rows"] if r["loss"] == loss):
            points = curves.get(_key(r)) or []
            if not points:
                continue
            label = r["row"] + (f" (seed {r['seed']})" if r["second_seed"] else "")
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=label,
                    color=colours[r["row"]], linestyle="--" if r["second_seed"] else "-", alpha=0.7 if r["second_seed"] else 1)
            lit = r.get("lit")
            if lit and lit.get("unfrozen_at_tokens") is not None:
                x = lit["unfrozen_at_tokens"]
                y = min(points, key=lambda p: abs(p[0] - x))[1]
                ax.axvline(x, color=colours[r["row"]], linestyle=":", linewidth=1)
                ax.plot([x], [y], marker="*", markersize=12, color=colours[r["row"]])
                imps = ", ".join(f"{100 * i:.2f}%" for i in lit["trigger"]["improvements"] if i is not None)
                ax.annotate(f"LIT (seed {r['seed']}) unfroze, step {lit['unfrozen_at_step']}\n(improvement {imps} < "
                            f"{100 * lit['threshold']:.0f}%)", (x, y), xytext=(6, 14 + 30 * stacked),
                            textcoords="offset points", fontsize=7, color=colours[r["row"]])
                stacked += 1
        for m in record.get("tokens_to_match") or []:
            if m["loss"] == loss and m["seed"] == record["seed"] and m["tokens"] is not None:
                ax.axhline(m["scratch_final"], color="grey", linestyle=":", linewidth=0.8)
                ax.plot([m["tokens"]], [m["scratch_final"]], marker="x", markersize=8, color=colours[m["row"]])
        ax.set_title(f"loss: {loss}")
        ax.set_xlabel("training tokens")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("validation next-token loss")
    fig.suptitle(record["table"] + (f" ({record['arch']})" if record.get("arch") else ""))
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def match_page(paths: list[Path], out_dir: Path) -> Path:
    """The tokens-to-match figures of several xatl-table2 records (``orderings.json``) side by side:
    ``out_dir/tokens-to-match.md`` and, with matplotlib, ``tokens-to-match.png``."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    for p, rec in zip(paths, records):
        if rec.get("table") != "xatl-table2" or rec.get("tokens_to_match") is None:
            raise LinearizeError(f"{p} is no xatl-table2 record with tokens to match")
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# XATL: tokens to reach scratch's final validation loss, by architecture", "",
             "| arch | loss | seed | row | training tokens | scratch's final loss | tokens to reach it | fewer tokens |",
             "|---|---|---|---|---|---|---|---|"]
    bars = []
    for rec in records:
        for m in rec["tokens_to_match"]:
            lines.append(f"| {rec['arch']} | {m['loss']} | {m['seed']} | {m['row']} | {m['scratch_tokens']:,} | "
                         f"{m['scratch_final']:.4f} | {_tokens_or(m)} | {_fewer(m)} |")
            bars.append((f"{rec['arch']}\n{m['loss']}, seed {m['seed']}", m["row"], m["fewer"] or 0.0))
    lines += ["", f"The target (issue 45): E+FFN with >= {MATCH_TARGET}x fewer tokens than scratch (XATL: up to 2.5x; "
              "RetNet at 5M tokens, 2026-11-22: 1.66x). 'not reached': the row never reached scratch's final loss."]
    try:
        from ..eval.plots import _pyplot

        plt = _pyplot()
        groups = list(dict.fromkeys(g for g, _, _ in bars))
        rows = list(dict.fromkeys(r for _, r, _ in bars))
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(groups)), 3.6))
        width = 0.8 / max(1, len(rows))
        for j, row in enumerate(rows):
            xs = [groups.index(g) + j * width for g, r, _ in bars if r == row]
            ax.bar(xs, [v for _, r, v in bars if r == row], width=width, label=row, color=f"C{j % 10}")
        ax.axhline(MATCH_TARGET, color="grey", linestyle=":", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels(groups, fontsize=7)
        ax.set_ylabel("x fewer tokens than scratch")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "tokens-to-match.png", dpi=120)
        plt.close(fig)
        lines += ["", "![tokens to match](tokens-to-match.png)"]
    except LinearizeError:
        pass
    path = out_dir / "tokens-to-match.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m linearize.recipes.orderings match A/orderings.json B/orderings.json --out DIR``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m linearize.recipes.orderings",
                                description="Tokens-to-match of several xatl-table2 runs side by side.")
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("match", help="write DIR/tokens-to-match.md (and .png)")
    m.add_argument("records", nargs="+", type=Path, help="orderings.json of xatl-table2 runs")
    m.add_argument("--out", type=Path, required=True, help="folder of the page")
    args = p.parse_args(argv)
    try:
        print(match_page(args.records, args.out))
    except LinearizeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
