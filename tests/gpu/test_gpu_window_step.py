"""The window softmax's ring step as one Triton launch (``ops/window/step_triton.py``) on CUDA against the PyTorch
ring step, at a kept layer's shapes (9 query heads on 3 key heads, head dim 64, a ring of 1,280 slots) and off
them: token after token, the outputs and the ring's every buffer; and replayed from a CUDA graph around the
ring. The same for float8 rings (``float8_window_step_ring`` on the kernel, which quantises the new token and
writes its codes, against its PyTorch path on the read-back ring: codes and scales bit for bit), the float8
kernel rotating q and k itself, and the kernel's e4m3 pieces against torch on CUDA: decoding (integer and the
GPU's own conversion), encoding, a vector's quantisation. Skipped without CUDA."""

import pytest
import torch

from linearize import ops
from linearize.ops import window as W

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 64

try:  # the test kernels at module level: Triton's JIT resolves a kernel's callees among its module's globals
    import triton
    import triton.language as tl

    from linearize.ops.window.step_triton import _e4m3, _e4m3_code, _e4m3_value, _quantize

    @triton.jit
    def _decode_e4m3(b_ptr, o_ptr, N: tl.constexpr, NATIVE: tl.constexpr):
        i = tl.arange(0, N)
        b = tl.load(b_ptr + i)
        if NATIVE:
            x = _e4m3_value(b, True)
        else:
            x = _e4m3(b)
        tl.store(o_ptr + i, x)

    @triton.jit
    def _encode_e4m3(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + i, _e4m3_code(tl.load(x_ptr + i, mask=i < N, other=0.0)), mask=i < N)

    @triton.jit
    def _quantize_rows(x_ptr, c_ptr, s_ptr, D, BD: tl.constexpr):
        row = tl.program_id(0)
        d = tl.arange(0, BD)
        codes, scale = _quantize(tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32), d < D)
        tl.store(c_ptr + row * D + d, codes.to(tl.uint8), mask=d < D)
        tl.store(s_ptr + row, scale)
except ImportError:  # no Triton: the module's tests are skipped anyway (no CUDA)
    _decode_e4m3 = _encode_e4m3 = _quantize_rows = None


def _ring(b, hk, w, dtype, fill, g):
    """A ring with about ``fill`` of its slots valid (the others zero), the counter near its end."""
    valid = torch.rand(b, w, device="cuda", generator=g) < fill
    keys, values = (torch.randn(b, hk, w, D, device="cuda", generator=g).to(dtype) * valid[:, None, :, None]
                    for _ in range(2))
    return ops.RingHybridState(keys, keys[..., :0], values, torch.zeros(b, hk, 1, 1, D + 1, device="cuda"), valid,
                               slot=torch.tensor(w - 3, device="cuda"))


def _reference(q, k, v, ring, **kw):
    W.WINDOW_STEP_KERNEL = False
    try:
        return W.window_softmax_step_ring(q, k, v, ring, **kw)
    finally:
        W.WINDOW_STEP_KERNEL = True


def _qkv(b, h, hk, dtype, g):
    """Strided slices of one projection's output, as the adapters split it."""
    out = torch.randn(b, 1, (h + 2 * hk) * D, device="cuda", generator=g).to(dtype)
    return tuple(x.unflatten(-1, (-1, D)).transpose(1, 2) for x in out.split([h * D, hk * D, hk * D], -1))


@pytest.mark.parametrize("shape", [(1, 9, 3, 1280), (64, 9, 3, 1280), (3, 6, 2, 333), (2, 4, 4, 100)])
@pytest.mark.parametrize("ring_dtype,q_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float16, torch.float16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("parts", [None, 1, 3])
def test_window_step_kernel_equals_the_torch_step_on_cuda(shape, ring_dtype, q_dtype, softcap, parts):
    from linearize.ops.window.step_triton import window_step_ring_triton

    b, h, hk, w = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    ring = _ring(b, hk, w, ring_dtype, 0.4, g)
    twin = ring.map(torch.clone)
    tol = 1e-4 if ring_dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for i in range(6):  # wraps around after 3
            q, k, v = _qkv(b, h, hk, q_dtype, g)
            assert W._use_window_step_kernel(q, ring)
            want, twin = _reference(q, k, v, twin, scale=D ** -0.5, softcap=softcap)
            got, ring = window_step_ring_triton(q, k, v, ring, scale=D ** -0.5, softcap=softcap, parts=parts)
            assert got.dtype == q_dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            for a, c in ((ring.keys, twin.keys), (ring.values, twin.values), (ring.valid, twin.valid),
                         (ring.slot, twin.slot)):
                assert torch.equal(a, c), i


def _captured(step, ring):
    """``step(ring)`` captured in a CUDA graph (the kernels compiled first on a scratch copy, on a side stream):
    (the graph, the step's output buffer)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        scratch = ring.map(torch.clone)
        for _ in range(2):
            step(scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = step(ring)
    return graph, o


def _replays(graph, o, inputs, reference, steps, g):
    """Replay ``graph`` ``steps`` times, ``inputs`` refilled at random before each, its output ``o`` against
    ``reference()`` (the same step run eagerly on the twin ring, in place); yields each step's index for the
    caller's checks of the rings."""
    for i in range(steps):
        for x in inputs:
            x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        graph.replay()
        torch.testing.assert_close(o.float(), reference().float(), atol=2e-2, rtol=2e-2)
        yield i


@pytest.mark.parametrize("programs", [None, 1])  # the ring in parts merged in the launch; one part
def test_window_step_replays_from_a_cuda_graph(programs, monkeypatch):
    """One step captured (the dispatch takes the kernel) and replayed past the ring's end, against the PyTorch
    step run eagerly on a copy."""
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    batch, h, hk, w = 2, 9, 3, 256
    g = torch.Generator(device="cuda").manual_seed(1)
    ring = _ring(batch, hk, w, torch.bfloat16, 0.5, g)
    twin = ring.map(torch.clone)
    q, k, v = (torch.zeros(batch, n, 1, D, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    with torch.no_grad():
        graph, o = _captured(lambda r: W.window_softmax_step_ring(q, k, v, r, scale=0.125), ring)
        for i in _replays(graph, o, (q, k, v), lambda: _reference(q, k, v, twin, scale=0.125)[0], w + 20, g):
            assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid), i
        assert torch.equal(ring.keys, twin.keys) and torch.equal(ring.values, twin.values)


@pytest.mark.parametrize("programs", [None, 1])
@pytest.mark.parametrize("float8", [False, True])
@pytest.mark.parametrize("own", [False, True])
def test_sinks_ring_step_and_settling_replay_from_a_cuda_graph(programs, float8, own, monkeypatch):
    """A ring with 4 attention sinks (``ops/window/sinks.py``) after a left-padded prompt whose second sequence
    lacks two: the kernel's step and ``settle_sinks`` captured together and replayed past the ring's end, against
    the PyTorch step and settling run eagerly on a copy (the slot stays past the sinks; the sinks fill in).
    ``own``: the sink slots scored by queries of their own (the reach's ``sink_q``)."""
    from linearize.ops.window import float8 as f8
    from linearize.ops.window import step_triton
    from linearize.ops.window.sinks import settle_sinks, sink_ring_state, sink_window_state

    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    batch, h, hk, w, sinks = 2, 9, 3, 256, 4
    g = torch.Generator(device="cuda").manual_seed(3)
    k0, v0 = (torch.randn(batch, hk, 8, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(batch, 8, dtype=torch.bool, device="cuda")
    mask[1, :6] = False
    codes = None
    if float8:
        (kr, k8, ks), (vr, v8, vs) = f8.fake_quantize(k0), f8.fake_quantize(v0)
        k0, v0, codes = kr, vr, (k8, ks, v8, vs)
    ring = sink_ring_state(sink_window_state(k0, v0, w, sinks, mask, codes), w)
    assert ring.fill.tolist() == [4, 2] and _use_kernel(ring, float8)
    twin = ring.map(torch.clone)
    q, k, v, sq = (torch.zeros(batch, n, 1, D, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk, h))
    kw = dict(scale=0.125, sink_q=sq if own else None)

    def step(r, kernel=True):
        if float8:
            o, _ = _float8_step(q, k, v, r, kernel, **kw)
        else:
            o, _ = W.window_softmax_step_ring(q, k, v, r, **kw) if kernel else _reference(q, k, v, r, **kw)
        settle_sinks(r)
        return o, r

    with torch.no_grad():
        graph, o = _captured(step, ring)
        for i in _replays(graph, o, (q, k, v, sq), lambda: step(twin, kernel=False)[0], w + 20, g):
            assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid), i
            assert torch.equal(ring.fill, twin.fill), i
        assert ring.fill.tolist() == [4, 4] and sinks <= int(ring.slot) < sinks + w
        raw = (lambda x: x.view(torch.uint8)) if float8 else (lambda x: x)  # noqa: E731
        assert torch.equal(raw(ring.keys), raw(twin.keys)) and torch.equal(raw(ring.values), raw(twin.values))


def _use_kernel(ring, float8) -> bool:
    from linearize.ops.window import float8 as f8

    q = torch.zeros(ring.keys.shape[0], 9, 1, D, device="cuda", dtype=torch.bfloat16)
    return f8._use_float8_step_kernel(q, ring) if float8 else W._use_window_step_kernel(q, ring)


def _float8_ring(b, hk, w, fill, g):
    """A float8 ring with about ``fill`` of its slots valid (the others' codes and scales zero), the counter
    near its end."""
    from linearize.ops.window.float8 import Float8RingState, quantize

    valid = torch.rand(b, w, device="cuda", generator=g) < fill
    (k8, ks), (v8, vs) = (quantize(torch.randn(b, hk, w, D, device="cuda", generator=g) * 3) for _ in range(2))
    keep = valid[:, None, :, None]
    codes = [(x.view(torch.uint8) * keep).view(k8.dtype) for x in (k8, v8)]
    return Float8RingState(codes[0], torch.zeros(b, hk, w, 0, device="cuda"), codes[1],
                           torch.zeros(b, hk, 1, 1, D + 1, device="cuda"), valid,
                           slot=torch.tensor(w - 3, device="cuda"), key_scale=ks * keep, value_scale=vs * keep)


def _float8_step(q, k, v, ring, kernel, **kw):
    """``float8_window_step_ring`` on the kernel or (``FLOAT8_STEP_KERNEL`` off) on the read-back ring."""
    from linearize.ops.window import float8 as f8

    f8.FLOAT8_STEP_KERNEL = kernel
    try:
        assert f8._use_float8_step_kernel(q, ring) == kernel
        return f8.float8_window_step_ring(q, k, v, ring, W.window_softmax_step_ring, **kw)
    finally:
        f8.FLOAT8_STEP_KERNEL = True


def _kernel_steps_agree(ring, h, q_dtype, softcap, steps, g):
    """``steps`` tokens through a float8 ring on the kernel and through a copy of it on the PyTorch path: the
    outputs, and the rings' codes, scales, valid slots and counter, bit for bit."""
    b, hk = ring.keys.shape[:2]
    twin = ring.map(torch.clone)
    tol = 1e-4 if q_dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for i in range(steps):
            q, k, v = _qkv(b, h, hk, q_dtype, g)
            want, twin = _float8_step(q, k, v, twin, False, scale=D ** -0.5, softcap=softcap)
            got, ring = _float8_step(q, k, v, ring, True, scale=D ** -0.5, softcap=softcap)
            assert got.dtype == q_dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            for a, c in ((ring.keys, twin.keys), (ring.values, twin.values)):
                assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), i
            for a, c in ((ring.key_scale, twin.key_scale), (ring.value_scale, twin.value_scale),
                         (ring.valid, twin.valid), (ring.slot, twin.slot)):
                assert torch.equal(a, c), i


@pytest.mark.parametrize("shape", [(1, 9, 3, 1280), (64, 9, 3, 1280), (3, 6, 2, 333), (2, 4, 4, 100)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("programs", [None, 1])
def test_float8_ring_step_kernel_equals_the_torch_path_on_cuda(shape, q_dtype, softcap, programs, monkeypatch):
    """``float8_window_step_ring`` on the kernel reading the codes against its PyTorch path on the read-back
    ring, token after token (the ring in parts and in one; with one program aimed for, in one on the crowded
    tiles, ``STEP_CROWDED_FP8``): the outputs, and the ring's codes, scales, valid slots and counter."""
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    b, h, hk, w = shape
    g = torch.Generator(device="cuda").manual_seed(2)
    ring = _float8_ring(b, hk, w, 0.4, g)
    _kernel_steps_agree(ring, h, q_dtype, softcap, 6, g)  # wraps around after 3


@pytest.mark.parametrize("tiles", [(True, 64, 2), (False, 16, 4), (False, 32, 4)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_crowded_float8_ring_step_equals_the_torch_path_on_cuda(tiles, q_dtype, monkeypatch):
    """Batch 256 on 3 key heads (crowded: a program per sequence and key head) on each candidate of
    ``STEP_CROWDED_FP8`` (tensor cores or broadcast sums) against the PyTorch path on the read-back ring, token after
    token: the outputs, and the ring's codes, scales, valid slots and counter."""
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_CROWDED_FP8", tiles)
    b, h, hk, w = 256, 9, 3, 333
    assert step_triton.step_tiles(b, hk, D, True, step_triton._target_programs(torch.device("cuda")))[0] == tiles[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    ring = _float8_ring(b, hk, w, 0.6, g)
    _kernel_steps_agree(ring, h, q_dtype, None, 5, g)


@pytest.mark.parametrize("b,programs,crowded", [(1, None, None), (64, None, None), (256, None, (True, 64, 2)),
                                                 (3, 1, None)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("held", [True, False])
def test_float8_ring_step_with_values_held_equals_the_torch_path_on_cuda(b, programs, crowded, q_dtype, held,
                                                                         monkeypatch):
    """``STEP_HOLD_VALUES``: the values converted where they are loaded (the product then reads them as 16-bit
    words; the default) or as float8 codes past shared memory, on the default tiles (the ring in parts at batch 1
    and 64, in one with one program aimed for) and the crowded ones at batch 256, against the PyTorch path, token
    after token."""
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_HOLD_VALUES", held)
    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    monkeypatch.setattr(step_triton, "STEP_CROWDED_FP8", crowded)
    g = torch.Generator(device="cuda").manual_seed(4)
    ring = _float8_ring(b, 3, 1284 if b < 256 else 333, 0.5, g)
    _kernel_steps_agree(ring, 9, q_dtype, None, 5, g)


@pytest.mark.parametrize("native", [False, True])
def test_float8_e4m3_decoding_on_cuda(native):
    """The kernel's e4m3 decoding of every byte but the NaNs, as torch reads the codes: by integer arithmetic
    (``_e4m3``) and by the GPU's own conversion (``_e4m3_value``, NATIVE: what the kernel uses on sm_89+)."""
    if native and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 conversions need sm_89")
    codes = torch.arange(256, device="cuda", dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256, device="cuda")
    _decode_e4m3[(1,)](codes, got, N=256, NATIVE=native)
    want = codes.view(torch.float8_e4m3fn).float()
    real = (codes & 0x7F) != 0x7F
    assert torch.equal(got[real], want[real]) and torch.equal(got[real].signbit(), want[real].signbit())


def _encoder_inputs(g):
    """fp32 numbers up to 464 in size, both signs: every finite e4m3 value, the midpoints between neighbours (ties)
    and the fp32 numbers either side, the subnormal range down to fp32's subnormals, random bit patterns and
    log-uniform magnitudes."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    pos = every[every > 0].unique()
    mids = ((pos[:-1].double() + pos[1:].double()) / 2).float()
    inf = torch.tensor(float("inf"))
    small = torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -6, 2.0 ** -7, 1e-20, 1e-38, 1e-40, 1e-45])
    bits = torch.randint(0, 2 ** 31 - 1, (200000,), generator=g, dtype=torch.int32).view(torch.float32)
    logs = torch.exp2(torch.rand(200000, generator=g) * 40 - 31)
    x = torch.cat([every[~every.isnan()], mids, mids.nextafter(inf), mids.nextafter(-inf), small,
                   small.nextafter(inf), small.nextafter(-inf), torch.tensor([448.0, 456.0, 464.0]), bits, logs])
    x = x[x.abs() <= 464]
    return torch.cat([x, -x]).cuda()


def test_float8_e4m3_encoding_on_cuda():
    """The kernel's e4m3 encoding (``_e4m3_code``) bit for bit as torch converts fp32 on CUDA (and on the CPU):
    ties to even, subnormals, signed zeros."""
    x = _encoder_inputs(torch.Generator().manual_seed(6))
    got = torch.empty(x.shape, device="cuda", dtype=torch.int32)
    _encode_e4m3[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).int()
    bad = got != want
    assert not bad.any(), (x[bad][:8], got[bad][:8], want[bad][:8])
    assert torch.equal(want.cpu(), x.cpu().to(torch.float8_e4m3fn).view(torch.uint8).int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["random", "tiny"])
def test_float8_quantize_on_cuda(dtype, rows):
    """The kernel's quantisation of a vector (``_quantize``: ``div_rn`` divisions, ``_e4m3_code``) bit for bit
    as ``float8.quantize`` on CUDA: random vectors of every size, zeros of both signs, ties; ``tiny``: vectors
    whose scale is clamped to float32's tiny, fp32 subnormals among them (a flush to zero would show here)."""
    from linearize.ops.window.float8 import quantize

    g = torch.Generator().manual_seed(7)
    if rows == "random":
        x = torch.randn(4096, 12, generator=g) * torch.exp2(torch.randint(-40, 40, (4096, 1), generator=g).float())
        ties = torch.tensor([448.0, 5.5 * 2 ** -9, 0.5 * 2 ** -9, 1.0625, -1.1875, 2 ** -6 + 2 ** -10, 13.0, 104.0,
                             -0.0, 3.0, 2 ** -10, -(2 ** -10)])[None]
        x = torch.cat([x, torch.zeros(1, 12), torch.full((1, 12), -0.0), ties])
    else:
        x = torch.randn(64, 12, generator=g) * torch.tensor([1e-36, 1e-38, 1e-40, 1e-43]).repeat(16)[:, None]
    x = x.to(dtype).cuda()
    codes = torch.empty(x.shape, device="cuda", dtype=torch.uint8)
    scales = torch.empty(x.shape[0], device="cuda")
    _quantize_rows[(x.shape[0],)](x, codes, scales, x.shape[1], BD=16)
    want, want_scale = quantize(x)
    assert torch.equal(scales, want_scale[:, 0])
    bad = codes != want.view(torch.uint8)
    assert not bad.any(), (x[bad][:8], codes[bad][:8], want.view(torch.uint8)[bad][:8])


@pytest.mark.parametrize("programs", [None, 1])
def test_float8_ring_step_replays_from_a_cuda_graph(programs, monkeypatch):
    """A float8 ring's step captured (quantising, writing the codes and the kernel) and replayed past the
    ring's end, against the PyTorch path run eagerly on a copy."""
    from linearize.ops.window import float8 as f8
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    batch, h, hk, w = 2, 9, 3, 256
    g = torch.Generator(device="cuda").manual_seed(3)
    ring = _float8_ring(batch, hk, w, 0.5, g)
    twin = ring.map(torch.clone)
    q, k, v = (torch.zeros(batch, n, 1, D, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    step = lambda r: f8.float8_window_step_ring(q, k, v, r, W.window_softmax_step_ring, scale=0.125)  # noqa: E731
    with torch.no_grad():
        graph, o = _captured(step, ring)
        for i in _replays(graph, o, (q, k, v), lambda: _float8_step(q, k, v, twin, False, scale=0.125)[0], w + 20, g):
            assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid), i
        for a, c in ((ring.keys, twin.keys), (ring.values, twin.values)):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(ring.key_scale, twin.key_scale) and torch.equal(ring.value_scale, twin.value_scale)


@pytest.mark.parametrize("rot", [D, D // 2])
def test_window_step_kernel_rotates_q_and_k_itself_on_cuda(rot):
    """``position_embeddings`` given: the kernel's RoPE (fp32, by rotating halves over ``rot`` dims) against the
    families' RoPE in PyTorch, then the PyTorch step, in bf16 at a kept layer's shapes."""
    from linearize.models.base import rope_rotate_half
    from linearize.ops.window.step_triton import window_step_ring_triton

    g = torch.Generator(device="cuda").manual_seed(5)
    ring = _ring(4, 3, 1280, torch.bfloat16, 0.7, g)
    twin = ring.map(torch.clone)
    for t in range(8):
        q, k, v = _qkv(4, 9, 3, torch.bfloat16, g)
        angles = torch.randn(4, 1, rot // 2, device="cuda", generator=g) * 3 + t
        cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
        with torch.no_grad():
            got, ring = window_step_ring_triton(q, k, v, ring, scale=0.125, position_embeddings=(cos, sin))
            want, twin = _reference(rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin), v, twin, scale=0.125)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid)
        torch.testing.assert_close(ring.keys.float(), twin.keys.float(), atol=2e-2, rtol=2e-2)


def _adjacent(a, b):
    """Whether float8 codes ``a`` and ``b`` are the same or neighbours (their magnitudes one step apart, or both
    within one step of zero)."""
    a, b = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    ma, mb = a & 0x7F, b & 0x7F
    same_sign = (a ^ b) < 0x80
    return bool((((ma - mb).abs() <= 1) & (same_sign | ((ma <= 1) & (mb <= 1)))).all())


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot,programs", [(D, None), (D // 2, None), (D, 1)])
def test_float8_ring_step_kernel_rotates_q_and_k_itself_on_cuda(q_dtype, rot, programs, monkeypatch):
    """``position_embeddings`` given: the float8 kernel's RoPE (fp32, by rotating halves over ``rot`` dims; on
    CUDA the compiler may fuse its products and sums) then its quantisation, against RoPE in fp32 rounded once in
    PyTorch then the PyTorch path, at a kept layer's shapes, the ring in parts and in one: the outputs, the
    scales (to rounding), the codes (the same or neighbours), valid slots and counter."""
    from linearize.models.base import rope_rotate_half
    from linearize.ops.window import step_triton

    monkeypatch.setattr(step_triton, "STEP_PROGRAMS", programs)
    g = torch.Generator(device="cuda").manual_seed(8)
    ring = _float8_ring(4, 3, 1280, 0.7, g)
    twin = ring.map(torch.clone)
    tol, scale_tol = (1e-3, 1e-6) if q_dtype == torch.float32 else (3e-2, 1e-2)
    for t in range(8):
        q, k, v = _qkv(4, 9, 3, q_dtype, g)
        angles = torch.randn(4, 1, rot // 2, device="cuda", generator=g) * 3 + t
        cos, sin = (f(torch.cat([angles, angles], -1)).to(q_dtype) for f in (torch.cos, torch.sin))
        with torch.no_grad():
            got, ring = step_triton.window_step_ring_float8_triton(q, k, v, ring, scale=0.125,
                                                                   position_embeddings=(cos, sin))
            # RoPE as the kernel computes it: in fp32, rounded once to q's dtype (the families' bf16 RoPE rounds
            # each product and the sum: bf16 keys a bit off, their scales up to 0.8 % off)
            rq, rk = (rope_rotate_half(x.float(), cos.float(), sin.float()).to(x.dtype) for x in (q, k))
            want, twin = _float8_step(rq, rk, v, twin, False, scale=0.125)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert torch.equal(ring.slot, twin.slot) and torch.equal(ring.valid, twin.valid)
        assert torch.equal(ring.values.view(torch.uint8), twin.values.view(torch.uint8))
        assert torch.equal(ring.value_scale, twin.value_scale)
        torch.testing.assert_close(ring.key_scale, twin.key_scale, atol=0, rtol=scale_tol)
        assert _adjacent(ring.keys, twin.keys), t
