"""CUDA checks of the window-softmax layers' fast forms (``ops/window``): the one-launch Triton kernel
(``parallel_triton.py``) and the causal flash calls on blocks (``flash.py``), both prefill without a gradient,
against SDPA on masked blocks, in bf16 at a kept layer's shapes."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _strided(t, pad, dtype, seed):
    """q/k/v of 2 sequences as strided slices of one projection's output (9 query heads on 3 key heads, head dim 64),
    as the adapters give them; the second sequence left-padded by ``pad`` tokens (``key_mask`` None without)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(2, t, (9 + 6) * 64, device="cuda", generator=g).to(dtype)
    q, k, v = (x.unflatten(-1, (-1, 64)).transpose(1, 2) for x in out.split([9 * 64, 3 * 64, 3 * 64], -1))
    key_mask = None
    if pad:
        key_mask = torch.ones(2, t, dtype=torch.bool, device="cuda")
        key_mask[1, :pad] = False
    return q, k, v, key_mask


@pytest.mark.parametrize("t,window", [(4096, 1280), (3000, 1280), (1024, 256), (700, 1280)])
def test_flash_blocks_equal_sdpa_blocks_on_cuda(t, window, monkeypatch):
    from linearize.ops import window as W
    from linearize.ops.window import flash, window_softmax, window_softmax_sdpa

    monkeypatch.setattr(W, "WINDOW_TRITON", False)

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 9, t, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 3, t, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    with torch.no_grad():
        want = window_softmax_sdpa(q.float(), k.float(), v.float(), window=window, scale=0.125)
        assert flash.supported(q, k, v, window) == (t > window)
        got = window_softmax(q, k, v, window=window, scale=0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t,window,softcap,pad", [(4096, 1280, None, 0), (3000, 1280, None, 0), (5000, 4160, None, 0),
                                                   (1024, 256, 30.0, 0), (700, 1280, None, 0), (2500, 1280, None, 300),
                                                   (999, 64, None, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_kernel_equals_sdpa_blocks_on_cuda(t, window, softcap, pad, dtype):
    """Strided q/k/v (slices of one projection, as the adapters give them), grouped heads, left padding in one
    sequence (padding queries zero), soft-capping; the reference in fp32 (the blocked SDPA form, the definition
    with a soft-cap)."""
    from linearize.ops import window as W
    from linearize.ops.window import window_softmax, window_softmax_sdpa
    from linearize.ops.window.parallel_triton import window_softmax_triton

    q, k, v, key_mask = _strided(t, pad, dtype, seed=0)
    with torch.no_grad():
        assert W._use_window_triton(q, k, v, window)
        got = window_softmax(q, k, v, window=window, scale=0.125, softcap=softcap, key_mask=key_mask)
        if softcap is None:
            want = window_softmax_sdpa(q.float(), k.float(), v.float(), window=window, scale=0.125, key_mask=key_mask)
            want = want if key_mask is None else want * key_mask[:, None, :, None]
        else:
            W.WINDOW_TRITON = False
            try:
                want = window_softmax(q.float(), k.float(), v.float(), window=window, scale=0.125, softcap=softcap)
            finally:
                W.WINDOW_TRITON = True
        direct = window_softmax_triton(q, k, v, window=window, scale=0.125, softcap=softcap, key_mask=key_mask)
    assert got.dtype == dtype and got.transpose(1, 2).is_contiguous()
    assert torch.equal(got, direct)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t,window,sinks,softcap,pad", [(4096, 1280, 4, None, 0), (3000, 1280, 4, None, 300),
                                                         (2000, 256, 20, 30.0, 0), (700, 1280, 4, None, 0)])
@pytest.mark.parametrize("own", [False, True])
def test_window_kernel_with_sinks_equals_the_sdpa_form_on_cuda(t, window, sinks, softcap, pad, own):
    """Attention sinks in the prefill kernel (``ops/window/sinks.py``) against the blocked form in fp32 (by hand
    with a soft-cap), strided grouped heads, left padding; ``own``: the sinks scored by queries of their own (the
    reach's ``sink_q``)."""
    from linearize.ops.window import sinks as S
    from linearize.ops.window.parallel_triton import window_softmax_triton

    q, k, v, key_mask = _strided(t, pad, torch.bfloat16, seed=1)
    sq = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).to(q.dtype) \
        if own else None
    with torch.no_grad():
        got = S.window_softmax_sinks(q, k, v, window=window, sinks=sinks, scale=0.125, softcap=softcap,
                                     key_mask=key_mask, sink_q=sq)
        direct = window_softmax_triton(q, k, v, window=window, scale=0.125, softcap=softcap, key_mask=key_mask,
                                       sink_positions=S.sink_index(key_mask, 2, t, sinks, q.device), sink_q=sq)
        with torch.enable_grad():  # the blocked forms (a gradient wanted)
            qf = q.float().requires_grad_()
            want = S.window_softmax_sinks(qf, k.float(), v.float(), window=window, sinks=sinks, scale=0.125,
                                          softcap=softcap, key_mask=key_mask,
                                          sink_q=None if sq is None else sq.float()).detach()
    assert torch.equal(got, direct)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t,window,reach,pad", [(12000, 1280, 8191, 0), (9000, 4288, 8191, 500), (3000, 1280, 2000, 0)])
def test_sink_queries_made_in_the_kernel_equal_those_given_on_cuda(t, window, reach, pad):
    """The prefill kernel rotating the sinks' queries itself (``sink_rope``: a query past ``reach`` by the reach's
    tables) against the same kernel given them (``sink_q``, from ``rope_rotate_half`` as ``_sink_queries`` makes
    them): SmolLM2's heads, its RoPE tables, bf16, a left-padded sequence (positions shifted by the padding)."""
    from linearize.models.base import rope_rotate_half
    from linearize.ops.window import sinks as S
    from linearize.ops.window.parallel_triton import window_softmax_triton

    q, k, v, key_mask = _strided(t, pad, torch.bfloat16, seed=2)
    shift = torch.tensor([[0], [pad]], device="cuda")
    positions = (torch.arange(t, device="cuda")[None].expand(2, t) - shift).clamp(min=0)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))  # SmolLM2's rope_theta

    def table(p):
        return tuple(torch.cat([f(p[..., None].float() * inv)] * 2, dim=-1) for f in (torch.cos, torch.sin))

    cos, sin = (x.to(torch.bfloat16) for x in table(positions))
    at_cos, at_sin = table(torch.tensor(reach, device="cuda"))
    far = (positions > reach)[..., None]
    sq = rope_rotate_half(q, torch.where(far, at_cos.to(cos.dtype), cos),
                          torch.where(far, at_sin.to(sin.dtype), sin))
    pos = S.sink_index(key_mask, 2, t, 4, q.device)
    with torch.no_grad():
        made = window_softmax_triton(q, k, v, window=window, scale=0.125, key_mask=key_mask,
                                     position_embeddings=(cos, sin), sink_positions=pos,
                                     sink_rope=(at_cos, at_sin, positions, reach))
        given = window_softmax_triton(q, k, v, window=window, scale=0.125, key_mask=key_mask,
                                      position_embeddings=(cos, sin), sink_positions=pos, sink_q=sq)
    torch.testing.assert_close(made.float(), given.float(), atol=2e-2, rtol=2e-2)
    assert (made.float() - given.float()).abs().mean() < 1e-3  # rounding apart, the same queries


@pytest.mark.parametrize("float8,reach", [(False, None), (True, None), (False, 150), (True, 150)])
def test_window_layers_prefill_through_the_kernel_on_cuda(float8, reach, monkeypatch):
    """A student with kept window layers (64 and 128 tokens) prefills 300 tokens of a left-padded batch through the
    kernel, q rotated inside it, as through the PyTorch forms: the logits, and the fast decoder's tokens. ``reach``:
    with 4 sinks scored from position 150 on (the prefill kernel's sink queries, the ring step rotating them)."""
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.decode import FastDecoder
    from linearize.ops import window as W

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2, hidden_size=192,
                                                           num_attention_heads=6, max_position_embeddings=1024))
    model = linearize.convert(teacher.eval(), {"kind": "lolcats", "window": 16, "feature_dim": 16, "keep_softmax": [0, 1],
                                               "softmax_window": "64,1:128",
                                               **({"softmax_window_dtype": "float8"} if float8 else {}),
                                               **({"softmax_window_sinks": 4} if reach else {})})
    if reach:
        from linearize.models import get_adapter

        for m in linearize.mixers(model).values():
            m.set_reach(reach, get_adapter(model.config).rope_tables(model, m.layer_idx))
    model = model.to("cuda", torch.bfloat16)
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 97, (2, 300), generator=torch.Generator().manual_seed(0)).to("cuda")
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits.float()
        tokens = FastDecoder(model).generate(ids, mask, max_new_tokens=8, pad_token_id=0)
        monkeypatch.setattr(W, "WINDOW_TRITON", False)
        monkeypatch.setattr(W, "WINDOW_STEP_KERNEL", False)
        if float8:
            from linearize.ops.window import float8 as f8

            monkeypatch.setattr(f8, "FLOAT8_STEP_KERNEL", False)
        want = model(ids, attention_mask=mask).logits.float()
        ref_tokens = FastDecoder(model).generate(ids, mask, max_new_tokens=8, pad_token_id=0)
    real = mask.bool()[:, :, None]
    torch.testing.assert_close(got * real, want * real, atol=5e-2, rtol=5e-2)
    assert (tokens == ref_tokens).float().mean() > 0.9  # bf16: a near tie may turn a token
