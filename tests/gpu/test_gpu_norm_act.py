"""The fast decoder's RMSNorm and gated-activation Triton kernels on CUDA (skipped elsewhere): against their
PyTorch twins (``ops.norm_act``, bit for bit the families' modules) at the shapes decoding meets, and the fast
decoder with them (the default on CUDA) against itself without them, in a CUDA graph and eagerly, with fewer
launches per step."""

import pytest
import torch

import linearize
from helpers import plain_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16)]


def _agree(got, want, what, exact_share=0.97, unit=None):
    """fp32: to rounding; 16-bit: the same dtype, bit for bit on ``exact_share`` of the entries, two units in the
    last places elsewhere (two roundings; or 1e-5 of the largest entry: GELU's far tail, through exp, not 1 + tanh)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.dtype, want.dtype)
    g, w = got.double(), want.double()
    unit = unit or want.dtype  # the coarsest rounding on the way (fp32 output of bf16 input: bf16)
    if unit == torch.float32:
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err < 1e-5, (what, err)
        return
    share = (got == want).double().mean().item()
    ulp = w.abs() * (2.0 ** -6 if unit == torch.bfloat16 else 2.0 ** -9) + 1e-5 * w.abs().max()
    assert share >= exact_share and bool(((g - w).abs() <= ulp).all()), (what, share)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("d", [576, 64, 2048, 5000])  # SmolLM2's width, a head (Qwen3's q/k norm), wider, odd
@pytest.mark.parametrize("rows", [1, 7, 256, 4096])  # decode at batch 1 and 256, a prefill
def test_rms_norm_kernel_equals_its_twin_on_cuda(rows, d, offset):
    from linearize.ops.norm_act import rms_norm
    from linearize.ops.rms_norm_triton import rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    for x_dtype, w_dtype in DTYPES:
        x = (torch.randn(rows, 1, d, device="cuda", generator=g) * 3 + 0.5).to(x_dtype)
        w = (torch.randn(d, device="cuda", generator=g) * 0.5 + (0.0 if offset else 1.0)).to(w_dtype)
        _agree(rms_norm_triton(x, w, 1e-6, offset), rms_norm(x, w, 1e-6, offset), (x_dtype, w_dtype), unit=x_dtype)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("d", [576, 2048, 5000])
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_add_rms_norm_kernel_equals_its_twin_on_cuda(rows, d, offset):
    """A pre-norm layer's residual add with the norm after it: the sum bit for bit as ``residual + x``."""
    from linearize.ops.norm_act import add_rms_norm
    from linearize.ops.rms_norm_triton import add_rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    for x_dtype, w_dtype in DTYPES:
        x, r = ((torch.randn(rows, 1, d, device="cuda", generator=g) * 3).to(x_dtype) for _ in range(2))
        w = (torch.randn(d, device="cuda", generator=g) * 0.5 + (0.0 if offset else 1.0)).to(w_dtype)
        normed, summed = add_rms_norm_triton(x, r, w, 1e-6, offset)
        want_normed, want_summed = add_rms_norm(x, r, w, 1e-6, offset)
        assert torch.equal(summed, want_summed), (x_dtype, w_dtype)
        _agree(normed, want_normed, (x_dtype, w_dtype), unit=x_dtype)


def test_rms_norm_kernel_on_a_strided_view_on_cuda():
    """Qwen3's per-head q norm on the fused q/k/v product's rows: no copy, the twin's values."""
    from linearize.ops.norm_act import rms_norm
    from linearize.ops.rms_norm_triton import rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(64, 1, (16 + 2 * 8) * 128, device="cuda", generator=g).to(dtype)
        q = qkv[..., : 16 * 128].view(64, 1, 16, 128)
        w = torch.randn(128, device="cuda", generator=g).to(dtype)
        _agree(rms_norm_triton(q, w, 1e-6), rms_norm(q, w, 1e-6), dtype)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("i", [1536, 72, 8192])  # SmolLM2's MLP, small and odd, wide
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_gated_act_kernel_equals_its_twin_on_cuda(rows, i, act):
    from linearize.ops.gated_act_triton import gated_act_triton
    from linearize.ops.norm_act import gated_act

    g = torch.Generator(device="cuda").manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = (torch.randn(rows, 1, 2 * i, device="cuda", generator=g) * 1.5).to(dtype)
        _agree(gated_act_triton(h, act), gated_act(h, act), (dtype,))


def _students(tiny_model, dtype):
    spec = {"kind": "lolcats", "window": 4, "feature_dim": 8}
    for family, s in (("llama", spec), ("qwen3", spec), ("gemma", spec), ("llama", {**spec, "keep_softmax": [1]}),
                      ("llama", {"kind": "supra"})):
        model = linearize.convert(tiny_model(family, dtype=dtype).cuda(), s)
        model.generation_config.eos_token_id = None
        yield f"{family} {s}", model


def test_fast_decoder_with_the_kernels_on_cuda(tiny_model, monkeypatch):
    """The kernels (on by default here) in a CUDA graph = eagerly; fp32: the tokens of the decoder without them
    and of generate() (a rare near-tie may flip); bf16: a forward's logits with and without them to rounding."""
    from linearize.decode import FastDecoder, fused_projections, fused
    from linearize.ops import rms_norm_triton

    torch.backends.cuda.matmul.allow_tf32 = False
    calls = []
    kernel = rms_norm_triton.rms_norm_triton
    monkeypatch.setattr(rms_norm_triton, "rms_norm_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    ids = torch.randint(2, 97, (3, 11), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    for dtype in (torch.float32, torch.bfloat16):
        for name, model in _students(tiny_model, dtype):
            assert fused.kernels_default(model)
            calls.clear()
            graph = FastDecoder(model).generate(ids, mask, max_new_tokens=24, pad_token_id=0)
            assert calls, name  # the kernels ran (the prefill and the steps before the capture)
            eager = FastDecoder(model, cuda_graph=False).generate(ids, mask, max_new_tokens=24, pad_token_id=0)
            assert torch.equal(graph, eager), (name, dtype)
            if dtype == torch.float32:
                plain = FastDecoder(model, fuse_kernels=False).generate(ids, mask, max_new_tokens=24, pad_token_id=0)
                ref = plain_generate(model, ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                     pad_token_id=0)
                assert (graph == plain).float().mean() > 0.95 and (graph == ref).float().mean() > 0.95, name
            else:
                with torch.no_grad():
                    want = model(ids, attention_mask=mask).logits.double()
                    with fused_projections(model, kernels=True):
                        got = model(ids, attention_mask=mask).logits.double()
                assert ((got - want).norm() / want.norm()).item() < 2e-2, name
            assert not any(type(m).__name__.startswith("Fused") for m in model.modules()), name


def test_the_kernels_cut_the_decode_steps_launches_on_cuda(tiny_model, monkeypatch):
    """bench.profile's CUDA kernels per decode step, bf16: with the kernels at least 6 fewer a norm (7 expected; two
    a layer and the final one), 1 fewer a gated MLP and 2 fewer a layer for its residual adds than without them."""
    from linearize.bench.profile import profile_decode
    from linearize.decode import fused

    model = linearize.convert(tiny_model("llama", dtype=torch.bfloat16).cuda(), {"kind": "lolcats", "window": 4,
                                                                               "feature_dim": 8})
    with_kernels = profile_decode(model, batch=1, tokens=8, prompt_len=16, top=10**6)
    monkeypatch.setattr(fused, "KERNELS", False)
    without = profile_decode(model, batch=1, tokens=8, prompt_len=16, top=10**6)
    layers = model.config.num_hidden_layers
    saved = without["launches_per_step"] - with_kernels["launches_per_step"]
    # and the residual adds with the norms after them: two a layer
    assert saved >= 6 * (2 * layers + 1) + layers + 2 * layers - 0.5, (without["launches_per_step"],
                                                                       with_kernels["launches_per_step"])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_rope_tables_give_the_modules_bits_and_the_decoders_tokens_on_cuda(tiny_model, family, monkeypatch):
    """``decode.fused.rope_table`` on CUDA: the tables are the rotary module's own values bit for bit (bf16), and the
    fast decoder in a CUDA graph gives the same tokens with and without them."""
    from helpers import tiny_student
    from linearize.decode import FastDecoder, fused
    from linearize.models.fusion import RopeTable

    model = tiny_student(tiny_model, family, {"kind": "lolcats", "window": 4, "feature_dim": 8}).cuda().bfloat16()
    rotary = model.base_model.rotary_emb
    types = getattr(model.config, "layer_types", None) or ()
    table = RopeTable.of(rotary, 300, torch.bfloat16, torch.device("cuda"), types)
    positions = torch.randint(0, 300, (4, 5), device="cuda")
    x = torch.zeros(4, 5, model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    for kind in table.tables:
        args = (x, positions) if kind is None else (x, positions, kind)
        assert all(torch.equal(g, w) for g, w in zip(table(*args), rotary(*args))), kind
    ids = torch.randint(2, 97, (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(fused, "ROPE_TABLE", on)
        out[on] = FastDecoder(model).generate(ids, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(out[True], out[False])
