"""A Mamba (S6) mixer in place of each attention, the teacher's FFN kept: StripedMamba (XATL §4.1).

Mamba's block (Gu & Dao 2023) with the paper's defaults: expand 2 (``Dn = 2 * hidden`` channels),
a causal depthwise convolution of width 4, state size N = 16, ``dt_rank = ceil(hidden / 16)``:

    x, z = split(X W_in)                   x: [B, T, Dn]
    x    = silu(causal_conv1d(x))
    dt, B, C = split(x W_x);  dt = softplus(dt W_dt + b_dt)   (the softplus inside the scan's kernels)
    y    = selective_scan(x, dt, A = -exp(A_log), B, C, D)
    out  = (y * silu(z)) W_out

Every parameter is new and keeps Mamba's names (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
``A_log``, ``D``, ``out_proj``): the output projection reads ``2 * hidden`` features, so the
teacher's W_O (``hidden`` -> ``hidden``) does not fit it and is dropped. Initialisation follows
Mamba: A_log = log(1..N) per channel, D = 1, dt_proj's bias the inverse softplus of a step drawn
log-uniformly in [1e-3, 1e-1], its weight uniform(+-dt_rank^-1/2), the convolution PyTorch's
default; the other projections are drawn like the teacher's (normal(0, initializer_range)).

On CUDA, a padding-free sequence takes the convolution and its SiLU as one fused Triton op over the
channels-last ``[B, T, Dn]`` layout (``ops/causal_conv1d_triton.py``, chosen in ``conv_silu``); left
padding, float64, the CPU and torch.compile keep the PyTorch path. A CUDA-graph training step
(``linearize.graphed``) vouches for unpadded blocks, so it takes the fused op too.

The decoding state is one fp32 tensor ``[B, Dn, (K - 1) + N]``: the convolution's last ``K - 1``
inputs followed by the scan state, so the cache treats it like any other mixer's state.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..ops.fla_backend import triton_available
from ..ops.linear_attention import accum_dtype
from ..ops.selective_scan import causal_conv1d, causal_conv1d_step, selective_scan, selective_scan_step
from .fresh import FreshMixer


def use_fused_conv(xs: torch.Tensor, key_mask: torch.Tensor | None) -> bool:
    """Whether the sequence path's convolution and SiLU run as the fused Triton op: CUDA, Triton,
    not float64, no padding to mask, and not while torch.compile traces."""
    return (xs.is_cuda and xs.dtype != torch.float64 and key_mask is None and triton_available()
            and not torch.compiler.is_compiling())


def conv_silu(xs, weight, bias, conv_state, want_state, real, fused, step=False):
    """``silu(causal_conv1d(xs))`` over a sequence ``xs [B, T, Dn]`` (channels last) -> ``(xc [B, T, Dn],
    the convolution's final state or None)``. ``real`` ([B, 1, T] bool or None) marks the real tokens
    of a left-padded batch; ``fused`` takes the Triton op (which needs ``real`` None), else PyTorch's
    depthwise conv1d over the transposed ``[B, Dn, T]``; ``step`` is one decoding token (T = 1)
    through ``causal_conv1d_step``, which always returns the new state."""
    if fused:
        from ..ops.causal_conv1d_triton import causal_conv1d_silu_triton

        assert real is None and not step, "the fused convolution takes whole unpadded sequences"
        return causal_conv1d_silu_triton(xs, weight, bias, initial_state=conv_state, output_final_state=want_state)
    xs = xs.transpose(1, 2)  # [B, Dn, T]
    if real is not None:  # padding enters neither the convolution's window nor the scan
        xs = xs.masked_fill(~real, 0.0)
    if step:
        xc, conv_state = causal_conv1d_step(xs[..., 0], weight, bias, conv_state)
        xc = xc[..., None]
    else:
        xc, conv_state = causal_conv1d(xs, weight, bias, initial_state=conv_state, output_final_state=want_state)
    xc = F.silu(xc)
    if real is not None:
        xc = xc.masked_fill(~real, 0.0)
    return xc.transpose(1, 2), conv_state  # [B, T, Dn]


class MambaMixer(FreshMixer):
    kind = "striped_mamba"
    keeps_output = False
    expand = 2
    conv_width = 4
    state_size = 16

    def __init__(self, attn, adapter, geometry, spec, layer_idx, n_layers):
        super().__init__(attn, adapter, geometry, spec, layer_idx, n_layers)
        d = self.hidden_size
        dn = self.channels = self.expand * d
        n = self.state_size
        r = self.dt_rank = math.ceil(d / 16)
        self.in_proj = self.fresh_linear(d, 2 * dn)
        self.conv1d = self.new_parameters_like(
            nn.Conv1d(dn, dn, self.conv_width, groups=dn, padding=self.conv_width - 1, bias=True))
        self.x_proj = self.fresh_linear(dn, r + 2 * n)
        dt_proj = nn.Linear(r, dn, bias=True)
        with torch.no_grad():
            dt_proj.weight.uniform_(-(r ** -0.5), r ** -0.5)
            dt = torch.exp(torch.rand(dn) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.dt_proj = self.new_parameters_like(dt_proj)
        a_log = torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(dn, 1)
        self.A_log = nn.Parameter(a_log.to(device=self.teacher_device, dtype=self.teacher_dtype))
        self.D = nn.Parameter(torch.ones(dn, device=self.teacher_device, dtype=self.teacher_dtype))
        self.out_proj = self.fresh_linear(dn, d)

    def _split_state(self, state):
        if state is None:
            return None, None
        k = self.conv_width - 1
        return state[..., :k], state[..., k:]

    def mix(self, x, state, offset, want_state):
        b, t, _ = x.shape
        acc = accum_dtype(x.dtype)
        step = state is not None and t == 1
        conv_state, ssm_state = self._split_state(state)
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        real = None if self.key_mask is None else self.key_mask[:, None, :]  # left padding: [B, 1, T]
        w, bias = self.conv1d.weight, self.conv1d.bias
        xc, conv_state = conv_silu(xs, w, bias, conv_state, want_state, real,
                                   fused=not step and use_fused_conv(xs, self.key_mask), step=step)
        dt, Bm, Cm = self.x_proj(xc).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = self.dt_proj(dt)  # softplus comes in the scan (fused into the kernels on CUDA)
        A = -torch.exp(self.A_log.to(acc))
        if step:
            y, ssm_state = selective_scan_step(xc[:, 0], F.softplus(dt[:, 0].to(acc)), A, Bm[:, 0], Cm[:, 0], self.D,
                                               ssm_state)
            y = y[:, None]
        else:
            y, ssm_state = selective_scan(xc, dt, A, Bm, Cm, self.D, chunk_size=self.spec.chunk_size,
                                          initial_state=ssm_state, output_final_state=want_state,
                                          backend=self.spec.backend, delta_softplus=True)
        out = self.out_proj(y * F.silu(z))
        new_state = torch.cat([conv_state, ssm_state], dim=-1) if (step or want_state) else None
        return out, new_state

    def state_bytes(self, dtype):
        return self.channels * (self.conv_width - 1 + self.state_size) * 4

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, channels={self.channels}, state_size={self.state_size}, "
                f"conv_width={self.conv_width}, dt_rank={self.dt_rank}")
