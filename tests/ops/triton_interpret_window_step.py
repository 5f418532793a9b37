"""Run by test_window_step_triton.py in a subprocess, on the CPU through Triton's interpreter: the window
softmax's ring step as one Triton launch (``ops/window/step_triton.py``) against the PyTorch ring step
(``window_softmax_step_ring`` with the kernel switched off), token after token: the outputs, and the ring's
keys, values, valid slots and slot counter after each step.

Each case runs from two rings: one after a short left-padded prompt (``RingHybridState.from_state``: the
empty slots first and padding holes after them; the 46 steps of the fp32 cases fill it and go around), and a
full one in any order with the slot counter 7 slots before its end (the steps wrap around). Blocks of 16
slots: a ring of 40 slots is three blocks, the last one partial.

``gqa``: 6 query heads on 2 key heads, fp32 ring; ``softcap``: the same, soft-capped; ``mha``: as many query
as key heads, soft-capped; ``half``: a bf16 ring under fp32 and bf16 queries (soft-cap off and on) and an fp16
ring under bf16 ones; ``parts``: the ring in 2 and 3 parts per (sequence, key head), merged by the part that
arrives last (the last head to finish advances the slot counter), fp32 and bf16; ``strided``: q/k/v as slices of one projection's
output; ``fma``: the products as broadcast sums (``STEP_MMA = False``) instead of ``tl.dot`` tiles;
``rope``: the kernel rotating q and k itself, full and partial rotary dims; ``decoder``: the fast decoder of tiny
students with kept window layers, the kernel (rotating q and k) against the PyTorch step.

Float8 rings (``ops/window/float8.py``), ``float8_window_step_ring`` with the kernel (``FLOAT8_STEP_KERNEL``,
the dispatch told it runs on CUDA) against its PyTorch path on the read-back ring, from the same two rings:
The kernel quantises the new token itself, so every float8 case compares the ring's codes and scales bit for
bit, the new keys and values holding -0s, zero vectors and entries with subnormal codes (``_special``).
``float8``: fp32 queries (6 on 2 key heads), then bf16 ones; ``float8_softcap``: soft-capped, and as many
query as key heads; ``float8_parts``: the ring in 2 and 3 parts; ``float8_rope``: the kernel rotating q and k
(full and partial rotary, whole ring and in parts) against RoPE in PyTorch then the PyTorch path;
``float8_rope_bf16``: the
same as ``float8_rope`` in bf16, RoPE rounded once as the kernel does, the casts rounded as on CUDA;
``float8_encode``: the kernel's e4m3 encoding against ``Tensor.to(float8_e4m3fn)`` (every value, the ties
between neighbours, subnormals, signed zeros, random numbers, out of range); ``float8_quantize``: its
quantisation of a vector against ``float8.quantize``; ``float8_decode``: the kernel's e4m3 decoding of every
byte but the NaNs against torch's; ``float8_decoder``: the fast decoder of tiny students with float8 window
layers (the kernel rotating q and k). ``sinks``: rings with attention sinks, whole and in parts; ``sinks_decoder``: the
fast decoder of students whose window layers have sinks (fp32 rings and float8 ones)."""

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers.py
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_interpret_patch  # noqa: E402,F401  (NumPy >= 2.4 and Triton 3.6's interpreter)
from interpret_checks import _close, bf16_rounded_like_cuda  # noqa: E402
from linearize import ops  # noqa: E402
from linearize.ops import window as window_ops  # noqa: E402
from linearize.ops.window import float8 as f8  # noqa: E402
from linearize.ops.window import step_triton, window_softmax_step_ring, window_state  # noqa: E402
from linearize.ops.window.step_triton import window_step_ring_triton  # noqa: E402

torch.set_grad_enabled(False)
step_triton.STEP_BLOCK = 16
B, D, W = 2, 16, 40


def _reference(q, k, v, ring, **kw):
    """The PyTorch ring step (the dispatch forced off the kernel)."""
    window_ops.WINDOW_STEP_KERNEL = False
    try:
        return window_softmax_step_ring(q, k, v, ring, **kw)
    finally:
        window_ops.WINDOW_STEP_KERNEL = True


def _starts(h, hk, dtype, gen):
    """Two rings of ``W`` slots in ``dtype``: partly empty after a left-padded prompt, and full in any order."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    prompt = 9
    mask = torch.ones(B, prompt, dtype=torch.bool)
    mask[1, :4] = False  # left padding: holes among the ring's first slots
    partly = ops.RingHybridState.from_state(window_state(r(B, hk, prompt, D).to(dtype), r(B, hk, prompt, D).to(dtype),
                                                         W, mask), W, keep_key_features=False)
    full = ops.RingHybridState.from_state(window_state(r(B, hk, W, D).to(dtype), r(B, hk, W, D).to(dtype), W), W,
                                          keep_key_features=False)
    order = torch.randperm(W, generator=gen)  # any order: the softmax does not depend on it
    full.keys, full.values = full.keys[:, :, order].contiguous(), full.values[:, :, order].contiguous()
    full.slot.fill_(W - 7)  # wraps around after 7 steps
    return (("partly", partly), ("full", full))


def _steps(h, hk, dtype, q_dtype, softcap, *, parts=None, steps=46, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kw = dict(scale=D ** -0.5, softcap=softcap)
    tol = 2e-5 if dtype == torch.float32 and q_dtype == torch.float32 else 2e-2
    for name, start in _starts(h, hk, dtype, gen):
        ring, twin = start, start.map(torch.clone)
        for i in range(steps):
            if strided:  # slices of one projection's output [B, 1, (H + 2 Hk) D], as a fused q/k/v product gives
                out = torch.randn(B, 1, (h + 2 * hk) * D, generator=gen).to(q_dtype) * 2
                q, k, v = (x.unflatten(-1, (-1, D)).transpose(1, 2) for x in out.split([h * D, hk * D, hk * D], -1))
            else:
                q = (torch.randn(B, h, 1, D, generator=gen) * 2).to(q_dtype)
                k, v = (torch.randn(B, hk, 1, D, generator=gen).to(q_dtype) for _ in range(2))
            if dtype != q_dtype:  # the interpreter rounds fp32 to bf16 toward zero (CUDA and torch to nearest):
                q, k, v = (x.to(dtype).to(q_dtype) for x in (q, k, v))  # inputs that the ring's dtype holds
            want, twin = _reference(q, k, v, twin, **kw)
            got, ring = window_step_ring_triton(q, k, v, ring, **kw, parts=parts)
            where = (name, i, h, hk, str(dtype), str(q_dtype), softcap, parts)
            assert got.dtype == q_dtype and got.shape == (B, h, 1, D), where
            _close(got, want.double(), where, tol=tol)
            assert torch.equal(ring.keys, twin.keys) and torch.equal(ring.values, twin.values), where
            assert torch.equal(ring.valid, twin.valid) and torch.equal(ring.slot, twin.slot), where
            assert not ring.counters.any(), where  # the arrival counts left zero for the next step
        if steps >= W:
            assert bool(ring.valid.all()), name  # the steps filled the ring


def check_gqa():
    _steps(6, 2, torch.float32, torch.float32, None)


def check_softcap():
    _steps(6, 2, torch.float32, torch.float32, 3.0, seed=1)


def check_mha():
    _steps(2, 2, torch.float32, torch.float32, 3.0, seed=2)


def check_half():
    _steps(6, 2, torch.bfloat16, torch.float32, None, steps=20, seed=3)
    _steps(6, 2, torch.bfloat16, torch.bfloat16, 3.0, steps=20, seed=4)
    _steps(6, 2, torch.float16, torch.bfloat16, None, steps=12, seed=10)


def check_parts():
    _steps(6, 2, torch.float32, torch.float32, 3.0, parts=3, steps=20, seed=5)
    _steps(6, 2, torch.bfloat16, torch.bfloat16, None, parts=2, steps=10, seed=6)
    tile, step_triton.MERGE_PARTS = step_triton.MERGE_PARTS, 2  # three parts two at a time: a whole tile, a partial
    try:
        _steps(6, 2, torch.float32, torch.float32, None, parts=3, steps=12, seed=12)
    finally:
        step_triton.MERGE_PARTS = tile


def check_strided():
    _steps(6, 2, torch.float32, torch.float32, None, strided=True, steps=10, seed=7)


def check_sinks():
    """Rings with attention sinks (``ops/window/sinks.py``): 3 sink slots before 40 ring slots, from a left-padded
    prompt whose second sequence (2 real tokens) lacks a sink; the kernel whole and in 2 parts (the slot advanced
    past the sinks in the same launch), each step followed by ``settle_sinks``, against the PyTorch step."""
    from linearize.ops.window.sinks import settle_sinks, sink_ring_state, sink_window_state

    gen = torch.Generator().manual_seed(11)
    kw = dict(scale=D ** -0.5, softcap=None)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[1, :4] = False
    for parts, own in ((None, False), (2, False), (None, True), (2, True)):  # own: the sinks' own queries (reach)
        k0, v0 = torch.randn(B, 2, 6, D, generator=gen), torch.randn(B, 2, 6, D, generator=gen)
        ring = sink_ring_state(sink_window_state(k0, v0, W, 3, mask), W)
        twin = ring.map(torch.clone)
        assert ring.fill.tolist() == [3, 2] and int(ring.slot) == 3
        for i in range(50):
            q = torch.randn(B, 6, 1, D, generator=gen) * 2
            k, v = torch.randn(B, 2, 1, D, generator=gen), torch.randn(B, 2, 1, D, generator=gen)
            sink_q = torch.randn(B, 6, 1, D, generator=gen) * 2 if own else None
            want, twin = _reference(q, k, v, twin, **kw, sink_q=sink_q)
            settle_sinks(twin)
            got, ring = window_step_ring_triton(q, k, v, ring, **kw, parts=parts, sink_q=sink_q)
            settle_sinks(ring)
            where = ("sinks", parts, own, i)
            _close(got, want.double(), where, tol=2e-5)
            assert torch.equal(ring.keys, twin.keys) and torch.equal(ring.values, twin.values), where
            assert torch.equal(ring.valid, twin.valid) and torch.equal(ring.slot, twin.slot), where
            assert torch.equal(ring.fill, twin.fill), where
            assert 3 <= int(ring.slot) < 3 + W, where
        assert ring.fill.tolist() == [3, 3] and bool(ring.valid.all()), parts


def check_sinks_rope():
    """The sinks' queries rotated inside the kernel (``sink_rope``: the tables at the reach for the sequences past
    it; here one of the batch is, the other not) against ``sink_q`` rotated in PyTorch then the PyTorch step: full
    and partial rotary dims, fp32 and float8 rings, whole and in parts."""
    from linearize.models.base import rope_rotate_half
    from linearize.ops.window.sinks import settle_sinks, sink_ring_state, sink_window_state

    gen = torch.Generator().manual_seed(12)
    mask = torch.ones(B, 6, dtype=torch.bool)
    for rot, parts, float8 in ((D, None, False), (D // 2, 2, False), (D, 2, True)):
        k0, v0 = torch.randn(B, 2, 6, D, generator=gen), torch.randn(B, 2, 6, D, generator=gen)
        codes = None
        if float8:
            (k0, k8, ks), (v0, v8, vs) = f8.fake_quantize(k0), f8.fake_quantize(v0)
            codes = (k8, ks, v8, vs)
        ring = sink_ring_state(sink_window_state(k0, v0, W, 3, mask, codes), W)
        twin = ring.map(torch.clone)
        positions = torch.tensor([5, 20])
        reach = 12
        freq = torch.rand(rot // 2, generator=gen)
        angles = lambda p: torch.cat([p[..., None] * freq] * 2, -1)  # noqa: E731
        table = lambda p: (angles(p).cos(), angles(p).sin())  # noqa: E731
        at_cos, at_sin = (x.reshape(-1) for x in table(torch.tensor(float(reach))))
        for t in range(10):
            q = torch.randn(B, 6, 1, D, generator=gen)
            k, v = (torch.randn(B, 2, 1, D, generator=gen) for _ in range(2))
            p = (positions + t).float()
            cos, sin = (x[:, None] for x in table(p))  # [B, 1, R]
            launch = step_triton.window_step_ring_float8_triton if float8 else window_step_ring_triton
            got, ring = launch(q, k, v, ring, scale=0.3, parts=parts, position_embeddings=(cos, sin),
                               sink_rope=(at_cos, at_sin, positions + t, reach))
            settle_sinks(ring)
            over = (positions + t > reach)[:, None, None]
            sink_q = rope_rotate_half(q, torch.where(over, at_cos, cos), torch.where(over, at_sin, sin))
            rq, rk = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
            if float8:
                want, twin = _float8_step(rq, rk, v, twin, False, scale=0.3, sink_q=sink_q)
            else:
                want, twin = _reference(rq, rk, v, twin, scale=0.3, sink_q=sink_q)
            settle_sinks(twin)
            _close(got, want.double(), ("sinks_rope", rot, parts, float8, t), tol=2e-5 if not float8 else 2e-2)
            assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid)


def check_decoder(float8=False, sinks=0, reach=None):
    """The fast decoder of tiny float32 students with kept window layers (Llama's two of 6 and 9 tokens, GQA;
    Gemma 2's one of 9, soft-capped), the ring step on the kernel (the dispatch told it runs on CUDA) against
    the PyTorch step, from a batch with a left-padded prompt, the rings wrapping around: every window step's
    output, and the greedy tokens. ``float8``: the window layers' rings in float8; ``sinks``: with that many
    attention sinks (7: more than the padded prompt's 5 real tokens); ``reach``: the window layers' (at least the
    window + the sinks; past it a query scores the sinks from there)."""
    from transformers import AutoModelForCausalLM

    import linearize
    from helpers import tiny_config
    from linearize.decode import FastDecoder
    from linearize.mixers.window import WindowSoftmax

    rules = window_ops._use_window_step_kernel, f8._use_float8_step_kernel
    step = WindowSoftmax.step
    outputs = []

    def recorded(self, *args):
        o, state = step(self, *args)
        outputs.append((isinstance(state, f8.Float8RingState if float8 else ops.RingHybridState), o.clone()))
        return o, state

    WindowSoftmax.step = recorded
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    try:
        for family in ("llama", "gemma2"):
            torch.manual_seed(0)
            teacher = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=2)).eval()
            model = linearize.convert(teacher, {"kind": "lolcats", "window": 4, "feature_dim": 8,
                                                "keep_softmax": [0, 1], "softmax_window": "6,1:9",
                                                "softmax_window_sinks": sinks,
                                                **({"softmax_window_dtype": "float8"} if float8 else {})})
            model.generation_config.eos_token_id = None
            if reach is not None:
                from linearize.models import get_adapter

                for m in model.modules():
                    if isinstance(m, WindowSoftmax):
                        m.set_reach(reach, get_adapter(model.config).rope_tables(model, m.layer_idx))
            plain = FastDecoder(model).generate(ids, mask, max_new_tokens=16, pad_token_id=0)
            want, outputs[:] = list(outputs), []
            window_ops._use_window_step_kernel = f8._use_float8_step_kernel = lambda q, state: True  # as on CUDA
            try:
                fused = FastDecoder(model).generate(ids, mask, max_new_tokens=16, pad_token_id=0)
            finally:
                window_ops._use_window_step_kernel, f8._use_float8_step_kernel = rules
            assert torch.equal(fused, plain), family
            assert len(outputs) == len(want) >= 15 and all(ring for ring, _ in outputs), family  # 15 steps a layer
            for i, ((_, got), (_, ref)) in enumerate(zip(outputs, want)):
                _close(got, ref.double(), (family, i))
            outputs.clear()
    finally:
        WindowSoftmax.step = step


def check_rope():
    """The kernel rotating q and k itself (``position_embeddings``) against RoPE by rotating halves in PyTorch
    then the PyTorch step: full and partial rotary dims, a batch of positions, the ring whole and in parts."""
    from linearize.models.base import rope_rotate_half

    gen = torch.Generator().manual_seed(11)
    for rot, parts in ((D, None), (D // 2, 3)):
        for _, start in _starts(6, 2, torch.float32, gen):
            ring, twin = start, start.map(torch.clone)
            for t in range(12):
                q = torch.randn(B, 6, 1, D, generator=gen)
                k, v = (torch.randn(B, 2, 1, D, generator=gen) for _ in range(2))
                angles = torch.randn(B, 1, rot // 2, generator=gen) * 3 + t
                cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
                got, ring = window_step_ring_triton(q, k, v, ring, scale=0.3, parts=parts,
                                                    position_embeddings=(cos, sin))
                rq, rk = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
                want, twin = _reference(rq, rk, v, twin, scale=0.3)
                _close(got, want.double(), ("rope", rot, t), tol=2e-5)
                torch.testing.assert_close(ring.keys, twin.keys, atol=1e-5, rtol=1e-5)
                assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid)


def check_fma():
    step_triton.STEP_MMA = False
    try:
        _steps(6, 2, torch.float32, torch.float32, 3.0, steps=12, seed=8)
        _steps(2, 2, torch.bfloat16, torch.bfloat16, None, parts=3, steps=12, seed=9)
        _float8_steps(6, 2, torch.float32, 3.0, steps=12, seed=17)  # float8 rings: the codes decoded, no tl.dot
        _float8_steps(6, 2, torch.bfloat16, None, parts=2, steps=10, seed=18)
    finally:
        step_triton.STEP_MMA = True


def _exact(x):
    """``x`` scaled to a largest entry of 1.75 in each vector: a scale of ``2^-8``, so that the read-back codes
    are bf16 numbers (the interpreter rounds fp32 to bf16 toward zero, CUDA and torch to nearest)."""
    return x / x.abs().amax(-1, keepdim=True) * 1.75


def _float8_starts(hk, gen, exact=False):
    """Two float8 rings of ``W`` slots, as ``_starts``: partly empty after a left-padded prompt, and full in any
    order (codes and scales moved together). ``exact``: scales that bf16 read-backs hold (``_exact``)."""
    r = lambda *s: (_exact if exact else torch.as_tensor)(torch.randn(*s, generator=gen))  # noqa: E731

    def ring(t, key_mask):
        k, k8, ks = f8.fake_quantize(r(B, hk, t, D))
        v, v8, vs = f8.fake_quantize(r(B, hk, t, D))
        return f8.Float8RingState.from_state(f8.float8_window_state(window_state(k, v, W, key_mask), k8, ks, v8, vs),
                                             W)

    prompt = 9
    mask = torch.ones(B, prompt, dtype=torch.bool)
    mask[1, :4] = False
    partly, full = ring(prompt, mask), ring(W, None)
    order = torch.randperm(W, generator=gen)
    shuffle = lambda x: x[:, :, order].contiguous()  # noqa: E731
    full.keys, full.values = (shuffle(x.view(torch.uint8)).view(f8.FLOAT8) for x in (full.keys, full.values))
    full.key_scale, full.value_scale = shuffle(full.key_scale), shuffle(full.value_scale)
    full.slot.fill_(W - 7)
    return (("partly", partly), ("full", full))


def _special(x, i):
    """``x`` ``[B, Hk, 1, D]`` with entries whose codes the kernel must round as torch does: -0 (its sign kept),
    one far below the vector's largest (a subnormal e4m3 code) and one that rounds to -0; at step 3 a vector
    of -0s, at step 5 one of zeros (scale float32's tiny, codes 0x80 and 0). Numbers that bf16 holds where
    ``x`` is ``_exact``'s."""
    x = x.clone()
    top = x.abs().amax(-1)
    x[..., 1], x[..., -1] = 0.0, -0.0
    x[..., 2], x[..., -2] = top * 1.5 * 2 ** -16, -top * 2 ** -21
    if i == 3:
        x[0, 0] = -0.0
    if i == 5:
        x[-1, -1] = 0.0
    return x


def _float8_step(q, k, v, ring, kernel, parts=None, **kw):
    """``float8_window_step_ring`` on the kernel (the dispatch told it runs on CUDA; ``parts`` parts of the ring)
    or, ``FLOAT8_STEP_KERNEL`` off, its PyTorch path."""
    rule, launch = f8._use_float8_step_kernel, step_triton.window_step_ring_float8_triton
    f8.FLOAT8_STEP_KERNEL = kernel
    f8._use_float8_step_kernel = lambda q, state: f8.FLOAT8_STEP_KERNEL
    step_triton.window_step_ring_float8_triton = functools.partial(launch, parts=parts)
    try:
        return f8.float8_window_step_ring(q, k, v, ring, window_softmax_step_ring, **kw)
    finally:
        f8.FLOAT8_STEP_KERNEL, f8._use_float8_step_kernel = True, rule
        step_triton.window_step_ring_float8_triton = launch


def _same_ring(ring, twin, where):
    """Two float8 rings' buffers bit for bit: codes, scales, valid slots and counter."""
    for a, c in ((ring.keys, twin.keys), (ring.values, twin.values)):
        assert a.dtype == f8.FLOAT8 and torch.equal(a.view(torch.uint8), c.view(torch.uint8)), where
    for a, c in ((ring.key_scale, twin.key_scale), (ring.value_scale, twin.value_scale), (ring.valid, twin.valid),
                 (ring.slot, twin.slot)):
        assert torch.equal(a, c), where


def _float8_steps(h, hk, q_dtype, softcap, *, parts=None, steps=46, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kw = dict(scale=D ** -0.5, softcap=softcap)
    exact = q_dtype != torch.float32
    tol = 2e-2 if exact else 2e-5
    for name, start in _float8_starts(hk, gen, exact):
        ring, twin = start, start.map(torch.clone)
        for i in range(steps):
            q = (torch.randn(B, h, 1, D, generator=gen) * 2).to(q_dtype)
            k, v = (torch.randn(B, hk, 1, D, generator=gen) for _ in range(2))
            k, v = (_special(_exact(x) if exact else x, i).to(q_dtype) for x in (k, v))
            want, twin = _float8_step(q, k, v, twin, False, **kw)
            got, ring = _float8_step(q, k, v, ring, True, parts=parts, **kw)
            where = (name, i, h, hk, str(q_dtype), softcap, parts)
            assert got.dtype == q_dtype and got.shape == (B, h, 1, D), where
            _close(got, want.double(), where, tol=tol)
            _same_ring(ring, twin, where)
        if steps >= W:
            assert bool(ring.valid.all()), name


def check_float8():
    _float8_steps(6, 2, torch.float32, None, seed=11)
    _float8_steps(6, 2, torch.bfloat16, None, steps=12, seed=12)


def check_float8_softcap():
    _float8_steps(6, 2, torch.float32, 3.0, steps=20, seed=13)
    _float8_steps(2, 2, torch.bfloat16, 3.0, steps=12, seed=14)


def check_float8_parts():
    _float8_steps(6, 2, torch.float32, 3.0, parts=3, steps=20, seed=15)
    _float8_steps(6, 2, torch.bfloat16, None, parts=2, steps=10, seed=16)


def check_float8_rope():
    """The float8 kernel rotating q and k itself (``position_embeddings``), then quantising k, against RoPE by
    rotating halves in PyTorch then the PyTorch path: full and partial rotary dims, the ring whole and in 3
    parts, fp32 queries: the outputs, and every buffer of the ring bit for bit."""
    from linearize.models.base import rope_rotate_half

    gen = torch.Generator().manual_seed(17)
    kw = dict(scale=D ** -0.5, softcap=None)
    for rot, parts, steps in ((D, None, 46), (D // 2, 3, 12), (D // 2, None, 12), (D, 2, 9)):
        for name, start in _float8_starts(2, gen):
            ring, twin = start, start.map(torch.clone)
            for t in range(steps):
                q = torch.randn(B, 6, 1, D, generator=gen) * 2
                k, v = (_special(torch.randn(B, 2, 1, D, generator=gen), t) for _ in range(2))
                angles = torch.randn(B, 1, rot // 2, generator=gen) * 3 + t
                cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
                got, ring = step_triton.window_step_ring_float8_triton(q, k, v, ring, **kw, parts=parts,
                                                                       position_embeddings=(cos, sin))
                rq, rk = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
                want, twin = _float8_step(rq, rk, v, twin, False, **kw)
                where = ("float8_rope", name, rot, parts, t)
                _close(got, want.double(), where, tol=2e-5)
                _same_ring(ring, twin, where)
            if steps >= W:
                assert bool(ring.valid.all()), name


def check_float8_rope_bf16():
    """bf16 q, k, v and cos / sin: the kernel rotates in fp32 and rounds once to bf16 (q and k), then quantises k;
    against RoPE computed the same way in PyTorch, then the PyTorch path (the families' bf16 RoPE rounds each
    product and the sum: a bit off here and there, so one e4m3 code off). The casts round as on CUDA. The ring's
    codes and scales bit for bit, the outputs to bf16 rounding."""
    from linearize.models.base import rope_rotate_half

    def rope(x, cos, sin):
        return rope_rotate_half(x.float(), cos.float(), sin.float()).to(x.dtype)

    gen = torch.Generator().manual_seed(19)
    kw = dict(scale=D ** -0.5, softcap=None)
    with bf16_rounded_like_cuda():
        for rot, parts in ((D, None), (D // 2, 3)):
            for name, start in _float8_starts(2, gen):
                ring, twin = start, start.map(torch.clone)
                for t in range(12):
                    q = (torch.randn(B, 6, 1, D, generator=gen) * 2).bfloat16()
                    k, v = (_special(torch.randn(B, 2, 1, D, generator=gen), t).bfloat16() for _ in range(2))
                    angles = torch.randn(B, 1, rot // 2, generator=gen) * 3 + t
                    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
                    got, ring = step_triton.window_step_ring_float8_triton(q, k, v, ring, **kw, parts=parts,
                                                                           position_embeddings=(cos, sin))
                    want, twin = _float8_step(rope(q, cos, sin), rope(k, cos, sin), v, twin, False, **kw)
                    where = ("float8_rope_bf16", name, rot, parts, t)
                    assert got.dtype == want.dtype == torch.bfloat16, where
                    _close(got, want.double(), where, tol=1e-2)
                    _same_ring(ring, twin, where)


def encoder_inputs(gen, beyond=False):
    """fp32 numbers for the e4m3 encoder, both signs: every finite e4m3 value (zeros of both signs), the
    midpoints between neighbours (ties, to even) and the fp32 numbers either side of them, the subnormal range
    below 2^-6 down to fp32's subnormals, 448 to 464 (which round to 448), and random bit patterns and
    log-uniform magnitudes up to 464. ``beyond``: also past 464, inf and NaN (saturated by torch 2.13)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f8.FLOAT8).float()
    every = every[~every.isnan()]
    pos = every[every > 0].unique()  # sorted
    mids = ((pos[:-1].double() + pos[1:].double()) / 2).float()
    assert torch.equal(mids.double(), (pos[:-1].double() + pos[1:].double()) / 2)  # fp32 holds them
    inf = torch.tensor(float("inf"))
    near = torch.cat([mids, mids.nextafter(inf), mids.nextafter(-inf)])
    small = torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -6, 2.0 ** -7, 1e-20, 1e-38, 1e-40, 1e-45])
    small = torch.cat([small, small.nextafter(inf), small.nextafter(-inf)])
    top = torch.tensor([448.0, 450.0, 456.0, 460.0, 464.0, 463.99])
    bits = torch.randint(0, 2 ** 31 - 1, (20000,), generator=gen, dtype=torch.int32).view(torch.float32)
    bits = bits[bits.abs() <= 464]
    logs = torch.exp2(torch.rand(20000, generator=gen) * 40 - 31).clamp(max=464)
    x = torch.cat([every, near, small, top, bits, logs])
    if beyond:
        past = torch.tensor([470.0, 479.99, 480.0, 1e6, 3e38, float("inf"), float("nan")])
        x = torch.cat([x, torch.tensor([464.0]).nextafter(inf), past])
    return torch.cat([x, -x]).contiguous()


@triton.jit
def _encode(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, step_triton._e4m3_code(tl.load(x_ptr + i, mask=i < N, other=0.0)), mask=i < N)


def check_float8_encode():
    """The kernel's e4m3 encoding (``_e4m3_code``) against ``Tensor.to(float8_e4m3fn)`` bit for bit: ties to
    even, subnormals, signed zeros, and out of range as torch."""
    x = encoder_inputs(torch.Generator().manual_seed(18), beyond=True)
    got = torch.empty(x.shape, dtype=torch.int32)
    _encode[(triton.cdiv(x.numel(), 4096),)](x, got, x.numel(), BLOCK=4096)
    want = x.to(f8.FLOAT8).view(torch.uint8).to(torch.int32)
    bad = got != want
    assert not bad.any(), (x[bad][:8], got[bad][:8], want[bad][:8])


@triton.jit
def _quantize_rows(x_ptr, c_ptr, s_ptr, D, BD: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BD)
    codes, scale = step_triton._quantize(tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32), d < D)
    tl.store(c_ptr + row * D + d, codes.to(tl.uint8), mask=d < D)
    tl.store(s_ptr + row, scale)


def quantize_rows(gen):
    """Rows for the kernel's quantisation (12 wide: a padded tile): random ones of every size, zeros of both
    signs, largest entries at 448 times powers of 2, rows so small that the scale is clamped to float32's
    tiny (fp32 subnormals among them), and rows holding e4m3's ties."""
    r = torch.randn(64, 12, generator=gen) * torch.exp2(torch.randint(-40, 40, (64, 1), generator=gen).float())
    zeros = torch.zeros(2, 12)
    zeros[1] = -0.0
    powers = torch.randn(4, 12, generator=gen)
    powers[:, 0] = 448.0 * torch.tensor([1.0, 2.0 ** -20, 2.0 ** 10, 0.5])
    tiny = torch.randn(3, 12, generator=gen) * torch.tensor([[1e-36], [1e-38], [1e-41]])
    ties = torch.tensor([448.0, 5.5 * 2 ** -9, 0.5 * 2 ** -9, 1.0625, -1.1875, 2 ** -6 + 2 ** -10, 13.0, 104.0,
                         -0.0, 3.0, 2 ** -10, -(2 ** -10)])[None]
    return torch.cat([r, zeros, powers, tiny, ties])


def check_float8_quantize():
    """The kernel's quantisation of one vector (``_quantize``) against ``float8.quantize``, codes and scales bit
    for bit, from fp32 and from bf16 (bf16's subnormals left out: the interpreter reads them wrong)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = quantize_rows(torch.Generator().manual_seed(19)).to(dtype)
        if dtype == torch.bfloat16:
            x = x[~((x != 0) & (x.float().abs() < torch.finfo(torch.float32).tiny)).any(1)]
        codes = torch.empty(x.shape, dtype=torch.uint8)
        scales = torch.empty(x.shape[0])
        _quantize_rows[(x.shape[0],)](x, codes, scales, x.shape[1], BD=16)
        want, want_scale = f8.quantize(x)
        assert torch.equal(scales, want_scale[:, 0]), (dtype, scales, want_scale[:, 0])
        assert torch.equal(codes, want.view(torch.uint8)), dtype


@triton.jit
def _decode(b_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, step_triton._e4m3(tl.load(b_ptr + i)))


def check_float8_decode():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256)
    _decode[(1,)](codes, got, N=256)
    want = codes.view(f8.FLOAT8).to(torch.float32)
    real = (codes & 0x7F) != 0x7F  # all but the NaNs
    assert torch.equal(got[real], want[real]), (got[real] - want[real]).abs().max()
    assert torch.equal(got[real].signbit(), want[real].signbit())  # 0x80 is -0


def check_float8_decoder():
    check_decoder(float8=True)


class _Launches:
    """Stands in for ``_window_ring_step`` and records each launch's (MMA, BW, num_warps)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((kw["MMA"], kw["BW"], kw["num_warps"]))
            return self.kernel[grid](*args, **kw)
        return launch


def check_float8_crowded():
    before = step_triton.STEP_PROGRAMS, step_triton.STEP_CROWDED_FP8, step_triton._window_ring_step
    step_triton.STEP_PROGRAMS = 1  # every step crowded: the ring's own tiles, whatever its batch
    try:
        for tiles in ((False, 16, 4), (True, 32, 2)):
            step_triton.STEP_CROWDED_FP8 = tiles
            step_triton._window_ring_step = spy = _Launches(before[2])
            _float8_steps(6, 2, torch.float32, 3.0, steps=12, seed=19)
            _float8_steps(6, 2, torch.bfloat16, None, steps=10, seed=20)
            check_decoder(float8=True, sinks=3, reach=0)
            assert spy.seen and set(spy.seen) == {tiles}, (tiles, set(spy.seen))
    finally:
        step_triton.STEP_PROGRAMS, step_triton.STEP_CROWDED_FP8, step_triton._window_ring_step = before


def check_sinks_decoder():
    check_decoder(sinks=3)
    check_decoder(float8=True, sinks=7)
    check_decoder(sinks=3, reach=0)
    check_decoder(float8=True, sinks=3, reach=0)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["gqa", "softcap", "mha", "half", "parts", "strided", "rope", "fma", "decoder",
                                 "float8", "float8_softcap", "float8_parts", "float8_rope",
                                 "float8_rope_bf16", "float8_encode", "float8_quantize", "float8_decode",
                                 "float8_decoder", "float8_crowded", "sinks", "sinks_decoder", "sinks_rope"]:
        globals()[f"check_{name}"]()
    print("ok")
