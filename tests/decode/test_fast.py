"""The fast decoding path: the ring-window op, greedy tokens equal to generate() for every mixer,
left padding, sampling on the device, generate(custom_generate=...), EOS, streaming, fixed memory;
kept sliding-window softmax layers (Gemma's local layers) from a ring of their window."""

import pytest
import torch

from helpers import (CollectStreamer, greedy_by_full_forwards, plain_generate, run_triton_interpreter_script,
                     tiny_student)

import linearize
from linearize import LinearizeError, ops
from linearize.decode import FastDecoder, Sampling, decode, fast_generate, filter_logits, next_tokens
from linearize.convert.xatl_transfer import build_xatl

TOL = 1e-10

STUDENTS = [
    ("llama", {"kind": "lolcats", "window": 4, "feature_dim": 8}),
    ("llama", {"kind": "lolcats", "window": 16, "feature_dim": 8}),  # the prompt fits in the window
    ("llama", {"kind": "linear", "feature_map": "hedgehog", "feature_dim": 8}),
    ("llama", {"kind": "linear", "feature_map": "relu", "decay": "retnet"}),
    ("llama", {"kind": "supra"}),
    ("llama", {"kind": "supra", "norm": "sum", "decay": "none"}),
    ("llama", {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [1]}),
    ("qwen3", {"kind": "lolcats", "window": 4, "feature_dim": 8}),
    ("gpt_neox", {"kind": "lolcats", "window": 4, "feature_dim": 8}),
    ("gpt_neox", {"kind": "supra"}),
    ("gemma2", {"kind": "lolcats", "window": 4, "feature_dim": 8}),  # soft-capping, scaled embeddings
    ("smollm3", {"kind": "supra"}),  # a layer without RoPE
    ("llama", {"kind": "delta", "window": 4, "chunk_size": 8}),  # the gated delta rule's ring
]
XATL = [("retnet", None), ("mamba", None), ("retnet", "xatl"), ("mamba", "xatl")]


def _ids(b=1, t=9, seed=0):
    return torch.randint(2, 97, (b, t), generator=torch.Generator().manual_seed(seed))




def _xatl(tiny_model, arch, hybrid, dtype=torch.float64):
    model, _ = build_xatl(tiny_model("llama", dtype=dtype, num_hidden_layers=4), arch,
                          keep_softmax=hybrid, seed=0)
    model.generation_config.eos_token_id = None
    return model


def _all_models(tiny_model):
    for family, spec in STUDENTS:
        yield f"{family}-{spec}", tiny_student(tiny_model, family, spec)
    for arch, hybrid in XATL:
        yield f"xatl-{arch}-{hybrid}", _xatl(tiny_model, arch, hybrid)
    teacher = tiny_model("llama", dtype=torch.float64)
    teacher.generation_config.eos_token_id = None
    yield "teacher", teacher  # every layer softmax: static key/value buffers only
    gemma = _gemma3(tiny_model)  # sliding layers 0, 1 (8 tokens) and global layer 2
    yield "gemma3-teacher", gemma  # rings for the local layers, static buffers for the global one
    yield "gemma3-keep_sliding", linearize.convert(gemma, {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                            "keep_sliding": True})


def _gemma3(tiny_model):
    model = tiny_model("gemma3_text", dtype=torch.float64, sliding_window=8)
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    return model


# --------------------------------------------------------------------------- the ring window


@pytest.mark.parametrize("keep_features", [True, False])
@pytest.mark.parametrize("t,window", [(3, 8), (8, 8), (13, 4), (1, 1)])
def test_ring_step_equals_the_shifting_step(t, window, keep_features):
    """Decoding from a ring of w slots gives the outputs of the shifting window, token after token,
    whether the ring stores the window's key features or recomputes them on eviction."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    b, h, hk, d, f, n = 2, 6, 2, 4, 5, 12
    w_feat = r(d, f)
    fmap = lambda x: torch.nn.functional.softplus(x @ w_feat)  # noqa: E731
    q, k, v = r(b, h, t + n, d), r(b, hk, t + n, d), r(b, hk, t + n, d)
    xs = [q, k, r(b, h, t + n, f).exp(), fmap(k), v]
    gamma = torch.sigmoid(r(h))
    key_mask = torch.ones(b, t, dtype=torch.bool)
    key_mask[1, : t // 2] = False  # left padding inside the prompt
    kw = dict(scale=0.5, softcap=None)
    _, state = ops.hybrid_attention_chunked(*(x[:, :, :t] for x in xs), gamma, window=window, **kw,
                                            output_final_state=True, key_mask=key_mask)
    ring = ops.RingHybridState.from_state(state, window, keep_key_features=keep_features)
    assert ring.keys.shape[2] == window and ring.key_features.shape[2] == (window if keep_features else 0)
    for i in range(t, t + n):
        one = [x[:, :, i : i + 1] for x in xs]
        ref, state = ops.hybrid_attention_step(*one, gamma, state, window=window, **kw)
        out, ring = ops.hybrid_attention_step_ring(*one, gamma, ring, **kw, key_feature_map=fmap)
        assert torch.allclose(out, ref, atol=TOL, rtol=0), (out - ref).abs().max()
    assert torch.allclose(ring.linear, state.linear, atol=1e-9, rtol=0)


def test_fused_decode_step_gives_the_same_tokens():
    """The fast decoder with the one-launch LoLCATs step (what runs on CUDA), run on the CPU by
    Triton's interpreter: the tokens of the fast decoder without it (GQA, soft-capping, left padding;
    partial RoPE and a layer without RoPE through the same step in ``test_lolcats_length.py``); with
    attention sinks (a cache of the first tokens), once every sequence's are cached, the tokens of the
    sparse cache's own step."""
    run_triton_interpreter_script("triton_interpret_hybrid_fused.py", "decoder")


def test_dropping_key_features_shrinks_the_state(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8})
    prompt = _ids(b=2, t=9)
    lean, full = FastDecoder(model), FastDecoder(model, keep_key_features=True)
    assert torch.equal(lean.generate(prompt, max_new_tokens=12), full.generate(prompt, max_new_tokens=12))
    assert lean.timings["state_bytes"] < full.timings["state_bytes"]


# --------------------------------------------------------------------------- the fast path = generate()


def test_fast_greedy_equals_generate_for_every_mixer(tiny_model):
    prompt = _ids(b=2, t=9)
    for name, model in _all_models(tiny_model):
        ref = plain_generate(model, prompt, max_new_tokens=14, do_sample=False, pad_token_id=0)
        fast = fast_generate(model, prompt, max_new_tokens=14, pad_token_id=0)
        assert torch.equal(fast, ref), name


def test_fast_greedy_equals_full_forwards_past_the_window(tiny_model):
    """Long enough for tokens to leave the window many times over (the ring wraps around)."""
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 3, "feature_dim": 8})
    prompt = _ids(b=1, t=5, seed=4)
    assert torch.equal(fast_generate(model, prompt, max_new_tokens=20), greedy_by_full_forwards(model, prompt, 20))


def test_left_padded_batch_equals_each_sequence_alone(tiny_model):
    prompts = [_ids(t=9, seed=1)[0], _ids(t=4, seed=2)[0], _ids(t=6, seed=3)[0]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    for name, model in _all_models(tiny_model):
        batch = fast_generate(model, ids, mask, max_new_tokens=10, pad_token_id=0)
        for i, p in enumerate(prompts):
            alone = fast_generate(model, p[None], max_new_tokens=10, pad_token_id=0)
            assert torch.equal(batch[i, width:], alone[0, len(p):]), (name, i)


@pytest.mark.parametrize("arch", ["retnet", "mamba"])
def test_xatl_left_padding_through_plain_generate(tiny_model, arch):
    """RetNet and Mamba leave padding out of their states in the ordinary path too."""
    model = _xatl(tiny_model, arch, None)
    prompts = [_ids(t=8, seed=1)[0], _ids(t=3, seed=2)[0]]
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 8 - len(p):], mask[i, 8 - len(p):] = p, 1
    batch = plain_generate(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = plain_generate(model, p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, 8:], alone[0, len(p):]), i


def test_reachable_through_generate(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8})
    prompt = _ids(b=2, t=7)
    ref = plain_generate(model, prompt, max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=9, do_sample=False, pad_token_id=0, custom_generate=decode), ref)
    with pytest.raises(LinearizeError, match="num_beams"):
        model.generate(prompt, max_new_tokens=3, num_beams=2, custom_generate=decode)
    with pytest.raises(LinearizeError, match="repetition_penalty"):
        model.generate(prompt, max_new_tokens=3, repetition_penalty=1.3, custom_generate=decode)
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=9, do_sample=True, top_k=1, pad_token_id=0, custom_generate=decode)
    assert torch.equal(sampled, ref)  # top-k 1 through generate()'s config is greedy


def test_eos_ends_a_sequence_and_pads_the_rest(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "supra"})
    prompt = _ids(b=2, t=6)
    free = fast_generate(model, prompt, max_new_tokens=12, pad_token_id=0)
    eos = int(free[0, 6 + 3])  # sequence 0's fourth new token becomes the EOS
    out = fast_generate(model, prompt, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    row = out[0, 6:]
    first = int((row == eos).nonzero()[0])
    assert torch.equal(row[: first + 1], free[0, 6 : 6 + first + 1])
    assert (row[first + 1 :] == 0).all()
    ref = plain_generate(model, prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out[:, : ref.shape[1]], ref)


def test_any_of_several_eos_ids_ends_a_sequence(tiny_model):
    """A list of EOS ids (Llama 3 has three): each sequence ends at the first of any, padded after it with a
    pad id that is not one of them; the rest as generate() gives them."""
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8})
    prompt = _ids(b=3, t=6, seed=5)
    free = fast_generate(model, prompt, max_new_tokens=12, pad_token_id=0)
    eos = sorted({int(free[0, 6 + 2]), int(free[1, 6 + 5])})  # sequence 0's third new token, 1's sixth
    out = fast_generate(model, prompt, max_new_tokens=12, eos_token_id=eos, pad_token_id=1)
    ref = plain_generate(model, prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(out[:, : ref.shape[1]], ref)
    ended = 0
    for row, free_row in zip(out[:, 6:], free[:, 6:]):
        hits = [i for i, tok in enumerate(row.tolist()) if tok in eos]
        if hits:
            ended += 1
            assert torch.equal(row[: hits[0] + 1], free_row[: hits[0] + 1]) and (row[hits[0] + 1 :] == 1).all()
    assert ended >= 2


def test_streamer_sees_every_token(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8})


    streamer = CollectStreamer()
    out = fast_generate(model, _ids(t=5), max_new_tokens=7, streamer=streamer)
    assert streamer.ended and torch.equal(torch.cat(streamer.parts), out[0])


def test_state_buffers_do_not_grow_with_new_tokens(tiny_model):
    """Converted layers hold the same bytes whatever the length; only kept softmax layers size
    their key/value buffers for the whole output."""
    from linearize.decode import StaticKVLayer

    def held(model, n):
        dec = FastDecoder(model)
        prompt = _ids(t=6)
        _, cache = dec._prefill(prompt, torch.ones_like(prompt))
        static = dec._static_cache(cache, 6 + n, torch.tensor(6))
        return sum(layer.nbytes for layer in static.layers if not isinstance(layer, StaticKVLayer))

    for spec in ({"kind": "lolcats", "window": 4, "feature_dim": 8}, {"kind": "supra"}):
        model = tiny_student(tiny_model, "llama", spec)
        assert held(model, 10) == held(model, 1000) > 0


def test_the_prefill_cache_is_emptied_as_the_buffers_take_over(tiny_model):
    """A large batch must not hold the prefill's states and the decoding buffers both whole: each
    prefill layer lets go of its tensors once its buffer exists, and the buffers share no memory
    with what the prefill cache still holds."""
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [1]})
    dec = FastDecoder(model)
    prompt = _ids(t=6)
    _, cache = dec._prefill(prompt, torch.ones_like(prompt))
    static = dec._static_cache(cache, 16, torch.tensor(6))
    for layer in cache.layers:
        assert getattr(layer, "state", None) is None and getattr(layer, "keys", None) is None
    assert len(static.layers) == len(cache.layers)
    from linearize.decode.buffers import layer_tensors as _layer_tensors

    assert all(sum(x.numel() for x in _layer_tensors(layer)) > 0 for layer in static.layers)
    # no buffer is a view that keeps a larger prefill tensor alive (the ring's dropped key features
    # once were an empty slice of the prefill's: 1.5 MB per sequence of SmolLM2 held unseen)
    for layer in static.layers:
        for x in _layer_tensors(layer):
            assert x.untyped_storage().nbytes() == x.numel() * x.element_size()


def test_a_prefill_state_holds_no_view_of_the_prompt(tiny_model):
    """Every converted layer's state after a prompt owns exactly its memory, for every mixer, with
    q/k/v fused into one product: the window's last keys are not a slice of the prompt's, nor the
    values a split of the fused projection (at a large batch those views held twice the state)."""
    from linearize.cache import LinearizeCache, state_tensors
    from linearize.decode import fused_projections

    prompt = _ids(t=13)
    for name, model in _all_models(tiny_model):
        cache = LinearizeCache(model)
        with torch.no_grad(), fused_projections(model):
            model(prompt, past_key_values=cache, use_cache=True)
        states = [x for layer in cache.layers for x in state_tensors(getattr(layer, "state", None))]
        assert states or name.endswith("teacher"), name
        for x in states:
            assert x.untyped_storage().nbytes() == x.numel() * x.element_size(), (name, tuple(x.shape))


# --------------------------------------------------------------------------- sampling


def test_filters_keep_what_they_should():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda s: torch.isfinite(filter_logits(logits, s))[0].tolist()  # noqa: E731
    assert kept(Sampling(True, top_k=2)) == [True, True, False, False]
    assert kept(Sampling(True, top_p=0.5)) == [True, False, False, False]
    assert kept(Sampling(True, top_p=0.79)) == [True, True, False, False]
    assert kept(Sampling(True, top_p=0.81)) == [True, True, True, False]
    assert kept(Sampling(True, top_p=1.0)) == [True] * 4
    with pytest.raises(LinearizeError):
        Sampling(True, temperature=0.0)


def test_draws_follow_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(40000, 1)
    counts = torch.bincount(next_tokens(logits, Sampling(True)), minlength=4).float() / 40000
    assert torch.allclose(counts, probs, atol=0.01), counts
    hot = torch.bincount(next_tokens(logits, Sampling(True, temperature=0.5)), minlength=4).float() / 40000
    sharp = probs**2 / (probs**2).sum()
    assert torch.allclose(hot, sharp, atol=0.01), hot
    assert set(next_tokens(logits[:2000], Sampling(True, top_k=2)).tolist()) == {0, 1}


def test_sampling_with_one_candidate_is_greedy(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8})
    prompt = _ids(b=2, t=6)
    greedy = fast_generate(model, prompt, max_new_tokens=8)
    assert torch.equal(fast_generate(model, prompt, max_new_tokens=8, do_sample=True, top_k=1), greedy)
    assert torch.equal(fast_generate(model, prompt, max_new_tokens=8, do_sample=True, top_p=1e-6), greedy)
    torch.manual_seed(3)
    a = fast_generate(model, prompt, max_new_tokens=8, do_sample=True, temperature=1.5)
    torch.manual_seed(3)
    assert torch.equal(a, fast_generate(model, prompt, max_new_tokens=8, do_sample=True, temperature=1.5))


def test_bad_input_fails_with_one_line(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "supra"})
    with pytest.raises(LinearizeError, match="max_new_tokens"):
        fast_generate(model, _ids(), max_new_tokens=0)
    with pytest.raises(LinearizeError, match="CUDA"):
        FastDecoder(model, cuda_graph=True) if not torch.cuda.is_available() else (_ for _ in ()).throw(
            LinearizeError("CUDA present"))


def test_sliding_layers_decode_from_a_ring_of_their_window(tiny_model):
    """Gemma's local layers kept (keep_sliding): greedy tokens equal full forwards for prompts shorter
    than, as long as and longer than the window, tokens leaving the window many times over; the
    state is the same whatever the number of new tokens."""
    student = linearize.convert(_gemma3(tiny_model), {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                      "keep_sliding": True})
    assert sorted(linearize.mixers(student)) == [2]
    sizes = set()
    for t in (3, 7, 8, 9, 13):
        prompt = _ids(b=1, t=t, seed=t)
        assert torch.equal(fast_generate(student, prompt, max_new_tokens=20), greedy_by_full_forwards(student, prompt, 20)), t
    for n in (10, 40):
        decoder = FastDecoder(student)
        decoder.generate(_ids(b=2, t=13), max_new_tokens=n, pad_token_id=0)
        sizes.add(decoder.timings["state_bytes"])
    assert len(sizes) == 1


def test_a_sliding_layer_whose_cache_keeps_no_window_is_refused(tiny_model, monkeypatch):
    """Where the prefill's cache would hold a sliding layer whole, the ring has nothing to start from:
    one line, naming the layers."""
    from linearize.decode import loop

    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [0]})
    monkeypatch.setattr(loop, "sliding_layers", lambda cfg: {0})
    with pytest.raises(LinearizeError, match=r"sliding-window softmax layers \(\[0\]\)"):
        FastDecoder(model)


@pytest.mark.slow
def test_compiled_step_compiles_once_and_decodes_the_same(tiny_model):
    """torch.compile of the decode step: the same tokens, and no recompilation per token (a Python
    counter changing every step would recompile it each time)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8}, dtype=torch.float32)
    prompt = _ids(b=2, t=9)
    eager = fast_generate(model, prompt, max_new_tokens=12)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        assert torch.equal(fast_generate(model, prompt, max_new_tokens=12, compile=True), eager)
        assert torch.equal(fast_generate(model, prompt, max_new_tokens=12, compile=True), eager)


def test_info_reports_the_fast_state(tiny_model):
    """``linearize info``'s figure for the fast path is what the fast decoder's converted layers hold
    (their ring buffers, less the one-byte validity flags and the slot counters)."""
    from linearize.decode import StaticKVLayer
    from linearize.info import state_bytes

    model = tiny_student(tiny_model, "llama", {"kind": "lolcats", "window": 4, "feature_dim": 8}, dtype=torch.float32)
    dec = FastDecoder(model)
    prompt = _ids(b=1, t=6)
    _, cache = dec._prefill(prompt, torch.ones_like(prompt))
    static = dec._static_cache(cache, 10, torch.tensor(6))
    held = sum(x.numel() * x.element_size() for layer in static.layers if not isinstance(layer, StaticKVLayer)
               for x in layer.state.tensors()[:4])
    info = state_bytes(model)
    assert info["fast_fixed"] == held < info["fixed"]


def test_one_new_token_comes_from_the_prefill(tiny_model):
    model = tiny_student(tiny_model, "llama", {"kind": "supra"})
    prompt = _ids(b=2, t=5)
    ref = plain_generate(model, prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(model, prompt, max_new_tokens=1), ref)


def test_prefill_in_slices_of_the_batch_changes_nothing(tiny_model):
    prompts = [_ids(t=9, seed=1)[0], _ids(t=4, seed=2)[0], _ids(t=6, seed=3)[0]]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 9 - len(p):], mask[i, 9 - len(p):] = p, 1
    for spec in ({"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [1]}, {"kind": "supra"}):
        model = tiny_student(tiny_model, "llama", spec)
        whole = FastDecoder(model).generate(ids, mask, max_new_tokens=10)
        assert torch.equal(FastDecoder(model, prefill_batch=2).generate(ids, mask, max_new_tokens=10), whole)
    model = _xatl(tiny_model, "mamba", "xatl")
    whole = FastDecoder(model).generate(ids, mask, max_new_tokens=10)
    assert torch.equal(FastDecoder(model, prefill_batch=1).generate(ids, mask, max_new_tokens=10), whole)
