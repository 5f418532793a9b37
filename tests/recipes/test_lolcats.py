"""The LoLCATs recipe on a tiny teacher: stage 1 lowers every layer's attention MSE, stage 2 lowers
the validation loss, a resumed run continues the same run, and the merged checkpoint stands alone."""

import json

import pytest
import torch

import linearize

from linearize.recipes import lolcats


def _config(ws, out, **kw):
    base = dict(teacher=str(ws / "teacher"), data=str(ws / "corpus.jsonl"), out=str(out), block_len=32,
                eval_blocks=8, batch_size=4, eval_steps=10, patience=None, dtype="float32",
                spec={"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4},
                stage1_steps=30, stage2_steps=40, stage2_lr=1e-2, sample_prompt="w5 w6 w7")
    base.update(kw)
    return lolcats.LolcatsConfig(**base)


def test_both_stages_improve_and_checkpoint_stands_alone(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    res = lolcats.run(_config(workspace, tmp_path / "run"))
    before, after = res["layer_mse_before"], res["layer_mse_after"]
    assert set(before) == {0, 1, 2}
    assert all(after[i] < before[i] for i in before), (before, after)
    ppl = res["perplexity"]
    assert ppl["after_stage2"] < ppl["after_stage1"]
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stage2 = [e["eval_loss"] for e in evals if e["stage"] == "stage2" and "eval_loss" in e]
    assert stage2[-1] < stage2[0]
    model, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("priority", ["recall", "novelty"])
def test_trains_with_a_sparse_cache(workspace, monkeypatch, tmp_path, priority):
    """LoLCATs trained with its sparse exact cache on (the cache shorter than the blocks, so tokens are
    cached and evicted): stage 1 lowers every layer's attention MSE, stage 2 trains through the cache
    (its LoRA, merged, changes the teacher's projections), and the checkpoint keeps the cache and its
    rule. Whether stage 2 lowers the loss is not asserted: on this tiny corpus 12 steps of it raise the
    held-out ppl with or without the cache (5.08 -> 5.63 without, 5.03 -> 5.75 with; 40 steps without
    lower it: test_both_stages_improve_and_checkpoint_stands_alone)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    spec = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4, "sparse_cache": 3,
            "sparse_priority": priority}
    res = lolcats.run(_config(workspace, tmp_path / "run", spec=spec, stage1_steps=12, stage2_steps=12))
    assert all(res["layer_mse_after"][i] < res["layer_mse_before"][i] for i in range(3))
    assert all(torch.isfinite(torch.tensor(v)) for v in res["perplexity"].values())
    model, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    teacher = AutoModelForCausalLM.from_pretrained(workspace / "teacher")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[q_proj], teacher.state_dict()[q_proj])
    assert model.config.linearize["spec"]["sparse_cache"] == 3
    assert model.config.linearize["spec"]["sparse_priority"] == priority


def test_stage1_trains_what_the_conversion_added(workspace, monkeypatch, tmp_path):
    """Attention transfer trains every parameter the mixer added and nothing of the teacher's: for the
    gated delta rule that is its feature maps and its gates (decay, write strength, mix), not only the
    feature maps LoLCATs has."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    spec = {"kind": "delta", "window": 4, "chunk_size": 8}
    res = lolcats.run(_config(workspace, tmp_path / "run", spec=spec, stages=("stage1",), stage1_steps=8))
    assert all(res["layer_mse_after"][i] < res["layer_mse_before"][i] for i in range(3))
    teacher = AutoModelForCausalLM.from_pretrained(workspace / "teacher")
    init = linearize.convert(teacher, spec)
    student, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    for i, mixer in linearize.mixers(student).items():
        before = dict(linearize.mixers(init)[i].named_parameters())
        new = {n for n, _ in mixer.new_parameters()}
        assert {"feature_map_q.weight", "decay_proj.weight", "beta_proj.weight", "mix_proj.bias", "A_log"} <= new
        for name, p in mixer.named_parameters():
            assert torch.equal(p, before[name]) != (name in new), (i, name)  # trained iff added


def test_layer_by_layer_stage1(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    res = lolcats.run(_config(workspace, tmp_path / "run", stages=("stage1",), layers_per_block=1, stage1_steps=15))
    assert res["stage1"]["blocks"] == 3
    assert all(res["layer_mse_after"][i] < res["layer_mse_before"][i] for i in range(3))


def test_stages_report_set_up_and_steady_state(workspace, monkeypatch, tmp_path):
    """Each stage's record splits its time: set-up (each block's caching of the teacher's hidden states,
    its Trainer and its first 2 steps) and steady state (the later steps); both stages together under
    ``train``; one speed line per training in metrics.jsonl; the summary prints both."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    slow = lolcats._inputs_of

    def caching(*args, **kwargs):  # the teacher's states take 0.3 s more to cache: counted as set-up
        import time

        time.sleep(0.3)
        return slow(*args, **kwargs)

    monkeypatch.setattr(lolcats, "_inputs_of", caching)
    res = lolcats.run(_config(workspace, tmp_path / "run", layers_per_block=2, stage1_steps=5, stage2_steps=4,
                              eval_steps=2))
    one, two, both = res["stage1"], res["stage2"], res["train"]
    assert one["blocks"] == 2 and (one["setup"]["steps"], one["steady"]["steps"]) == (2 * 2, 2 * 3)
    assert one["setup"]["seconds"] >= 4 * 0.3  # two blocks, each caching its train and eval inputs
    assert (two["setup"]["steps"], two["steady"]["steps"]) == (2, 2)
    assert two["steady"]["tokens"] == 2 * 4 * 32 and two["steady"]["tokens_per_second"] > 0
    assert both["steady"]["steps"] == 8
    assert both["steady"]["tokens"] == one["steady"]["tokens"] + two["steady"]["tokens"]
    for r in (one, two, both):
        assert r["setup"]["seconds"] + r["steady"]["seconds"] + r["other_seconds"] == pytest.approx(r["seconds"])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows if "speed" in r] == ["stage1[0]", "stage1[1]", "stage2"]
    text = lolcats.summary(res)
    assert "stage1: 10 steps" in text and "set-up " in text and "(4 steps), steady " in text
    # the whole run's wall time by phase: what is not training shows too
    phases = res["phases"]
    assert list(phases)[:4] == ["teacher", "data", "perplexity: teacher", "convert"]
    assert {"attention MSE", "stage 1", "perplexity: students", "stage 2", "save", "sample"} <= set(phases)
    assert phases["stage 1"] >= one["seconds"] >= 4 * 0.3 and phases["stage 2"] >= two["seconds"]
    assert all(v >= 0 for v in phases.values())
    assert f"wall time {sum(phases.values()):.0f}s: " in text


@pytest.mark.parametrize("k", [1, 2])
def test_blocks_from_cached_inputs_train_like_recomputed_ones(workspace, monkeypatch, tmp_path, k):
    """LoLCATs §3.3.2: a block trained on the teacher's cached hidden states sees exactly what it
    sees when the earlier layers run at every step; the full layer list is back afterwards."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    curves, results = {}, {}
    for how in ("cache", "recompute"):
        results[how] = lolcats.run(_config(workspace, tmp_path / how, stages=("stage1",), layers_per_block=k,
                                           stage1_steps=4, eval_steps=2, block_inputs=how))
        rows = [json.loads(x) for x in (tmp_path / how / "metrics.jsonl").read_text().splitlines()]
        curves[how] = [(r["stage"], r["step"], r.get("loss", r.get("eval_loss"))) for r in rows
                       if "loss" in r or "eval_loss" in r]
    assert [c[:2] for c in curves["cache"]] == [c[:2] for c in curves["recompute"]]
    for (_, _, a), (_, _, b) in zip(curves["cache"], curves["recompute"]):
        assert a == pytest.approx(b, rel=1e-4)
    assert results["cache"]["layer_mse_after"] == pytest.approx(results["recompute"]["layer_mse_after"], rel=1e-4)
    model, _ = linearize.load(tmp_path / "cache" / "final", device="cpu")
    assert len(linearize.mixers(model)) == 3


def test_resume_continues_the_same_run(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    lolcats.run(_config(workspace, tmp_path / "a", stages=("stage2",), stage2_steps=20))
    lolcats.run(_config(workspace, tmp_path / "b", stages=("stage2",), stage2_steps=10))
    resumed = lolcats.run(_config(workspace, tmp_path / "b", stages=("stage2",), stage2_steps=20, resume=True))
    assert resumed["stage2"]["steps"] == 20
    a, _ = linearize.load(tmp_path / "a" / "final", device="cpu")
    b, _ = linearize.load(tmp_path / "b" / "final", device="cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layers_per_block", [None, 1])
def test_resume_after_stage_one_keeps_its_weights(workspace, monkeypatch, tmp_path, layers_per_block):
    """A run stopped after stage 1 (or in stage 2) and resumed ends as the uninterrupted run: stage 1,
    marked done, comes back with its trained weights (block by block when block-wise) instead of
    leaving stage 2 to start from the untrained conversion."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    kw = dict(stage1_steps=10, layers_per_block=layers_per_block, eval_steps=5)
    whole = lolcats.run(_config(workspace, tmp_path / "a", stage2_steps=20, **kw))
    lolcats.run(_config(workspace, tmp_path / "b", stages=("stage1",), **kw))  # stopped between the stages
    resumed = lolcats.run(_config(workspace, tmp_path / "b", stage2_steps=20, resume=True, **kw))
    assert resumed["stage1"]["steps"] == 0  # nothing trained again
    for key in ("after_stage1", "after_stage2"):
        assert resumed["perplexity"][key] == pytest.approx(whole["perplexity"][key], rel=1e-4), key
    a, _ = linearize.load(tmp_path / "a" / "final", device="cpu")
    b, _ = linearize.load(tmp_path / "b" / "final", device="cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-4, msg=name)


def _cli_args(ws, out, *extra):
    return ["lolcats", "--teacher", str(ws / "teacher"), "--data", str(ws / "corpus.jsonl"), "--out", str(out),
            "--budget", "cpu", "--block-len", "32", "--feature-dim", "8", "--window", "4", "--eval-steps", "2",
            "--dtype", "float32", "--device", "cpu", *extra]


def test_cli_runs_the_comparison_rows(workspace, monkeypatch, tmp_path, capsys):
    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(_cli_args(workspace, tmp_path / "rows", "--stage1-steps", "2", "--stage2-steps", "2",
                          "--rows", "swap-finetune,no-window")) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "[swap-finetune]" in text and "[no-window]" in text
    assert (tmp_path / "rows" / "swap-finetune" / "final" / "config.json").exists()
    assert '"kind": "linear"' in (tmp_path / "rows" / "no-window" / "final" / "config.json").read_text()
    if not torch.cuda.is_available():  # --cuda-graph auto (the default): eager, the reason said once per row
        notes = [line for line in captured.err.splitlines() if "CUDA graphs" in line]
        note = "linearize: training eagerly, not as CUDA graphs (--cuda-graph auto): there is no CUDA device"
        assert notes == [note] * 2
        eager = {"graphed": False, "why": "there is no CUDA device"}
        records = [json.loads((tmp_path / "rows" / row / "results.json").read_text())["cuda_graph"]
                   for row in ("swap-finetune", "no-window")]
        assert records == [{"setting": "auto", "stage2": eager}, {"setting": "auto", "stage1": eager, "stage2": eager}]


def test_cli_checks_every_row_before_training_any(workspace, monkeypatch, tmp_path, capsys):
    from linearize.cli import main
    from linearize.recipes import lolcats

    monkeypatch.setattr(lolcats, "run", lambda cfg: pytest.fail("a row trained before the bad one was caught"))
    assert main(_cli_args(workspace, tmp_path / "rows", "--rows", "lolcats,no-windw")) != 0
    assert "unknown ablation row 'no-windw'" in capsys.readouterr().err


def test_two_processes_equal_one(workspace, tmp_path):
    """Full-batch steps: 2 gloo processes x 4 blocks see the same 8 blocks as 1 process x 8 blocks."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LINEARIZE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    common = ["--train-blocks", "8", "--grad-accum", "1", "--stage1-steps", "3", "--stage2-steps", "3",
              "--eval-steps", "1"]
    one = _cli_args(workspace, tmp_path / "one", "--batch-size", "8", *common)
    two = _cli_args(workspace, tmp_path / "two", "--batch-size", "4", *common)
    # --standalone: torchrun picks a free local port, so a busy machine cannot make this fail
    for command in ([sys.executable, "-m", "linearize", *one],
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     "-m", "linearize", *two]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command[2]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    losses = {}
    for run in ("one", "two"):
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        losses[run] = [(x["stage"], x["step"], x["loss"]) for x in lines if "loss" in x]
    # Same batches, gradients averaged by DDP: step 1 agrees to rounding; after that Adam at lr 1e-2
    # turns rounding in near-zero gradients into sign-like updates, so the curves agree to ~1%.
    assert [x[:2] for x in losses["one"]] == [x[:2] for x in losses["two"]]
    assert losses["one"][0][2] == pytest.approx(losses["two"][0][2], rel=1e-5)
    for (_, _, la), (_, _, lb) in zip(losses["one"], losses["two"]):
        assert la == pytest.approx(lb, rel=2e-2)
    assert json.loads((tmp_path / "two" / "stage2" / "train_config.json").read_text())["world_size"] == 2
    linearize.load(tmp_path / "two" / "final", device="cpu")  # rank 0 wrote a loadable checkpoint


@pytest.mark.parametrize("kind", ["lolcats", "linear"])
def test_attention_weight_cross_entropy(tiny_model, kind):
    """The optional Hedgehog loss: the mixers' weights are distributions, and a full window is the teacher's."""
    from linearize.distill import build_objective, transfer_probes

    student = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": kind, "window": 64, "feature_dim": 8})
    ids = torch.randint(0, 97, (2, 21))
    loss_fn = build_objective("attention_mse", context=dict(layers=(0, 1, 2), mse_factor=0.0, xent_factor=1.0))
    loss = loss_fn(student, {"input_ids": ids})
    loss.backward()
    with torch.no_grad(), transfer_probes(student, [0, 1, 2], with_xent=True) as probes:
        student(input_ids=ids, use_cache=False)
    xents = [p.xent.item() for p in probes.values()]
    assert loss.item() == pytest.approx(sum(xents) / 3, rel=1e-12)
    if kind == "lolcats":  # window >= T: the hybrid's weights are the teacher's, so xent = teacher entropy
        assert all(p.mse.item() < 1e-20 for p in probes.values())
    assert all(x > 0 for x in xents)
    if kind == "linear":  # the loss reaches the feature maps
        grad = linearize.mixers(student)[0].feature_map_q.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_layer_mse_plot_is_written(workspace, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    lolcats.run(_config(workspace, tmp_path / "run", stages=("stage1",), stage1_steps=4))
    png = tmp_path / "run" / "layer_mse.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_run_has_its_tokens_curves_mse_and_attention_maps(workspace, monkeypatch, tmp_path, capsys):
    """The #6 report on a real recipe run: eval its checkpoint, then one page with the run's figures."""
    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    res = lolcats.run(_config(workspace, tmp_path / "run", stage1_steps=4, stage2_steps=4, eval_steps=2))
    assert res["train"]["tokens"] == (res["stage1"]["steps"] + res["stage2"]["steps"]) * 4 * 32
    assert res["stage1"]["tokens_per_second"] > 0
    record = tmp_path / "eval.json"
    assert main(["eval", str(tmp_path / "run" / "final"), "--source", str(workspace / "corpus.jsonl"),
                 "--block-len", "32", "--max-blocks", "2", "--device", "cpu", "--quiet", "--out", str(record)]) == 0
    page = tmp_path / "report" / "page.md"
    assert main(["report", str(record), "--out", str(page), "--attention-maps"]) == 0
    text = page.read_text()
    assert "| train tokens | train time |" in text and f"{res['train']['tokens'] / 1e6:.1f}M" in text
    links = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(links) == 3, text  # curves, per-layer MSE, attention maps
    for link in links:
        assert (page.parent / link).stat().st_size > 1000


def test_full_window_mixer_weights_are_the_teachers(tiny_model):
    """The attention maps compare like with like: a hybrid whose window covers the sequence draws
    exactly the teacher's softmax weights; a mixer without normalised weights is refused."""
    from linearize.eval.attention_maps import attention_weights

    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    student = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": "lolcats", "window": 16})
    maps = attention_weights(student, ids)
    assert set(maps) == {0, 1, 2}
    for teacher, mine in maps.values():
        assert teacher.shape == (6, 12, 12)
        torch.testing.assert_close(mine, teacher, atol=1e-6, rtol=0)
    short = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": "lolcats", "window": 2})
    teacher, mine = attention_weights(short, ids)[0]
    assert (mine - teacher).abs().max() > 1e-3
    torch.testing.assert_close(mine.sum(-1), torch.ones(6, 12), atol=1e-6, rtol=0)
    with pytest.raises(linearize.LinearizeError, match="no normalised attention weights"):
        attention_weights(linearize.convert(tiny_model("llama"), "supra"), ids)


def test_choose_worst_takes_the_largest_scores_in_layer_order():
    assert lolcats.choose_worst({0: 0.1, 1: 0.9, 2: 0.5, 3: 0.9}, 2) == [1, 3]
    assert lolcats.choose_worst({0: 0.2, 1: 0.2, 2: 0.1}, 1) == [0]  # a tie goes to the lower layer
    assert lolcats.auto_softmax_count("auto:2") == 2 and lolcats.auto_softmax_count((1, 2)) is None
    with pytest.raises(linearize.LinearizeError, match="positive whole K"):
        lolcats.auto_softmax_count("auto:x")


def test_auto_softmax_layers_keep_the_worst_fitted_layer(workspace, monkeypatch, tmp_path):
    """keep_softmax auto:1: stage 1 trains every layer, the one with the largest attention MSE after it
    becomes the teacher's softmax attention again, the others keep their trained feature maps, and the
    checkpoint records the scores and the choice; the same seed chooses the same layer."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    runs = [lolcats.run(_config(workspace, tmp_path / name, keep_softmax="auto:1", stage1_steps=6, stage2_steps=4,
                                eval_steps=3)) for name in ("a", "b")]
    res = runs[0]
    scores = res["layer_mse_after"]
    chosen = res["auto_softmax"]["chosen"]
    assert chosen == [max(scores, key=scores.get)] and runs[1]["auto_softmax"]["chosen"] == chosen
    assert res["auto_softmax"]["scores"] == {str(i): pytest.approx(v) for i, v in scores.items()}
    assert res["auto_softmax"]["score"].startswith("mse: ")
    assert f"softmax kept at layers {chosen} (auto:1 by mse: " in lolcats.summary(res)
    model, _ = linearize.load(tmp_path / "a" / "final", device="cpu")
    assert sorted(linearize.mixers(model)) == sorted(set(range(3)) - set(chosen))
    record = model.config.linearize
    assert record["keep_softmax"] == chosen and record["auto_softmax"]["chosen"] == chosen
    ppl = res["perplexity"]
    assert ppl["after_stage1"] < ppl["after_stage1, every layer linear"]  # the worst layer back to softmax helps


@pytest.mark.parametrize("sinks", [0, 2])
def test_auto_softmax_layers_with_a_window_decode_in_constant_memory(workspace, monkeypatch, tmp_path, sinks):
    """keep_softmax auto:1 with softmax_window: the chosen layer keeps the teacher's softmax over its last W
    tokens (a WindowSoftmax mixer, no parameters; with 2 attention sinks too), so every layer of the saved student
    is recurrent; it loads, and the fast decoder gives generate()'s tokens."""
    from helpers import plain_generate
    from linearize.decode import fast_generate
    from linearize.mixers.window import WindowSoftmax

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    spec = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4, "softmax_window": 8,
            "softmax_window_sinks": sinks}
    res = lolcats.run(_config(workspace, tmp_path / "w", keep_softmax="auto:1", spec=spec, stage1_steps=4,
                              stage2_steps=3, eval_steps=3))
    chosen = res["auto_softmax"]["chosen"]
    model, _ = linearize.load(tmp_path / "w" / "final", device="cpu")
    layers = linearize.mixers(model)
    assert sorted(layers) == [0, 1, 2] and [i for i, m in layers.items() if isinstance(m, WindowSoftmax)] == chosen
    assert model.config.linearize["spec"]["softmax_window"] == 8 and model.config.linearize["keep_softmax"] == chosen
    assert all(m.sinks == sinks for m in layers.values() if isinstance(m, WindowSoftmax))
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 97, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = plain_generate(model, ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(model, ids, torch.ones_like(ids), max_new_tokens=12, pad_token_id=0), ref)


def test_auto_softmax_needs_stage_one(workspace, tmp_path):
    with pytest.raises(linearize.LinearizeError, match="needs stage 1"):
        lolcats.run(_config(workspace, tmp_path / "x", keep_softmax="auto:1", stages=("stage2",)))


@pytest.mark.parametrize("family, k, converted", [("llama", 3, 3), ("gemma3_text", 1, 1)])
def test_auto_softmax_asking_for_every_converted_layer_fails_before_training(workspace, tiny_model, family, k,
                                                                             converted, monkeypatch, tmp_path):
    """auto:K with K at least the layers the spec converts (Gemma 3's local layers stay under keep_sliding, so
    fewer than the model has) is one clear error before stage 1, not a failure or a wasted run after it."""
    from helpers import tiny_tokenizer

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    teacher = workspace / "teacher"
    if family != "llama":
        teacher = tmp_path / family
        tiny_model(family).save_pretrained(teacher)
        tiny_tokenizer().save_pretrained(teacher)
    spec = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4, "keep_sliding": True}
    with pytest.raises(linearize.LinearizeError, match=f"auto:{k} would keep softmax in every one of the {converted} "):
        lolcats.run(_config(workspace, tmp_path / "x", teacher=str(teacher), keep_softmax=f"auto:{k}", spec=spec))
    assert not (tmp_path / "x" / "stage1").exists()


def test_auto_softmax_through_the_cli(workspace, monkeypatch, tmp_path, capsys):
    from linearize.cli import main

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    assert main(_cli_args(workspace, tmp_path / "run", "--stage1-steps", "2", "--stage2-steps", "2",
                          "--keep-softmax", "auto:1", "--auto-softmax-score", "recall",
                          "--auto-softmax-distance", "12")) == 0
    assert "(auto:1 by recall: " in capsys.readouterr().out
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["linearize"]
    assert len(config["keep_softmax"]) == 1 and config["auto_softmax"]["k"] == 1
    assert config["auto_softmax"]["copy_task"]["distance"] == 12
    assert main(["supra", "--keep-softmax", "auto:1", "--teacher", str(tmp_path / "absent"),
                 "--out", str(tmp_path / "s")]) == 2
    assert "is chosen by LoLCATs' attention transfer" in capsys.readouterr().err


def _copy_task(generator, n, t=32, back=10):
    """Random tokens; the label at each position is the token ``back`` places earlier."""
    ids = torch.randint(2, 97, (n, t), generator=generator)
    labels = torch.full_like(ids, -100)
    labels[:, back:] = ids[:, :-back]
    return ids, labels


def _recall(model, ids, labels):
    """How often the model's next-token argmax is the labelled token."""
    with torch.no_grad():
        pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    real = labels[:, 1:] != -100
    return (pred[real] == labels[:, 1:][real]).float().mean().item()


RECALL_SPEC = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4}


@pytest.fixture(scope="module")
def recall_teacher(tmp_path_factory):
    """A tiny teacher trained to repeat the token 10 places back, beyond the window of 4, saved with a
    random-word corpus in ``root``: converting one of its layers alone (``carrier``, the one that
    learnt the look-up) ruins that recall, converting either other one does not. ``test``: recall
    prompts (``_copy_task``)."""
    from types import SimpleNamespace

    from helpers import tiny_config, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("recall")
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama"))
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    g, test = torch.Generator().manual_seed(0), _copy_task(torch.Generator().manual_seed(9), 64)
    for _ in range(300):
        ids, labels = _copy_task(g, 16)
        teacher(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        if _recall(teacher, *test) > 0.98:
            break
    assert _recall(teacher, *test) > 0.98
    alone = {i: _recall(linearize.convert(teacher, RECALL_SPEC, keep_softmax=[j for j in range(3) if j != i]), *test)
             for i in range(3)}  # recall with only layer i converted
    carrier = min(alone, key=alone.get)
    assert alone[carrier] < 0.3 and all(r > 0.9 for i, r in alone.items() if i != carrier), alone
    teacher.save_pretrained(root / "teacher")
    tiny_tokenizer().save_pretrained(root / "teacher")
    docs = torch.randint(2, 97, (40, 64), generator=torch.Generator().manual_seed(1))
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": " ".join(f"w{int(i)}" for i in d)}) + "\n"
                                               for d in docs))
    return SimpleNamespace(root=root, teacher=teacher, carrier=carrier, test=test)


def _recall_config(t, out, **kw):
    """auto:1 after a short stage 1 on ``recall_teacher``."""
    return lolcats.LolcatsConfig(
        teacher=str(t.root / "teacher"), data=str(t.root / "corpus.jsonl"), out=str(out), block_len=32,
        eval_blocks=4, batch_size=4, eval_steps=10, patience=None, dtype="float32", spec=RECALL_SPEC,
        keep_softmax="auto:1", stages=("stage1",), stage1_steps=10, sample_prompt="w5 w6", **kw)


def test_auto_softmax_keeps_the_layer_a_trained_teacher_recalls_with(recall_teacher, monkeypatch, tmp_path):
    """auto:1 (by attention MSE) keeps the layer the trained teacher recalls with softmax, and the
    student (the other layers linearized and fitted by stage 1) recalls as the teacher does."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    carrier = recall_teacher.carrier
    res = lolcats.run(_recall_config(recall_teacher, tmp_path / "run"))
    assert res["auto_softmax"]["chosen"] == [carrier], res["layer_mse_after"]
    student, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    assert sorted(linearize.mixers(student)) == sorted(set(range(3)) - {carrier})
    assert _recall(student, *recall_teacher.test) > 0.9


def test_copy_task_repeats_a_span_beyond_the_window():
    """The recall score's task: random regular tokens, the first span again ``distance`` tokens later,
    labels on the copy but its first token; the same seed draws the same task."""
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    ids, labels = lolcats.copy_task(tok, 97, 20, sequences=3, span=8, seed=5)
    assert ids.shape == labels.shape == (3, 28)
    assert torch.equal(ids[:, 20:], ids[:, :8]) and not torch.equal(ids[:, 8:16], ids[:, :8])
    assert (labels[:, :21] == -100).all() and torch.equal(labels[:, 21:], ids[:, 21:])
    assert ids.min() >= 2 and ids.max() <= 96  # w0 (pad, unk) and w1 (eos) are special
    assert torch.equal(lolcats.copy_task(tok, 97, 20, sequences=3, span=8, seed=5)[0], ids)
    assert not torch.equal(lolcats.copy_task(tok, 97, 20, sequences=3, span=8, seed=6)[0], ids)
    short, _ = lolcats.copy_task(tok, 97, 6, span=8)  # the span is at most the distance
    assert short.shape == (lolcats.RECALL_SEQUENCES, 12) and torch.equal(short[:, 6:], short[:, :6])
    assert lolcats.copy_task(tok, 40, 20)[0].max() < 40  # only ids the model embeds
    assert lolcats.recall_distance(lolcats.LolcatsConfig(spec=RECALL_SPEC)) == 16  # 4 x the window
    assert lolcats.recall_distance(lolcats.LolcatsConfig()) == 256
    assert lolcats.recall_distance(lolcats.LolcatsConfig(spec=RECALL_SPEC, auto_softmax_distance=10)) == 10


def test_copy_loss_falls_when_the_recalling_layer_is_softmax(recall_teacher):
    """The recall score on the converted teacher (every layer linear): the recalling layer's softmax
    attention alone brings the copy loss down, the others' do not; every layer softmax is the teacher;
    the greedy second round scores the rest with the first choice softmax; nothing stays swapped."""
    from helpers import tiny_tokenizer

    student = linearize.convert(recall_teacher.teacher, RECALL_SPEC)
    kept = linearize.mixers(student)
    c = recall_teacher.carrier
    ids, labels = lolcats.copy_task(tiny_tokenizer(), 97, 10, seed=0)  # the teacher's distance
    linear = lolcats.copy_loss(student, ids, labels)
    alone = {i: lolcats.copy_loss(student, ids, labels, [i]) for i in range(3)}
    assert alone[c] < linear - 1.0 and all(abs(alone[i] - linear) < 0.2 for i in range(3) if i != c), (linear, alone)
    teacher = lolcats.copy_loss(recall_teacher.teacher, ids, labels)
    assert lolcats.copy_loss(student, ids, labels, range(3)) == pytest.approx(teacher, abs=1e-4)
    chosen, rounds = lolcats.recall_choice(student, ids, labels, 2)
    assert c in chosen and len(chosen) == 2 and [r["softmax"] for r in rounds] == [[], [c]]
    assert rounds[0]["loss"] == pytest.approx(linear) and rounds[1]["loss"] == pytest.approx(alone[c])
    assert rounds[0]["scores"] == {str(i): pytest.approx(linear - alone[i]) for i in range(3)}
    assert rounds[1]["scores"] == {str(i): pytest.approx(alone[c] - lolcats.copy_loss(student, ids, labels, [c, i]))
                                   for i in range(3) if i != c}
    assert linearize.mixers(student) == kept and lolcats.copy_loss(student, ids, labels) == linear
    # the output layer on the labelled positions alone (the default) scores as the whole forward does
    assert lolcats.copy_loss(student, ids, labels, [c], head=None) == pytest.approx(alone[c], rel=1e-6)


def test_recall_choice_takes_the_layers_before_a_candidate_from_the_rounds_forward(recall_teacher, monkeypatch):
    """``recall_choice`` runs each candidate from its own layer on, the earlier layers' outputs taken from its
    round's recorded forward (``LayerOutputs``): the same losses as whole forwards (above), fewer layers computed
    (1 + 3 + 2 whole forwards of 3 layers would be 18), and no layer left patched; the output layer runs on the
    labelled positions alone. ``LayerOutputs`` alone: a
    forward resumed at any layer gives the whole forward's logits bit for bit; a layer never recorded is refused."""
    from helpers import tiny_tokenizer

    from linearize.distill.probes import LayerOutputs
    from linearize.errors import LinearizeError

    student = linearize.convert(recall_teacher.teacher, RECALL_SPEC)
    ids, labels = lolcats.copy_task(tiny_tokenizer(), 97, 10, seed=0)
    outputs = LayerOutputs(student)
    layer_type = type(outputs.layers[0])
    computed = []
    real_forward = layer_type.forward

    def counting(self, *args, **kwargs):
        computed.append(outputs.layers.index(self))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(layer_type, "forward", counting)
    with outputs.recording("x"):
        whole = student(input_ids=ids).logits
    assert computed == [0, 1, 2]
    for start in range(3):
        computed.clear()
        with outputs.resuming("x", start):
            assert torch.equal(student(input_ids=ids).logits, whole)
        assert computed == list(range(start, 3))
    with pytest.raises(LinearizeError, match="no output"):
        with outputs.resuming("y", 1):
            pass
    computed.clear()
    chosen, rounds = lolcats.recall_choice(student, ids, labels, 2)
    c = recall_teacher.carrier
    assert c in chosen and rounds[1]["softmax"] == [c]
    # the output layer's check (a few tokens, whole), the first forward, 3 candidates from their layers, the next
    # round's forward from c, 2 candidates
    assert len(computed) == 3 + 3 + (3 + 2 + 1) + (3 - c) + sum(3 - i for i in range(3) if i != c) < 3 + 18
    assert all("forward" not in layer.__dict__ for layer in outputs.layers)
    assert list(student.model.layers) == outputs.layers  # every layer back in its place


def test_recall_score_is_the_same_for_a_seed(recall_teacher):
    """The recall score draws its task from the run's seed: the same seed scores and chooses the same,
    another seed draws another task. It does not read the attention MSE, which would choose otherwise."""
    from dataclasses import replace

    from helpers import tiny_tokenizer

    student = linearize.convert(recall_teacher.teacher, RECALL_SPEC)
    cfg = lolcats.LolcatsConfig(spec=RECALL_SPEC, auto_softmax_score="recall", auto_softmax_distance=10, seed=3)
    mse = {i: 0.0 if i == recall_teacher.carrier else 9.0 for i in range(3)}
    chosen, record = lolcats.auto_softmax_choice(student, tiny_tokenizer(), mse, 1, cfg)
    assert (chosen, record) == lolcats.auto_softmax_choice(student, tiny_tokenizer(), mse, 1, cfg)
    assert chosen == [recall_teacher.carrier] and record["copy_task"]["seed"] == 3
    other = lolcats.auto_softmax_choice(student, tiny_tokenizer(), mse, 1, replace(cfg, seed=4))[1]
    assert other["copy_task"]["seed"] == 4 and other["scores"] != record["scores"]
    by_mse = lolcats.auto_softmax_choice(student, tiny_tokenizer(), mse, 1, replace(cfg, auto_softmax_score="mse"))
    assert by_mse[0] != chosen and by_mse[1]["score"].startswith("mse: ")


def test_recall_score_keeps_the_recalling_layer_and_records_it(recall_teacher, monkeypatch, tmp_path):
    """auto:1 by the recall score after stage 1 keeps the recalling layer softmax; the score's name,
    every layer's score and the choice are in results.json and the checkpoint's config, and the
    summary names the score."""
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    c = recall_teacher.carrier
    res = lolcats.run(_recall_config(recall_teacher, tmp_path / "run", auto_softmax_score="recall",
                                     auto_softmax_distance=10))
    record = res["auto_softmax"]
    assert record["chosen"] == [c] and record["k"] == 1 and record["score"].startswith("recall: ")
    assert set(record["scores"]) == {"0", "1", "2"} and max(record["scores"], key=record["scores"].get) == str(c)
    assert record["copy_task"]["distance"] == 10 and record["rounds"][0]["scores"] == record["scores"]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["auto_softmax"] == record
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["linearize"]
    assert config["auto_softmax"] == record and config["keep_softmax"] == [c]
    student, _ = linearize.load(tmp_path / "run" / "final", device="cpu")
    assert sorted(linearize.mixers(student)) == sorted(set(range(3)) - {c})
    assert _recall(student, *recall_teacher.test) > 0.9
    assert f"softmax kept at layers [{c}] (auto:1 by recall: " in lolcats.summary(res)


def test_auto_softmax_takes_a_count_or_a_share_of_the_converted_layers():
    """auto:K keeps K layers; auto:F (0 < F < 1) that share of the converted ones, rounded, at least one, so a
    recipe travels between depths (SmolLM2's 30 layers, Gemma 3's few global ones); anything else is one line."""
    assert lolcats.auto_softmax_count("auto:14") == 14 and lolcats.auto_softmax_count((1, 2)) is None
    assert lolcats.auto_softmax_count(" auto:0.45 ") == 0.45
    assert [lolcats.auto_softmax_layers(r, n) for r, n in [(14, 30), (0.45, 30), (0.45, 3), (0.1, 3)]] == [14, 14, 1, 1]
    for bad in ("auto:0", "auto:-2", "auto:1.5", "auto:x", "auto:"):
        with pytest.raises(linearize.LinearizeError, match="positive whole K, or a share"):
            lolcats.auto_softmax_count(bad)


def test_auto_softmax_long_gives_some_chosen_layers_a_longer_window(workspace, monkeypatch, tmp_path):
    """auto:2 with softmax_window 8 and auto_softmax_long 1@80: of the two chosen layers, the one whose softmax
    most lowers the copy loss 16 tokens back keeps 80 tokens, the other 8; recorded, saved, loaded, and the
    fast decoder gives generate()'s tokens."""
    from helpers import plain_generate
    from linearize.decode import fast_generate

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    spec = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4, "softmax_window": 8}
    res = lolcats.run(_config(workspace, tmp_path / "w", keep_softmax="auto:2", spec=spec, stage1_steps=3,
                              stage2_steps=2, eval_steps=2, auto_softmax_long="1@80"))
    chosen, long = res["auto_softmax"]["chosen"], res["auto_softmax"]["long"]
    assert len(chosen) == 2 and len(long["chosen"]) == 1 and set(long["chosen"]) <= set(chosen)
    assert long["window"] == 80 and long["distance"] == 16 and set(long["scores"]) == {str(i) for i in chosen}
    model, _ = linearize.load(tmp_path / "w" / "final", device="cpu")
    windows = {i: m.window for i, m in linearize.mixers(model).items() if m.kind == "window"}
    assert windows == {i: 80 if i in long["chosen"] else 8 for i in chosen}
    assert f"of those, {long['chosen']} over 80 tokens" in lolcats.summary(res)
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 97, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = plain_generate(model, ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(model, ids, torch.ones_like(ids), max_new_tokens=12, pad_token_id=0), ref)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_default_recipes_shape_trains_on_each_family(workspace, tiny_model, family, monkeypatch, tmp_path):
    """``lolcats_tiers``' settings at a tiny scale (a share of the converted layers kept over a window, a far tier
    asking for more layers than the share keeps, so all of them take it; attention sinks; float8): both stages run on
    Llama and Gemma 3 (whose local layers stay as they are) teachers; the saved student's window layers have
    the sinks and the float8 rings, and the fast decoder gives generate()'s tokens."""
    from transformers import AutoTokenizer

    from helpers import plain_generate
    from linearize.decode import fast_generate

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    teacher = workspace / "teacher"
    if family != "llama":  # the workspace teacher's tokenizer; Gemma 3 with two global layers of six
        teacher = tmp_path / family
        more = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 2 + ["full_attention"]) if family == \
            "gemma3_text" else {}
        if more:
            more["layer_types"] = more["layer_types"] * 2
        tiny_model(family, **more).save_pretrained(teacher)
        AutoTokenizer.from_pretrained(workspace / "teacher").save_pretrained(teacher)
    spec = {"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4, "keep_sliding": True,
            "softmax_window": 8, "softmax_window_sinks": 2, "softmax_window_dtype": "float8"}
    res = lolcats.run(_config(workspace, tmp_path / "w", teacher=str(teacher), keep_softmax="auto:0.47", spec=spec,
                              auto_softmax_score="recall", auto_softmax_long="4@80", stage1_steps=3, stage2_steps=2,
                              eval_steps=2))
    chosen, long = res["auto_softmax"]["chosen"], res["auto_softmax"]["long"]["chosen"]
    assert chosen and long == chosen  # the far tier's count past the share: every chosen layer
    model, _ = linearize.load(tmp_path / "w" / "final", device="cpu")
    windows = {i: m for i, m in linearize.mixers(model).items() if m.kind == "window"}
    assert sorted(windows) == chosen
    assert all(m.window == 80 and m.sinks == 2 and m.float8 for m in windows.values())
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 97, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = plain_generate(model, ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(model, ids, torch.ones_like(ids), max_new_tokens=12, pad_token_id=0), ref)


@pytest.mark.parametrize("settings, message", [
    ({"auto_softmax_score": "entropy"}, "auto_softmax_score must be one of mse, recall, got 'entropy'"),
    ({"auto_softmax_score": "recall", "keep_softmax": (1,)}, "which this run does not ask for"),
    ({"auto_softmax_score": "recall", "auto_softmax_distance": 1}, "auto_softmax_distance must be a whole number"),
    ({"spec": {"kind": "lolcats", "softmax_window": "64,1:256"}}, "auto:K has not chosen its layers yet"),
    ({"auto_softmax_long": "x@"}, "auto_softmax_long must be N@W2"),
    ({"auto_softmax_long": "1@512"}, "the longer window must pass the kept layers' softmax_window"),
    ({"auto_softmax_long": "1@100", "spec": {"kind": "lolcats", "softmax_window": 64}}, "must pass the kept layers'"),
    ({"auto_softmax_long": "2@512", "spec": {"kind": "lolcats", "softmax_window": 64}}, "more layers than auto:1"),
    ({"auto_softmax_long": "1@512", "keep_softmax": (1,)}, "this run does not ask for auto:K"),
])
def test_bad_auto_softmax_settings_fail_in_one_line_before_loading(tmp_path, settings, message):
    cfg = lolcats.LolcatsConfig(**{"teacher": str(tmp_path / "absent"), "out": str(tmp_path / "run"),
                                   "keep_softmax": "auto:1", **settings})
    with pytest.raises(linearize.LinearizeError, match=message) as err:
        lolcats.run(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_auto_softmax_picks_the_layer_with_sharp_attention(workspace, monkeypatch, tmp_path):
    """A teacher whose layer 1 attends sharply (its q/k scaled up: close to a lookup, what recall needs)
    while layers 0 and 2 attend almost uniformly (q/k scaled down: easy for a linear map): auto:1
    keeps layer 1 softmax."""
    from helpers import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    teacher = AutoModelForCausalLM.from_pretrained(workspace / "teacher")
    with torch.no_grad():
        for i, layer in enumerate(teacher.model.layers):
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(6.0 if i == 1 else 0.1)
    teacher.save_pretrained(tmp_path / "teacher")
    tiny_tokenizer().save_pretrained(tmp_path / "teacher")
    res = lolcats.run(_config(workspace, tmp_path / "run", teacher=str(tmp_path / "teacher"), keep_softmax="auto:1",
                              stages=("stage1",), stage1_steps=6, eval_steps=3))
    assert res["auto_softmax"]["chosen"] == [1], res["layer_mse_after"]


def test_cuda_graph_decisions_per_stage(monkeypatch):
    """``cuda_graph`` (auto by default) decided per stage, before anything loads: on CUDA both stages
    replay (stage 1's attention_mse captured whole; stage 2's lm, kl or kl+lm); what rules a stage out
    is named (auto trains it eagerly), refused in one line under on, and reaches the stage's TrainConfig."""
    from linearize.recipes.lolcats import LolcatsConfig, cuda_graphs, stage_config

    def decide(**settings):
        cfg = LolcatsConfig(**settings)
        return {stage: cuda_graphs(cfg, stage) for stage in ("stage1", "stage2")}

    yes = (True, None)
    assert LolcatsConfig().cuda_graph == "auto"
    if not torch.cuda.is_available():
        assert decide() == {"stage1": (False, "there is no CUDA device"), "stage2": (False, "there is no CUDA device")}
        assert stage_config(LolcatsConfig(), "stage1", "o").cuda_graph is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for settings in ({}, {"xent_factor": 0.1}, {"loss": "kl"}, {"loss": "kl+lm", "kl_top_k": 8},
                     {"layers_per_block": 1, "block_inputs": "recompute"}, {"cuda_graph": "on"}, {"cuda_graph": True}):
        assert decide(**settings) == {"stage1": yes, "stage2": yes}, settings
    assert [stage_config(LolcatsConfig(), s, "o").cuda_graph for s in ("stage1", "stage2")] == [True, True]
    assert decide(cuda_graph="off") == {"stage1": (False, None), "stage2": (False, None)}
    assert stage_config(LolcatsConfig(cuda_graph=False), "stage2", "o").cuda_graph is False

    blockwise = decide(layers_per_block=2)
    assert blockwise["stage2"] == yes and not blockwise["stage1"][0]
    assert blockwise["stage1"][1].startswith("block-wise stage 1 from cached inputs")
    assert stage_config(LolcatsConfig(layers_per_block=2), "stage1", "o").cuda_graph is False
    # a sparse cache's PyTorch form asks the host nothing on packed blocks: it captures like the kernels
    assert decide(spec={"kind": "lolcats", "sparse_cache": 16, "sparse_priority": "first"}) == {"stage1": yes, "stage2": yes}
    hidden = decide(loss="kl+hidden_mse")
    assert hidden["stage1"] == yes and hidden["stage2"][1].startswith("hidden_mse in the loss 'kl+hidden_mse' cannot")
    refusals = {"layers_per_block": 2, "loss": "hidden_mse"}
    for key, value in refusals.items():
        with pytest.raises(linearize.LinearizeError, match="^--cuda-graph on: ") as err:
            decide(cuda_graph="on", **{key: value})
        assert "\n" not in str(err.value) and str(err.value).endswith("--cuda-graph auto or off trains eagerly")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert decide()["stage1"][1].startswith("FSDP's sharded parameters")


def test_cuda_graph_flag_of_the_lolcats_command(monkeypatch, tmp_path, capsys):
    """``--cuda-graph`` alone is on, ``--cuda-graph off|auto`` the others, unset is auto; a recipe file's
    true/false are on/off and flags win; a bad value is one line."""
    from linearize.cli import main

    seen = []
    monkeypatch.setattr(lolcats, "run", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(lolcats, "summary", lambda results, row="lolcats": "")
    (tmp_path / "true.yaml").write_text("cuda_graph: true\n")
    (tmp_path / "false.yaml").write_text("cuda_graph: false\n")
    commands = (["--cuda-graph"], [], ["--cuda-graph", "off"], ["--cuda-graph", "auto"],
                ["--config", str(tmp_path / "true.yaml")], ["--config", str(tmp_path / "false.yaml")],
                ["--config", str(tmp_path / "true.yaml"), "--cuda-graph", "auto"])
    for extra in commands:
        assert main(["lolcats", *extra, "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 0
    assert [cfg.cuda_graph for cfg in seen] == ["on", "auto", "off", "auto", "on", "off", "auto"]
    (tmp_path / "bad.yaml").write_text("cuda_graph: sometimes\n")
    assert main(["lolcats", "--config", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == ("linearize: error: cuda_graph must be auto, on or off (or true/false), "
                                               "got 'sometimes'")


def test_cuda_graph_on_refuses_a_run_before_loading(monkeypatch, tmp_path, capsys):
    """``--cuda-graph on`` where a stage cannot replay stops in one line before the teacher loads:
    without CUDA, or (on CUDA) block-wise stage 1 from cached inputs."""
    from linearize.cli import main

    monkeypatch.setattr(linearize, "load_teacher", lambda *a, **k: pytest.fail("the teacher was loaded"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["lolcats", "--cuda-graph", "--out", str(tmp_path / "o"), "--budget", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == ("linearize: error: --cuda-graph on: there is no CUDA device; "
                                               "--cuda-graph auto or off trains eagerly")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["lolcats", "--cuda-graph", "on", "--layers-per-block", "1", "--out", str(tmp_path / "o"),
                 "--budget", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("linearize: error: --cuda-graph on: block-wise stage 1 from cached inputs") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_graphed_stages_train_through_the_graphed_loss(workspace, monkeypatch, tmp_path):
    """The recipe's plumbing of graphed stages on the CPU: with both stages graphed (said to be), stage 1's
    steps run the attention_mse objective and stage 2's the LoRA model's next-token loss through the
    callable a graph captures (``_TrainingLoss``, here eagerly in place of the replay); results.json
    records the decisions; stage 1 still lowers every layer's attention MSE."""
    from linearize.distill import next_token_loss
    from linearize.graphed import _TrainingLoss
    from linearize.recipes import engine

    made = []

    class StandIn:
        def __init__(self, model, loss_fn, cfg, args, train_dataset=None):
            self.loss_fn, self.calls = loss_fn, 0
            self.step = _TrainingLoss(model, None, None if loss_fn is next_token_loss else loss_fn)
            made.append(self)

        def __call__(self, input_ids, labels, *teacher):
            self.calls += 1
            assert not teacher  # neither stage reads a teacher's tensors
            return self.step(input_ids, labels)

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(lolcats, "cuda_graphs", lambda cfg, stage: (True, None))
    monkeypatch.setattr(engine, "_graphed_loss", StandIn)
    res = lolcats.run(_config(workspace, tmp_path / "run", stage1_steps=6, stage2_steps=3))
    assert res["cuda_graph"] == {"setting": "auto", "stage1": {"graphed": True}, "stage2": {"graphed": True}}
    assert [m.calls for m in made] == [6, 3]
    stage1, stage2 = made
    assert stage1.loss_fn.captured_whole and repr(stage1.loss_fn) == "attention_mse"
    assert stage2.loss_fn is next_token_loss and type(stage2.step.model).__name__.startswith("Peft")
    assert all(res["layer_mse_after"][i] < res["layer_mse_before"][i] for i in range(3))
    for stage in ("stage1/joint", "stage2"):
        assert json.loads((tmp_path / "run" / stage / "train_config.json").read_text())["cuda_graph"] is True


def test_the_recall_score_runs_as_many_rows_a_forward_as_a_training_steps_tokens_allow(monkeypatch):
    """A recall forward keeps no activations: it runs ``RECALL_TOKENS`` x a step's tokens, so the default's
    1 x 8,192 a step takes all 8 rows of 1,088 (and of 4,288, the far tier's) in one forward, not one by one;
    never fewer rows than the training batch, never more than the task has; the choice asks for that many."""
    from linearize.recipes.settings import LolcatsConfig

    tiers = LolcatsConfig(batch_size=1, block_len=8192)
    assert lolcats.recall_rows(tiers, 1088) == lolcats.recall_rows(tiers, 4288) == lolcats.RECALL_SEQUENCES == 8
    assert lolcats.recall_rows(LolcatsConfig(batch_size=2, block_len=256), 1088) == 2 * 8 * 256 // 1088 == 3
    assert lolcats.recall_rows(LolcatsConfig(batch_size=4, block_len=32), 4288) == 4
    asked = []
    monkeypatch.setattr(lolcats, "recall_choice", lambda student, ids, labels, k, rows, candidates=None: (
        asked.append((ids.shape[1], rows)) or ([0], [{"scores": {}, "loss": 0.0}])))
    monkeypatch.setattr(lolcats, "copy_task", lambda tok, rows, distance, seed: (
        torch.zeros(8, distance + 64, dtype=torch.long), None))
    student = torch.nn.Module()
    student.get_input_embeddings = lambda: torch.nn.Embedding(4, 2)
    cfg = LolcatsConfig(batch_size=1, block_len=8192, auto_softmax_score="recall", auto_softmax_distance=1024,
                        auto_softmax_long="1@4288")
    lolcats.auto_softmax_choice(student, None, {}, 1, cfg)
    lolcats.auto_long_choice(student, None, [0], cfg)
    assert asked == [(1088, 8), (4288, 8)]
