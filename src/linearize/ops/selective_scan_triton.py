"""Mamba's selective scan as two fused Triton kernels (forward, backward): the CUDA twin of
``selective_scan_chunked``.

The PyTorch forms materialise ``[B, T, Dn, N]`` tensors and run tens of small kernels per chunk,
which leaves StripedMamba far slower than the attention it replaces. Here one program owns one
sequence and a block of channels, keeps its ``[channels, N]`` state in registers and walks the
sequence once: nothing of size ``T x Dn x N`` ever reaches memory.

* forward: ``h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t``, ``y_t = C_t . h_t + D u_t``; the state
  entering every ``CHUNK`` tokens is saved (``[B, T / CHUNK, Dn, N]``) for the backward pass.
* backward: chunks in reverse; each chunk's states are recomputed from its checkpoint into a
  per-program scratch buffer, then walked backwards carrying ``dL/dh``. Gradients that sum over
  channels (``B``, ``C``) are written per channel block and summed by PyTorch; ``A``'s and ``D``'s
  per sequence, likewise.

Everything accumulates in fp32 whatever the input dtype. Tested against the PyTorch forms with
Triton's interpreter on the CPU (``tests/test_xatl_ops.py``) and on CUDA (``tests/test_gpu_decode.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32
BLOCK_D = 32


@triton.jit
def _inputs(u_ptr, dt_ptr, b_ptr, row, DN, N, d, n, dm, nm):
    """Token ``row``'s inputs u_t, dt_t (this block's channels) and B_t, in fp32."""
    u = tl.load(u_ptr + row * DN + d, mask=dm, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * DN + d, mask=dm, other=0.0).to(tl.float32)
    bt = tl.load(b_ptr + row * N + n, mask=nm, other=0.0).to(tl.float32)
    return u, dt, bt


@triton.jit
def _scan_fwd(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, h0_ptr, y_ptr, ckpt_ptr, hT_ptr,
              T, DN, N, n_chunks,
              HAS_D: tl.constexpr, HAS_H0: tl.constexpr, CHUNK: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    bi = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    n = tl.arange(0, BN)
    dm = d < DN
    nm = n < N
    m2 = dm[:, None] & nm[None, :]
    tile = d[:, None] * N + n[None, :]
    a = tl.load(a_ptr + tile, mask=m2, other=0.0).to(tl.float32)
    if HAS_H0:
        h = tl.load(h0_ptr + bi * DN * N + tile, mask=m2, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BD, BN], dtype=tl.float32)
    if HAS_D:
        dv = tl.load(d_ptr + d, mask=dm, other=0.0).to(tl.float32)
    for t in range(T):
        if t % CHUNK == 0:
            tl.store(ckpt_ptr + (bi * n_chunks + t // CHUNK) * DN * N + tile, h, mask=m2)
        row = bi * T + t
        u, dt, bt = _inputs(u_ptr, dt_ptr, b_ptr, row, DN, N, d, n, dm, nm)
        ct = tl.load(c_ptr + row * N + n, mask=nm, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * a) * h + (dt * u)[:, None] * bt[None, :]
        y = tl.sum(h * ct[None, :], axis=1)
        if HAS_D:
            y += dv * u
        tl.store(y_ptr + row * DN + d, y, mask=dm)
    tl.store(hT_ptr + bi * DN * N + tile, h, mask=m2)


@triton.jit
def _scan_bwd(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, ckpt_ptr, dy_ptr, dhT_ptr, scratch_ptr,
              du_ptr, ddt_ptr, da_ptr, dbp_ptr, dcp_ptr, dd_ptr, dh0_ptr,
              T, DN, N, n_chunks, n_dblocks,
              HAS_D: tl.constexpr, HAS_DHT: tl.constexpr, CHUNK: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    bi = tl.program_id(0)
    pd = tl.program_id(1)
    d = pd * BD + tl.arange(0, BD)
    n = tl.arange(0, BN)
    dm = d < DN
    nm = n < N
    m2 = dm[:, None] & nm[None, :]
    tile = d[:, None] * N + n[None, :]
    local = tl.arange(0, BD)[:, None] * BN + n[None, :]  # a [BD, BN] tile of the scratch buffer
    scratch = scratch_ptr + (bi * n_dblocks + pd) * CHUNK * BD * BN
    a = tl.load(a_ptr + tile, mask=m2, other=0.0).to(tl.float32)
    if HAS_D:
        dv = tl.load(d_ptr + d, mask=dm, other=0.0).to(tl.float32)
    if HAS_DHT:
        dh = tl.load(dhT_ptr + bi * DN * N + tile, mask=m2, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BD, BN], dtype=tl.float32)
    da = tl.zeros([BD, BN], dtype=tl.float32)
    dd = tl.zeros([BD], dtype=tl.float32)
    for jj in range(n_chunks):
        j = n_chunks - 1 - jj
        start = tl.load(ckpt_ptr + (bi * n_chunks + j) * DN * N + tile, mask=m2, other=0.0)
        h = start
        for i in range(CHUNK):  # recompute the chunk's states
            t = j * CHUNK + i
            if t < T:
                row = bi * T + t
                u, dt, bt = _inputs(u_ptr, dt_ptr, b_ptr, row, DN, N, d, n, dm, nm)
                h = tl.exp(dt[:, None] * a) * h + (dt * u)[:, None] * bt[None, :]
                tl.store(scratch + i * BD * BN + local, h)
        tl.debug_barrier()
        for ii in range(CHUNK):  # and walk them backwards
            i = CHUNK - 1 - ii
            t = j * CHUNK + i
            if t < T:
                row = bi * T + t
                u, dt, bt = _inputs(u_ptr, dt_ptr, b_ptr, row, DN, N, d, n, dm, nm)
                ct = tl.load(c_ptr + row * N + n, mask=nm, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * DN + d, mask=dm, other=0.0).to(tl.float32)
                h_t = tl.load(scratch + i * BD * BN + local)
                if i > 0:
                    h_prev = tl.load(scratch + (i - 1) * BD * BN + local)
                else:
                    h_prev = start
                dh += dy[:, None] * ct[None, :]
                decay = tl.exp(dt[:, None] * a)
                tl.store(dcp_ptr + ((row * n_dblocks) + pd) * N + n, tl.sum(dy[:, None] * h_t, axis=0), mask=nm)
                tl.store(dbp_ptr + ((row * n_dblocks) + pd) * N + n, tl.sum(dh * (dt * u)[:, None], axis=0), mask=nm)
                ddt = tl.sum(dh * (a * decay * h_prev + u[:, None] * bt[None, :]), axis=1)
                du = tl.sum(dh * bt[None, :], axis=1) * dt
                if HAS_D:
                    du += dv * dy
                    dd += dy * u
                da += dh * (dt[:, None] * decay * h_prev)
                tl.store(du_ptr + row * DN + d, du, mask=dm)
                tl.store(ddt_ptr + row * DN + d, ddt, mask=dm)
                dh = dh * decay
        tl.debug_barrier()  # the next chunk reuses the scratch buffer
    tl.store(dh0_ptr + bi * DN * N + tile, dh, mask=m2)
    tl.store(da_ptr + bi * DN * N + tile, da, mask=m2)
    if HAS_D:
        tl.store(dd_ptr + bi * DN + d, dd, mask=dm)


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, h0):
        bsz, t, dn = u.shape
        n = A.shape[-1]
        u, dt, A, B, C = (x.contiguous() for x in (u, dt, A, B, C))
        D = D.contiguous() if D is not None else None
        h0 = h0.contiguous() if h0 is not None else None
        n_chunks = triton.cdiv(t, CHUNK)
        f32 = dict(device=u.device, dtype=torch.float32)
        y = torch.empty(bsz, t, dn, **f32)
        ckpt = torch.empty(bsz, n_chunks, dn, n, **f32)
        h_final = torch.empty(bsz, dn, n, **f32)
        grid = (bsz, triton.cdiv(dn, BLOCK_D))
        _scan_fwd[grid](u, dt, A, B, C, D if D is not None else u, h0 if h0 is not None else u, y, ckpt, h_final,
                        t, dn, n, n_chunks, HAS_D=D is not None, HAS_H0=h0 is not None, CHUNK=CHUNK, BD=BLOCK_D,
                        BN=triton.next_power_of_2(n))
        ctx.save_for_backward(u, dt, A, B, C, D, ckpt)
        ctx.h0_info = None if h0 is None else (h0.dtype, h0.requires_grad)
        return y.to(u.dtype), h_final

    @staticmethod
    def backward(ctx, dy, dh_final):
        u, dt, A, B, C, D, ckpt = ctx.saved_tensors
        bsz, t, dn = u.shape
        n = A.shape[-1]
        bn = triton.next_power_of_2(n)
        n_chunks = ckpt.shape[1]
        n_dblocks = triton.cdiv(dn, BLOCK_D)
        f32 = dict(device=u.device, dtype=torch.float32)
        du, ddt = torch.empty(bsz, t, dn, **f32), torch.empty(bsz, t, dn, **f32)
        da = torch.empty(bsz, dn, n, **f32)
        dbp, dcp = torch.empty(bsz, t, n_dblocks, n, **f32), torch.empty(bsz, t, n_dblocks, n, **f32)
        dd = torch.empty(bsz, dn, **f32)
        dh0 = torch.empty(bsz, dn, n, **f32)
        scratch = torch.empty(bsz * n_dblocks * CHUNK * BLOCK_D * bn, **f32)
        dy = dy.contiguous()
        has_dht = dh_final is not None
        _scan_bwd[(bsz, n_dblocks)](
            u, dt, A, B, C, D if D is not None else u, ckpt, dy, dh_final.contiguous() if has_dht else dy, scratch,
            du, ddt, da, dbp, dcp, dd, dh0, t, dn, n, n_chunks, n_dblocks,
            HAS_D=D is not None, HAS_DHT=has_dht, CHUNK=CHUNK, BD=BLOCK_D, BN=bn)
        grad_d = dd.sum(0).to(D.dtype) if D is not None else None
        grad_h0 = dh0.to(ctx.h0_info[0]) if ctx.h0_info is not None and ctx.h0_info[1] else None
        return (du.to(u.dtype), ddt.to(dt.dtype), da.sum(0).to(A.dtype), dbp.sum(2).to(B.dtype),
                dcp.sum(2).to(C.dtype), grad_d, grad_h0)


def selective_scan_triton(u, dt, A, B, C, D=None, *, initial_state=None, output_final_state=False):
    """``selective_scan_chunked``'s contract on fused kernels: ``(y [B, T, Dn], final state or None)``."""
    y, final = _SelectiveScan.apply(u, dt, A, B, C, D, initial_state)
    return y, (final if output_final_state else None)
