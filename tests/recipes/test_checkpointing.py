"""``--gradient-checkpointing`` (``engine.checkpointed_layers``): each decoder layer recomputed in the backward.
The same losses and gradients as without it (float64), less kept for the backward, and off again afterwards."""

import pytest
import torch

import linearize
from linearize.distill import build_objective, next_token_loss, transfer_probes
from linearize.errors import LinearizeError
from linearize.recipes.engine import checkpointed_layers
from linearize.recipes.lora import add_lora

SPEC = {"kind": "lolcats", "window": 4, "feature_dim": 8}


def _student(tiny_model, spec=SPEC):
    torch.manual_seed(0)
    return linearize.convert(tiny_model("llama", dtype=torch.float64), spec).train()


def _loss_grads_saved(model, loss_fn, ids, on: bool):
    """The loss, the trainable parameters' gradients and the bytes the autograd graph kept outside the
    checkpointed layers (a checkpointed layer keeps its own through checkpoint's inner hooks)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    model.zero_grad(set_to_none=True)
    with checkpointed_layers(model, on, "test"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model, {"input_ids": ids, "labels": ids})
        loss.backward()
    grads = {n.replace(".mixer.", "."): p.grad.clone() for n, p in model.named_parameters()  # probes hold the mixers
             if p.requires_grad and p.grad is not None}
    return loss.detach(), grads, sum(saved)


def _agree(a, b):
    assert torch.allclose(a[0], b[0], rtol=1e-12, atol=1e-14)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.allclose(a[1][name], b[1][name], rtol=1e-10, atol=1e-13), name
    assert b[2] < a[2] / 2  # checkpointed: far less kept for the backward


def test_attention_transfer_is_the_same_with_its_layers_recomputed(tiny_model):
    student = _student(tiny_model)
    for name, p in student.named_parameters():
        p.requires_grad_("feature_map" in name or "window" in name)
    loss_fn = build_objective("attention_mse", context=dict(layers=(0, 1, 2), mse_factor=1000.0, xent_factor=0.0))
    ids = torch.randint(0, 97, (2, 24))
    plain = _loss_grads_saved(student, loss_fn, ids, False)
    # as run_stage1 does: the probes stay in place until the backward has recomputed every layer
    with transfer_probes(student, (0, 1, 2), tie=False):
        _agree(plain, _loss_grads_saved(student, loss_fn, ids, True))
    with pytest.raises(Exception, match="different metadata"):  # without: the backward recomputes the plain mixers
        _loss_grads_saved(student, loss_fn, ids, True)


def test_nothing_a_recomputed_layer_makes_outlives_the_backward(tiny_model):
    """A layer's recompute in the backward builds a graph of its own; none of its tensors may be kept after the
    backward (a probe that kept its recomputed loss terms held every layer's saved tensors between steps: 22 GB
    at 8B)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    student = _student(tiny_model)
    for name, p in student.named_parameters():
        p.requires_grad_("feature_map" in name or "window" in name)
    loss_fn = build_objective("attention_mse", context=dict(layers=(0, 1, 2), mse_factor=1000.0, xent_factor=1.0))
    ids = torch.randint(0, 97, (2, 24))
    phase, made = ["forward"], {"forward": [], "backward": []}

    def keep(module, args, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor):
                made[phase[0]].append(StorageWeakRef(t.untyped_storage()))

    with transfer_probes(student, (0, 1, 2), with_xent=True, tie=False) as probes:
        handles = [m.register_forward_hook(keep) for m in student.modules()]
        with checkpointed_layers(student, True, "test"):
            loss = loss_fn(student, {"input_ids": ids, "labels": ids})
            read = {i: (p.mse, p.xent) for i, p in probes.items()}
            phase[0] = "backward"
            loss.backward()
        assert all(p.mse is read[i][0] and p.xent is read[i][1] for i, p in probes.items())  # the forward's terms
        del loss, read
        gc.collect()
        for h in handles:
            h.remove()
        assert made["backward"], "no layer was recomputed"
        alive = [r for r in made["backward"] if not r.expired()]
        assert not alive, f"the memory of {len(alive)} of {len(made['backward'])} recomputed tensors outlives the backward"


def test_a_probed_students_state_dict_is_the_plain_students(tiny_model):
    """A checkpointed stage 1 keeps its probes in place for the whole run, so its Trainer checkpoints are the
    probed student's state dict: the same names and values as the plain student's, each loading (strictly)
    into the other (before, the probes' ``mixer.`` level made a resume without the flag load nothing of the
    maps, with a warning)."""
    student = _student(tiny_model)
    plain = {k: v.clone() for k, v in student.state_dict().items()}
    with transfer_probes(student, (0, 1), tie=False):
        probed = student.state_dict()
        assert set(probed) == set(plain)
        assert all(torch.equal(probed[k], plain[k]) for k in plain)
        changed = {k: v + 1 if v.is_floating_point() else v for k, v in plain.items()}
        student.load_state_dict(changed)  # strict: the plain names load into the probed student
    assert all(torch.equal(student.state_dict()[k], changed[k]) for k in plain)
    student.load_state_dict(plain)
    with transfer_probes(student, (0, 1), tie=False):
        saved = {k: v.clone() for k, v in student.state_dict().items()}
    student.load_state_dict(saved)  # and the probed student's into the plain one
    assert all(torch.equal(student.state_dict()[k], plain[k]) for k in plain)


def test_probes_in_place_serve_the_same_layers_only(tiny_model):
    student = _student(tiny_model)
    with transfer_probes(student, (0, 1), tie=False) as outer:
        with transfer_probes(student, (0, 1), tie=False) as inner:
            assert inner == outer
        with pytest.raises(LinearizeError, match=r"in place on layers \[0, 1\]; asked for \[0, 1, 2\]"):
            with transfer_probes(student, (0, 1, 2), tie=False):
                pass


def test_lora_next_token_training_is_the_same_with_its_layers_recomputed(tiny_model):
    student = add_lora(_student(tiny_model), 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    for name, p in student.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: no gradient reaches A
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 97, (2, 24))
    _agree(_loss_grads_saved(student, next_token_loss, ids, False), _loss_grads_saved(student, next_token_loss, ids, True))


def test_every_weight_training_is_the_same_with_its_layers_recomputed(tiny_model):
    student = _student(tiny_model, {"kind": "supra"})
    ids = torch.randint(0, 97, (2, 24))
    _agree(_loss_grads_saved(student, next_token_loss, ids, False), _loss_grads_saved(student, next_token_loss, ids, True))


def test_checkpointing_is_off_again_afterwards_and_refused_where_a_model_has_none(tiny_model):
    student = _student(tiny_model)
    layer = student.model.layers[0]
    with checkpointed_layers(student, True, "stage1"):
        assert layer.gradient_checkpointing
    assert not layer.gradient_checkpointing
    with pytest.raises(LinearizeError, match="stage2: --gradient-checkpointing: Linear has no checkpointed layers"):
        with checkpointed_layers(torch.nn.Linear(2, 2), True, "stage2"):
            pass


def test_a_checkpointed_run_trains_eagerly_and_says_why():
    from linearize.graphed import use_graphs

    assert use_graphs("auto", cuda=True, checkpointing=True) == (
        False, "--gradient-checkpointing recomputes each layer in the backward (a step is checkpointed or graphed, "
               "not both)")
    with pytest.raises(LinearizeError, match="--cuda-graph on: --gradient-checkpointing"):
        use_graphs("on", cuda=True, checkpointing=True)


def test_lolcats_trains_the_same_with_its_layers_recomputed(workspace, monkeypatch, tmp_path):
    """Both LoLCATs stages with and without --gradient-checkpointing from one seed: the same losses (the
    recomputed layers give the same values), and the layers are plain again in the saved student."""
    import json

    from linearize.recipes import engine, lolcats

    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "home"))
    entered, real = [], engine.checkpointed_layers

    def recording(model, on, stage):
        entered.append((stage, on))
        return real(model, on, stage)

    monkeypatch.setattr(engine, "checkpointed_layers", recording)
    results = []
    for on in (False, True):
        cfg = lolcats.LolcatsConfig(
            teacher=str(workspace / "teacher"), data=str(workspace / "corpus.jsonl"), out=str(tmp_path / f"run{on}"),
            block_len=32, eval_blocks=4, batch_size=4, eval_steps=10, patience=None, dtype="float32",
            spec={"kind": "lolcats", "feature_map": "hedgehog", "feature_dim": 8, "window": 4},
            stage1_steps=6, stage2_steps=6, sample_prompt="w5 w6", gradient_checkpointing=on)
        results.append(lolcats.run(cfg))
        lines = [json.loads(line) for line in (tmp_path / f"run{on}" / "metrics.jsonl").open()]
        results[-1]["losses"] = [x[k] for x in lines for k in ("eval_loss", "train_loss") if k in x]
    plain, checkpointed = results
    assert len(plain["losses"]) == 4 and checkpointed["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert checkpointed["perplexity"] == pytest.approx(plain["perplexity"], rel=1e-4)
    assert entered == [("stage1[0]", False), ("stage2", False), ("stage1[0]", True), ("stage2", True)]
    model, _ = linearize.load(tmp_path / "runTrue" / "final", device="cpu")
    assert not model.model.layers[0].gradient_checkpointing
