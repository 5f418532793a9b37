"""The fast decoder's norm and activation kernels (``decode.fused`` with ``kernels``): which modules they stand
in for (exactly the kernels' function, checked on the CPU), swapped in for a call and restored after it,
exceptions included; on by default only on CUDA and without ``compile``; and, through Triton's interpreter, the
fast decoder with them forced on decodes generate()'s tokens."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import plain_generate, run_triton_interpreter_script, tiny_student

from linearize.convert import mixers
from linearize.decode import FastDecoder, fast_generate, fused_projections
from linearize.decode import fused
from linearize.models.fusion import (FusedGatedMLP, FusedRMSNorm, ResidualFusion, activation_kind, residual_fusable,
                                     rms_norm_kind)

LOLCATS = {"kind": "lolcats", "window": 4, "feature_dim": 8}


def _ids(b=2, t=9, seed=0):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def _norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


# --------------------------------------------------------------------------- which modules


@pytest.mark.parametrize("family,norm,act", [
    ("llama", "weight", "silu"), ("mistral", "weight", "silu"), ("qwen2", "weight", "silu"),
    ("qwen3", "weight", "silu"), ("smollm3", "weight", "silu"), ("gemma", "offset", "gelu_tanh"),
    ("gemma2", "offset", "gelu_tanh"), ("gemma3_text", "offset", "gelu_tanh"), ("gpt_neox", None, None)])
def test_the_families_norms_and_activations_are_recognised(tiny_model, family, norm, act):
    model = tiny_model(family)
    norms = [m for m in model.modules() if "Norm" in type(m).__name__]
    assert norms and {rms_norm_kind(m) for m in norms} == {norm}
    mlp = model.base_model.layers[0].mlp
    assert activation_kind(getattr(mlp, "act_fn", None) or mlp.act) == act


def test_modules_computing_anything_else_keep_their_own_path(tiny_model):
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = tiny_model("llama").model.norm
    assert rms_norm_kind(norm) == "weight"
    hooked = LlamaRMSNorm(48)
    hooked.register_forward_hook(lambda *a: None)
    patched = LlamaRMSNorm(48)
    patched.forward = lambda x: x
    assert rms_norm_kind(hooked) is None and rms_norm_kind(patched) is None

    class RoundsLater(LlamaRMSNorm):  # Gemma's rounding with Llama's weight: one bit off in 16 bits
        __module__ = "transformers.models.made_up"

        def forward(self, x):
            h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * h).to(x.dtype)

    assert rms_norm_kind(RoundsLater(48)) is None

    class Local(LlamaRMSNorm):  # not a transformers family's class
        pass

    assert rms_norm_kind(Local(48)) is None
    assert rms_norm_kind(nn.LayerNorm(48)) is None
    assert activation_kind(ACT2FN["gelu_python_tanh"]) is None  # the tanh form in Python rounds differently
    assert activation_kind(ACT2FN["gelu"]) is None and activation_kind(nn.ReLU()) is None
    assert activation_kind(nn.SiLU()) == "silu"
    silu = ACT2FN["silu"]
    silu.register_forward_pre_hook(lambda *a: None)
    assert activation_kind(silu) is None


# --------------------------------------------------------------------------- swapped in and out


def _state(model):
    return ([(name, type(m), id(m)) for name, m in model.named_modules()],
            {name: p for name, p in model.named_parameters()})


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_every_norm_and_mlp_is_swapped_for_the_call_and_restored(tiny_model, family):
    model = tiny_student(tiny_model, family, LOLCATS)
    before, norms = _state(model), _norms(model)
    if family == "qwen3":  # the per-head q/k norms inside the converted layers are among them
        assert sum(m is mx.q_norm or m is mx.k_norm for m in norms for mx in mixers(model).values()) == 6
    with fused_projections(model, kernels=True) as n:
        stand_ins = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
        assert [m.norm for m in stand_ins] == norms
        inside = dict(model.named_modules())  # each norm reached only through its stand-in
        assert all(isinstance(inside[name.rpartition(".")[0]], FusedRMSNorm)
                   for name, m in inside.items() if any(m is x for x in norms))
        assert {m.offset for m in stand_ins} == {family == "gemma"}
        mlps = [layer.mlp for layer in model.model.layers]
        assert all(isinstance(m, FusedGatedMLP) and m.act == ("gelu_tanh" if family == "gemma" else "silu")
                   for m in mlps)
        layers = model.model.layers
        paired = [isinstance(vars(layer).get("forward"), ResidualFusion) for layer in layers]
        assert paired == [family != "gemma"] * len(layers)  # Gemma's layers norm after the attention and MLP too
        assert n == len(norms) + len(mixers(model)) + len(mlps) + sum(paired)
    assert _state(model)[0] == before[0] and _state(model)[1] == before[1]
    assert not any("forward" in vars(layer) for layer in model.model.layers)
    with fused_projections(model, kernels=False):  # the projections alone, as before
        assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
        assert all(m.act is None for m in model.modules() if isinstance(m, FusedGatedMLP))
    with fused_projections(model, enabled=False, kernels=True) as n:  # the norms alone (with the adds before them)
        assert n == len(norms) + (0 if family == "gemma" else len(model.model.layers))
        assert not any(isinstance(m, FusedGatedMLP) for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"), fused_projections(model, kernels=True):
        raise RuntimeError("boom")
    assert _state(model)[0] == before[0]


def test_a_failing_call_restores_every_module(tiny_model):
    model = tiny_student(tiny_model, "llama", LOLCATS)
    before = _state(model)

    class Fails:
        def put(self, x):
            assert any(isinstance(m, FusedRMSNorm) for m in model.modules())
            if len(x.shape) == 1:
                raise RuntimeError("boom")

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="boom"):
        fast_generate(model, _ids(), max_new_tokens=5, streamer=Fails(), fuse_kernels=True)
    assert _state(model)[0] == before[0]


@pytest.mark.parametrize("family,spec", [("llama", LOLCATS), ("gemma", LOLCATS), ("qwen3", {"kind": "supra"}),
                                         ("llama", {**LOLCATS, "keep_softmax": [1]})])
def test_stand_ins_fall_back_for_float64_and_decode_generates_tokens(tiny_model, family, spec):
    """float64 (CPU tests) is not a kernel dtype: the stand-ins run the modules, and the tokens are generate()'s."""
    model = tiny_student(tiny_model, family, spec)
    prompt = _ids()
    ref = plain_generate(model, prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(model, prompt, max_new_tokens=10, pad_token_id=0, fuse_kernels=True), ref)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "smollm3"])
def test_a_pre_norm_layer_with_its_adds_fused_computes_its_class_forward(tiny_model, family):
    """``ResidualFusion`` (the adds with the norms after them) against
    each family's own decoder-layer forward, the hidden states after every layer and the logits: the same; the
    next layer's input norm and the final norm take the norms computed ahead, and only for that very tensor.
    (float64: the stand-ins' PyTorch paths; the kernels themselves: ``triton_interpret_norm_act.py``.)"""
    model = tiny_student(tiny_model, family, {**LOLCATS, "keep_softmax": [1]}).double()
    ids = _ids()
    with torch.no_grad():
        want = model(ids, output_hidden_states=True)
        with fused_projections(model, enabled=False, kernels=True):
            assert all(isinstance(vars(layer).get("forward"), ResidualFusion) for layer in model.model.layers)
            got = model(ids, output_hidden_states=True)
            final = model.model.norm
            assert isinstance(final, FusedRMSNorm) and "_ahead" not in vars(final)  # taken by the final norm
            x = torch.randn(2, 3, final.norm.weight.shape[0], dtype=torch.float64)
            summed = final.add_norm_ahead(x, x)
            assert torch.equal(final(summed.clone()), final.norm(summed))  # another tensor: normalised anew
            assert torch.equal(final(summed), final.norm(summed))  # and the stale one was dropped
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert torch.equal(a, b)
    assert torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_stand_ins_run_their_modules_where_a_gradient_must_flow(tiny_model, family):
    """The kernels are forward-only: in fp32 (a kernel dtype) with gradients wanted, every stand-in (norms, the
    gated activation, the adds with the norms) runs its module's own path, so the loss and every gradient are
    those of the model as it is (on the CPU a kernel call would fail: none is made)."""
    model = tiny_student(tiny_model, family, LOLCATS).float()
    ids = _ids()

    def backward():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def grads():  # by the model's own names (the stand-ins are out again)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss = backward()
    want = grads()
    with fused_projections(model, enabled=True, kernels=True) as replaced:
        assert replaced > 0
        got_loss = backward()
    got = grads()
    assert torch.equal(got_loss, want_loss) and set(got) == set(want) and len(want) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_layers_that_are_not_the_plain_pre_norm_pair_keep_their_forward(tiny_model):
    for family in ("gemma", "gemma2", "gemma3_text"):  # norms after the attention and the MLP as well
        model = tiny_student(tiny_model, family, LOLCATS)
        with fused_projections(model, kernels=True):
            assert not any(residual_fusable(layer) or "forward" in vars(layer) for layer in model.model.layers)
    model = tiny_student(tiny_model, "llama", LOLCATS)
    own = model.model.layers[0].forward
    model.model.layers[0].forward = lambda *a, **kw: own(*a, **kw)  # a forward of its own: left to it
    model.model.layers[1].register_forward_hook(lambda *a: None)  # a hook sees the same inputs and output
    with fused_projections(model, kernels=True):
        assert not isinstance(vars(model.model.layers[0])["forward"], ResidualFusion)
        assert isinstance(vars(model.model.layers[1]).get("forward"), ResidualFusion)
    assert "forward" in vars(model.model.layers[0]) and "forward" not in vars(model.model.layers[1])
    with fused_projections(model, kernels=False):  # no norm kernels: nothing to pair the adds with
        assert not any(isinstance(vars(layer).get("forward"), ResidualFusion) for layer in model.model.layers)


# --------------------------------------------------------------------------- when


def test_on_by_default_only_where_the_kernels_run_and_nothing_compiles(tiny_model, monkeypatch):
    model = tiny_student(tiny_model, "llama", LOLCATS)
    assert not fused.kernels_default(model)  # the CPU
    assert FastDecoder(model).fuse_kernels is False
    from linearize.decode import loop

    monkeypatch.setattr(loop, "kernels_default", lambda model: True)  # as on CUDA with Triton
    assert FastDecoder(model).fuse_kernels is True
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # (nothing runs here: no need to load dynamo)
    assert FastDecoder(model, compile=True).fuse_kernels is False  # torch.compile fuses them itself
    assert FastDecoder(model, fuse_kernels=False).fuse_kernels is False
    from linearize.ops import availability

    monkeypatch.setattr(availability, "triton_available", lambda: True)
    on_cuda = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]))
    assert fused.kernels_default(on_cuda)
    monkeypatch.setattr(fused, "KERNELS", False)  # the switch for before-and-after benchmarks
    assert not fused.kernels_default(on_cuda)


def test_the_fast_decoder_with_the_kernels_decodes_generates_tokens():
    """Through Triton's interpreter: Llama (SiLU), Qwen3 (per-head q/k norms), Gemma ((1 + weight) norms, GELU)
    and a kept softmax layer, fp32 with left padding: the kernels on every forward, generate()'s tokens, every
    module restored, and a decode step with 5 fewer launches a norm and 1 fewer an MLP."""
    run_triton_interpreter_script("triton_interpret_norm_act.py", "decoder")
