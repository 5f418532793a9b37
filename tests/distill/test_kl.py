"""The KL loss (``linearize/distill/kl.py``): a value and a gradient worked out by hand, 0 for a
student that is its teacher (full and top-k, through both teacher forms), and the top-k cache."""

import math

import pytest
import torch

import linearize
from linearize import LinearizeError
from linearize.distill import FrozenTeacher, SameModelTeacher, build_objective
from linearize.distill.kl import kl_from_logits, kl_top_k


def test_value_and_gradient_by_hand():
    # teacher logits (0, 0, ln 2) at temperature 2: p proportional to (1, 1, sqrt 2); the student is uniform
    teacher = torch.tensor([[0.0, 0.0, math.log(2.0)]], dtype=torch.float64)
    student = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    p = [1 / (2 + math.sqrt(2)), 1 / (2 + math.sqrt(2)), math.sqrt(2) / (2 + math.sqrt(2))]
    want = 4 * sum(pi * math.log(pi / (1 / 3)) for pi in p)  # tau^2 x KL(p || uniform)
    value = kl_from_logits(student, teacher, temperature=2.0)
    assert value.item() == pytest.approx(want, rel=1e-12)
    value.backward()
    # d/ds_j [tau^2 KL(p || softmax(s / tau))] = tau (q_j - p_j)
    torch.testing.assert_close(student.grad, torch.tensor([[2 * (1 / 3 - pi) for pi in p]], dtype=torch.float64),
                               atol=1e-12, rtol=0)


def test_top_k_by_hand():
    # the teacher's top 2 of (3, 1, 0, 2) are tokens 0 and 3: p = softmax(3, 2); the student's logits
    # there are (0, 1): q = softmax(0, 1), both renormalised over the two tokens
    teacher = torch.tensor([[3.0, 1.0, 0.0, 2.0]], dtype=torch.float64)
    student = torch.tensor([[0.0, 5.0, -1.0, 1.0]], dtype=torch.float64)
    values, indices = teacher.topk(2, dim=-1)
    e = math.e
    p = [e / (e + 1), 1 / (e + 1)]
    q = [1 / (1 + e), e / (1 + e)]
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert kl_top_k(student, values, indices).item() == pytest.approx(want, rel=1e-12)


def test_kl_is_nonnegative_and_averages_over_tokens():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g, dtype=torch.float64), torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    per_token = [kl_from_logits(s[b, i], t[b, i]).item() for b in range(2) for i in range(5)]
    assert min(per_token) >= 0
    assert kl_from_logits(s, t).item() == pytest.approx(sum(per_token) / 10, rel=1e-12)


@pytest.mark.parametrize("top_k", [None, 7])
def test_a_student_that_is_its_teacher_scores_zero(tiny_model, top_k):
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    teacher = tiny_model("llama", dtype=torch.float64)
    options = {"kl": {"top_k": top_k, "temperature": 2.0}}
    # a frozen copy of the model itself
    same = build_objective("kl", options, teacher=FrozenTeacher(teacher))
    assert abs(same(teacher, batch).item()) < 1e-12
    # a LoLCATs student whose window covers the sequence is its teacher; its own softmax view teaches it
    student = linearize.convert(teacher, {"kind": "lolcats", "window": 16, "feature_dim": 8})
    assert abs(build_objective("kl", options, teacher=SameModelTeacher())(student, batch).item()) < 1e-10
    # a real student is not: KL > 0 and its gradient reaches the student's new weights only
    short = linearize.convert(teacher, {"kind": "lolcats", "window": 2, "feature_dim": 8})
    for p in short.parameters():
        p.requires_grad_(False)
    fmap = linearize.mixers(short)[0].feature_map_q.weight
    fmap.requires_grad_(True)
    loss = build_objective("kl", options, teacher=SameModelTeacher())(short, batch)
    assert loss.item() > 1e-6
    loss.backward()
    assert fmap.grad is not None and fmap.grad.abs().sum() > 0


def test_top_k_cache_runs_the_teacher_once_per_block(tiny_model):
    model = tiny_model("llama", dtype=torch.float64)
    calls = []
    teacher = FrozenTeacher(tiny_model("llama", dtype=torch.float64, seed=1))
    teacher.model.register_forward_hook(lambda *a: calls.append(1))
    objective = build_objective("kl", {"kl": {"top_k": 5, "cache": True}}, teacher=teacher)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    first = objective(model, {"input_ids": ids, "labels": ids})
    second = objective(model, {"input_ids": ids, "labels": ids})
    assert len(calls) == 1
    assert second.item() == pytest.approx(first.item(), rel=1e-12)
    objective(model, {"input_ids": ids.flip(0), "labels": ids.flip(0)})  # the same blocks in another order
    assert len(calls) == 1


@pytest.mark.parametrize("options,match", [({"temperature": 0}, "temperature"), ({"top_k": 0}, "top_k"),
                                           ({"cache": True}, "give top_k"), ({"tau": 2}, "no option tau")])
def test_bad_options_are_one_line(options, match):
    with pytest.raises(LinearizeError, match=match):
        build_objective("kl", {"kl": options})


@pytest.mark.parametrize("spec,options,count", [
    ("kl", {}, 1), ("kl", {"top_k": 5}, 2), ("kl", {"top_k": 5, "cache": True}, 2),
    ("kl+lm", {"temperature": 2.0}, 1), ("0.5*kl+next_token", {"top_k": 5, "cache": True}, 2),
])
def test_the_graphed_form_equals_the_eager_objective(tiny_model, spec, options, count):
    """What a CUDA graph replays (``from_outputs`` of the student's forward and the teacher's tensors,
    computed first) gives the eager objective's value and gradients; ``_TrainingLoss`` (the captured
    callable) too. The top-k cache still runs the teacher once per block."""
    from linearize.graphed import _TrainingLoss

    model = tiny_model("llama", dtype=torch.float64)
    calls = []
    teacher = FrozenTeacher(tiny_model("llama", dtype=torch.float64, seed=1))
    teacher.model.register_forward_hook(lambda *a: calls.append(1))
    objective = build_objective(spec, {"kl": options}, teacher=teacher)
    assert objective.capturable
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    params = list(model.parameters())

    eager = objective(model, batch)
    eager_grads = torch.autograd.grad(eager, params)
    tensors = objective.teacher_tensors(model, batch)
    assert len(tensors) == count and not any(t.requires_grad for t in tensors)
    assert len(calls) == (1 if options.get("cache") else 2)
    for value in (objective.from_outputs(model(input_ids=ids, labels=ids, use_cache=False), batch, tensors),
                  _TrainingLoss(model, None, objective)(ids, ids, *tensors)):
        assert value.item() == pytest.approx(eager.item(), rel=1e-12)
        for a, b in zip(torch.autograd.grad(value, params), eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    with pytest.raises(LinearizeError, match=f"reads {count} teacher tensors, got {count + 1}"):
        objective.from_outputs(model(input_ids=ids, labels=ids, use_cache=False), batch, (*tensors, ids))
