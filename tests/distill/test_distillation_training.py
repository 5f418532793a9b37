"""Training on the teacher's signal through the engine: a tiny SUPRA and a tiny XATL student
distilled with KL get closer to their teacher, and a run on another objective also logs its
validation next-token loss (``eval_next_token``)."""

import json

import pytest
import torch

import linearize
from linearize.data import BlockDataset
from linearize.distill import FrozenTeacher, build_objective, next_token_loss
from linearize.recipes.engine import TrainConfig, train
from linearize.convert.xatl_transfer import build_xatl


def _teacher(tiny_model):
    return tiny_model("llama", num_hidden_layers=2)


def _blocks(n, seed):
    # a learnable language: counting upwards from a random start
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(2, 60, (n, 1), generator=g)
    return BlockDataset(starts + torch.arange(24))


def _kl(student, teacher, data) -> float:
    objective = build_objective("kl", teacher=FrozenTeacher(teacher))
    ids = data.blocks
    with torch.no_grad():
        return objective(student, {"input_ids": ids, "labels": ids}).item()


@pytest.mark.parametrize("build", ["supra", "xatl"])
def test_kl_distillation_brings_the_student_to_the_teacher(tiny_model, tmp_path, build):
    teacher = _teacher(tiny_model)
    if build == "supra":
        student = linearize.convert(teacher, {"kind": "supra"})
    else:
        student, _ = build_xatl(teacher, "retnet", transfer="embeddings,ffn,qkv", seed=0)
    for p in student.parameters():
        p.requires_grad_(True)
    train_ds, eval_ds = _blocks(32, 0), _blocks(8, 1)
    before = _kl(student, teacher, eval_ds)
    objective = build_objective("kl", {"kl": {"temperature": 2.0}}, teacher=FrozenTeacher(teacher))
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=3e-3, max_steps=12, batch_size=8, eval_steps=6,
                      logging_steps=6, eval_next_token=True, save_steps=100)
    train(student, train_ds, eval_ds, objective, cfg, stage="distill")
    after = _kl(student, teacher, eval_ds)
    assert after < 0.7 * before, (before, after)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and all("eval_next_token" in r for r in evals)
    # the last evaluation ran on the final weights: its next-token loss is the validation set's
    with torch.no_grad():
        want = next_token_loss(student, {"input_ids": eval_ds.blocks, "labels": eval_ds.blocks}).item()  # one batch of 8
    assert evals[-1]["eval_next_token"] == pytest.approx(want, rel=1e-5)


def test_no_extra_evaluation_unless_asked(tiny_model, tmp_path):
    model = _teacher(tiny_model)
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=2, batch_size=4, eval_steps=2,
                      save_steps=100)
    train(model, _blocks(8, 0), _blocks(4, 1), next_token_loss, cfg, stage="lm")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows) and not any("eval_next_token" in r for r in rows)
