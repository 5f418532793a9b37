"""Mamba's selective scan as fused Triton kernels parallel over time chunks: the CUDA twin of
``selective_scan_chunked``.

The recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t``, ``y_t = C_t . h_t + D u_t`` is
linear in ``h``, so the sequence is cut into time chunks of ``CHUNK`` tokens and every
(sequence, block of channels, chunk) gets its own program: the work runs in parallel over
``B x T``, and only a short walk over chunks stays sequential.

Layout: one channel per thread. A program holds a block of channels as 1-D vectors, and a
channel's ``N`` state entries as a tuple of ``N`` such vectors (``N`` is a compile-time constant,
the loops over it are unrolled). So the per-channel inputs (u, dt, dy) are loaded once per thread,
the sums over the state (``y``, ``du``, ``ddt``) stay inside a thread, and only the sums over
channels (``dB``, ``dC``) cross threads. (A ``[channels, N]`` tile instead lets Triton spread the
state over lanes: it replicated every per-channel value 16 times, and the backward ran out of
registers.) ``B_t`` and ``C_t`` are shared by all channels: each of their entries is one scalar load.
States in memory (chunk states, checkpoints) are stored state-index-major, ``[N, Dn]``, so those
stores are coalesced over channels.

forward, three launches:

1. per chunk, the scan from a zero state: the chunk's local end state and ``sum_t dt_t``
   (its total decay is ``exp(A sum dt)``);
2. per (sequence, block of state entries), a walk over chunks that turns these into the true
   state entering each chunk, ``h_in[c+1] = exp(A S_c) h_in[c] + local[c]``, from the initial
   state; the last one is the final state;
3. per chunk, the scan again from its true entering state, writing ``y`` and a checkpoint of the
   state every ``CKPT`` tokens (kept for the backward pass).

backward, three launches, mirrored:

1. per chunk, ``dL/dh`` at the chunk's start from its own outputs only (walked back from zero);
2. a walk over chunks in reverse giving ``dL/dh`` at every chunk's end (from ``dL/dh_T``) and
   ``dL/dh0``;
3. per chunk, the fused backward from that ``dL/dh``, ``GROUP`` tokens at a time: a group's
   states are recomputed from its checkpoint into registers (the g-th group of a checkpoint
   interval advances ``GROUP g`` tokens first) and walked backwards, so no state goes through
   memory. Sums over channels (``dB``, ``dC``) are written per channel block, sums over time
   (``dA``, ``dD``) per chunk; PyTorch adds them up.

With ``delta_softplus`` (Mamba's name), ``dt`` comes before its softplus: the forward's first pass
applies it once per element and stores the steps (fp32) for the other passes, and the backward
multiplies ddt by softplus' derivative as it stores it. (That replaces PyTorch's cast, softplus and
softplus backward over ``[B, T, Dn]``.)

Decays are ``exp2(dt * A log2(e))``. Everything accumulates in fp32 whatever the input dtype; y, du
and ddt are written in their inputs' dtypes. Tested against the PyTorch forms with Triton's
interpreter on the CPU (``tests/ops/triton_interpret_scan.py``) and on CUDA
(``tests/gpu/test_gpu_kernels.py``); the constants are the fastest of ``dev/scan_bench.py --sweep``
on an H100 (docs/RESULTS.md), except ``CKPT``: 4 was 4-9 % faster than 8 but doubles the
checkpoints' memory (302 MB per layer at 16 x 1024 instead of 151).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128  # tokens per program (time chunk); a multiple of CKPT
CKPT = 8  # the forward's checkpoint interval, a multiple of GROUP
GROUP = 4  # tokens whose states the backward holds in registers at once, a multiple of 4
BLOCK_D = 32  # channels per program of the backward's last pass (its dB, dC are summed per block)
FWD_BLOCK_D = 32  # channels per program of the other per-token passes
CARRY_BLOCK = 512  # state entries per program of the walks over chunks
FWD_WARPS = 1  # warps per program of the forward passes and the backward's first pass
BWD_WARPS = 1  # warps per program of the backward's last pass


@triton.jit
def _only(m, valid):
    """The mask ``m`` where the scalar ``valid`` holds, else all False. (Not ``m & valid``: Triton
    3.9's interpreter gives that an int32 dtype, which loads and stores refuse as a mask.)"""
    return tl.where(valid, m, False)


@triton.jit
def _chan(ptr, row, DN, d, dm, valid):
    """Token ``row``'s value of this block's channels ``d`` (fp32; 0 where masked or not ``valid``)."""
    return tl.load(ptr + row * DN + d, mask=_only(dm, valid), other=0.0).to(tl.float32)


@triton.jit
def _chans(ptr, r, t0, T, DN, d, dm, G: tl.constexpr):
    """Tokens t0 .. t0 + G - 1's (rows r ..) values of channels ``d``: a tuple of G vectors, their
    loads issued together (fp32; 0 past T)."""
    out = ()
    for k in tl.static_range(G):
        out = out + (_chan(ptr, r + k, DN, d, dm, t0 + k < T),)
    return out


@triton.jit
def _softplus(x):
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))`` for any x; log1p by its series below 0.1
    (Triton's core has no log1p, and log(1 + e) loses e's digits when e is small)."""
    e = tl.exp(-tl.abs(x))
    series = e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - e * (0.25 - e * (0.2 - e / 6.0)))))
    return tl.maximum(x, 0.0) + tl.where(e < 0.1, series, tl.log(1.0 + e))


@triton.jit
def _delta(dt_ptr, row, DN, d, dm, valid, SOFTPLUS: tl.constexpr):
    """Token ``row``'s step dt of channels ``d`` (through softplus with ``SOFTPLUS``), fp32; 0 where
    masked or not ``valid`` (a step that changes nothing)."""
    m = _only(dm, valid)
    x = tl.load(dt_ptr + row * DN + d, mask=m, other=0.0).to(tl.float32)
    if SOFTPLUS:
        x = tl.where(m, _softplus(x), 0.0)
    return x


@triton.jit
def _scalars(ptr, row, valid, N: tl.constexpr):
    """Token ``row``'s ``N`` entries of B or C, one scalar each (fp32; 0 for a token not ``valid``)."""
    out = ()
    for k in tl.static_range(N):
        out = out + (tl.load(ptr + row * N + k, mask=valid, other=0.0).to(tl.float32),)
    return out


@triton.jit
def _a_log2(a_ptr, d, dm, N: tl.constexpr):
    """``A log2(e)`` of channels ``d``, one vector per state index."""
    out = ()
    for k in tl.static_range(N):
        out = out + (tl.load(a_ptr + d * N + k, mask=dm, other=0.0).to(tl.float32) * 1.4426950408889634,)
    return out


@triton.jit
def _zeros(BD: tl.constexpr, N: tl.constexpr):
    """A zero state of ``BD`` channels: N vectors."""
    out = ()
    for k in tl.static_range(N):
        out = out + (tl.zeros([BD], dtype=tl.float32),)
    return out


@triton.jit
def _load_state(ptr, d, dm, DN, N: tl.constexpr):
    """A state stored ``[N, Dn]`` (fp32) at ``ptr``: channels ``d``."""
    out = ()
    for k in tl.static_range(N):
        out = out + (tl.load(ptr + k * DN + d, mask=dm, other=0.0),)
    return out


@triton.jit
def _store_state(ptr, h, d, dm, DN, N: tl.constexpr):
    for k in tl.static_range(N):
        tl.store(ptr + k * DN + d, h[k], mask=dm)


@triton.jit
def _step(h, a, dt, u, b, N: tl.constexpr):
    """The state after one token: ``exp(dt A) h + dt u B``."""
    w = dt * u
    out = ()
    for k in tl.static_range(N):
        out = out + (tl.exp2(dt * a[k]) * h[k] + w * b[k],)
    return out


@triton.jit
def _advance4(h, u_ptr, dt_ptr, b_ptr, delta_ptr, r, t0, T, DN, d, dm, a, N: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The state after tokens t0 .. t0 + 3 (rows r ..) from the state before them (loads issued
    together), and the sum of their dt. With ``SOFTPLUS``, ``dt`` is before softplus and the steps
    after it are stored at ``delta_ptr`` (fp32) for the later passes."""
    us = _chans(u_ptr, r, t0, T, DN, d, dm, 4)
    dts = ()
    for k in tl.static_range(4):
        dts = dts + (_delta(dt_ptr, r + k, DN, d, dm, t0 + k < T, SOFTPLUS),)
    if SOFTPLUS:
        for k in tl.static_range(4):
            tl.store(delta_ptr + (r + k) * DN + d, dts[k], mask=_only(dm, t0 + k < T))
    for k in tl.static_range(4):
        h = _step(h, a, dts[k], us[k], _scalars(b_ptr, r + k, t0 + k < T, N), N)
    return h, (dts[0] + dts[1]) + (dts[2] + dts[3])


@triton.jit
def _fwd_local(u_ptr, dt_ptr, a_ptr, b_ptr, delta_ptr, local_ptr, dtsum_ptr, T, DN, n_chunks,
               N: tl.constexpr, SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr, BD: tl.constexpr):
    """Pass 1: chunk ``c``'s scan from a zero state -> its end state and its ``sum dt`` (and, with
    ``SOFTPLUS``, its steps after softplus, for the later passes)."""
    bi = tl.program_id(0)
    c = tl.program_id(2)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < DN
    a = _a_log2(a_ptr, d, dm, N)
    h = _zeros(BD, N)
    s = tl.zeros([BD], dtype=tl.float32)
    for i in range(0, CHUNK, 4):
        t0 = c * CHUNK + i
        if t0 < T:
            h, s4 = _advance4(h, u_ptr, dt_ptr, b_ptr, delta_ptr, bi * T + t0, t0, T, DN, d, dm, a, N, SOFTPLUS)
            s += s4
    _store_state(local_ptr + (bi * n_chunks + c) * DN * N, h, d, dm, DN, N)
    tl.store(dtsum_ptr + (bi * n_chunks + c) * DN + d, s, mask=dm)


@triton.jit
def _fwd_carry(a_ptr, local_ptr, dtsum_ptr, h0_ptr, ckpt_ptr, hT_ptr, DN, N, n_chunks, n_ckpts,
               HAS_H0: tl.constexpr, PER_CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2: the state entering every chunk (into its first checkpoint) and the final state.
    ``h0`` and the final state are ``[Dn, N]``; the rest ``[N, Dn]``."""
    bi = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flat (state index, channel) entries
    m = idx < DN * N
    d = idx % DN
    dn_idx = d * N + idx // DN  # the same entry in [Dn, N]
    a = tl.load(a_ptr + dn_idx, mask=m, other=0.0).to(tl.float32)
    if HAS_H0:
        h = tl.load(h0_ptr + bi * DN * N + dn_idx, mask=m, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(n_chunks):
        tl.store(ckpt_ptr + (bi * n_ckpts + c * PER_CHUNK) * DN * N + idx, h, mask=m)
        s = tl.load(dtsum_ptr + (bi * n_chunks + c) * DN + d, mask=m, other=0.0)
        loc = tl.load(local_ptr + (bi * n_chunks + c) * DN * N + idx, mask=m, other=0.0)
        h = tl.exp(a * s) * h + loc
    tl.store(hT_ptr + bi * DN * N + dn_idx, h, mask=m)


@triton.jit
def _out4(h, r, t0, T, u_ptr, dt_ptr, b_ptr, c_ptr, y_ptr, DN, d, dm, a, dv, N: tl.constexpr):
    """Tokens t0 .. t0 + 3 (rows r ..): their outputs y, and the state after them."""
    us = _chans(u_ptr, r, t0, T, DN, d, dm, 4)
    dts = _chans(dt_ptr, r, t0, T, DN, d, dm, 4)
    for k in tl.static_range(4):
        h = _step(h, a, dts[k], us[k], _scalars(b_ptr, r + k, t0 + k < T, N), N)
        ct = _scalars(c_ptr, r + k, t0 + k < T, N)
        y = dv * us[k]
        for j in tl.static_range(N):
            y += ct[j] * h[j]
        tl.store(y_ptr + (r + k) * DN + d, y, mask=_only(dm, t0 + k < T))
    return h


@triton.jit
def _fwd_out(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, ckpt_ptr, T, DN, n_ckpts,
             HAS_D: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr, CKPT: tl.constexpr,
             BD: tl.constexpr):
    """Pass 3: chunk ``c``'s scan from its true entering state -> ``y`` and its other checkpoints."""
    bi = tl.program_id(0)
    c = tl.program_id(2)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < DN
    a = _a_log2(a_ptr, d, dm, N)
    dv = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        dv = tl.load(d_ptr + d, mask=dm, other=0.0).to(tl.float32)
    h = _load_state(ckpt_ptr + (bi * n_ckpts + c * (CHUNK // CKPT)) * DN * N, d, dm, DN, N)
    for i in range(0, CHUNK, 4):
        t0 = c * CHUNK + i
        if t0 < T:
            if (i % CKPT == 0) & (i > 0):
                _store_state(ckpt_ptr + (bi * n_ckpts + t0 // CKPT) * DN * N, h, d, dm, DN, N)
            h = _out4(h, bi * T + t0, t0, T, u_ptr, dt_ptr, b_ptr, c_ptr, y_ptr, DN, d, dm, a, dv, N)


@triton.jit
def _bwd_local(dt_ptr, a_ptr, c_ptr, dy_ptr, dh_ptr, T, DN, n_chunks,
               N: tl.constexpr, CHUNK: tl.constexpr, BD: tl.constexpr):
    """Backward pass 1: dL/d(state entering chunk ``c``) through chunk ``c``'s own outputs. Four
    tokens at a time, backwards."""
    bi = tl.program_id(0)
    c = tl.program_id(2)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < DN
    a = _a_log2(a_ptr, d, dm, N)
    dh = _zeros(BD, N)
    for ii in range(0, CHUNK, 4):
        t0 = c * CHUNK + CHUNK - 4 - ii  # the group's first token
        if t0 < T:
            r = bi * T + t0
            dts = _chans(dt_ptr, r, t0, T, DN, d, dm, 4)
            dys = _chans(dy_ptr, r, t0, T, DN, d, dm, 4)
            for kk in tl.static_range(4):
                ct = _scalars(c_ptr, r + 3 - kk, t0 + 3 - kk < T, N)
                nxt = ()
                for j in tl.static_range(N):
                    nxt = nxt + ((dh[j] + dys[3 - kk] * ct[j]) * tl.exp2(dts[3 - kk] * a[j]),)
                dh = nxt
    _store_state(dh_ptr + (bi * n_chunks + c) * DN * N, dh, d, dm, DN, N)


@triton.jit
def _bwd_carry(a_ptr, dh_ptr, dtsum_ptr, dhT_ptr, dh0_ptr, DN, N, n_chunks,
               HAS_DHT: tl.constexpr, BLOCK: tl.constexpr):
    """Backward pass 2, in place: chunk-local dL/dh at chunk starts -> the full dL/dh at chunk ends.
    ``dL/dh_T`` and ``dL/dh0`` are ``[Dn, N]``; the rest ``[N, Dn]``."""
    bi = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = idx < DN * N
    d = idx % DN
    dn_idx = d * N + idx // DN
    a = tl.load(a_ptr + dn_idx, mask=m, other=0.0).to(tl.float32)
    if HAS_DHT:
        g = tl.load(dhT_ptr + bi * DN * N + dn_idx, mask=m, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([BLOCK], dtype=tl.float32)
    for cc in range(n_chunks):
        c = n_chunks - 1 - cc
        at = dh_ptr + (bi * n_chunks + c) * DN * N + idx
        loc = tl.load(at, mask=m, other=0.0)
        tl.store(at, g, mask=m)
        s = tl.load(dtsum_ptr + (bi * n_chunks + c) * DN + d, mask=m, other=0.0)
        g = tl.exp(a * s) * g + loc
    tl.store(dh0_ptr + bi * DN * N + dn_idx, g, mask=m)


@triton.jit
def _bwd_token(row, valid, h_prev, u, dt, raw, dy, a, dh, da, dd, dv, b_ptr, c_ptr, du_ptr, ddt_ptr, dbp_ptr,
               dcp_ptr, part, DN, d, dm, HAS_D: tl.constexpr, N: tl.constexpr, SOFTPLUS: tl.constexpr):
    """One token of the backward walk, from the state before it (``h_prev``) and dL/d(state after
    it) (``dh``): stores du, ddt (towards ``raw``, dt before softplus, with ``SOFTPLUS``) and this
    channel block's parts of dB, dC; returns dL/d(state before it) and the running sums for dA and
    dD."""
    bt = _scalars(b_ptr, row, valid, N)
    ct = _scalars(c_ptr, row, valid, N)
    w = dt * u
    sb = tl.zeros_like(u)  # sum_n g_n B_n
    sa = tl.zeros_like(u)  # sum_n g_n A_n exp(dt A_n) h_prev_n / ln 2
    dh_out = ()
    da_out = ()
    for k in tl.static_range(N):
        e = tl.exp2(dt * a[k])
        kept = e * h_prev[k]
        g = dh[k] + dy * ct[k]
        tl.store(dcp_ptr + part * N + k, tl.sum(dy * (kept + w * bt[k]), axis=0), mask=valid)
        tl.store(dbp_ptr + part * N + k, tl.sum(g * w, axis=0), mask=valid)
        q = g * kept
        sa += q * a[k]
        sb += g * bt[k]
        da_out = da_out + (da[k] + q * dt,)
        dh_out = dh_out + (g * e,)
    du = sb * dt
    if HAS_D:
        du += dv * dy
        dd += dy * u
    tl.store(du_ptr + row * DN + d, du, mask=_only(dm, valid))
    ddt = sa * 0.6931471805599453 + u * sb
    if SOFTPLUS:  # through softplus: times its derivative, sigmoid(raw) = exp(raw - softplus(raw))
        ddt *= tl.exp(raw - dt)
    tl.store(ddt_ptr + row * DN + d, ddt, mask=_only(dm, valid))
    return dh_out, da_out, dd


@triton.jit
def _group_bwd(h0, r0, t0, T, u_ptr, dt_ptr, b_ptr, c_ptr, raw_ptr, dy_ptr, du_ptr, ddt_ptr, dbp_ptr, dcp_ptr, a, dh, da,
               dd, dv, pd, n_dblocks, DN, d, dm, HAS_D: tl.constexpr, N: tl.constexpr, SOFTPLUS: tl.constexpr,
               G: tl.constexpr):
    """Tokens t0 .. t0 + G - 1 (rows r0 ...) backwards from the state before them, ``h0``: the
    states before each of them are recomputed into registers (tuples, unrolled), then walked back."""
    us = _chans(u_ptr, r0, t0, T, DN, d, dm, G)
    dts = _chans(dt_ptr, r0, t0, T, DN, d, dm, G)
    # dt before softplus, with SOFTPLUS (loaded with the rest: a load where it is used stalls the walk)
    raws = _chans(raw_ptr, r0, t0, T, DN, d, dm, G) if SOFTPLUS else dts
    ys = _chans(dy_ptr, r0, t0, T, DN, d, dm, G)
    hs = (h0,)
    for k in tl.static_range(G - 1):
        hs = hs + (_step(hs[k], a, dts[k], us[k], _scalars(b_ptr, r0 + k, t0 + k < T, N), N),)
    for kk in tl.static_range(G):  # token G - 1 - kk (indices written out: they must stay constexpr)
        dh, da, dd = _bwd_token(r0 + G - 1 - kk, t0 + G - 1 - kk < T, hs[G - 1 - kk], us[G - 1 - kk],
                                dts[G - 1 - kk], raws[G - 1 - kk], ys[G - 1 - kk], a, dh, da, dd, dv, b_ptr, c_ptr,
                                du_ptr, ddt_ptr, dbp_ptr, dcp_ptr, (r0 + G - 1 - kk) * n_dblocks + pd, DN, d, dm, HAS_D, N,
                                SOFTPLUS)
    return dh, da, dd


@triton.jit
def _bwd_chunks(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, raw_ptr, ckpt_ptr, dy_ptr, dhend_ptr,
                du_ptr, ddt_ptr, dap_ptr, dbp_ptr, dcp_ptr, ddp_ptr,
                T, DN, n_chunks, n_ckpts, n_dblocks, HAS_D: tl.constexpr, N: tl.constexpr, SOFTPLUS: tl.constexpr,
                CHUNK: tl.constexpr, CKPT: tl.constexpr, GROUP: tl.constexpr, BD: tl.constexpr):
    """Backward pass 3: chunk ``c``'s gradients from dL/dh at its end. The states stay in registers:
    each group of ``GROUP`` tokens is recomputed from its checkpoint (advancing ``GROUP g`` tokens
    for the g-th group of a checkpoint interval) and walked backwards; tokens past T are steps that
    change nothing."""
    bi = tl.program_id(0)
    pd = tl.program_id(1)
    c = tl.program_id(2)
    d = pd * BD + tl.arange(0, BD)
    dm = d < DN
    a = _a_log2(a_ptr, d, dm, N)
    dv = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        dv = tl.load(d_ptr + d, mask=dm, other=0.0).to(tl.float32)
    dh = _load_state(dhend_ptr + (bi * n_chunks + c) * DN * N, d, dm, DN, N)
    da = _zeros(BD, N)
    dd = tl.zeros([BD], dtype=tl.float32)
    for jj in range(CHUNK // CKPT):
        j = c * (CHUNK // CKPT) + CHUNK // CKPT - 1 - jj  # the checkpoint's index
        if j < n_ckpts:
            start = _load_state(ckpt_ptr + (bi * n_ckpts + j) * DN * N, d, dm, DN, N)
            for gg in range(CKPT // GROUP):
                t0 = j * CKPT + (CKPT // GROUP - 1 - gg) * GROUP  # the group's first token
                if t0 < T:
                    h0 = start
                    for t in range(j * CKPT, t0, 4):
                        h0, _ = _advance4(h0, u_ptr, dt_ptr, b_ptr, dt_ptr, bi * T + t, t, T, DN, d, dm, a, N, False)
                    dh, da, dd = _group_bwd(h0, bi * T + t0, t0, T, u_ptr, dt_ptr, b_ptr, c_ptr, raw_ptr, dy_ptr, du_ptr,
                                            ddt_ptr, dbp_ptr, dcp_ptr, a, dh, da, dd, dv, pd, n_dblocks, DN, d, dm,
                                            HAS_D, N, SOFTPLUS, GROUP)
    _store_state(dap_ptr + (bi * n_chunks + c) * DN * N, da, d, dm, DN, N)
    if HAS_D:
        tl.store(ddp_ptr + (bi * n_chunks + c) * DN + d, dd, mask=dm)


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, h0, softplus):
        assert CHUNK % CKPT == 0 and CKPT % GROUP == 0 and GROUP % 4 == 0, \
            "CHUNK must be a multiple of CKPT, CKPT of GROUP, GROUP of 4"
        bsz, t, dn = u.shape
        n = A.shape[-1]
        u, dt, A, B, C = (x.contiguous() for x in (u, dt, A, B, C))
        D = D.contiguous() if D is not None else None
        h0 = h0.contiguous() if h0 is not None else None
        n_chunks, n_ckpts = triton.cdiv(t, CHUNK), triton.cdiv(t, CKPT)
        f32 = dict(device=u.device, dtype=torch.float32)
        y = torch.empty(bsz, t, dn, device=u.device, dtype=u.dtype)
        local = torch.empty(bsz, n_chunks, n, dn, **f32)
        dtsum = torch.empty(bsz, n_chunks, dn, **f32)
        ckpt = torch.empty(bsz, n_ckpts, n, dn, **f32)
        h_final = torch.empty(bsz, dn, n, **f32)
        # with softplus, the first pass also stores the steps after it (fp32) for the other passes
        delta = torch.empty(bsz, t, dn, **f32) if softplus else dt
        grid = (bsz, triton.cdiv(dn, FWD_BLOCK_D), n_chunks)
        _fwd_local[grid](u, dt, A, B, delta, local, dtsum, t, dn, n_chunks, N=n, SOFTPLUS=softplus, CHUNK=CHUNK,
                         BD=FWD_BLOCK_D, num_warps=FWD_WARPS)
        _fwd_carry[(bsz, triton.cdiv(dn * n, CARRY_BLOCK))](
            A, local, dtsum, h0 if h0 is not None else u, ckpt, h_final, dn, n, n_chunks, n_ckpts,
            HAS_H0=h0 is not None, PER_CHUNK=CHUNK // CKPT, BLOCK=CARRY_BLOCK)
        _fwd_out[grid](u, delta, A, B, C, D if D is not None else u, y, ckpt, t, dn, n_ckpts,
                       HAS_D=D is not None, N=n, CHUNK=CHUNK, CKPT=CKPT, BD=FWD_BLOCK_D, num_warps=FWD_WARPS)
        ctx.save_for_backward(u, dt, delta if softplus else None, A, B, C, D, ckpt, dtsum)
        ctx.chunks = (CHUNK, CKPT, GROUP)  # the layout of ckpt and dtsum, and the backward's groups
        ctx.h0_info = None if h0 is None else (h0.dtype, h0.requires_grad)
        return y, h_final

    @staticmethod
    def backward(ctx, dy, dh_final):
        u, dt, delta, A, B, C, D, ckpt, dtsum = ctx.saved_tensors
        softplus = delta is not None
        delta = delta if softplus else dt
        chunk, ckpt_len, group = ctx.chunks
        bsz, t, dn = u.shape
        n = A.shape[-1]
        n_chunks, n_ckpts, n_dblocks = dtsum.shape[1], ckpt.shape[1], triton.cdiv(dn, BLOCK_D)
        f32 = dict(device=u.device, dtype=torch.float32)
        dy = dy.contiguous()
        has_dht = dh_final is not None
        dh = torch.empty(bsz, n_chunks, n, dn, **f32)
        dh0 = torch.empty(bsz, dn, n, **f32)
        _bwd_local[(bsz, triton.cdiv(dn, FWD_BLOCK_D), n_chunks)](
            delta, A, C, dy, dh, t, dn, n_chunks, N=n, CHUNK=chunk, BD=FWD_BLOCK_D, num_warps=FWD_WARPS)
        _bwd_carry[(bsz, triton.cdiv(dn * n, CARRY_BLOCK))](
            A, dh, dtsum, dh_final.contiguous() if has_dht else dh, dh0, dn, n, n_chunks,
            HAS_DHT=has_dht, BLOCK=CARRY_BLOCK)
        du, ddt = torch.empty_like(u), torch.empty_like(dt)
        dap = torch.empty(bsz, n_chunks, n, dn, **f32)
        ddp = torch.empty(bsz, n_chunks, dn, **f32)
        dbp, dcp = torch.empty(bsz, t, n_dblocks, n, **f32), torch.empty(bsz, t, n_dblocks, n, **f32)
        _bwd_chunks[(bsz, n_dblocks, n_chunks)](
            u, delta, A, B, C, D if D is not None else u, dt, ckpt, dy, dh,
            du, ddt, dap, dbp, dcp, ddp, t, dn, n_chunks, n_ckpts, n_dblocks,
            HAS_D=D is not None, N=n, SOFTPLUS=softplus, CHUNK=chunk, CKPT=ckpt_len, GROUP=group, BD=BLOCK_D,
            num_warps=BWD_WARPS)
        grad_d = ddp.sum((0, 1)).to(D.dtype) if D is not None else None
        grad_h0 = dh0.to(ctx.h0_info[0]) if ctx.h0_info is not None and ctx.h0_info[1] else None
        return (du, ddt, dap.sum((0, 1)).t().to(A.dtype), dbp.sum(2).to(B.dtype), dcp.sum(2).to(C.dtype), grad_d,
                grad_h0, None)


def selective_scan_triton(u, dt, A, B, C, D=None, *, initial_state=None, output_final_state=False,
                          delta_softplus=False):
    """``selective_scan_chunked``'s contract on fused kernels: ``(y [B, T, Dn], final state or None)``.
    ``delta_softplus``: ``dt`` is taken before softplus, which the kernels apply (and differentiate)."""
    y, final = _SelectiveScan.apply(u, dt, A, B, C, D, initial_state, bool(delta_softplus))
    return y, (final if output_final_state else None)
