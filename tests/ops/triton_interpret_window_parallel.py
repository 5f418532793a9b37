"""Run by test_window_parallel_triton.py in a subprocess, on the CPU through Triton's interpreter: the window
softmax over a whole sequence as one Triton launch (``ops/window/parallel_triton.py``) against the definition
in float64 (each query's scores over all keys, everything outside its last ``W`` real keys masked out).

Tiles of 16 queries and 16 keys, so that short sequences cross many tiles, windows cross tile edges, and the
last tile is partial.

``gqa``: 6 query heads on 2 key heads, windows of 1, 5, 16, 23, 40 and longer than the sequence, lengths not a
multiple of the tiles; ``tiles``: query tiles of 32 and 64 over key blocks of 16; ``mha``: as many query as key heads; ``softcap``: Gemma's soft-cap; ``padding``: a
left-padded sequence beside a full one (padding keys left out, padding queries zero); ``strided``: q/k/v as
slices of one projection's output, as the adapters give them; ``half``: bf16 and fp16 inputs against the
definition on the same rounded inputs; ``rope``: q rotated inside the kernel, full and partial rotary dims; ``sinks``: attention sinks beside the window
(``ops/window/sinks.py``); ``sink_rope``: the sinks' queries past the reach made inside the kernel; ``model``: tiny students' prefill through the kernel (q rotated in it; with sinks too)
against the PyTorch forms, and the fast decoder from its states; ``dispatch``:
``window_softmax`` takes the kernel without a gradient and
not with one, and the mixers' sequence forms (the window layer, the delta hybrid's window) give the same
outputs through it as through the blocked SDPA form."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from interpret_checks import _close, _masks  # noqa: E402
from linearize.ops import window as window_ops  # noqa: E402
from linearize.ops.window import parallel_triton  # noqa: E402
from linearize.ops.window.parallel_triton import window_softmax_triton  # noqa: E402
from linearize.ops.window.sinks import sink_index  # noqa: E402

torch.set_grad_enabled(False)
parallel_triton.PARALLEL_BM = 16
parallel_triton.PARALLEL_BN = 16
B, D = 2, 16


def definition(q, k, v, window, scale, softcap=None, key_mask=None, sinks=0, sink_q=None):
    """Softmax over each query's last ``window`` real keys and its sequence's first ``sinks`` real tokens (those that
    have left its window scored by ``sink_q`` where given), float64; padding queries weigh themselves, then 0."""
    q, k, v = (x.double() for x in (q, k, v))
    h, hk, t = q.shape[1], k.shape[1], q.shape[2]
    k, v = (x.repeat_interleave(h // hk, dim=1) for x in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    pos = torch.arange(t)
    dist = pos[:, None] - pos[None, :]
    real = torch.ones(q.shape[0], t, dtype=torch.bool) if key_mask is None else key_mask.bool()
    is_sink = real & (real.long().cumsum(1) <= sinks)
    if sink_q is not None:
        far = ((dist >= window)[None] & is_sink[:, None, :])[:, None]
        s = torch.where(far, sink_q.double() @ k.transpose(-1, -2) * scale, s)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ok = ((dist >= 0) & (dist < window))[None, None]
    if sinks:
        ok = ok | ((dist >= 0)[None] & is_sink[:, None, :])[:, None]
    if key_mask is not None:
        ok = ok & key_mask[:, None, None, :] | (dist == 0)[None, None]
    o = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1) @ v
    return o if key_mask is None else o * key_mask[:, None, :, None]


def _case(h, hk, t, window, *, softcap=None, pad=0, dtype=torch.float32, strided=False, seed=0, sinks=0,
          own=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # slices of one projection's output [B, T, (H + 2 Hk) D]
        out = torch.randn(B, t, (h + 2 * hk) * D, generator=gen).to(dtype)
        q, k, v = (x.unflatten(-1, (-1, D)).transpose(1, 2) for x in out.split([h * D, hk * D, hk * D], -1))
    else:
        q = (torch.randn(B, h, t, D, generator=gen) * 2).to(dtype)
        k, v = (torch.randn(B, hk, t, D, generator=gen).to(dtype) for _ in range(2))
    key_mask = _masks(B, t, pad)
    pos = sink_index(key_mask, B, t, sinks, q.device) if sinks else None
    sink_q = (torch.randn(q.shape, generator=gen) * 2).to(dtype) if own else None  # the sinks' own queries
    got = window_softmax_triton(q, k, v, window=window, scale=D ** -0.5, softcap=softcap, key_mask=key_mask,
                                sink_positions=pos, sink_q=sink_q)
    want = definition(q, k, v, window, D ** -0.5, softcap, key_mask, sinks, sink_q)
    where = (h, hk, t, window, softcap, pad, str(dtype), strided, sinks, own)
    assert got.dtype == dtype and got.shape == (B, h, t, D), where
    assert got.transpose(1, 2).is_contiguous(), where  # [B, T, H, D] memory: what the output projection reads
    _close(got, want, where, tol=2e-5 if dtype == torch.float32 else 1e-2)


def check_gqa():
    for t, window in ((37, 1), (37, 5), (50, 16), (50, 23), (64, 40), (21, 40), (33, 33)):
        _case(6, 2, t, window, seed=t + window)


def check_tiles():
    """Query tiles of two and four key blocks: several blocks cross the diagonal, whole blocks between the edges."""
    for bm, bn in ((32, 16), (64, 16)):
        parallel_triton.PARALLEL_BM, parallel_triton.PARALLEL_BN = bm, bn
        try:
            for t, window in ((100, 1), (100, 7), (100, 40), (130, 57), (70, 200)):
                _case(6, 2, t, window, seed=bm + t + window)
            _case(6, 2, 100, 40, pad=13, softcap=3.0, seed=bm)
        finally:
            parallel_triton.PARALLEL_BM = parallel_triton.PARALLEL_BN = 16


def check_mha():
    _case(2, 2, 45, 19, seed=1)


def check_softcap():
    _case(6, 2, 45, 19, softcap=3.0, seed=2)
    _case(2, 2, 30, 64, softcap=3.0, seed=3)


def check_padding():
    _case(6, 2, 45, 19, pad=11, seed=4)
    _case(6, 2, 45, 19, pad=30, softcap=3.0, seed=5)
    _case(2, 2, 20, 64, pad=7, seed=6)


def check_strided():
    _case(6, 2, 41, 17, strided=True, seed=7)


def check_half():
    _case(6, 2, 41, 17, dtype=torch.bfloat16, seed=8)
    _case(6, 2, 41, 17, dtype=torch.float16, pad=5, seed=9)


def check_rope():
    """q rotated in the kernel (full and partial rotary dims, tables per sequence or shared), against the
    definition on q rotated by ``rope_rotate_half`` (the families' RoPE by rotating halves)."""
    from linearize.models.base import rope_rotate_half

    for rot, shared, pad, dtype in ((D, True, 0, torch.float32), (D // 2, False, 9, torch.float32),
                                    (D, False, 0, torch.bfloat16)):
        gen = torch.Generator().manual_seed(rot + pad)
        t = 45
        q = (torch.randn(B, 6, t, D, generator=gen) * 2).to(dtype)
        k, v = (torch.randn(B, 2, t, D, generator=gen).to(dtype) for _ in range(2))
        angles = torch.randn(1 if shared else B, t, rot // 2, generator=gen) * 3
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        key_mask = _masks(B, t, pad)
        got = window_softmax_triton(q, k, v, window=19, scale=D ** -0.5, key_mask=key_mask,
                                    position_embeddings=(cos, sin))
        turned = rope_rotate_half(q.double(), cos.double(), sin.double()).to(dtype)
        want = definition(turned, k, v, 19, D ** -0.5, key_mask=key_mask)
        _close(got, want, ("rope", rot, shared, pad, str(dtype)), tol=2e-5 if dtype == torch.float32 else 1e-2)


def check_sinks():
    """Attention sinks: 1, 4 and 20 of them (a tile of 32), windows crossing tiles, left padding (a sequence with
    fewer real tokens than sinks), soft-capping, bf16, and query tiles of 64."""
    for t, window, sinks, pad, softcap, dtype in ((50, 7, 4, 0, None, torch.float32), (50, 16, 1, 0, 3.0, torch.float32),
                                                  (61, 9, 4, 13, None, torch.float32), (40, 5, 20, 0, None, torch.float32),
                                                  (30, 8, 4, 27, 3.0, torch.float32), (12, 40, 4, 0, None, torch.float32),
                                                  (45, 11, 4, 6, None, torch.bfloat16)):
        for own in (False, True):  # the sinks scored by the window's queries, or by their own (the reach's)
            _case(6, 2, t, window, sinks=sinks, pad=pad, softcap=softcap, dtype=dtype, seed=t + window + sinks,
                  own=own)
    parallel_triton.PARALLEL_BM = 64
    try:
        _case(6, 2, 130, 23, sinks=4, pad=9, seed=99)
        _case(6, 2, 130, 23, sinks=4, pad=9, seed=99, own=True)
    finally:
        parallel_triton.PARALLEL_BM = 16


def check_sink_rope():
    """The sinks' queries made inside the kernel (``sink_rope``): a query whose position passes the reach weighs the
    sinks by q rotated with the reach's tables, the others by q rotated at their own; positions shared or per
    sequence (left padding shifts them), full and partial rotary dims, fp32 and bf16, against the definition on the
    queries ``rope_rotate_half`` gives (what ``WindowSoftmax._sink_queries`` computes), and bit for bit against the
    same kernel given those queries as ``sink_q``."""
    from linearize.models.base import rope_rotate_half

    t, window, sinks = 45, 9, 4
    for rot, per_seq, pad, dtype, reach in ((D, False, 0, torch.float32, 20), (D // 2, True, 7, torch.float32, 13),
                                            (D, True, 5, torch.bfloat16, 30), (D, False, 0, torch.float32, 100)):
        gen = torch.Generator().manual_seed(rot + pad + reach)
        q = (torch.randn(B, 6, t, D, generator=gen) * 2).to(dtype)
        k, v = (torch.randn(B, 2, t, D, generator=gen).to(dtype) for _ in range(2))
        key_mask = _masks(B, t, pad)
        positions = torch.arange(t)[None].expand(B, t) - (torch.tensor([[0], [pad]]) if per_seq else 0)
        positions = positions.clamp(min=0) if per_seq else positions[:1]
        freqs = torch.randn(rot // 2, generator=gen).abs()
        table = lambda p: tuple(torch.cat([f(p[..., None].double() * freqs)] * 2, dim=-1)  # noqa: E731
                                for f in (torch.cos, torch.sin))
        cos, sin = (x.to(dtype) for x in table(positions))
        at_cos, at_sin = (x.float() for x in table(torch.tensor(reach)))
        far = (positions > reach)[..., None]
        moved = (torch.where(far, at_cos.to(dtype), cos), torch.where(far, at_sin.to(dtype), sin))
        sink_q = rope_rotate_half(q, *moved)
        pos = sink_index(key_mask, B, t, sinks, q.device)
        got = window_softmax_triton(q, k, v, window=window, scale=D ** -0.5, key_mask=key_mask,
                                    position_embeddings=(cos, sin), sink_positions=pos,
                                    sink_rope=(at_cos, at_sin, positions, reach))
        given = window_softmax_triton(q, k, v, window=window, scale=D ** -0.5, key_mask=key_mask,
                                      position_embeddings=(cos, sin), sink_positions=pos, sink_q=sink_q)
        turned = rope_rotate_half(q.double(), cos.double(), sin.double()).to(dtype)
        want = definition(turned, k, v, window, D ** -0.5, key_mask=key_mask, sinks=sinks, sink_q=sink_q)
        where = ("sink_rope", rot, per_seq, pad, str(dtype), reach)
        _close(got, want, where, tol=2e-5 if dtype == torch.float32 else 1e-2)
        if dtype == torch.float32:
            torch.testing.assert_close(got, given, atol=1e-6, rtol=0, msg=str(where))
        if reach >= t:  # no query past it: the same as no sink queries at all
            plain = window_softmax_triton(q, k, v, window=window, scale=D ** -0.5, key_mask=key_mask,
                                          position_embeddings=(cos, sin), sink_positions=pos)
            assert torch.equal(got, plain), where
    try:  # sink_rope needs q's RoPE in the kernel and stands instead of sink_q
        window_softmax_triton(q, k, v, window=window, scale=D ** -0.5, sink_positions=pos,
                              sink_rope=(at_cos, at_sin, positions, 3))
    except ValueError as e:
        assert "position_embeddings" in str(e)
    else:
        raise AssertionError("sink_rope without position_embeddings was taken")


def check_model():
    """Tiny float32 students with kept window layers (Llama: windows of 6 and 9 over prompts of 17, GQA; Gemma 2's
    global layer, soft-capped; float8 windows): the prefill through the kernel (q rotated inside it) against the PyTorch
    forms, on a batch with a left-padded prompt: the logits, the window states the cache keeps, and the fast
    decoder's greedy tokens from them."""
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.decode import FastDecoder
    from linearize.mixers import window as window_mixer

    ids = torch.randint(2, 97, (2, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    calls = []
    real = parallel_triton.window_softmax_triton

    made = []  # per launch: the sinks' queries made inside the kernel (sink_rope), given (sink_q), or neither

    def counted(*a, **kw):
        calls.append(kw.get("position_embeddings") is not None)
        made.append("rope" if kw.get("sink_rope") is not None else "given" if kw.get("sink_q") is not None else None)
        return real(*a, **kw)

    parallel_triton.window_softmax_triton = counted
    try:
        for family, extra in (("llama", {}), ("gemma2", {}), ("llama", {"softmax_window_dtype": "float8"}),
                              ("llama", {"softmax_window_sinks": 3}),
                              ("llama", {"softmax_window_sinks": 3, "reach": 0}),
                              ("llama", {"softmax_window_sinks": 14, "softmax_window_dtype": "float8"})):
            reach = extra.get("reach")
            extra = {key: value for key, value in extra.items() if key != "reach"}
            torch.manual_seed(0)
            teacher = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2)).eval()
            model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 8, "keep_softmax": [0, 1],
                                                "softmax_window": "6,1:9", **extra})
            model.generation_config.eos_token_id = None
            if reach is not None:  # the least reach (the window + the sinks): queries past it score the sinks from it
                from linearize.models import get_adapter

                for m in model.modules():
                    if isinstance(m, window_mixer.WindowSoftmax):
                        m.set_reach(reach, get_adapter(model.config).rope_tables(model, m.layer_idx))
            window_ops.WINDOW_TRITON = False
            want = model(ids, attention_mask=mask).logits
            plain = FastDecoder(model).generate(ids, mask, max_new_tokens=12, pad_token_id=0)
            window_ops.WINDOW_TRITON = True
            calls.clear()
            made.clear()
            got = model(ids, attention_mask=mask).logits
            layers = sum(isinstance(m, window_mixer.WindowSoftmax) for m in model.modules())
            assert layers and calls == [True] * layers, (family, calls)  # every window layer, q rotated in the kernel
            assert made == [("rope" if reach is not None else None)] * layers, (family, made)  # past the reach
            real_tokens = mask.bool()[:, :, None]
            _close(got * real_tokens, (want * real_tokens).double(), (family, extra))
            if reach is not None:  # the sinks' queries from _sink_queries instead: the same logits
                window_mixer.WINDOW_PREFILL_SINK_ROPE = False
                made.clear()
                _close(model(ids, attention_mask=mask).logits * real_tokens, (want * real_tokens).double(), family)
                assert made == ["given"] * layers, made
                window_mixer.WINDOW_PREFILL_SINK_ROPE = True
            fused = FastDecoder(model).generate(ids, mask, max_new_tokens=12, pad_token_id=0)
            assert torch.equal(fused, plain), (family, extra)
            window_mixer.WINDOW_PREFILL_ROPE = False  # the kernel with q rotated first
            calls.clear()
            _close(model(ids, attention_mask=mask).logits * real_tokens, (want * real_tokens).double(), family)
            assert calls == [False] * layers, calls
            window_mixer.WINDOW_PREFILL_ROPE = True
    finally:
        parallel_triton.window_softmax_triton = real
        window_ops.WINDOW_TRITON = True
        window_mixer.WINDOW_PREFILL_ROPE = True
        window_mixer.WINDOW_PREFILL_SINK_ROPE = True


def check_dispatch():
    from linearize.ops.delta.window import delta_window_chunked

    gen = torch.Generator().manual_seed(10)
    q = torch.randn(B, 6, 45, D, generator=gen)
    k, v = (torch.randn(B, 2, 45, D, generator=gen) for _ in range(2))
    calls = []
    real = parallel_triton.window_softmax_triton

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    parallel_triton.window_softmax_triton = counted
    try:
        key_mask = _masks(B, 45, 9)
        got = window_ops.window_softmax(q, k, v, window=19, scale=0.25, key_mask=key_mask)
        assert len(calls) == 1
        window_ops.WINDOW_TRITON = False
        want = window_ops.window_softmax(q, k, v, window=19, scale=0.25, key_mask=key_mask)
        assert len(calls) == 1
        _close(got, want.double(), "window_softmax")
        with torch.enable_grad():  # a gradient wanted: the blocked form, which has one
            window_ops.WINDOW_TRITON = True
            window_ops.window_softmax(q.requires_grad_(), k, v, window=19, scale=0.25)
            assert len(calls) == 1
        # the delta hybrid's sequence form: the same through the kernel as through SDPA on blocks
        qd, kd = (torch.nn.functional.normalize(torch.randn(B, n, 45, D, generator=gen), dim=-1) for n in (6, 2))
        g = -torch.rand(B, 2, 45, generator=gen)
        beta = torch.rand(B, 2, 45, generator=gen)
        lam = torch.rand(B, 6, 45, generator=gen)
        args = (q.detach(), k, qd, kd, v, g, beta, lam)
        kw = dict(window=19, scale=0.25, key_mask=key_mask, output_final_state=True)
        y, _ = delta_window_chunked(*args, **kw)
        assert len(calls) == 2
        window_ops.WINDOW_TRITON = False
        y_ref, _ = delta_window_chunked(*args, **kw)
        _close(y, y_ref.double(), "delta window")
    finally:
        parallel_triton.window_softmax_triton = real
        window_ops.WINDOW_TRITON = True


if __name__ == "__main__":
    for name in sys.argv[1:] or ["gqa", "tiles", "mha", "softcap", "padding", "strided", "half", "rope", "sinks",
                                 "sink_rope", "model", "dispatch"]:
        globals()[f"check_{name}"]()
    print("ok")
