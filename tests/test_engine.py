"""The training engine's guards: a NaN loss, empty data and nothing to train end with one line."""

import pytest
import torch

from linearize import LinearizeError
from linearize.data import BlockDataset
from linearize.recipes.engine import TrainConfig, next_token_loss, train


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


def test_empty_data_and_nothing_trainable(tiny_model, tmp_path):
    model = tiny_model("llama")
    cfg = TrainConfig(output_dir=str(tmp_path), learning_rate=1e-3, max_steps=1)
    with pytest.raises(LinearizeError, match="training data is empty"):
        train(model, BlockDataset(torch.zeros(0, 16, dtype=torch.long)), None, next_token_loss, cfg, stage="t")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(LinearizeError, match="nothing to train"):
        train(model, _data(), None, next_token_loss, cfg, stage="t")
