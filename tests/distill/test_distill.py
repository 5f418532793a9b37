"""The loss components (``linearize.distill``): one signature, a registry by name, weighted sums;
attention transfer through explicit probes; hidden-state alignment; the mixers stay attention."""

import pytest
import torch

import linearize
from linearize import LinearizeError
from linearize.distill import (LOSSES, FrozenTeacher, Loss, SameModelTeacher, build_objective, parse_objective,
                               softmax_view, transfer_probes)


def _batch(seed=0, b=2, t=12):
    ids = torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_the_registry_and_the_objective_syntax():
    assert {"next_token", "attention_mse", "hidden_mse", "kl"} <= set(LOSSES)
    assert parse_objective("kl+next_token") == [(1.0, "kl"), (1.0, "next_token")]
    assert parse_objective("0.5*kl + 2*next_token") == [(0.5, "kl"), (2.0, "next_token")]
    assert parse_objective({"kl": 0.25}) == [(0.25, "kl")]
    for bad, match in (("kl+nope", "unknown loss nope"), ("kl*0.5", "cannot read"), ("kl+kl", "twice")):
        with pytest.raises(LinearizeError, match=match):
            parse_objective(bad)


def test_a_new_loss_is_one_class():
    class Zero(Loss):
        name = "test_zero"

        def __call__(self, step):
            return step.outputs().logits.sum() * 0

    try:
        assert LOSSES["test_zero"] is Zero
        assert repr(build_objective("test_zero+next_token")) == "test_zero + next_token"
    finally:
        del LOSSES["test_zero"]


def test_weighted_sum_shares_one_student_forward(tiny_model):
    model = tiny_model("llama", dtype=torch.float64)
    teacher = FrozenTeacher(tiny_model("llama", dtype=torch.float64, seed=1))
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    batch = _batch()
    both = build_objective("0.5*kl+next_token", teacher=teacher)(model, batch)
    assert len(calls) == 1
    kl = build_objective("kl", teacher=teacher)(model, batch)
    nt = build_objective("next_token")(model, batch)
    assert both.item() == pytest.approx(0.5 * kl.item() + nt.item(), rel=1e-12)
    from linearize.distill import next_token_loss

    nt_plain = next_token_loss(model, batch)
    assert nt.item() == nt_plain.item()


def test_the_mixer_is_only_attention():
    from linearize.mixers import Mixer

    for name in ("mode", "transfer_loss", "transfer_xent", "with_xent", "_teacher_forward", "teacher_attention"):
        assert not hasattr(Mixer, name), name


def test_attention_transfer_probes_swap_in_and_out(tiny_model):
    student = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": "linear", "feature_dim": 8})
    before = dict(linearize.mixers(student))
    with transfer_probes(student, [1]) as probes:
        assert set(probes) == {1}
        kinds = [type(layer.self_attn).__name__ for layer in student.model.layers]
        assert kinds == ["SoftmaxAttention", "AttentionTransferProbe", "SoftmaxAttention"]
        assert not linearize.mixers(student)
    assert linearize.mixers(student) == before
    with pytest.raises(RuntimeError), transfer_probes(student, [0]):  # put back on errors too
        raise RuntimeError
    assert linearize.mixers(student) == before


def test_attention_mse_trains_only_its_layers_and_matches_layer_mse(tiny_model):
    from linearize.distill import layer_mse

    student = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": "linear", "feature_dim": 8})
    batch = _batch()
    loss = build_objective("attention_mse", context={"layers": (0, 2), "mse_factor": 1.0})(student, batch)
    loss.backward()
    ms = linearize.mixers(student)
    assert ms[0].feature_map_q.weight.grad.abs().sum() > 0 and ms[2].feature_map_q.weight.grad.abs().sum() > 0
    assert ms[1].feature_map_q.weight.grad is None  # layer 1 gave the teacher's output
    per_layer = layer_mse(student, batch["input_ids"], batch_size=2)
    assert loss.item() == pytest.approx((per_layer[0] + per_layer[2]) / 2, rel=1e-10)


def test_attention_transfer_backward_stops_at_each_layer(tiny_model):
    """Each layer's MSE trains that layer alone: its backward computes nothing for the teacher's weights
    before it (an MLP weight made trainable gets no gradient at all, not a zero one), and each layer's
    gradients are those of its MSE alone, with the layer probed by itself (the weight-0 ties that FSDP
    training adds change nothing)."""
    from linearize.distill import transfer_probes

    student = linearize.convert(tiny_model("llama", dtype=torch.float64), {"kind": "lolcats", "window": 2})
    for p in student.parameters():
        p.requires_grad_(False)
    maps = {i: m.feature_map_q.weight for i, m in linearize.mixers(student).items()}
    for w in maps.values():
        w.requires_grad_(True)
    mlp = student.model.layers[0].mlp.down_proj.weight
    mlp.requires_grad_(True)
    batch = _batch()
    build_objective("attention_mse", context={"mse_factor": 1.0})(student, batch).backward()
    assert mlp.grad is None
    joint = {i: w.grad.clone() for i, w in maps.items()}
    for tie in (False, True):
        for i, w in maps.items():
            w.grad = None
            with transfer_probes(student, [i], tie=tie) as probes:
                student(input_ids=batch["input_ids"], use_cache=False)
            (probes[i].mse / len(maps)).backward()
            torch.testing.assert_close(w.grad, joint[i], atol=1e-12, rtol=0)
        assert mlp.grad is None


def test_hidden_alignment_is_zero_for_the_teacher_and_teacher_forced(tiny_model):
    teacher = tiny_model("llama", dtype=torch.float64)
    batch = _batch()
    exact = linearize.convert(teacher, {"kind": "lolcats", "window": 16, "feature_dim": 8})
    for form in (SameModelTeacher(), FrozenTeacher(teacher)):
        assert build_objective("hidden_mse", teacher=form)(exact, batch).item() < 1e-20
    student = linearize.convert(teacher, {"kind": "linear", "feature_dim": 8})
    loss = build_objective("hidden_mse", {"hidden_mse": {"layers": (1, 2)}}, teacher=FrozenTeacher(teacher))(student, batch)
    assert loss.item() > 0
    loss.backward()
    ms = linearize.mixers(student)
    assert ms[0].feature_map_q.weight.grad is None  # layer 1 starts from the teacher's hidden states
    assert ms[1].feature_map_q.weight.grad.abs().sum() > 0
    # free-running, layer 2's error also reaches layer 1's weights through its input
    free = build_objective("hidden_mse", {"hidden_mse": {"layers": (2,), "teacher_forced": False}},
                           teacher=FrozenTeacher(teacher))(student, batch)
    student.zero_grad(set_to_none=True)
    free.backward()
    assert ms[1].feature_map_q.weight.grad.abs().sum() > 0


def test_hidden_alignment_for_a_built_student_needs_a_frozen_teacher(tiny_model):
    from linearize.convert.xatl_transfer import build_xatl

    teacher = tiny_model("llama")
    student, _ = build_xatl(teacher, "retnet", seed=0)
    assert build_objective("hidden_mse", teacher=FrozenTeacher(teacher))(student, _batch()).item() > 0
    with pytest.raises(LinearizeError, match="distill_teacher: copy"):
        build_objective("hidden_mse", teacher=SameModelTeacher())(student, _batch())


def test_softmax_view_turns_lora_off(tiny_model):
    from peft import LoraConfig, get_peft_model

    teacher = tiny_model("llama", dtype=torch.float64)
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 2, "feature_dim": 8})
    peft_model = get_peft_model(student, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = _batch()["input_ids"]
    with torch.no_grad(), softmax_view(peft_model):
        viewed = peft_model(input_ids=ids).logits
    torch.testing.assert_close(viewed, teacher(ids).logits, atol=1e-10, rtol=0)


def test_the_graphed_path_takes_capturable_and_whole_objectives_and_refuses_others(tiny_model, monkeypatch):
    from linearize.graphed import _TrainingLoss
    from linearize.recipes import engine

    model = tiny_model("llama")
    cfg = engine.TrainConfig(output_dir="unused", learning_rate=1e-3, max_steps=1, cuda_graph=True)
    args = engine.training_arguments(cfg, False)
    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: True)
    nt = build_objective("2*next_token")
    assert nt.capturable
    graphed = engine._graphed_loss(model, nt, cfg, args)
    assert graphed.objective is nt
    kl = build_objective("kl+next_token", teacher=FrozenTeacher(tiny_model("llama", seed=1)))
    assert engine._graphed_loss(model, kl, cfg, args).objective is kl  # the teacher's logits enter as inputs
    transfer = build_objective("attention_mse")  # runs the student's forward itself: captured whole
    assert transfer.captured_whole and not transfer.capturable
    assert nt.uncapturable == kl.uncapturable == transfer.uncapturable == []
    assert build_objective("attention_mse+next_token").uncapturable == ["attention_mse"]
    assert engine._graphed_loss(model, transfer, cfg, args).objective is transfer
    with pytest.raises(LinearizeError, match=r"'attention_mse \+ next_token' cannot be captured"):
        engine._graphed_loss(model, build_objective("attention_mse+next_token"), cfg, args)
    with pytest.raises(LinearizeError, match="'hidden_mse' cannot be captured"):
        engine._graphed_loss(model, build_objective("hidden_mse", teacher=FrozenTeacher(tiny_model("llama"))), cfg, args)
    batch = _batch()
    with torch.no_grad():
        value = _TrainingLoss(model, None, nt)(batch["input_ids"], batch["labels"])
        assert value.item() == pytest.approx(2 * engine.next_token_loss(model, batch).item(), rel=1e-6)
