"""CUDA-graph training (``linearize.graphed``): what can be checked without a GPU.

Capture fails on any host synchronisation inside the captured forward and backward. Here the
capture is simulated on the CPU (transformers and the mixers are told a stream is capturing) and
every operation that would make the host wait for the device is refused; the replay itself is
checked against the eager step on CUDA (tests/gpu/test_gpu.py).
"""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linearize.bench.train import build

SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
           torch.ops.aten.item.default, torch.ops.aten.nonzero.default}


class RefuseHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            raise AssertionError(f"{func} would make the host wait for the device inside a CUDA graph")
        return func(*args, **(kwargs or {}))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.parametrize("name", ["teacher", "supra", "t2r", "retnet", "striped_mamba"])
def test_a_training_step_never_waits_on_the_device_while_capturing(tiny_model, monkeypatch, name):
    base = importlib.import_module("linearize.mixers.base")
    import transformers.utils.import_utils as hf_import_utils

    model = build(tiny_model("llama"), name)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    eager = _loss(model, ids)
    grads = torch.autograd.grad(eager, [p for p in model.parameters() if p.requires_grad])

    monkeypatch.setattr(base, "capturing", lambda: True)
    monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)
    with RefuseHostSync():
        captured = _loss(model, ids)
        captured_grads = torch.autograd.grad(captured, [p for p in model.parameters() if p.requires_grad])
    # the masks a capture keeps as tensors change nothing in a batch without padding
    assert torch.allclose(captured, eager, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(captured_grads, grads))


@pytest.mark.parametrize("top_k", [None, 5])
def test_a_kl_step_never_waits_on_the_device_while_capturing(tiny_model, monkeypatch, top_k):
    """The captured part of a distillation step: the student's forward, KL to the teacher's tensors
    (computed before, outside the capture) and the backward."""
    base = importlib.import_module("linearize.mixers.base")
    import transformers.utils.import_utils as hf_import_utils

    from linearize.distill import FrozenTeacher, build_objective
    from linearize.graphed import _NextTokenLoss

    model = build(tiny_model("llama"), "supra")
    model.train()
    objective = build_objective("kl+next_token", {"kl": {"top_k": top_k, "cache": top_k is not None}},
                                teacher=FrozenTeacher(tiny_model("llama", seed=1)))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    teacher = objective.teacher_tensors(model, {"input_ids": ids, "labels": ids})
    monkeypatch.setattr(base, "capturing", lambda: True)
    monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)
    with RefuseHostSync():
        loss = _NextTokenLoss(model, None, objective)(ids, ids, *teacher)
        loss.backward()
    assert loss.item() > 0


def test_the_sync_guard_catches_a_host_sync():
    x = torch.ones(3)
    with pytest.raises(AssertionError, match="host wait"), RefuseHostSync():
        bool(x.sum() > 0)


def test_key_padding_mask_keeps_a_tensor_while_capturing(monkeypatch):
    base = importlib.import_module("linearize.mixers.base")
    mask = torch.ones(2, 5, dtype=torch.long)
    assert base.key_padding_mask(mask, 5) is None  # all real: no mask to apply
    monkeypatch.setattr(base, "capturing", lambda: True)
    kept = base.key_padding_mask(mask, 5)
    assert kept.dtype == torch.bool and kept.all()
    with base.unpadded_batches():  # a graphed training step: no attention mask, so nothing to keep
        assert base.key_padding_mask(mask, 5) is None
    assert base.key_padding_mask(mask, 5) is not None  # and only inside


def test_a_graphed_step_tells_the_mixers_its_batches_are_unpadded(tiny_model, monkeypatch):
    """The graphed loss runs the model inside ``unpadded_batches``: no mixer keeps a mask tensor."""
    base = importlib.import_module("linearize.mixers.base")
    import transformers.utils.import_utils as hf_import_utils

    from linearize.graphed import _NextTokenLoss

    model = build(tiny_model("llama"), "striped_mamba")
    fresh = importlib.import_module("linearize.mixers.fresh")
    masks = []
    original = base.key_padding_mask
    monkeypatch.setattr(base, "capturing", lambda: True)
    monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)  # it builds a mask then
    monkeypatch.setattr(fresh, "key_padding_mask", lambda *a: masks.append(original(*a)) or masks[-1])
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _NextTokenLoss(model, None)(ids, ids)
    assert masks and all(m is None for m in masks)
