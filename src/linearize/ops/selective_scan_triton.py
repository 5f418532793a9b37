"""Mamba's selective scan as fused Triton kernels parallel over time chunks: the CUDA twin of
``selective_scan_chunked``.

The recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t``, ``y_t = C_t . h_t + D u_t`` is
linear in ``h``, so the sequence is cut into time chunks of ``CHUNK`` tokens and every
(sequence, block of ``BLOCK_D`` channels, chunk) gets its own program: the work runs in parallel
over ``B x T``, not only over ``B``, and only a short walk over chunks stays sequential. States
live in registers; nothing of size ``T x Dn x N`` reaches memory. (It replaced a scan that walked
the whole sequence in each program, with which StripedMamba trained at 0.22x the teacher's
tokens/s at 2 x 8192 on an H100.)

forward, three launches:

1. per chunk, the scan from a zero state: the chunk's local end state and ``sum_t dt_t``
   (its total decay is ``exp(A sum dt)``);
2. per (sequence, block of state entries), a walk over chunks that turns these into the true
   state entering each chunk, ``h_in[c+1] = exp(A S_c) h_in[c] + local[c]``, from the initial
   state; the last one is the final state;
3. per chunk, the scan again from its true entering state, writing ``y`` and a checkpoint of the
   state every ``CKPT`` tokens (``[B, T / CKPT, Dn, N]``, kept for the backward pass).

backward, three launches, mirrored:

1. per chunk, ``dL/dh`` at the chunk's start from its own outputs only (walked back from zero);
2. a walk over chunks in reverse giving ``dL/dh`` at every chunk's end (from ``dL/dh_T``) and
   ``dL/dh0``;
3. per chunk, the fused backward from that ``dL/dh``, ``GROUP`` tokens at a time: a group's
   states are recomputed from its ``CKPT`` checkpoint into registers (the g-th group of a
   checkpoint interval advances ``GROUP g`` tokens first) and walked backwards, so no state goes
   through memory. (A version that recomputed whole checkpoint intervals into a scratch buffer in
   global memory needed barriers and a persistent launch to keep the buffers cached; it was
   slower.) Sums over channels (``dB``, ``dC``) are written per channel block, sums over time
   (``dA``, ``dD``) per chunk; PyTorch adds them up.

The per-token passes load four tokens' inputs at once, so their latency is paid once per four
tokens. The constants below are the fastest of ``scripts/scan_bench.py --sweep`` on an H100
(docs/RESULTS.md). y, du and ddt are written in their inputs' dtypes. (dt's softplus stays outside, in PyTorch: inside
the kernels every pass recomputed it for every state entry, and the scan took 0.5 ms more per
layer on an H100 than the elementwise pass it saved.)

Everything accumulates in fp32 whatever the input dtype. Tested against the PyTorch forms with
Triton's interpreter on the CPU (``tests/triton_interpret_scan.py``) and on CUDA
(``tests/test_gpu_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128  # tokens per program (time chunk); a multiple of CKPT
CKPT = 8  # the forward's checkpoint interval, a multiple of GROUP
GROUP = 4  # tokens whose states the backward holds in registers at once, a multiple of 4
BLOCK_D = 64  # channels per program
CARRY_BLOCK = 512  # state entries per program of the walks over chunks
FWD_WARPS = 2  # warps per program of the forward passes and the backward's first pass
BWD_WARPS = 4  # warps per program of the backward's last pass
BWD_MAXNREG = None  # a register cap per thread for the backward's last pass (None: the compiler's choice)


@triton.jit
def _only(m, valid):
    """The mask ``m`` where the scalar ``valid`` holds, else all False. (Not ``m & valid``: Triton
    3.9's interpreter gives that an int32 dtype, which loads and stores refuse as a mask.)"""
    return tl.where(valid, m, False)


@triton.jit
def _inputs(u_ptr, dt_ptr, b_ptr, row, valid, DN, N, d, n, dm, nm):
    """Token ``row``'s inputs u_t, dt_t (this block's channels) and B_t, in fp32. Masked-off
    channels and tokens that are not ``valid`` get u = dt = 0: a step that changes nothing."""
    dm = _only(dm, valid)
    u = tl.load(u_ptr + row * DN + d, mask=dm, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * DN + d, mask=dm, other=0.0).to(tl.float32)
    bt = tl.load(b_ptr + row * N + n, mask=_only(nm, valid), other=0.0).to(tl.float32)
    return u, dt, bt


@triton.jit
def _tile(a_ptr, pd, DN, N, BD: tl.constexpr, BN: tl.constexpr):
    """Channel block ``pd``'s ``[BD, BN]`` tile of the state: channels, state indices, their masks,
    the offsets and ``A`` on it (fp32)."""
    d = pd * BD + tl.arange(0, BD)
    n = tl.arange(0, BN)
    dm = d < DN
    nm = n < N
    m2 = dm[:, None] & nm[None, :]
    tile = d[:, None] * N + n[None, :]
    a = tl.load(a_ptr + tile, mask=m2, other=0.0).to(tl.float32)
    return d, n, dm, nm, m2, tile, a


@triton.jit
def _row(ptr, row, width, idx, m, valid):
    """Token ``row``'s entries ``idx`` of a ``[rows, width]`` tensor, fp32, zero where masked or not valid."""
    return tl.load(ptr + row * width + idx, mask=_only(m, valid), other=0.0).to(tl.float32)


@triton.jit
def _advance4(h, u_ptr, dt_ptr, b_ptr, bi, t0, T, DN, N, d, n, dm, nm, a):
    """The state after tokens t0 .. t0 + 3 from the state before them (loads issued together), and
    the sum of their dt."""
    r = bi * T + t0
    u0, dt0, b0 = _inputs(u_ptr, dt_ptr, b_ptr, r, t0 < T, DN, N, d, n, dm, nm)
    u1, dt1, b1 = _inputs(u_ptr, dt_ptr, b_ptr, r + 1, t0 + 1 < T, DN, N, d, n, dm, nm)
    u2, dt2, b2 = _inputs(u_ptr, dt_ptr, b_ptr, r + 2, t0 + 2 < T, DN, N, d, n, dm, nm)
    u3, dt3, b3 = _inputs(u_ptr, dt_ptr, b_ptr, r + 3, t0 + 3 < T, DN, N, d, n, dm, nm)
    h = tl.exp(dt0[:, None] * a) * h + (dt0 * u0)[:, None] * b0[None, :]
    h = tl.exp(dt1[:, None] * a) * h + (dt1 * u1)[:, None] * b1[None, :]
    h = tl.exp(dt2[:, None] * a) * h + (dt2 * u2)[:, None] * b2[None, :]
    return tl.exp(dt3[:, None] * a) * h + (dt3 * u3)[:, None] * b3[None, :], (dt0 + dt1) + (dt2 + dt3)


@triton.jit
def _fwd_local(u_ptr, dt_ptr, a_ptr, b_ptr, local_ptr, dtsum_ptr, T, DN, N, n_chunks,
               CHUNK: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """Pass 1: chunk ``c``'s scan from a zero state -> its end state and its ``sum dt``. Four tokens
    at a time, their loads issued together."""
    bi = tl.program_id(0)
    c = tl.program_id(2)
    d, n, dm, nm, m2, tile, a = _tile(a_ptr, tl.program_id(1), DN, N, BD, BN)
    h = tl.zeros([BD, BN], dtype=tl.float32)
    s = tl.zeros([BD], dtype=tl.float32)
    for i in range(0, CHUNK, 4):
        t0 = c * CHUNK + i
        if t0 < T:
            h, s4 = _advance4(h, u_ptr, dt_ptr, b_ptr, bi, t0, T, DN, N, d, n, dm, nm, a)
            s += s4
    tl.store(local_ptr + (bi * n_chunks + c) * DN * N + tile, h, mask=m2)
    tl.store(dtsum_ptr + (bi * n_chunks + c) * DN + d, s, mask=dm)


@triton.jit
def _fwd_carry(a_ptr, local_ptr, dtsum_ptr, h0_ptr, ckpt_ptr, hT_ptr, DN, N, n_chunks, n_ckpts,
               HAS_H0: tl.constexpr, PER_CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2: the state entering every chunk (into its first checkpoint) and the final state."""
    bi = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flat (channel, state) entries
    m = idx < DN * N
    d = idx // N
    a = tl.load(a_ptr + idx, mask=m, other=0.0).to(tl.float32)
    if HAS_H0:
        h = tl.load(h0_ptr + bi * DN * N + idx, mask=m, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(n_chunks):
        tl.store(ckpt_ptr + (bi * n_ckpts + c * PER_CHUNK) * DN * N + idx, h, mask=m)
        s = tl.load(dtsum_ptr + (bi * n_chunks + c) * DN + d, mask=m, other=0.0)
        loc = tl.load(local_ptr + (bi * n_chunks + c) * DN * N + idx, mask=m, other=0.0)
        h = tl.exp(a * s) * h + loc
    tl.store(hT_ptr + bi * DN * N + idx, h, mask=m)


@triton.jit
def _fwd_out(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, ckpt_ptr, T, DN, N, n_ckpts,
             HAS_D: tl.constexpr, CHUNK: tl.constexpr, CKPT: tl.constexpr, BD: tl.constexpr,
             BN: tl.constexpr):
    """Pass 3: chunk ``c``'s scan from its true entering state -> ``y`` and its other checkpoints.
    Four tokens at a time."""
    bi = tl.program_id(0)
    c = tl.program_id(2)
    d, n, dm, nm, m2, tile, a = _tile(a_ptr, tl.program_id(1), DN, N, BD, BN)
    dv = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        dv = tl.load(d_ptr + d, mask=dm, other=0.0).to(tl.float32)
    h = tl.load(ckpt_ptr + (bi * n_ckpts + c * (CHUNK // CKPT)) * DN * N + tile, mask=m2, other=0.0)
    for i in range(0, CHUNK, 4):
        t0 = c * CHUNK + i
        if t0 < T:
            if (i % CKPT == 0) & (i > 0):
                tl.store(ckpt_ptr + (bi * n_ckpts + t0 // CKPT) * DN * N + tile, h, mask=m2)
            r = bi * T + t0
            u0, dt0, b0 = _inputs(u_ptr, dt_ptr, b_ptr, r, t0 < T, DN, N, d, n, dm, nm)
            u1, dt1, b1 = _inputs(u_ptr, dt_ptr, b_ptr, r + 1, t0 + 1 < T, DN, N, d, n, dm, nm)
            u2, dt2, b2 = _inputs(u_ptr, dt_ptr, b_ptr, r + 2, t0 + 2 < T, DN, N, d, n, dm, nm)
            u3, dt3, b3 = _inputs(u_ptr, dt_ptr, b_ptr, r + 3, t0 + 3 < T, DN, N, d, n, dm, nm)
            c0 = _row(c_ptr, r, N, n, nm, t0 < T)
            c1 = _row(c_ptr, r + 1, N, n, nm, t0 + 1 < T)
            c2 = _row(c_ptr, r + 2, N, n, nm, t0 + 2 < T)
            c3 = _row(c_ptr, r + 3, N, n, nm, t0 + 3 < T)
            h = tl.exp(dt0[:, None] * a) * h + (dt0 * u0)[:, None] * b0[None, :]
            tl.store(y_ptr + r * DN + d, tl.sum(h * c0[None, :], axis=1) + dv * u0, mask=_only(dm, t0 < T))
            h = tl.exp(dt1[:, None] * a) * h + (dt1 * u1)[:, None] * b1[None, :]
            tl.store(y_ptr + (r + 1) * DN + d, tl.sum(h * c1[None, :], axis=1) + dv * u1, mask=_only(dm, t0 + 1 < T))
            h = tl.exp(dt2[:, None] * a) * h + (dt2 * u2)[:, None] * b2[None, :]
            tl.store(y_ptr + (r + 2) * DN + d, tl.sum(h * c2[None, :], axis=1) + dv * u2, mask=_only(dm, t0 + 2 < T))
            h = tl.exp(dt3[:, None] * a) * h + (dt3 * u3)[:, None] * b3[None, :]
            tl.store(y_ptr + (r + 3) * DN + d, tl.sum(h * c3[None, :], axis=1) + dv * u3, mask=_only(dm, t0 + 3 < T))


@triton.jit
def _decay_in(dt_ptr, dy_ptr, c_ptr, row, valid, DN, N, d, n, dm, nm, a):
    """What the backward's first pass needs of token ``row``: its decay exp(dt A) and dy_t C_t
    (identity and zero for a token that is not ``valid``)."""
    dt = _row(dt_ptr, row, DN, d, dm, valid)
    dy = _row(dy_ptr, row, DN, d, dm, valid)
    ct = _row(c_ptr, row, N, n, nm, valid)
    return tl.exp(dt[:, None] * a), dy[:, None] * ct[None, :]


@triton.jit
def _bwd_local(dt_ptr, a_ptr, c_ptr, dy_ptr, dh_ptr, T, DN, N, n_chunks,
               CHUNK: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """Backward pass 1: dL/d(state entering chunk ``c``) through chunk ``c``'s own outputs. Four
    tokens at a time, backwards."""
    bi = tl.program_id(0)
    c = tl.program_id(2)
    d, n, dm, nm, m2, tile, a = _tile(a_ptr, tl.program_id(1), DN, N, BD, BN)
    dh = tl.zeros([BD, BN], dtype=tl.float32)
    for ii in range(0, CHUNK, 4):
        t0 = c * CHUNK + CHUNK - 4 - ii  # the group's first token
        if t0 < T:
            r = bi * T + t0
            e0, g0 = _decay_in(dt_ptr, dy_ptr, c_ptr, r, t0 < T, DN, N, d, n, dm, nm, a)
            e1, g1 = _decay_in(dt_ptr, dy_ptr, c_ptr, r + 1, t0 + 1 < T, DN, N, d, n, dm, nm, a)
            e2, g2 = _decay_in(dt_ptr, dy_ptr, c_ptr, r + 2, t0 + 2 < T, DN, N, d, n, dm, nm, a)
            e3, g3 = _decay_in(dt_ptr, dy_ptr, c_ptr, r + 3, t0 + 3 < T, DN, N, d, n, dm, nm, a)
            dh = (dh + g3) * e3
            dh = (dh + g2) * e2
            dh = (dh + g1) * e1
            dh = (dh + g0) * e0
    tl.store(dh_ptr + (bi * n_chunks + c) * DN * N + tile, dh, mask=m2)


@triton.jit
def _bwd_carry(a_ptr, dh_ptr, dtsum_ptr, dhT_ptr, dh0_ptr, DN, N, n_chunks,
               HAS_DHT: tl.constexpr, BLOCK: tl.constexpr):
    """Backward pass 2, in place: chunk-local dL/dh at chunk starts -> the full dL/dh at chunk ends."""
    bi = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = idx < DN * N
    d = idx // N
    a = tl.load(a_ptr + idx, mask=m, other=0.0).to(tl.float32)
    if HAS_DHT:
        g = tl.load(dhT_ptr + bi * DN * N + idx, mask=m, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([BLOCK], dtype=tl.float32)
    for cc in range(n_chunks):
        c = n_chunks - 1 - cc
        at = dh_ptr + (bi * n_chunks + c) * DN * N + idx
        loc = tl.load(at, mask=m, other=0.0)
        tl.store(at, g, mask=m)
        s = tl.load(dtsum_ptr + (bi * n_chunks + c) * DN + d, mask=m, other=0.0)
        g = tl.exp(a * s) * g + loc
    tl.store(dh0_ptr + bi * DN * N + idx, g, mask=m)


@triton.jit
def _bwd_token(row, valid, h_t, h_prev, decay, u, dt, bt, ct, dy, a, dh, da, dd, dv, du_ptr, ddt_ptr,
               dbp_ptr, dcp_ptr, pd, n_dblocks, DN, N, d, n, dm, nm, HAS_D: tl.constexpr):
    """One token of the backward walk, given the state after it (``h_t``), before it (``h_prev``), its
    decay and inputs: stores du, ddt and this channel block's parts of dB, dC; returns dL/dh before
    the token and the running sums for dA and dD."""
    dh += dy[:, None] * ct[None, :]
    tl.store(dcp_ptr + (row * n_dblocks + pd) * N + n, tl.sum(dy[:, None] * h_t, axis=0), mask=_only(nm, valid))
    tl.store(dbp_ptr + (row * n_dblocks + pd) * N + n, tl.sum(dh * (dt * u)[:, None], axis=0), mask=_only(nm, valid))
    ddt = tl.sum(dh * (a * decay * h_prev + u[:, None] * bt[None, :]), axis=1)
    du = tl.sum(dh * bt[None, :], axis=1) * dt
    if HAS_D:
        du += dv * dy
        dd += dy * u
    da += dh * (dt[:, None] * decay * h_prev)
    tl.store(du_ptr + row * DN + d, du, mask=_only(dm, valid))
    tl.store(ddt_ptr + row * DN + d, ddt, mask=_only(dm, valid))
    return dh * decay, da, dd


@triton.jit
def _group_bwd(h0, r0, t0, T, u_ptr, dt_ptr, b_ptr, c_ptr, dy_ptr, du_ptr, ddt_ptr, dbp_ptr, dcp_ptr, a, dh, da, dd,
               dv, pd, n_dblocks, DN, N, d, n, dm, nm, HAS_D: tl.constexpr, G: tl.constexpr):
    """Tokens t0 .. t0 + G - 1 (rows r0 ...) backwards from the state before them, ``h0``: their
    states and decays are recomputed into registers (tuples, unrolled), then walked back."""
    us = ()
    dts = ()
    bs = ()
    cs = ()
    ys = ()
    for k in tl.static_range(G):
        u, dt, bt = _inputs(u_ptr, dt_ptr, b_ptr, r0 + k, t0 + k < T, DN, N, d, n, dm, nm)
        us = us + (u,)
        dts = dts + (dt,)
        bs = bs + (bt,)
        cs = cs + (_row(c_ptr, r0 + k, N, n, nm, t0 + k < T),)
        ys = ys + (_row(dy_ptr, r0 + k, DN, d, dm, t0 + k < T),)
    hs = (h0,)
    es = ()
    for k in tl.static_range(G):
        e = tl.exp(dts[k][:, None] * a)
        hs = hs + (e * hs[k] + (dts[k] * us[k])[:, None] * bs[k][None, :],)
        es = es + (e,)
    for kk in tl.static_range(G):  # token G - 1 - kk (indices written out: they must stay constexpr)
        dh, da, dd = _bwd_token(r0 + G - 1 - kk, t0 + G - 1 - kk < T, hs[G - kk], hs[G - 1 - kk], es[G - 1 - kk],
                                us[G - 1 - kk], dts[G - 1 - kk], bs[G - 1 - kk], cs[G - 1 - kk], ys[G - 1 - kk], a,
                                dh, da, dd, dv, du_ptr, ddt_ptr, dbp_ptr, dcp_ptr, pd, n_dblocks, DN, N, d, n, dm,
                                nm, HAS_D)
    return dh, da, dd


@triton.jit
def _bwd_chunks(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, ckpt_ptr, dy_ptr, dhend_ptr,
                du_ptr, ddt_ptr, dap_ptr, dbp_ptr, dcp_ptr, ddp_ptr,
                T, DN, N, n_chunks, n_ckpts, n_dblocks, HAS_D: tl.constexpr,
                CHUNK: tl.constexpr, CKPT: tl.constexpr, GROUP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """Backward pass 3: chunk ``c``'s gradients from dL/dh at its end. The states stay in registers:
    each group of ``GROUP`` tokens is recomputed from its checkpoint (advancing ``GROUP g`` tokens
    for the g-th group of a checkpoint interval) and walked backwards; tokens past T are steps that
    change nothing."""
    bi = tl.program_id(0)
    pd = tl.program_id(1)
    c = tl.program_id(2)
    d, n, dm, nm, m2, tile, a = _tile(a_ptr, pd, DN, N, BD, BN)
    dv = tl.zeros([BD], dtype=tl.float32)
    if HAS_D:
        dv = tl.load(d_ptr + d, mask=dm, other=0.0).to(tl.float32)
    dh = tl.load(dhend_ptr + (bi * n_chunks + c) * DN * N + tile, mask=m2, other=0.0)
    da = tl.zeros([BD, BN], dtype=tl.float32)
    dd = tl.zeros([BD], dtype=tl.float32)
    for jj in range(CHUNK // CKPT):
        j = c * (CHUNK // CKPT) + CHUNK // CKPT - 1 - jj  # the checkpoint's index
        if j < n_ckpts:
            start = tl.load(ckpt_ptr + (bi * n_ckpts + j) * DN * N + tile, mask=m2, other=0.0)
            for gg in range(CKPT // GROUP):
                t0 = j * CKPT + (CKPT // GROUP - 1 - gg) * GROUP  # the group's first token
                if t0 < T:
                    h0 = start
                    for t in range(j * CKPT, t0, 4):
                        h0, _ = _advance4(h0, u_ptr, dt_ptr, b_ptr, bi, t, T, DN, N, d, n, dm, nm, a)
                    dh, da, dd = _group_bwd(h0, bi * T + t0, t0, T, u_ptr, dt_ptr, b_ptr, c_ptr, dy_ptr, du_ptr,
                                            ddt_ptr, dbp_ptr, dcp_ptr, a, dh, da, dd, dv, pd, n_dblocks, DN, N,
                                            d, n, dm, nm, HAS_D, GROUP)
    tl.store(dap_ptr + (bi * n_chunks + c) * DN * N + tile, da, mask=m2)
    if HAS_D:
        tl.store(ddp_ptr + (bi * n_chunks + c) * DN + d, dd, mask=dm)


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, h0):
        assert CHUNK % CKPT == 0 and CKPT % GROUP == 0 and GROUP % 4 == 0, \
            "CHUNK must be a multiple of CKPT, CKPT of GROUP, GROUP of 4"
        bsz, t, dn = u.shape
        n = A.shape[-1]
        bn = triton.next_power_of_2(n)
        u, dt, A, B, C = (x.contiguous() for x in (u, dt, A, B, C))
        D = D.contiguous() if D is not None else None
        h0 = h0.contiguous() if h0 is not None else None
        n_chunks, n_ckpts, n_dblocks = triton.cdiv(t, CHUNK), triton.cdiv(t, CKPT), triton.cdiv(dn, BLOCK_D)
        f32 = dict(device=u.device, dtype=torch.float32)
        y = torch.empty(bsz, t, dn, device=u.device, dtype=u.dtype)
        local = torch.empty(bsz, n_chunks, dn, n, **f32)
        dtsum = torch.empty(bsz, n_chunks, dn, **f32)
        ckpt = torch.empty(bsz, n_ckpts, dn, n, **f32)
        h_final = torch.empty(bsz, dn, n, **f32)
        grid = (bsz, n_dblocks, n_chunks)
        _fwd_local[grid](u, dt, A, B, local, dtsum, t, dn, n, n_chunks, CHUNK=CHUNK, BD=BLOCK_D,
                         BN=bn, num_warps=FWD_WARPS)
        _fwd_carry[(bsz, triton.cdiv(dn * n, CARRY_BLOCK))](
            A, local, dtsum, h0 if h0 is not None else u, ckpt, h_final, dn, n, n_chunks, n_ckpts,
            HAS_H0=h0 is not None, PER_CHUNK=CHUNK // CKPT, BLOCK=CARRY_BLOCK)
        _fwd_out[grid](u, dt, A, B, C, D if D is not None else u, y, ckpt, t, dn, n, n_ckpts,
                       HAS_D=D is not None, CHUNK=CHUNK, CKPT=CKPT, BD=BLOCK_D, BN=bn,
                       num_warps=FWD_WARPS)
        ctx.save_for_backward(u, dt, A, B, C, D, ckpt, dtsum)
        ctx.chunks = (CHUNK, CKPT, GROUP)  # the layout of ckpt and dtsum, and the backward's groups
        ctx.h0_info = None if h0 is None else (h0.dtype, h0.requires_grad)
        return y, h_final

    @staticmethod
    def backward(ctx, dy, dh_final):
        u, dt, A, B, C, D, ckpt, dtsum = ctx.saved_tensors
        chunk, ckpt_len, group = ctx.chunks
        bsz, t, dn = u.shape
        n = A.shape[-1]
        bn = triton.next_power_of_2(n)
        n_chunks, n_ckpts, n_dblocks = dtsum.shape[1], ckpt.shape[1], triton.cdiv(dn, BLOCK_D)
        f32 = dict(device=u.device, dtype=torch.float32)
        dy = dy.contiguous()
        has_dht = dh_final is not None
        dh = torch.empty(bsz, n_chunks, dn, n, **f32)
        dh0 = torch.empty(bsz, dn, n, **f32)
        grid = (bsz, n_dblocks, n_chunks)
        _bwd_local[grid](dt, A, C, dy, dh, t, dn, n, n_chunks, CHUNK=chunk, BD=BLOCK_D, BN=bn,
                         num_warps=FWD_WARPS)
        _bwd_carry[(bsz, triton.cdiv(dn * n, CARRY_BLOCK))](
            A, dh, dtsum, dh_final.contiguous() if has_dht else dh, dh0, dn, n, n_chunks,
            HAS_DHT=has_dht, BLOCK=CARRY_BLOCK)
        du, ddt = torch.empty_like(u), torch.empty_like(dt)
        dap = torch.empty(bsz, n_chunks, dn, n, **f32)
        ddp = torch.empty(bsz, n_chunks, dn, **f32)
        dbp, dcp = torch.empty(bsz, t, n_dblocks, n, **f32), torch.empty(bsz, t, n_dblocks, n, **f32)
        _bwd_chunks[grid](
            u, dt, A, B, C, D if D is not None else u, ckpt, dy, dh,
            du, ddt, dap, dbp, dcp, ddp, t, dn, n, n_chunks, n_ckpts, n_dblocks,
            HAS_D=D is not None, CHUNK=chunk, CKPT=ckpt_len, GROUP=group, BD=BLOCK_D, BN=bn,
            num_warps=BWD_WARPS, **({"maxnreg": BWD_MAXNREG} if BWD_MAXNREG else {}))
        grad_d = ddp.sum((0, 1)).to(D.dtype) if D is not None else None
        grad_h0 = dh0.to(ctx.h0_info[0]) if ctx.h0_info is not None and ctx.h0_info[1] else None
        return (du, ddt, dap.sum((0, 1)).to(A.dtype), dbp.sum(2).to(B.dtype), dcp.sum(2).to(C.dtype), grad_d,
                grad_h0)


def selective_scan_triton(u, dt, A, B, C, D=None, *, initial_state=None, output_final_state=False):
    """``selective_scan_chunked``'s contract on fused kernels: ``(y [B, T, Dn], final state or None)``."""
    y, final = _SelectiveScan.apply(u, dt, A, B, C, D, initial_state)
    return y, (final if output_final_state else None)
