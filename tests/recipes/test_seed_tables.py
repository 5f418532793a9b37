"""Issue 45's tables through ``linearize orderings``: each table's rows differ only in the setting they
ablate (same seed, data order and tokens), for either XATL architecture and for the second-seed rows;
the closest pair and the paper's claims judged against the seed-to-seed difference; LIT's unfreezing
recorded (metrics.jsonl, results.json, the page); tokens to match scratch; tiny end-to-end runs."""

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from linearize.cli import main
from linearize.errors import LinearizeError
from linearize.recipes.lit import LitCallback
from linearize.recipes import orderings
from linearize.recipes.supra import SupraConfig
from linearize.recipes.xatl import XatlConfig

# settings that make the data order and the token budget: every row of a table shares them
SHARED = ("seed", "data", "block_len", "batch_size", "grad_accum", "train_blocks", "eval_blocks", "eval_steps", "lr",
          "min_lr", "warmup_steps", "weight_decay", "teacher", "dtype", "kl_temperature", "kl_top_k", "cuda_graph",
          "compile", "patience")
# what each table's rows may differ in (besides out): the setting it ablates
ABLATES = {"supra-table3": {"spec", "new_weights_first", "steps"}, "xatl-table2": {"transfer", "keep_softmax"},
           "xatl-table3": {"freeze"}}


def _base(table: str, tmp_path, arch: str = "retnet", **kw):
    if table.startswith("supra"):
        return SupraConfig(out=str(tmp_path / table), steps=100, align_steps=5, **kw)
    return XatlConfig(out=str(tmp_path / table), arch=arch, spec={"kind": arch}, steps=100, align_steps=5, **kw)


def _diff(a, b) -> set:
    da, db = asdict(a), asdict(b)
    return {k for k in da if da[k] != db[k]} - {"out"}


def _budget(cfg) -> int:
    return cfg.steps + getattr(cfg, "new_weights_first", 0)


@pytest.mark.parametrize("table, arch", [("supra-table3", None), ("xatl-table2", "retnet"),
                                         ("xatl-table2", "striped_mamba"), ("xatl-table3", "retnet"),
                                         ("xatl-table3", "striped_mamba")])
def test_rows_differ_only_in_the_setting_they_ablate(table, arch, tmp_path):
    base = _base(table, tmp_path, *([] if arch is None else [arch]))
    configs = orderings.row_configs(table, base, ["lm", "kl+lm"])
    for loss in ("lm", "kl+lm"):
        rows = {row: cfg for (l, row), cfg in configs.items() if l == loss}
        first = next(iter(rows.values()))
        for row, cfg in rows.items():
            assert _diff(first, cfg) <= ABLATES[table], (row, _diff(first, cfg))
            assert {k: getattr(cfg, k) for k in SHARED} == {k: getattr(first, k) for k in SHARED}
            assert _budget(cfg) == 100 and cfg.loss == loss and cfg.align_steps == (0 if loss == "lm" else 5)
            assert Path(cfg.out) == Path(base.out) / orderings._tag(loss) / row
            if arch is not None:
                assert cfg.arch == arch and cfg.spec["kind"] == arch
    # across the losses a row differs in the loss (and the kl rows' alignment stage) alone
    for (loss, row), cfg in configs.items():
        assert _diff(configs[("lm", row)], cfg) <= {"loss", "align_steps"}


def test_striped_mamba_rows_leave_out_wo(tmp_path):
    mamba = orderings.row_configs("xatl-table2", _base("xatl-table2", tmp_path, "striped_mamba"), ["lm"])
    assert [row for _, row in mamba] == ["scratch", "E", "E+FFN", "hybrid"]  # Mamba cannot take W_O
    assert mamba[("lm", "hybrid")].transfer == "embeddings,ffn,attention"
    assert mamba[("lm", "hybrid")].keep_softmax == "xatl"
    retnet = orderings.row_configs("xatl-table2", _base("xatl-table2", tmp_path), ["lm"])
    assert [row for _, row in retnet] == ["scratch", "E", "E+FFN", "E+FFN+WO", "hybrid"]
    assert retnet[("lm", "hybrid")].transfer == "embeddings,ffn,wo,attention"
    picked = orderings.row_configs("xatl-table2", _base("xatl-table2", tmp_path, "striped_mamba"), ["lm"],
                                   rows=["E+FFN", "scratch"])
    assert [row for _, row in picked] == ["scratch", "E+FFN"]  # table order
    with pytest.raises(LinearizeError, match="E\\+FFN\\+WO transfers W_O"):
        orderings.row_configs("xatl-table2", _base("xatl-table2", tmp_path, "striped_mamba"), ["lm"], rows=["E+FFN+WO"])
    with pytest.raises(LinearizeError, match="has no row nope"):
        orderings.row_configs("xatl-table3", _base("xatl-table3", tmp_path), ["lm"], rows=["lit", "nope"])


def _finish(cfg, ppl: float, curve=()):
    """A finished run's files: results.json with ``ppl`` and metrics.jsonl with ``curve`` (step, eval_loss)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"perplexity": {"student, after training": ppl},
                                                  "train": {"tokens": 100 * 8 * 1024, "steps": 100}}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"stage": "uptrain", "step": s, "eval_loss": v}) + "\n"
                                               for s, v in curve))


def test_second_seed_reruns_the_closest_pair_with_only_the_seed_changed(tmp_path):
    base = _base("xatl-table3", tmp_path)
    configs = orderings.row_configs("xatl-table3", base, ["lm", "kl+lm"])
    ppl = {"frozen": 300.0, "unfrozen": 250.0, "lit": 245.0}
    for (loss, row), cfg in configs.items():
        _finish(cfg, ppl[row] * (1 if loss == "lm" else 0.5) + (60 if loss == "kl+lm" and row == "frozen" else 0))
    assert {loss: pair[:2] for loss, pair in orderings.closest_pairs(configs).items()} == {
        "lm": ("lit", "unfrozen"), "kl+lm": ("lit", "unfrozen")}
    seeds = orderings.seed_configs(configs, 7)
    assert set(seeds) == {(loss, row) for loss in ("lm", "kl+lm") for row in ("lit", "unfrozen")}
    for key, cfg in seeds.items():
        assert _diff(configs[key], cfg) == {"seed"} and cfg.seed == 7
        assert Path(cfg.out) == Path(base.out) / orderings._tag(key[0]) / "seed7" / key[1]
    orderings.check_second_seed(base, configs, 7)
    with pytest.raises(LinearizeError, match="other than the rows'"):
        orderings.check_second_seed(base, configs, base.seed)
    one = orderings.row_configs("xatl-table3", base, ["lm"], rows=["lit"])
    with pytest.raises(LinearizeError, match="at least two rows"):
        orderings.check_second_seed(base, one, 1)


@pytest.mark.parametrize("relation, margin, noise, verdict", [
    ("<", 0.20, 0.05, "holds"), ("<", 0.02, 0.05, "within noise"), ("<", -0.20, 0.05, "reversed"),
    ("<", -0.02, 0.05, "within noise"), ("<", 0.20, None, "holds (one seed)"), ("<", -0.2, None, "reversed (one seed)"),
    ("<=", 0.01, 0.05, "holds"), ("<=", -0.02, 0.05, "holds (within noise)"), ("<=", -0.20, 0.05, "reversed"),
    (">=", -0.01, 0.05, "holds"), (">=", 0.02, 0.05, "holds (within noise)"), (">=", 0.20, 0.05, "reversed"),
])
def test_claims_are_judged_against_the_seed_to_seed_difference(relation, margin, noise, verdict):
    assert orderings.judge(relation, margin, noise)[0] == verdict


def test_tokens_to_reach_interpolates_between_evaluations():
    curve = [(100, 9.0), (200, 7.0), (300, 6.0), (400, 5.5)]
    assert orderings.tokens_to_reach(curve, 6.5) == pytest.approx(250)
    assert orderings.tokens_to_reach(curve, 9.5) == 100  # already there at the first evaluation
    assert orderings.tokens_to_reach(curve, 5.5) == 400
    assert orderings.tokens_to_reach(curve, 5.0) is None


def test_the_page_states_the_ordering_the_noise_and_tokens_to_match(tmp_path):
    """Finished runs scripted: E+FFN beats scratch at seed 0 by more than the seeds differ; E is worse
    than scratch (the paper's ordering reversed); scratch's final loss reached by E+FFN at 2/3 of its tokens."""
    base = _base("xatl-table2", tmp_path, "striped_mamba", batch_size=1, block_len=10, grad_accum=1)
    configs = orderings.row_configs("xatl-table2", base, ["lm"], rows=["scratch", "E", "E+FFN"])
    curves = {"scratch": [(10, 8.0), (20, 7.0), (30, 6.0)], "E": [(10, 8.5), (20, 7.5), (30, 6.5)],
              "E+FFN": [(10, 7.0), (20, 6.0), (30, 5.0)]}
    for (loss, row), cfg in configs.items():
        _finish(cfg, {"scratch": math.exp(6.0), "E": math.exp(6.5), "E+FFN": math.exp(5.0)}[row], curves[row])
    assert orderings.closest_pairs(configs)["lm"][:2] == ("scratch", "E")
    seeds = orderings.seed_configs(configs, 1)
    _finish(seeds[("lm", "scratch")], math.exp(6.1), [(10, 8.1), (20, 7.1), (30, 6.1)])
    _finish(seeds[("lm", "E")], math.exp(6.45), [(10, 8.4), (20, 7.4), (30, 6.45)])
    (Path(configs[("lm", "E+FFN")].out) / "eval.json").write_text(json.dumps(
        {"average": 0.3125, "tasks": {"piqa": {}, "arc_easy": {}}, "settings": {"limit": 300}}))
    record = orderings.summarise("xatl-table2", configs, Path(base.out), seeds=seeds)
    entry = record["orderings"]["lm"]
    assert entry["closest_pair"]["rows"] == ["scratch", "E"] and entry["noise"] == pytest.approx(0.1)
    verdicts = {(c["a"], c["b"]): c["verdict"] for c in entry["claims"]}
    assert verdicts == {("E", "scratch"): "reversed", ("E+FFN", "E"): "holds", ("E+FFN", "scratch"): "holds"}
    match = {(m["row"], m["seed"]): m for m in record["tokens_to_match"]}
    assert match[("E+FFN", 0)]["tokens"] == pytest.approx(200) and match[("E+FFN", 0)]["fewer"] == pytest.approx(1.5)
    assert match[("E", 0)]["tokens"] is None and match[("E", 1)]["tokens"] is None
    md = (Path(base.out) / "orderings.md").read_text()
    assert "**reversed**" in md and "Seed-to-seed difference (run-to-run noise): **0.1000**" in md
    assert "31.2 (2 tasks)" in md and "the target (>= 1.5x fewer) is **met**" in md
    assert json.loads((Path(base.out) / "orderings.json").read_text())["second_seed"] == 1
    page = orderings.match_page([Path(base.out) / "orderings.json", Path(base.out) / "orderings.json"], tmp_path / "m")
    assert page.read_text().count("| striped_mamba | lm | 0 | E+FFN |") == 2


class _State:
    def __init__(self):
        self.global_step, self.log_history, self.is_world_process_zero = 0, [], True


def test_lit_records_the_step_and_the_improvements_that_unfroze_it(tmp_path):
    log = tmp_path / "metrics.jsonl"
    cb = LitCallback(mode="lit", threshold=0.01, patience=2, log_path=str(log))
    state = _State()
    for step, loss in ((10, 6.0), (20, 5.0), (30, 4.98), (40, 4.0), (50, 3.99), (60, 3.985), (70, 3.0)):
        state.global_step = step
        cb.on_evaluate(None, state, None, metrics={"eval_loss": loss})
    rec = cb.record()
    assert rec["unfrozen_at_step"] == 60 and rec["fired"]
    assert rec["trigger"]["step"] == 60 and rec["trigger"]["previous"] == 3.99 and rec["trigger"]["value"] == 3.985
    assert rec["trigger"]["improvements"] == pytest.approx([0.01 / 4.0, 0.005 / 3.99])
    assert [e["step"] for e in rec["evaluations"]] == [10, 20, 30, 40, 50, 60]  # none after it fired
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 60 and lines[0]["lit_unfrozen"] == 1.0
    assert lines[0]["lit_improvements"] == pytest.approx(rec["trigger"]["improvements"])
    # restored from a checkpoint's state, it says the same
    saved = cb.state()
    restored = LitCallback(**saved["args"])
    for k, v in saved["attributes"].items():
        setattr(restored, k, v)
    assert restored.record() == rec
    never = LitCallback(mode="lit", threshold=0.001)
    for step, loss in ((10, 6.0), (20, 5.0)):
        state.global_step = step
        never.on_evaluate(None, state, None, metrics={"eval_loss": loss})
    assert never.record()["unfrozen_at_step"] is None and "trigger" not in never.record()
    assert "never unfroze" in orderings.lit_sentence(never.record(), 100)
    assert LitCallback(mode="frozen").record() == {"mode": "frozen"}


def _args(ws, out, *extra):
    return ["--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--out", str(out), "--budget", "cpu",
            "--block-len", "32", "--batch-size", "4", "--eval-blocks", "4", "--steps", "6", "--eval-steps", "2",
            "--lr", "3e-3", "--dtype", "float32", "--device", "cpu", *extra]


def test_xatl_table_three_with_lit_firing_and_a_second_seed(workspace, monkeypatch, tmp_path):
    """LIT at a threshold it must cross (100 %: at the second evaluation, step 4): the step and the
    improvement on the page, in results.json and metrics.jsonl; the closest pair again at seed 1."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    out = tmp_path / "x3"
    argv = ["orderings", "xatl-table3", *_args(workspace, out), "--losses", "lm", "--lit-threshold", "1.0",
            "--second-seed", "1"]
    assert main(argv) == 0
    record = json.loads((out / "orderings.json").read_text())
    first = [r for r in record["rows"] if not r["second_seed"]]
    second = [r for r in record["rows"] if r["second_seed"]]
    assert [r["row"] for r in first] == ["frozen", "unfrozen", "lit"] and len(second) == 2
    assert {r["tokens"] for r in record["rows"]} == {6 * 4 * 32} and {r["seed"] for r in second} == {1}
    assert [r["row"] for r in second] == record["orderings"]["lm"]["closest_pair"]["rows"]
    lit = json.loads((out / "lm" / "lit" / "results.json").read_text())["freeze"]
    assert lit["unfrozen_at_step"] == 4 and lit["trigger"]["improvements"][0] < 1.0
    assert any(json.loads(x).get("lit_unfrozen") for x in (out / "lm" / "lit" / "metrics.jsonl").read_text().splitlines())
    md = (out / "orderings.md").read_text()
    assert "unfroze the transferred weights at **step 4** (512 tokens)" in md
    assert "Seed-to-seed difference (run-to-run noise)" in md and "freezing the transferred weights hurts" in md
    assert (out / "curves.png").stat().st_size > 0
    # the second seed's rows differ from their first-seed rows in the seed alone
    for r in second:
        a = json.loads((out / "lm" / r["row"] / "results.json").read_text())["config"]
        b = json.loads((Path(r["out"]) / "results.json").read_text())["config"]
        assert {k for k in a if a[k] != b[k]} == {"seed", "out"}


def test_lit_resumed_after_it_unfroze_stays_unfrozen(workspace, monkeypatch, tmp_path):
    """A LIT run resumed from its last checkpoint restores the schedule's state (unfrozen at step 4), not
    a fresh one that would freeze the transferred weights again."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    out = tmp_path / "lit"
    argv = ["xatl", *_args(workspace, out), "--transfer", "embeddings,ffn", "--freeze", "lit", "--lit-threshold", "1.0"]
    assert main(argv) == 0
    assert json.loads((out / "results.json").read_text())["freeze"]["unfrozen_at_step"] == 4
    (out / "results.json").unlink()
    assert main([*argv, "--resume"]) == 0  # from checkpoint-6: nothing left to train
    assert json.loads((out / "results.json").read_text())["freeze"]["unfrozen_at_step"] == 4


def test_striped_mamba_transfer_beside_retnet(workspace, monkeypatch, tmp_path):
    """XATL Table 2's scratch vs E+FFN for StripedMamba and RetNet, then tokens to match side by side."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    records = []
    for arch in ("striped_mamba", "retnet"):
        out = tmp_path / arch
        assert main(["orderings", "xatl-table2", *_args(workspace, out), "--losses", "lm", "--arch", arch,
                     "--rows", "scratch,E+FFN"]) == 0
        record = json.loads((out / "orderings.json").read_text())
        assert record["arch"] == arch and [r["row"] for r in record["rows"]] == ["scratch", "E+FFN"]
        config = json.loads((out / "lm" / "E+FFN" / "results.json").read_text())["config"]
        assert config["arch"] == arch and config["spec"]["kind"] == arch and config["transfer"] == "embeddings,ffn"
        assert [m["row"] for m in record["tokens_to_match"]] == ["E+FFN"]
        assert "## Tokens to reach scratch's final validation loss" in (out / "orderings.md").read_text()
        records.append(out / "orderings.json")
    assert orderings.main(["match", *map(str, records), "--out", str(tmp_path / "side")]) == 0
    text = (tmp_path / "side" / "tokens-to-match.md").read_text()
    assert "| striped_mamba | lm | 0 | E+FFN |" in text and "| retnet | lm | 0 | E+FFN |" in text


@pytest.mark.parametrize("argv, message", [
    (["orderings", "supra-table3", "--arch", "retnet"], "--arch, --lit-threshold and --lit-patience are XATL's"),
    (["orderings", "xatl-table2", "--arch", "striped_mamba", "--rows", "E+FFN+WO"], "transfers W_O"),
    (["orderings", "xatl-table3", "--second-seed", "0"], "other than the rows'"),
    (["orderings", "xatl-table3", "--rows", "lit", "--second-seed", "1"], "at least two rows"),
])
def test_bad_seed_table_options_fail_before_the_teacher_loads(argv, message, tmp_path, capsys):
    assert main([*argv, "--teacher", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_supra_table_three_with_a_second_seed(workspace, monkeypatch, tmp_path):
    """SUPRA Table 3 at equal tokens (the 2-step row's first stage counted), its closest pair again at seed 3."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    out = tmp_path / "s3"
    assert main(["orderings", "supra-table3", *_args(workspace, out), "--losses", "lm", "--second-seed", "3"]) == 0
    record = json.loads((out / "orderings.json").read_text())
    assert [(r["row"], r["seed"]) for r in record["rows"][:3]] == [("supra", 0), ("t2r", 0), ("supra-2step", 0)]
    assert {r["tokens"] for r in record["rows"]} == {6 * 4 * 32} and len(record["rows"]) == 5
    pair = record["orderings"]["lm"]["closest_pair"]
    assert [r["row"] for r in record["rows"][3:]] == pair["rows"] and pair["seed"] == 3
    assert {c["says"] for c in record["orderings"]["lm"]["claims"]} == {
        "SUPRA beats T2R", "the 2-step variant gives no gain over 1-step"}
    assert all(Path(r["out"]).parent.name == "seed3" for r in record["rows"][3:])
