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
    from linearize.graphed import _TrainingLoss

    model = build(tiny_model("llama"), "supra")
    model.train()
    objective = build_objective("kl+next_token", {"kl": {"top_k": top_k, "cache": top_k is not None}},
                                teacher=FrozenTeacher(tiny_model("llama", seed=1)))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    teacher = objective.teacher_tensors(model, {"input_ids": ids, "labels": ids})
    monkeypatch.setattr(base, "capturing", lambda: True)
    monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)
    with RefuseHostSync():
        loss = _TrainingLoss(model, None, objective)(ids, ids, *teacher)
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

        class Unread:  # nor is the causal mask read (a reduction over it would be captured, replayed each step)
            def __getattr__(self, name):
                raise AssertionError(f"the mask was read: {name}")

        assert base.key_padding_mask(Unread(), 5) is None
    assert base.key_padding_mask(mask, 5) is not None  # and only inside


def test_a_graphed_step_tells_the_mixers_its_batches_are_unpadded(tiny_model, monkeypatch):
    """The graphed loss runs the model inside ``unpadded_batches``: no mixer keeps a mask tensor."""
    base = importlib.import_module("linearize.mixers.base")
    import transformers.utils.import_utils as hf_import_utils

    from linearize.graphed import _TrainingLoss

    model = build(tiny_model("llama"), "striped_mamba")
    fresh = importlib.import_module("linearize.mixers.fresh")
    masks = []
    original = base.key_padding_mask
    monkeypatch.setattr(base, "capturing", lambda: True)
    monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)  # it builds a mask then
    monkeypatch.setattr(fresh, "key_padding_mask", lambda *a: masks.append(original(*a)) or masks[-1])
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _TrainingLoss(model, None)(ids, ids)
    assert masks and all(m is None for m in masks)


def test_auto_graphs_a_run_only_where_every_condition_holds():
    """``use_graphs``, the cuda_graph setting's decision, on given facts (no device needed): auto and on
    graph a run on CUDA with a capturable loss; auto otherwise trains eagerly and names the first
    condition that fails, on refuses it in one line, off is eager without a reason."""
    from linearize import LinearizeError
    from linearize.graphed import use_graphs

    assert use_graphs("auto", cuda=True) == (True, None)
    assert use_graphs("on", cuda=True) == (True, None)
    assert use_graphs("off", cuda=True) == (False, None)
    failing = {
        "cuda": ({"cuda": False}, "there is no CUDA device"),
        "loss": ({"uncapturable": "hidden_mse in the loss 'kl+hidden_mse'"},
                 "hidden_mse in the loss 'kl+hidden_mse' cannot be captured"),
        "fsdp": ({"fsdp": True}, "FSDP's sharded parameters cannot be captured"),
        "compile": ({"compile": True}, "--compile is on"),
        "recipe": ({"other": "LIT needs a new capture"}, "LIT needs a new capture"),
    }
    for name, (facts, why) in failing.items():
        graphed, reason = use_graphs("auto", **{"cuda": True, **facts})
        assert not graphed and reason.startswith(why), name
        with pytest.raises(LinearizeError, match="^--cuda-graph on: " + why.replace("+", r"\+")) as err:
            use_graphs("on", **{"cuda": True, **facts})
        assert "\n" not in str(err.value) and "auto or off trains eagerly" in str(err.value)
        assert use_graphs("off", **{"cuda": True, **facts}) == (False, None)
    # the first condition that fails is the one named
    assert use_graphs("auto", cuda=False, fsdp=True, compile=True)[1] == "there is no CUDA device"
    assert use_graphs("auto", cuda=True, fsdp=True, compile=True)[1].startswith("FSDP")


def test_the_setting_takes_true_and_false_as_on_and_off():
    """A recipe file's (or a run config saved before auto's) true/false is on/off; anything else is one line."""
    from linearize import LinearizeError
    from linearize.graphed import graph_mode, use_graphs

    assert [graph_mode(v) for v in (True, False, "auto", "on", "off")] == ["on", "off", "auto", "on", "off"]
    assert use_graphs(True, cuda=True) == (True, None) and use_graphs(False, cuda=True) == (False, None)
    for bad in ("yes", "", None, 1):
        with pytest.raises(LinearizeError, match="cuda_graph must be auto, on or off"):
            graph_mode(bad)


def test_attention_transfer_is_the_loss_captured_whole():
    """``attention_mse`` runs the student's forward itself (its teacher is the student's own softmax
    view), so a graph captures its whole call; an objective is captured whole when every term is."""
    from linearize.distill import LOSSES, build_objective

    assert [name for name, cls in LOSSES.items() if cls.captured_whole] == ["attention_mse"]
    assert not any(cls.captured_whole and cls.capturable for cls in LOSSES.values())
    assert build_objective("attention_mse").captured_whole
    assert build_objective("2*attention_mse").captured_whole
    for spec in ("next_token", "kl+next_token", "attention_mse+next_token"):
        assert not build_objective(spec).captured_whole, spec


@pytest.mark.parametrize("kind,xent", [("lolcats", 0.0), ("lolcats", 1.0), ("linear", 0.0)])
def test_an_attention_transfer_step_never_waits_on_the_device_while_capturing(tiny_model, monkeypatch, kind, xent):
    """LoLCATs stage 1 as a graph captures it (``_TrainingLoss`` on the attention_mse objective: probes
    swapped in, the forward cut after the last trained layer): no host synchronisation, and the eager
    objective's value and gradients."""
    base = importlib.import_module("linearize.mixers.base")
    import transformers.utils.import_utils as hf_import_utils

    import linearize
    from linearize.distill import build_objective
    from linearize.graphed import _TrainingLoss
    from linearize.recipes.lolcats import _freeze_all_but

    model = linearize.convert(tiny_model("llama"), {"kind": kind, "feature_dim": 8, "window": 4})
    model.train()
    _freeze_all_but(model, {0, 1, 2})
    trained = [p for p in model.parameters() if p.requires_grad]
    objective = build_objective("attention_mse", context={"layers": (0, 1, 2), "mse_factor": 1000.0,
                                                          "xent_factor": xent})
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    eager = objective(model, {"input_ids": ids, "labels": ids})
    grads = torch.autograd.grad(eager, trained)
    monkeypatch.setattr(base, "capturing", lambda: True)
    monkeypatch.setattr(hf_import_utils, "is_cuda_stream_capturing", lambda: True)
    with RefuseHostSync():
        captured = _TrainingLoss(model, None, objective)(ids, ids)
        captured_grads = torch.autograd.grad(captured, trained)
    assert captured.item() > 0
    assert torch.allclose(captured, eager, rtol=1e-5, atol=1e-7)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(captured_grads, grads))
    assert all(type(m).__name__ != "AttentionTransferProbe" for m in model.modules())  # the mixers are back


@pytest.mark.parametrize("peft", [False, True])
def test_a_loss_captured_whole_calls_the_forward_accelerate_wrapped(tiny_model, peft):
    """Under accelerate's mixed precision ``model.forward`` is an autocast wrapper with a weight cache
    (which a capture cannot keep) and ``model._original_forward`` the forward it wrapped: a loss that
    calls ``model(...)`` itself gets the latter inside the captured callable, and the wrapper is back
    afterwards (a LoRA model, stage 2's, too)."""
    import linearize
    from linearize.distill import build_objective
    from linearize.graphed import _TrainingLoss

    model = linearize.convert(tiny_model("llama"), {"kind": "lolcats", "feature_dim": 8, "window": 4})
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    calls = []

    def wrapper(*args, **kwargs):  # what accelerate's autocast wrapper stands for here
        calls.append("wrapper")
        raise AssertionError("the autocast wrapper was called inside the captured loss")

    model._original_forward = model.forward
    model.forward = wrapper
    objective = build_objective("attention_mse", context={"mse_factor": 1000.0})
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = _TrainingLoss(model, None, objective)(ids, ids)
    assert loss.item() > 0 and not calls
    assert model.forward is wrapper  # restored
    with pytest.raises(AssertionError, match="autocast wrapper"):
        model(input_ids=ids)
    del model.forward  # a model accelerate never wrapped keeps its forward as it is
    del model._original_forward
    assert _TrainingLoss(model, None, objective)(ids, ids).item() == pytest.approx(loss.item())
    assert "forward" not in vars(model)
