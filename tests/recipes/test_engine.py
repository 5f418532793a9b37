"""The training engine's guards: a NaN loss, empty data and nothing to train end with one line; its
steps under CUDA graphs; and its set-up / steady split of a stage's time, on a fake clock."""

import re

import pytest
import torch

from linearize import LinearizeError
from linearize.data import BlockDataset
from linearize.recipes.engine import StepClock, TrainConfig, next_token_loss, split, split_line, train


def _data(n=8):
    return BlockDataset(torch.randint(0, 97, (n, 16), generator=torch.Generator().manual_seed(0)))


def test_nan_loss_stops_with_one_line_and_keeps_the_checkpoint(tiny_model, tmp_path):
    model = tiny_model("llama")
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        loss = next_token_loss(m, batch)
        return loss * float("nan") if calls["n"] > 2 else loss

    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=10, batch_size=2, eval_steps=2,
                      logging_steps=1)
    with pytest.raises(LinearizeError, match="NaN/inf") as err:
        train(model, _data(), None, loss_fn, cfg, stage="test")
    assert "\n" not in str(err.value)
    assert (tmp_path / "checkpoint-2").is_dir()  # saved before the NaN, still there


def test_keeping_no_checkpoints_writes_none_and_turns_early_stopping_off(tiny_model, tmp_path, capsys):
    def run(out, keep):
        cfg = TrainConfig(output_dir=str(out), learning_rate=1e-3, max_steps=6, batch_size=2, eval_steps=2,
                          logging_steps=1, early_stopping_patience=1, save_total_limit=keep)
        return train(tiny_model("llama"), _data(), _data(4), next_token_loss, cfg, stage="t")

    kept = run(tmp_path / "kept", 1)
    assert "checkpoint-6" in [p.name for p in (tmp_path / "kept").glob("checkpoint-*")]  # (and the best, if older)
    assert kept.args.load_best_model_at_end and "no early stopping" not in capsys.readouterr().err
    none = run(tmp_path / "none", 0)
    assert not list((tmp_path / "none").glob("checkpoint-*")) and none.state.global_step == 6
    assert not none.args.load_best_model_at_end and none.args.save_strategy == "no"
    err = capsys.readouterr().err
    assert "t: no early stopping" in err and "--keep-checkpoints 0" in err


def test_empty_data_and_nothing_trainable(tiny_model, tmp_path):
    model = tiny_model("llama")
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=1)
    with pytest.raises(LinearizeError, match="training data is empty"):
        train(model, BlockDataset(torch.zeros(0, 16, dtype=torch.long)), None, next_token_loss, cfg, stage="t")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(LinearizeError, match="nothing to train"):
        train(model, _data(), None, next_token_loss, cfg, stage="t")


def test_cuda_graph_training_goes_through_the_graphed_loss(tiny_model, tmp_path, monkeypatch):
    """--cuda-graph's plumbing on the CPU: every training step's loss (and so its backward) comes from
    the graphed callable, evaluation from the recipe's loss; an eager stand-in takes the graphs' place
    (the replay itself is checked against the eager step on CUDA, tests/gpu/test_gpu.py)."""
    from linearize.recipes import engine

    class StandIn:
        def __init__(self, model):
            self.model, self.calls = model, 0

        def __call__(self, input_ids, labels):
            self.calls += 1
            return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss

    made = []
    monkeypatch.setattr(engine, "_graphed_loss", lambda model, *a: made.append(StandIn(model)) or made[-1])
    model = tiny_model("llama")
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=4, batch_size=2, eval_steps=2,
                      cuda_graph=True, grad_accum=2)
    trainer = train(model, _data(), _data(4), next_token_loss, cfg, stage="t")
    assert made[0].calls == 8  # 4 steps x 2 accumulated batches; the evaluations did not use it
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_graphed_distillation_hands_the_teachers_logits_to_the_replay(tiny_model, tmp_path, monkeypatch):
    """--cuda-graph with kl+next_token, its plumbing on the CPU: each training step computes the teacher's
    logits eagerly and passes them to the graphed callable after the batch; a stand-in computing the
    objective from them (what the graphs replay) logs the eager Trainer's losses."""
    from linearize.distill import FrozenTeacher, build_objective
    from linearize.recipes import engine

    objective = build_objective("kl+next_token", teacher=FrozenTeacher(tiny_model("llama", seed=1)))
    seen = []

    def stand_in(model, *args):
        def replay(input_ids, labels, *teacher):
            seen.append(teacher)
            outputs = model(input_ids=input_ids, labels=labels, use_cache=False)
            return objective.from_outputs(outputs, {"input_ids": input_ids, "labels": labels}, teacher)
        return replay

    losses = {}
    for graphed in (False, True):
        monkeypatch.setattr(engine, "_graphed_loss", stand_in)
        cfg = TrainConfig(output_dir=str(tmp_path / str(graphed)), learning_rate=1e-3, max_steps=3, batch_size=2,
                          grad_accum=2, logging_steps=1, cuda_graph=graphed)
        trainer = train(tiny_model("llama"), _data(), None, objective, cfg, stage="t")
        losses[graphed] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(seen) == 6 and all(len(t) == 1 and t[0].shape == (2, 16, 97) for t in seen)
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_graphs_captured_before_ddp_get_the_teachers_tensors(tiny_model, tmp_path, monkeypatch):
    """Under several processes the graphs are captured before training, on a zero batch: a kl objective's
    capture gets the teacher's logits for that batch, the next-token loss's nothing more."""
    from linearize.distill import FrozenTeacher, build_objective
    from linearize.graphed import GraphedLoss
    from linearize.recipes import engine

    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=1, batch_size=3, cuda_graph=True)
    args = engine.training_arguments(cfg, False)
    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    primed = []
    monkeypatch.setattr(GraphedLoss, "prime", lambda self, *tensors: primed.append(tensors))
    kl = build_objective("kl+next_token", {"kl": {"top_k": 4}}, teacher=FrozenTeacher(tiny_model("llama", seed=1)))
    for loss_fn in (kl, next_token_loss):
        engine._graphed_loss(tiny_model("llama"), loss_fn, cfg, args, _data())
    assert [[tuple(t.shape) for t in p] for p in primed] == [[(3, 16), (3, 16), (3, 16, 4), (3, 16, 4)],
                                                              [(3, 16), (3, 16)]]
    assert not primed[0][0].any() and primed[0][3].dtype == torch.long


def test_cuda_graph_refusals(tiny_model, tmp_path, monkeypatch):
    from linearize.recipes import engine

    model = tiny_model("llama")
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=1, cuda_graph=True)
    if not torch.cuda.is_available():
        with pytest.raises(LinearizeError, match="--cuda-graph on: there is no CUDA device"):
            train(model, _data(), None, next_token_loss, cfg, stage="t")
    args = engine.training_arguments(cfg, False)
    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: True)
    with pytest.raises(LinearizeError, match="the loss '<lambda>' cannot be captured"):
        engine._graphed_loss(model, lambda m, b: next_token_loss(m, b), cfg, args)
    with pytest.raises(LinearizeError, match="not both"):
        engine._graphed_loss(model, next_token_loss, TrainConfig(**{**cfg.__dict__, "compile": True}), args)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(LinearizeError, match="FSDP's sharded parameters cannot be captured"):
        engine._graphed_loss(model, next_token_loss, cfg, args)


def test_graphed_runs_refuse_what_one_capture_cannot_replay(monkeypatch):
    """Under torchrun the graphs are captured once, before training: XATL's LIT (a new capture when it
    unfreezes) is refused with one line under --cuda-graph on and trains eagerly under auto; one
    process graphs it."""
    from linearize.recipes.uptrain import check_distillation, cuda_graphs
    from linearize.recipes.xatl import XatlConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_graphs(XatlConfig(cuda_graph="on", freeze="lit")) == (True, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LinearizeError, match="LIT's unfreezing needs a new capture") as err:
        check_distillation(XatlConfig(cuda_graph="on", freeze="lit"))
    assert "\n" not in str(err.value)
    graphed, why = cuda_graphs(XatlConfig(freeze="lit"))
    assert not graphed and "LIT's unfreezing needs a new capture" in why
    assert cuda_graphs(XatlConfig(cuda_graph="on", freeze="unfrozen")) == (True, None)


def test_auto_graphs_where_the_run_allows_it(monkeypatch):
    """A recipe's cuda_graph (auto by default) decided on this process: graphed on CUDA with a capturable
    loss, eager with the reason on the CPU, under FSDP, with --compile or a loss term that cannot be
    captured; the training stages' TrainConfig carries the decision."""
    from linearize.recipes import uptrain
    from linearize.recipes.supra import SupraConfig
    from linearize.recipes.uptrain import cuda_graphs

    assert SupraConfig().cuda_graph == "auto"
    if not torch.cuda.is_available():
        assert cuda_graphs(SupraConfig()) == (False, "there is no CUDA device")
        assert uptrain.train_config(SupraConfig(), "o", 1, 0).cuda_graph is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for loss in ("lm", "kl+lm"):
        assert cuda_graphs(SupraConfig(loss=loss)) == (True, None)
    assert uptrain.train_config(SupraConfig(), "o", 1, 0).cuda_graph is True
    assert uptrain.train_config(SupraConfig(cuda_graph="off"), "o", 1, 0).cuda_graph is False
    graphed, why = cuda_graphs(SupraConfig(loss="kl+hidden_mse"))
    assert not graphed and why.startswith("hidden_mse in the loss 'kl+hidden_mse' cannot be captured")
    assert cuda_graphs(SupraConfig(compile=True))[1].startswith("--compile is on")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert cuda_graphs(SupraConfig())[1].startswith("FSDP's sharded parameters")
    assert uptrain.train_config(SupraConfig(), "o", 1, 0).cuda_graph is False


def test_cuda_graph_takes_the_capturable_distillation_losses(monkeypatch):
    """--cuda-graph with --loss kl or kl+lm (full or top-k) is accepted before the teacher loads; a loss
    with a term that reads more of the teacher than its logits is refused with one line."""
    from linearize.recipes.supra import SupraConfig
    from linearize.recipes.uptrain import check_distillation
    from linearize.recipes.xatl import XatlConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for loss in ("lm", "kl", "kl+lm", "0.5*kl+lm"):
        check_distillation(SupraConfig(cuda_graph=True, loss=loss))
        check_distillation(XatlConfig(cuda_graph=True, loss=loss, kl_top_k=8))
    for loss, term in (("hidden_mse", "hidden_mse"), ("kl+mixer_mse", "mixer_mse")):
        check_distillation(SupraConfig(loss=loss))  # eager: fine
        with pytest.raises(LinearizeError, match=re.escape(f"{term} in the loss '{loss}' cannot be captured")) as err:
            check_distillation(SupraConfig(cuda_graph=True, loss=loss))
        assert "\n" not in str(err.value)


def test_the_alignment_stage_trains_eagerly_under_cuda_graph(tiny_model, monkeypatch, tmp_path):
    """--cuda-graph replays the training stage; the alignment stage reads the teacher, so it runs eagerly."""
    import types

    import linearize
    from linearize.recipes import engine, uptrain
    from linearize.recipes.supra import SupraConfig

    seen = []
    monkeypatch.setattr(engine, "train", lambda model, tr, ev, loss, cfg, **kw: seen.append(cfg) or
                        types.SimpleNamespace(state=types.SimpleNamespace(global_step=cfg.max_steps), speed=None))
    student = linearize.convert(tiny_model("llama"), {"kind": "supra"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the training stage's decision: graphed
    cfg = SupraConfig(cuda_graph=True, align_steps=3)
    assert uptrain._align(student, None, None, None, cfg, tmp_path)["steps"] == 3
    assert seen and seen[0].cuda_graph is False and uptrain.train_config(cfg, tmp_path, 5, 1).cuda_graph is True


class FakeClock:
    """A clock that moves only when told: ``clock()`` reads it, ``clock.advance(s)`` moves it on."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, seconds):
        self.t += seconds


def test_the_step_clock_splits_set_up_and_steady_state():
    """The callback alone, driven as the Trainer drives it: the set-up runs from the clock's making to
    the end of its second step; each later step counts from the end of what came before it (a step, or
    the evaluation / checkpoint / log line after one), so evaluations are in neither part."""
    now = FakeClock()
    clock = StepClock(setup_steps=2, now=now)
    now.advance(7)  # caching the teacher's states, building the Trainer
    clock.on_train_begin(None, None, None)
    for seconds in (5, 3):  # capture and compilation in step 1, a slow step 2
        now.advance(seconds)
        clock.on_step_end(None, None, None)
    for step in range(3, 7):
        now.advance(0.5 if step % 2 else 0.25)  # the steady steps: 0.5 + 0.25 + 0.5 + 0.25
        clock.on_step_end(None, None, None)
        if step == 4:
            now.advance(4)  # a log line, an evaluation and a checkpoint after step 4
            clock.on_log(None, None, None)
            now.advance(2)
            clock.on_evaluate(None, None, None)
            now.advance(1)
            clock.on_save(None, None, None)
    now.advance(0.5)
    clock.on_train_end(None, None, None)
    record = clock.measured(tokens_per_step=1000)
    assert record == {"seconds": pytest.approx(24.0),
                      "setup": {"seconds": pytest.approx(15.0), "steps": 2, "tokens": 2000},
                      "steady": {"seconds": pytest.approx(1.5), "steps": 4, "tokens": 4000,
                                 "tokens_per_second": pytest.approx(4000 / 1.5)}}
    both = split([record])
    assert both["other_seconds"] == pytest.approx(24.0 - 15.0 - 1.5)  # the evaluation and the end
    assert both["setup"]["tokens_per_second"] == pytest.approx(2000 / 15.0)
    assert split_line(both) == "set-up 15.0s (2 steps), steady 2,667 tok/s over 4 steps"


def test_a_stage_without_steady_steps_and_stages_added_up():
    now = FakeClock()
    short = StepClock(setup_steps=2, now=now)
    now.advance(3)
    short.on_step_end(None, None, None)  # one step: all set-up
    now.advance(1)
    short.on_train_end(None, None, None)
    one = short.measured(tokens_per_step=10)
    assert one["setup"] == {"seconds": 3.0, "steps": 1, "tokens": 10}
    assert one["steady"] == {"seconds": 0.0, "steps": 0, "tokens": 0, "tokens_per_second": None}
    assert split_line(split([one])).endswith("no steady steps")
    other = {"seconds": 10.0, "setup": {"seconds": 2.0, "steps": 2, "tokens": 20},
             "steady": {"seconds": 4.0, "steps": 8, "tokens": 80}}
    both = split([one, other], seconds=20.0)  # 20 s of wall time: the two stages and what ran between them
    assert both["setup"] == {"seconds": 5.0, "steps": 3, "tokens": 30, "tokens_per_second": 6.0}
    assert both["steady"] == {"seconds": 4.0, "steps": 8, "tokens": 80, "tokens_per_second": 20.0}
    assert both["other_seconds"] == 11.0
    assert split([])["steady"]["tokens_per_second"] is None  # a resumed stage with nothing left to train


def test_train_reports_the_split_on_a_fake_clock(tiny_model, tmp_path):
    """Through the engine: the Trainer's own hooks drive an injected clock, which moves 1 s per loss call
    (each training step, and each validation batch) and 10 s for what the stage does before ``train``.
    5 steps of 2 x 16 tokens, evaluated after steps 2 and 4 (2 batches each; this Trainer evaluates after
    the last step too): set-up 10 + 2 s over steps 1-2, steady 3 s over steps 3-5, the evaluations in
    neither; the record lands in the Trainer, the stage's train_config.json and the last line of
    metrics.jsonl."""
    import json

    now = FakeClock()
    evaluated = []

    def loss_fn(m, batch):
        now.advance(1.0)
        if not m.training:
            evaluated.append(1)
        return next_token_loss(m, batch)

    clock = StepClock(setup_steps=2, now=now)
    now.advance(10.0)  # e.g. caching the teacher's hidden states for this block
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=5, batch_size=2, eval_steps=2,
                      logging_steps=1)
    trainer = train(tiny_model("llama"), _data(), _data(4), loss_fn, cfg, stage="t", clock=clock)
    speed = trainer.speed
    assert len(evaluated) >= 4  # two batches after steps 2 and 4
    assert speed == {"seconds": pytest.approx(15.0 + len(evaluated)),
                     "setup": {"seconds": pytest.approx(12.0), "steps": 2, "tokens": 64},
                     "steady": {"seconds": pytest.approx(3.0), "steps": 3, "tokens": 96,
                                "tokens_per_second": pytest.approx(32.0)}}
    assert split([speed])["other_seconds"] == pytest.approx(len(evaluated))
    assert json.loads((tmp_path / "train_config.json").read_text())["speed"] == speed
    last = json.loads((tmp_path / "metrics.jsonl").read_text().strip().splitlines()[-1])
    assert last == {"stage": "t", "step": 5, "speed": speed}


def test_train_makes_its_own_clock_with_the_configs_set_up_steps(tiny_model, tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=4, batch_size=2, setup_steps=1)
    speed = train(tiny_model("llama"), _data(), None, next_token_loss, cfg, stage="t").speed
    assert (speed["setup"]["steps"], speed["steady"]["steps"]) == (1, 3)
    assert speed["steady"]["seconds"] > 0 and speed["steady"]["tokens_per_second"] > 0


def test_profiled_steps_come_after_the_set_up_and_land_in_the_stage_folder(tiny_model, tmp_path, capsys):
    """``profile_steps``: the steps after the set-up run under torch.profiler; their operators (the CPU's; kernels
    on CUDA) go to OUT/profile.json and a table to stdout; a stage that ends first reports what it profiled."""
    import json

    cfg = TrainConfig(output_dir=str(tmp_path / "a"), learning_rate=1e-3, max_steps=6, batch_size=2, eval_steps=100,
                      logging_steps=1, save_total_limit=0, setup_steps=2, profile_steps=3)
    trainer = train(tiny_model("llama"), _data(), None, next_token_loss, cfg, stage="t")
    record = json.loads((tmp_path / "a" / "profile.json").read_text())
    assert record["stage"] == "t" and record["steps"] == 3 and record["after_steps"] == 2
    assert record["unit"] == "operator" and record["top"] and record["us_per_step"] > 0 and record["wall_us_per_step"] > 0
    assert any(r["name"] == "aten::mm" or r["name"] == "aten::addmm" for r in record["top"])
    out = capsys.readouterr().out
    assert "profile of t: 3 steps after 2" in out and "| operator | us/step |" in out
    assert trainer.state.global_step == 6
    # the stage ends before the last profiled step: the steps it profiled
    cfg = TrainConfig(output_dir=str(tmp_path / "b"), learning_rate=1e-3, max_steps=4, batch_size=2, eval_steps=100,
                      logging_steps=1, save_total_limit=0, setup_steps=2, profile_steps=5)
    train(tiny_model("llama"), _data(), None, next_token_loss, cfg, stage="t")
    assert json.loads((tmp_path / "b" / "profile.json").read_text())["steps"] == 2


def test_the_recipes_hand_profile_steps_to_each_stage(tmp_path):
    from linearize.recipes import lolcats, uptrain
    from linearize.recipes.settings import SupraConfig

    for stage in ("stage1", "stage2"):
        assert lolcats.stage_config(lolcats.LolcatsConfig(profile_steps=3), stage, tmp_path).profile_steps == 3
    assert uptrain.train_config(SupraConfig(profile_steps=4), tmp_path, 10, 1).profile_steps == 4
    assert uptrain.train_config(SupraConfig(), tmp_path, 10, 1).profile_steps == 0


def test_a_sharded_student_is_gathered_on_the_main_process_alone_where_only_it_goes_on(tiny_model, monkeypatch):
    """``unsharded(main_only=True)``: every rank takes part in the gathers (collectives), the others keep no copy
    (eight CPU copies of a 70B student would not fit one host) and go on with the model as it was."""
    from linearize.distill import probes
    from linearize.recipes import engine

    model = tiny_model("llama")
    gathers = []
    monkeypatch.setattr(probes, "fully_sharded", lambda m: True)
    monkeypatch.setattr(engine, "gathered_state", lambda m, keep=True: gathers.append(keep) or (
        {n: t.clone() for n, t in m.state_dict().items()} if keep else {}))
    monkeypatch.setattr(engine, "is_main_process", lambda: False)
    assert engine.unsharded(model, device="cpu", main_only=True) is model and gathers == [False]
    copy = engine.unsharded(model, device="cpu")  # between stages every rank needs the plain model
    assert copy is not model and gathers == [False, True]
    monkeypatch.setattr(engine, "is_main_process", lambda: True)
    main = engine.unsharded(model, device="cpu", main_only=True)
    assert main is not model and gathers[-1] is True
    assert all(torch.equal(a, b) for a, b in zip(main.state_dict().values(), model.state_dict().values()))


def test_gathered_state_keeps_nothing_where_asked(tiny_model):
    from linearize.recipes.engine import gathered_state

    model = tiny_model("llama")
    assert gathered_state(model, keep=False) == {}
    assert gathered_state(model).keys() == model.state_dict().keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert list(gathered_state(model, only={name})) == [name]  # a stage's trained weights alone
