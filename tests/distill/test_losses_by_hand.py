"""The next-token and hidden-state losses against values and gradients worked out by hand (the KL
loss has its own in test_kl.py); the ``lm`` alias of the next-token loss."""

import copy

import pytest
import torch
from torch.nn import functional as F

from linearize.distill import FrozenTeacher, build_objective, parse_objective


def _batch(b=2, t=9, seed=0):
    ids = torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_lm_is_the_next_token_loss():
    assert parse_objective("kl+lm") == [(1.0, "kl"), (1.0, "next_token")]
    assert parse_objective("lm") == [(1.0, "next_token")]
    assert build_objective("0.5*lm").names == ["next_token"]


def test_next_token_value_and_gradient_by_hand(tiny_model):
    """Mean over the B x (T-1) predicted positions of -log softmax(logits_t)[x_{t+1}]; its gradient
    with respect to the logits is (softmax - onehot) / (B (T-1)), zero at the last position."""
    model = tiny_model("llama", dtype=torch.float64)
    batch = _batch()
    seen = {}

    def keep(module, args, out):
        out.retain_grad()
        seen["logits"] = out

    handle = model.lm_head.register_forward_hook(keep)
    loss = build_objective("lm")(model, batch)
    handle.remove()
    logits = seen["logits"].detach()
    ids = batch["input_ids"]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    want = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1).mean()
    # transformers computes the cross-entropy in float32 whatever the model's dtype
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    n = ids.shape[0] * (ids.shape[1] - 1)
    grad = torch.zeros_like(logits)
    grad[:, :-1] = (logp.exp() - F.one_hot(ids[:, 1:], logits.shape[-1])) / n
    torch.testing.assert_close(seen["logits"].grad, grad, atol=1e-8, rtol=0)


def test_hidden_mse_value_and_gradient_by_hand(tiny_model):
    """A student that is the teacher but for its layers' down projections, W' = W + D: given the
    teacher's hidden state entering layer 1 (teacher-forced), its output differs from the teacher's
    by a D^T, a the down projection's input there; so loss = mean((a D^T)^2) and
    dloss/dW' = 2 (a D^T)^T a / numel. Layer 0's own change does not reach the loss (forced)."""
    teacher = tiny_model("llama", dtype=torch.float64)
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(3)
    deltas = {}
    with torch.no_grad():
        for i in (0, 1):
            w = student.model.layers[i].mlp.down_proj.weight
            deltas[i] = torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.1
            w.add_(deltas[i])
    captured = {}
    handle = teacher.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: captured.update(a=args[0]))
    batch = _batch()
    with torch.no_grad():
        teacher(input_ids=batch["input_ids"], use_cache=False)
    handle.remove()
    a = captured["a"]  # [B, T, intermediate]
    err = a @ deltas[1].T  # [B, T, hidden]
    objective = build_objective("hidden_mse", {"hidden_mse": {"layers": (1,)}}, teacher=FrozenTeacher(teacher))
    loss = objective(student, batch)
    assert loss.item() == pytest.approx(err.pow(2).mean().item(), rel=1e-6)  # the loss is taken in float32
    loss.backward()
    want = 2 * torch.einsum("bth,bti->hi", err, a) / err.numel()
    torch.testing.assert_close(student.model.layers[1].mlp.down_proj.weight.grad, want, atol=1e-12, rtol=1e-5)
    assert student.model.layers[0].mlp.down_proj.weight.grad is None  # layer 1 reads the teacher's input


def test_mixer_mse_value_and_gradient_by_hand(tiny_model):
    """A student that is the teacher but for its W_O's, W_O' = W_O + D: given the teacher's input at
    layer 1, its attention output differs from the teacher's by z D^T, z what W_O reads; so
    loss = mean((z D^T)^2) and dloss/dW_O' = 2 (z D^T)^T z / numel. Layer 0's change does not reach
    it (teacher-forced) and nothing after layer 1 runs."""
    teacher = tiny_model("llama", dtype=torch.float64)
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(4)
    deltas = {}
    with torch.no_grad():
        for i in (0, 1):
            w = student.model.layers[i].self_attn.o_proj.weight
            deltas[i] = torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.1
            w.add_(deltas[i])
    captured = {}
    handle = teacher.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, args, out: captured.update(z=args[0]))
    batch = _batch()
    with torch.no_grad():
        teacher(input_ids=batch["input_ids"], use_cache=False)
    handle.remove()
    err = captured["z"] @ deltas[1].T
    objective = build_objective("mixer_mse", {"mixer_mse": {"layers": (1,)}}, teacher=FrozenTeacher(teacher))
    loss = objective(student, batch)
    assert loss.item() == pytest.approx(err.pow(2).mean().item(), rel=1e-6)  # taken in float32
    loss.backward()
    want = 2 * torch.einsum("bth,bti->hi", err, captured["z"]) / err.numel()
    torch.testing.assert_close(student.model.layers[1].self_attn.o_proj.weight.grad, want, atol=1e-12, rtol=1e-5)
    assert student.model.layers[0].self_attn.o_proj.weight.grad is None
    assert student.lm_head.weight.grad is None and student.model.layers[2].mlp.down_proj.weight.grad is None


def test_mixer_mse_is_zero_for_the_teacher_and_trains_a_built_student(tiny_model):
    from linearize.convert.xatl_transfer import build_xatl

    teacher = tiny_model("llama", dtype=torch.float64)
    batch = _batch()
    assert build_objective("mixer_mse", {"mixer_mse": {"layers": (0, 2)}},
                           teacher=FrozenTeacher(teacher))(teacher, batch).item() < 1e-20
    student, _ = build_xatl(teacher, "retnet", transfer="embeddings,ffn,wo,qkv", seed=0)
    loss = build_objective("mixer_mse", teacher=FrozenTeacher(teacher))(student, batch)  # every mixer layer
    assert loss.item() > 0
    loss.backward()
    layers = student.model.layers
    assert all(layers[i].self_attn.wq.weight.grad.abs().sum() > 0 for i in range(3))
    assert student.model.embed_tokens.weight.grad is None  # every layer starts from the teacher's input
