"""`linearize bench` measures both models and the student's cache does not grow with length."""

import json
import statistics

import pytest
import torch

from helpers import tiny_tokenizer
from linearize import convert, save
from linearize.cli import main


def test_bench_cli_on_tiny_models(tiny_model, tmp_path, capsys):
    teacher = tiny_model("llama")
    save(teacher, tiny_tokenizer(), tmp_path / "teacher")
    save(convert(teacher, "lolcats", window=4, feature_dim=8), tiny_tokenizer(), tmp_path / "student")
    assert main(["bench", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"), "--batch-sizes", "1", "2",
                 "--new-tokens", "8", "32", "--prompt-len", "6", "--device", "cpu", "--out", str(tmp_path / "b.json"),
                 "--teacher-paths", "generate", "static", "fast", "--paths", "fast", "generate", "--prefill-batch", "1", "--plots", str(tmp_path / "plots")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    pairs = {(r["model"], r["path"]) for r in rows}
    assert pairs == {("teacher", "generate"), ("teacher", "static"), ("teacher", "fast"),
                     ("student", "fast"), ("student", "generate")} and len(rows) == 20
    held = {(r["model"], r["path"], r["batch"], r["new_tokens"]): r["cache_bytes"] for r in rows}
    for path in ("fast", "generate"):
        assert held[("student", path, 2, 8)] == held[("student", path, 2, 32)] > 0
    assert held[("teacher", "generate", 2, 32)] > held[("teacher", "generate", 2, 8)]
    assert held[("teacher", "fast", 2, 32)] > held[("teacher", "fast", 2, 8)]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    text = capsys.readouterr().out
    assert "| student | fast |" in text and "| teacher | static |" in text
    assert (tmp_path / "plots" / "tok_s_vs_batch.png").stat().st_size > 0
    assert (tmp_path / "plots" / "memory_vs_length.png").stat().st_size > 0


def test_train_throughput_bench_on_a_tiny_teacher(tiny_model, tmp_path, capsys):
    import pytest

    from linearize.bench.train import main as bench_train

    teacher = tiny_model("llama")
    save(teacher, tiny_tokenizer(), tmp_path / "teacher")
    out = tmp_path / "not-yet" / "train.json"  # its folder is made
    assert bench_train(["--teacher", str(tmp_path / "teacher"), "--models", "teacher", "supra", "t2r", "retnet",
                        "striped_mamba", "--shapes", "2x16", "1x32", "--steps", "1", "--warmup", "1",
                        "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["batch"], r["length"]) for r in rows][:2] == [("teacher", 2, 16), ("teacher", 1, 32)]
    assert len(rows) == 10 and all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["ratio_to_teacher"] == 1.0 for r in rows if r["model"] == "teacher")
    assert "| striped_mamba | 1x32 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        bench_train(["--teacher", str(tmp_path / "teacher"), "--shapes", "16by1024", "--device", "cpu"])
    assert exit_info.value.code == 2


def test_train_bench_compiled_rows_compare_with_the_teacher(tiny_model):
    """--compile's plumbing (aot_eager here: the same graph capture without generating kernels)."""
    from linearize.bench.train import TrainRow, run, with_ratios

    seen = []  # the rows so far after each one: what a run cut short by a timeout still writes
    rows = run(tiny_model("llama"), ["teacher", "supra"], [(2, 16)], steps=1, warmup=1, compile="aot_eager",
               report=lambda so_far: seen.append([r.model for r in so_far]))
    assert [r.model for r in rows] == ["teacher+compile", "supra+compile"]
    assert seen == [["teacher+compile"], ["teacher+compile", "supra+compile"]]
    assert rows[0].ratio_to_teacher == 1.0 and rows[1].ratio_to_teacher > 0
    # the teacher's fastest run at a shape, however it ran, is the reference for every row there
    mixed = with_ratios([TrainRow("teacher", 2, 16, 200.0, 1, 1), TrainRow("teacher+graph", 2, 16, 100.0, 1, 1),
                         TrainRow("supra+graph", 2, 16, 150.0, 1, 1), TrainRow("supra", 4, 16, 150.0, 1, 1)])
    assert [r.ratio_to_teacher for r in mixed] == [1.0, 0.5, 0.75, None]


def test_train_bench_cuda_graph_needs_cuda(tiny_model):
    from linearize.bench.train import run
    from linearize.errors import LinearizeError

    if torch.cuda.is_available():
        pytest.skip("the CPU-only refusal")
    with pytest.raises(LinearizeError, match="needs a CUDA device"):
        run(tiny_model("llama"), ["teacher"], [(2, 16)], steps=1, warmup=1, cuda_graph=True)


def test_train_bench_times_each_model_eager_and_graphed_in_one_run(tiny_model, monkeypatch):
    """``--cuda-graph both``: every model is timed eagerly, then graphed, in the one run, and every row's
    ratio divides by the teacher's faster row at its shape; a setting other than off/on/both is one line."""
    from linearize.bench import train as bench
    from linearize.errors import LinearizeError

    speeds = {"teacher": 100.0, "teacher+graph": 120.0, "supra": 60.0, "supra+graph": 90.0}
    timed = []

    def measure(model, label, b, t, steps, warmup, cuda_graph=False, **kw):
        timed.append((label, cuda_graph))
        return bench.TrainRow(label, b, t, speeds[label], 1.0, 1)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # measure is stubbed: nothing runs on CUDA
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "_release", lambda cuda: None)
    rows = bench.run(tiny_model("llama"), ["teacher", "supra"], [(2, 16)], steps=1, warmup=1, cuda_graph="both")
    assert timed == [("teacher", False), ("teacher+graph", True), ("supra", False), ("supra+graph", True)]
    assert [round(r.ratio_to_teacher, 3) for r in rows] == [0.833, 1.0, 0.5, 0.75]
    import linearize

    got = []  # what the command line passes on: the flag alone is on, a value is taken as given
    monkeypatch.setattr(linearize, "load_teacher", lambda *a, **k: (None, None))
    monkeypatch.setattr(bench, "run", lambda *a, cuda_graph=None, **k: got.append(cuda_graph) or [])
    for flags in (["--cuda-graph", "both"], ["--cuda-graph"], []):
        assert bench.main(["--models", "teacher", "--shapes", "2x16", "--device", "cpu", *flags]) == 0
    assert got == ["both", "on", "off"]
    monkeypatch.undo()
    with pytest.raises(LinearizeError, match="off, on or both"):
        bench.run(tiny_model("llama"), ["teacher"], [(2, 16)], cuda_graph="sometimes")


def test_train_bench_times_the_distillation_step(tiny_model, monkeypatch):
    """``--loss kl+lm``: the students train on KL to a frozen copy of the teacher (+ next-token loss),
    the teacher's row stays its next-token fine-tune (the divisor); a loss that reads more of the
    teacher than its logits cannot be replayed from CUDA graphs and is refused under --cuda-graph."""
    from linearize.bench import train as bench
    from linearize.distill import Objective
    from linearize.errors import LinearizeError

    teacher = tiny_model("llama")
    calls = []
    real = Objective.__call__
    monkeypatch.setattr(Objective, "__call__", lambda self, m, b: calls.append(repr(self)) or real(self, m, b))
    rows = bench.run(teacher, ["teacher", "supra"], [(2, 16)], steps=1, warmup=1, loss="kl+lm")
    assert [r.model for r in rows] == ["teacher", "supra/kl+lm"]
    assert rows[0].ratio_to_teacher == 1.0 and rows[1].tokens_per_s > 0
    assert calls == ["kl + next_token"] * 2  # the student's warm-up and timed step; the teacher's row is lm
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(LinearizeError, match="cannot be captured"):
        bench.run(teacher, ["supra"], [(2, 16)], steps=1, warmup=1, loss="kl+hidden_mse", cuda_graph=True)


def test_train_bench_lolcats_stage_rows_train_what_each_stage_trains(tiny_model):
    """``lolcats-stage1``: the feature maps and window weights on the attention-transfer loss;
    ``lolcats-stage2``: LoRA on next-token loss; both timed against the teacher's full fine-tune."""
    from linearize.bench.train import build, run, stage_setup

    teacher = tiny_model("llama")
    stage1, objective1 = stage_setup(build(teacher, "lolcats-stage1"), "lolcats-stage1")
    trained = {n for n, p in stage1.named_parameters() if p.requires_grad}
    assert trained and all(".feature_map_" in n or n.endswith("window_logit") for n in trained)
    assert repr(objective1) == "attention_mse" and objective1.captured_whole
    ids = torch.randint(2, 97, (2, 8))
    assert objective1(stage1, {"input_ids": ids, "labels": ids}).item() > 0
    stage2, objective2 = stage_setup(build(teacher, "lolcats-stage2"), "lolcats-stage2")
    trained = {n for n, p in stage2.named_parameters() if p.requires_grad}
    assert objective2 is None and trained and all("lora_" in n for n in trained)
    rows = run(teacher, ["teacher", "lolcats-stage1", "lolcats-stage2"], [(2, 16)], steps=1, warmup=1)
    assert [r.model for r in rows] == ["teacher", "lolcats-stage1", "lolcats-stage2"]
    assert all(r.tokens_per_s > 0 and r.ratio_to_teacher > 0 for r in rows)


def test_train_bench_graphs_the_lolcats_stage_rows(tiny_model, monkeypatch):
    """``--cuda-graph`` graphs the stage rows as the recipe does: stage 1's attention_mse objective
    captured whole, stage 2's next-token loss on the LoRA model, no teacher tensors for either; the
    teacher's row is graphed too (the ratios compare graphed with graphed). On the CPU the capture is
    stood in for by the callable it captures, run eagerly."""
    import linearize.graphed as graphed_module
    from linearize.bench.train import run

    made = []

    class StandIn:
        def __init__(self, model, dtype=None, warmup=3, objective=None):
            self.model, self.objective, self.calls = model, objective, 0
            self.step = graphed_module._TrainingLoss(model, None, objective)
            made.append(self)

        def __call__(self, input_ids, labels, *teacher):
            assert not teacher
            self.calls += 1
            return self.step(input_ids, labels)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what run() asks; the models stay on the CPU
    monkeypatch.setattr(graphed_module, "GraphedLoss", StandIn)
    rows = run(tiny_model("llama"), ["teacher", "lolcats-stage1", "lolcats-stage2"], [(2, 16)], steps=2, warmup=1,
               cuda_graph=True)
    assert [r.model for r in rows] == ["teacher+graph", "lolcats-stage1+graph", "lolcats-stage2+graph"]
    assert all(r.note == "" and r.tokens_per_s > 0 and r.ratio_to_teacher > 0 for r in rows), rows
    assert [m.calls for m in made] == [3, 3, 3]  # every step, warm-up and timed, through the graphed loss
    teacher, stage1, stage2 = made
    assert teacher.objective is None and stage2.objective is None
    assert repr(stage1.objective) == "attention_mse"
    assert type(stage2.model).__name__.startswith("Peft")


def test_bench_prefill_sweep_on_tiny_models(tiny_model, tmp_path, capsys):
    """``linearize bench --prefill``: every (model, path) at every shape, ratios to the teacher's fastest
    path; an attention implementation that cannot run here (flash-attn on the CPU) leaves a note."""
    teacher = tiny_model("llama")
    save(teacher, tiny_tokenizer(), tmp_path / "teacher")
    save(convert(teacher, "lolcats", window=4, feature_dim=8), tiny_tokenizer(), tmp_path / "student")
    out = tmp_path / "prefill.json"
    assert main(["bench", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"), "--prefill", "1x8", "2x13",
                 "--prefill-teacher-paths", "sdpa", "eager", "flash_attention_2", "--prefill-paths", "kernels", "torch",
                 "--prefill-warmup", "1", "--prefill-repeats", "2", "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["model"], r["path"], r["batch"], r["prompt_len"]) for r in rows] == [
        (m, p, b, t) for m, ps in (("teacher", ("sdpa", "eager", "flash_attention_2")), ("student", ("kernels", "torch")))
        for p in ps for b, t in ((1, 8), (2, 13))]
    ran = [r for r in rows if r["tokens_per_s"]]
    assert {(r["model"], r["path"]) for r in ran} >= {("teacher", "sdpa"), ("teacher", "eager"), ("student", "kernels"),
                                                       ("student", "torch")}
    for shape in ((1, 8), (2, 13)):
        teacher_best = max(r["tokens_per_s"] for r in ran if r["model"] == "teacher" and (r["batch"], r["prompt_len"]) == shape)
        for r in ran:
            if (r["batch"], r["prompt_len"]) == shape:
                assert r["ratio_to_teacher"] == pytest.approx(r["tokens_per_s"] / teacher_best)
    for r in ran:  # every timed pass kept (at least the 2 repeats asked; the median is the row's ms)
        assert len(r["ms_each"]) >= 2 and r["ms"] == pytest.approx(statistics.median(r["ms_each"]), abs=1e-3)
    flash = [r for r in rows if r["path"] == "flash_attention_2"]
    assert all(r["note"] or r["tokens_per_s"] for r in flash)
    printed = capsys.readouterr().out
    assert "| student | torch | 2x13 |" in printed
    # timed shape by shape (every model and path at one shape, then the next), printed as they come
    timed = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["prompt_len"]) for r in timed] == [(1, 8)] * 5 + [(2, 13)] * 5
    assert [(r["model"], r["path"]) for r in timed[:5]] == [("teacher", "sdpa"), ("teacher", "eager"),
                                                            ("teacher", "flash_attention_2"), ("student", "kernels"),
                                                            ("student", "torch")]
    assert main(["bench", str(tmp_path / "student"), "--prefill", "2by8", "--device", "cpu"]) == 2


def test_the_bandwidth_floor_counts_the_weights_a_step_reads_and_the_state(tiny_model):
    from linearize.bench.decode import copy_bandwidth, floor_ms, step_weight_bytes

    untied = tiny_model("llama", tie_word_embeddings=False)
    everything = sum(p.numel() * p.element_size() for p in untied.parameters())
    embed = untied.get_input_embeddings().weight
    assert step_weight_bytes(untied) == everything - embed.numel() * embed.element_size()  # a step gathers rows
    tied = tiny_model("llama", tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    assert step_weight_bytes(tied) == sum(p.numel() * p.element_size() for p in tied.parameters())  # the head reads it
    assert step_weight_bytes(tied.to(torch.bfloat16)) * 2 == step_weight_bytes(tied.float())
    assert floor_ms(3_000_000, 1_000_000, 4e12) == pytest.approx(1.0e-3)  # 4 MB at 4 TB/s: 1 microsecond
    assert floor_ms(3_000_000, None, 4e12) is None and floor_ms(3_000_000, 0, None) is None
    assert copy_bandwidth("cpu") is None  # measured on CUDA only: a CPU row has no floor


def test_a_chunked_prefill_leaves_the_cache_a_whole_one_does(tiny_model, tmp_path, monkeypatch):
    """`bench --prefill-chunk N`: the prompt goes in N tokens at a time, into the same cache as all at once
    (teacher and student, float64), and generate() is asked for the same (transformers' prefill_chunk_size)."""
    from linearize.bench.decode import _prefill, measure
    from linearize.cache import cache_keyword

    teacher = tiny_model("llama").double()
    student = convert(teacher, "lolcats", window=4, feature_dim=8).double()
    prompt = torch.randint(0, teacher.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    whole, parts = _prefill(teacher, prompt, None), _prefill(teacher, prompt, 4)
    for a, b in zip(whole.layers, parts.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    whole, parts = _prefill(student, prompt, None), _prefill(student, prompt, 4)
    key, ids = cache_keyword(student), torch.tensor([[3], [5]])
    with torch.no_grad():  # the student's state: the next token's logits from each cache
        a = student(ids, **{key: whole}, use_cache=True).logits
        b = student(ids, **{key: parts}, use_cache=True).logits
    torch.testing.assert_close(a, b)
    asked = []
    generate = type(teacher).generate
    monkeypatch.setattr(type(teacher), "generate", lambda self, *a, **kw: asked.append(kw.get("prefill_chunk_size"))
                        or generate(self, *a, **kw))
    row = measure(teacher.float(), "teacher", 2, 11, 3, "generate", prefill_chunk=4)
    assert not row.note and row.decode_tok_s > 0 and asked and set(asked) == {4}
