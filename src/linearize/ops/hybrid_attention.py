"""The LoLCATs hybrid: softmax over the last ``w`` tokens, linear attention over all older ones.

For query t (LoLCATs eq. 7), with one shared normaliser:

    a_ts = gamma * exp(s_ts - c_t)      for t - w < s <= t   (s_ts = scale * q_t . k_s, softcapped)
    a_ts = phi_q(q_t) . phi_k(k_s)      for s <= t - w
    y_t  = sum_s a_ts v_s / sum_s a_ts

where ``c_t`` is the largest window score of query t (log-sum-exp stabilisation) and ``gamma`` a
per-head weight. The window always holds token t itself, so the denominator is at least
``gamma`` and needs no eps; when the window covers the whole sequence this is exactly softmax.

Shapes: ``q`` ``[B, H, T, D]`` and ``k`` ``[B, Hk, T, D]`` (after RoPE), ``qf`` ``[B, H, T, F]`` and
``kf`` ``[B, Hk, T, F]`` (their features), ``v`` ``[B, Hk, T, D]``; ``gamma`` ``[H]``. Keys are shared
by ``G = H / Hk`` query heads without being repeated.

Whole sequences: ``hybrid_attention`` runs the Triton kernels (``hybrid_triton.py``, gates included)
where ``use_hybrid_kernel`` allows and ``hybrid_attention_chunked`` (PyTorch) elsewhere.

Decoding state (``HybridState``): the last ``w`` keys, key features and values, plus the linear
state ``sum phi_k(k_s) [v_s, 1]`` over tokens that have left the window: constant in size.

Gates (``log_gate``, optional, ``[B, Hk, T]`` of ``log g_t <= 0``): the linear state fades. A key
``s`` that has left the window weighs ``prod_{s + w < u <= t} g_u`` in query ``t``'s linear term, so
the state after token ``t`` is ``S_t = g_t S_{t-1} + phi_k(k_{t-w}) [v_{t-w}, 1]``: a key starts
to fade when it leaves the window, and a constant ``g`` is a fixed decay with horizon ``1 / (1 - g)``.
Without gates the linear mass grows with the length against the window's; with them it stays
bounded. ``None`` is ``g = 1`` (LoLCATs), in every form exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fla_backend import triton_available
from .hybrid.state import HybridState
from .linear_attention import _augment, _group, accum_dtype

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_MAX_WINDOW = 128  # a query chunk's two window tiles are [w, w] each
KERNEL_MAX_WIDTH = 128  # head dim and feature width the tiles hold (256, Gemma 3's head dim, needs
# 268 KiB of shared memory, more than an H100's 227 KiB)


def _normalise(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den``, 0 where ``den`` is 0 (a padding query: no term, ``num`` is 0 too), with a finite
    gradient there (dividing by a clamped ``den`` sent ``dy / tiny`` back, which overflowed to inf
    and met the masks' zeros as NaN)."""
    return num / torch.where(den > 0, den, torch.ones((), dtype=den.dtype, device=den.device))


def _mixed(window_out: torch.Tensor, linear_out: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:
    """The output from the window's and the linear terms' ``[..., D + 1]`` sums (numerators, then the
    denominator): one shared normaliser (``mix`` None, LoLCATs), or each normalised on its own and
    mixed, ``(1 - m) y_window + m y_linear`` with ``m`` broadcast like the sums' leading dims (``m`` is 0
    for a query with no linear term yet)."""
    if mix is None:
        out = window_out + linear_out
        return _normalise(out[..., :-1], out[..., -1:])
    den = linear_out[..., -1:]
    m = mix * (den > 0)
    return (1 - m) * _normalise(window_out[..., :-1], window_out[..., -1:]) + m * _normalise(linear_out[..., :-1], den)


def _mix_shape(mix: torch.Tensor | None, n_kv: int, dims: int, dtype) -> torch.Tensor | None:
    """``mix`` ``[H]`` as ``[Hk, G, 1, ...]`` with ``dims`` trailing ones."""
    return None if mix is None else mix.to(dtype).reshape(n_kv, -1, *([1] * dims))


def _scores(q, k, scale, softcap):
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s


def _real_keys(key_mask, *tensors):
    """Zero the features and values of padding tokens (``key_mask`` [B, T], True = real)."""
    if key_mask is None:
        return tensors
    keep = key_mask[:, None, :, None]
    return tuple(torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in tensors)


def hybrid_attention_weights(q, k, qf, kf, gamma, *, window: int, scale: float, softcap: float | None = None,
                             key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None,
                             mix: torch.Tensor | None = None):
    """The hybrid's attention weights ``[B, H, T, T]`` (rows sum to one; zero for a padding query).
    ``mix`` ``[H]``: the window and linear terms normalised apart and mixed (see ``_mixed``).

    Quadratic: for the reference form and for LoLCATs' optional cross-entropy on attention weights.
    """
    acc = accum_dtype(q.dtype)
    n_kv, t = k.shape[1], q.shape[2]
    if key_mask is not None:
        (kf,) = _real_keys(key_mask, kf)
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    kk, kff = (x.to(acc).unsqueeze(2) for x in (k, kf))
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    pos = torch.arange(t, device=q.device)
    dist = pos[:, None] - pos[None, :]
    in_window = (dist >= 0) & (dist < window)
    older = dist >= window
    if key_mask is not None:
        in_window = in_window & key_mask[:, None, None, None, :]
    scores = _scores(qg, kk, scale, softcap)
    neg = torch.finfo(scores.dtype).min
    c = scores.masked_fill(~in_window, neg).amax(dim=-1, keepdim=True)
    a = g * torch.exp(scores.masked_fill(~in_window, neg) - c) * in_window
    linear = (qfg @ kff.transpose(-1, -2)) * older
    if log_gate is not None:
        linear = linear * _fade(log_gate.to(acc), window, older)
    if mix is None:
        a = _normalise(a + linear, (a + linear).sum(dim=-1, keepdim=True))
    else:
        den = linear.sum(dim=-1, keepdim=True)
        m = _mix_shape(mix, n_kv, 2, acc) * (den > 0)
        a = (1 - m) * _normalise(a, a.sum(dim=-1, keepdim=True)) + m * _normalise(linear, den)
    b, hk, grp = a.shape[:3]
    return a.reshape(b, hk * grp, t, t)


def _fade(log_gate, window: int, older):
    """``[B, Hk, 1, T, T]``: ``exp(G_t - G_{s+w})`` where key ``s`` is older than query ``t``'s window
    (``G`` the cumulative log gates), 0 elsewhere."""
    t = log_gate.shape[-1]
    cum = log_gate.cumsum(-1)
    # G at s + w for each key s (keys that never leave the window within T: any finite value)
    left = torch.nn.functional.pad(cum[..., window:], (0, min(window, t)))
    diff = cum[..., :, None] - left[..., None, :]
    return torch.where(older, diff, torch.full_like(diff, float("-inf"))).exp().unsqueeze(2)


def hybrid_attention_naive(q, k, qf, kf, v, gamma, *, window: int, scale: float, softcap: float | None = None,
                           key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None,
                           mix: torch.Tensor | None = None):
    """The quadratic reference. Returns ``[B, H, T, D]``.

    ``key_mask`` ``[B, T]`` (True = real token) leaves padding out of every query's sums; a padding
    query's own output is zero.
    """
    weights = hybrid_attention_weights(q, k, qf, kf, gamma, window=window, scale=scale, softcap=softcap,
                                       key_mask=key_mask, log_gate=log_gate, mix=mix)
    (v,) = _real_keys(key_mask, v)
    n_kv = k.shape[1]
    b, h, t, _ = weights.shape
    y = weights.view(b, n_kv, h // n_kv, t, t) @ v.to(weights.dtype).unsqueeze(2)
    return y.reshape(b, h, t, -1).to(q.dtype)


def hybrid_attention_chunked(
    q, k, qf, kf, v, gamma, *, window: int, scale: float, softcap: float | None = None,
    output_final_state: bool = False, key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HybridState | None]:
    """Linear-time form with chunks of ``window`` tokens.

    Queries of chunk c see keys of chunks c-1 and c (their window and the youngest linear keys,
    masked exactly) and the linear state of chunks <= c-2, a running sum. With gates: query ``i`` of
    chunk c weighs key ``j`` of chunk c-1 (older than its window when ``j <= i``) by
    ``exp(G_c[i] - G_c[j])`` (``G_c`` the log gates' cumulative sum within chunk c), and the state
    ``E_c`` of chunks <= c-2, taken at the end of chunk c-1, by ``exp(G_c[i])``; ``E_{c+1} =
    exp(G_c[-1]) E_c + P_{c-1}``, where ``P_m`` sums chunk m's keys each faded to the end of chunk m+1.
    Sums within a chunk stay small, so long sequences lose no precision to a long cumulative sum.
    """
    acc = accum_dtype(q.dtype)
    b, n_kv, t, d = k.shape
    w = window
    kf, v = _real_keys(key_mask, kf, v)
    n = -(-t // w)
    pad = n * w - t
    pad_t = lambda x, front: torch.nn.functional.pad(x, (0, 0, front, pad))  # noqa: E731
    qg = pad_t(_group(q, n_kv).to(acc), 0).unflatten(3, (n, w))  # [B, Hk, G, N, w, D]
    qfg = pad_t(_group(qf, n_kv).to(acc), 0).unflatten(3, (n, w))
    # Keys/values with one chunk of zeros in front, then overlapping pairs of chunks (c-1, c).
    pairs = lambda x: pad_t(x.to(acc), w).unfold(2, 2 * w, w).transpose(-1, -2).unsqueeze(2)  # noqa: E731
    k2, kf2, v2 = pairs(k), pairs(kf), pairs(v)  # [B, Hk, 1, N, 2w, *]
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None, None]  # [Hk, G, 1, 1, 1]

    i = torch.arange(w, device=q.device)[:, None]
    j = torch.arange(2 * w, device=q.device)[None, :]
    chunk = torch.arange(n, device=q.device)[:, None, None]
    # Query i of chunk c is t = c*w + i; key j of the pair is s = (c-1)*w + j; t - s = w + i - j.
    in_window = (j > i) & (j <= i + w) & ((chunk > 0) | (j >= w))  # [N, w, 2w]
    older = j <= i  # t - s >= w; in chunk 0 these keys are zero padding
    if key_mask is not None:  # real keys of each pair of chunks: [B, 1, 1, N, 1, 2w]
        real = torch.nn.functional.pad(key_mask, (w, pad)).unfold(1, 2 * w, w)
        in_window = in_window & real[:, None, None, :, None, :]

    scores = _scores(qg, k2, scale, softcap)  # [B, Hk, G, N, w, 2w]
    neg = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~in_window, neg)
    c = scores.amax(dim=-1, keepdim=True)
    linear = (qfg @ kf2.transpose(-1, -2)) * older
    kfc = pad_t(kf.to(acc), 0).unflatten(2, (n, w)).unsqueeze(2)
    vc = _augment(pad_t(v.to(acc), 0), True).unflatten(2, (n, w)).unsqueeze(2)
    v2a = _augment(v2, True)
    window_terms = g * torch.exp(scores - c) * in_window
    if log_gate is None:
        # numerators and (last column) denominator
        out = (window_terms + linear) @ v2a if mix is None else linear @ v2a
        # Linear state of chunks <= c-2: exclusive running sum of per-chunk sums, shifted by one more chunk.
        per_chunk = kfc.transpose(-1, -2) @ vc  # [B, Hk, 1, N, F, D+1]
        before = torch.cumsum(per_chunk, dim=3) - per_chunk  # state before chunk c
        older_state = torch.cat([torch.zeros_like(before[:, :, :, :1]), before[:, :, :, :-1]], dim=3)
        out = out + qfg @ older_state
    else:
        cum = torch.nn.functional.pad(log_gate.to(acc), (0, pad)).unflatten(2, (n, w)).cumsum(-1)  # [B, Hk, N, w]
        lower = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
        diff = cum[..., :, None] - cum[..., None, :]
        fade = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # [B, Hk, N, w, w]
        fade = torch.nn.functional.pad(fade, (0, w)).unsqueeze(2)  # keys of chunk c-1 only
        out = (window_terms + linear * fade) @ v2a if mix is None else (linear * fade) @ v2a
        # P_m: chunk m's keys faded to the end of chunk m + 1 (m = 0 .. N-2)
        to_end = (cum[..., 1:, -1:] - cum[..., 1:, :]).exp().unsqueeze(2)[..., None]  # [B, Hk, 1, N-1, w, 1]
        parts = (kfc[:, :, :, :-1] * to_end).transpose(-1, -2) @ vc[:, :, :, :-1]  # [B, Hk, 1, N-1, F, D+1]
        chunk_fade = cum[..., -1].exp()[:, :, None, :, None, None]  # [B, Hk, 1, N, 1, 1]
        states = [kfc.new_zeros(b, n_kv, 1, 1, kfc.shape[-1], d + 1)] * min(n, 2)
        for i in range(1, n - 1):
            states.append(chunk_fade[:, :, :, i : i + 1] * states[-1] + parts[:, :, :, i - 1 : i])
        older_state = torch.cat(states, dim=3)
        out = out + (qfg * cum.exp().unsqueeze(2)[..., None]) @ older_state

    if mix is None:  # ``out`` holds every term
        y = _normalise(out[..., :-1], out[..., -1:])
    else:
        y = _mixed(window_terms @ v2a, out, _mix_shape(mix, n_kv, 3, acc))
    y = y.flatten(3, 4)[..., :t, :].reshape(b, -1, t, d).to(q.dtype)
    state = hybrid_final_state(k, kf, v, window, key_mask, log_gate=log_gate) if output_final_state else None
    return y, state


def use_hybrid_kernel(q: torch.Tensor, backend: str = "auto", *, window: int, head_dim: int,
                      feature_width: int, dtype: torch.dtype | None = None) -> bool:
    """Whether whole sequences go through the Triton kernels (``hybrid_triton``).

    ``backend`` (the spec's): "torch" never; "auto" on CUDA for bf16 and fp16 inputs (fp32 ones
    under autocast are cast to its dtype first, ``kernel_dtype``) when Triton is installed, the
    window is at most ``KERNEL_MAX_WINDOW`` and the head dim and feature width (a Hedgehog map's
    half) at most ``KERNEL_MAX_WIDTH``, and not while ``torch.compile`` traces (the compiler fuses
    the PyTorch form itself); "fla" (CUDA kernels required) the same and fp32 too, in full-precision
    products, raising where the kernels cannot run. fp32 stays on the PyTorch form under "auto"
    (as the linear mixers' fla rule does): full-precision Triton products spill registers and
    compile slowly, TF32 ones would lose precision. float64 and the CPU take the PyTorch form.
    ``dtype``: decide as if ``q`` had it."""
    if backend == "torch":
        return False
    dtype = dtype or q.dtype
    ok = (q.is_cuda and dtype in KERNEL_DTYPES and triton_available() and window <= KERNEL_MAX_WINDOW
          and head_dim <= KERNEL_MAX_WIDTH and feature_width <= KERNEL_MAX_WIDTH)
    if backend == "fla" and not ok:
        raise RuntimeError(f"backend='fla' needs CUDA tensors in {', '.join(map(str, KERNEL_DTYPES))}, Triton, a "
                           f"window <= {KERNEL_MAX_WINDOW} and widths <= {KERNEL_MAX_WIDTH} for the hybrid's kernels")
    return ok and (backend == "fla" or dtype != torch.float32) and not torch.compiler.is_compiling()


def kernel_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The one dtype the kernels take for these inputs: under autocast on their device, its half
    dtype when any is fp32 (RoPE with fp32 cos/sin leaves q/k in fp32 there); else the promotion."""
    dtype = tensors[0].dtype
    for x in tensors[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    dev = tensors[0].device.type
    if dtype == torch.float32 and torch.is_autocast_enabled(dev):
        half = torch.get_autocast_dtype(dev)
        if half in (torch.bfloat16, torch.float16):
            return half
    return dtype


def hybrid_attention(
    q, k, qf, kf, v, gamma, *, window: int, scale: float, softcap: float | None = None,
    output_final_state: bool = False, key_mask: torch.Tensor | None = None, backend: str = "auto",
    log_gate: torch.Tensor | None = None, mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HybridState | None]:
    """Whole sequences, as ``hybrid_attention_chunked``: through the Triton kernels where
    ``use_hybrid_kernel`` allows (inputs cast to ``kernel_dtype``; the log gates stay as given), else
    the PyTorch form."""
    if mix is not None:  # the kernels have no apart-normalised terms: the PyTorch form
        return hybrid_attention_chunked(q, k, qf, kf, v, gamma, window=window, scale=scale, softcap=softcap,
                                        output_final_state=output_final_state, key_mask=key_mask, log_gate=log_gate,
                                        mix=mix)
    dtype = kernel_dtype(q, k, v, qf, kf)
    if use_hybrid_kernel(q, backend, window=window, head_dim=q.shape[-1], feature_width=qf.shape[-1], dtype=dtype):
        from .hybrid.chunk_triton import hybrid_triton

        q, k, v, qf, kf = (x.to(dtype) for x in (q, k, v, qf, kf))
        return hybrid_triton(q, k, v, gamma, qf=qf, kf=kf, window=window, scale=scale, softcap=softcap,
                             key_mask=key_mask, output_final_state=output_final_state, log_gate=log_gate)
    return hybrid_attention_chunked(q, k, qf, kf, v, gamma, window=window, scale=scale, softcap=softcap,
                                    output_final_state=output_final_state, key_mask=key_mask, log_gate=log_gate)


def hybrid_final_state(k, kf, v, window: int, key_mask=None, log_gate=None) -> HybridState:
    """The decoding state after a prompt: its last ``window`` tokens raw, the rest summed (each
    older key faded by the gates after it left the window: ``exp(G_{T-1} - G_{s+w})``)."""
    acc = accum_dtype(k.dtype)
    b, _, t, _ = k.shape
    kf, v = _real_keys(key_mask, kf, v)
    cut = max(t - window, 0)
    old_f, old_v = kf[:, :, :cut].to(acc), _augment(v[:, :, :cut].to(acc), True)
    if log_gate is not None and cut:
        lg = log_gate.to(acc)
        after = lg.flip(-1).cumsum(-1).flip(-1) - lg  # sum of the gates after each position
        old_f = old_f * after[..., window:, None].exp()
    linear = (old_f.transpose(-1, -2) @ old_v).unsqueeze(2)
    valid = key_mask[:, cut:] if key_mask is not None else torch.ones(b, t - cut, dtype=torch.bool, device=k.device)
    return HybridState(k[:, :, cut:], kf[:, :, cut:], v[:, :, cut:], linear, valid)


def empty_hybrid_state(batch, n_kv, head_dim, feature_dim, *, device=None, dtype=torch.float32) -> HybridState:
    z = lambda last: torch.zeros(batch, n_kv, 0, last, device=device, dtype=dtype)  # noqa: E731
    linear = torch.zeros(batch, n_kv, 1, feature_dim, head_dim + 1, device=device, dtype=accum_dtype(dtype))
    return HybridState(z(head_dim), z(feature_dim), z(head_dim), linear,
                       torch.zeros(batch, 0, dtype=torch.bool, device=device))


def _faded(linear: torch.Tensor, log_gate: torch.Tensor | None) -> torch.Tensor:
    """The linear state ``[B, Hk, 1, F, D + 1]`` times this step's gate (``log_gate`` ``[B, Hk, 1]``)."""
    if log_gate is None:
        return linear
    return linear * log_gate.to(linear.dtype).exp()[..., None, None]


def hybrid_attention_step(
    q, k, qf, kf, v, gamma, state: HybridState, *, window: int, scale: float, softcap: float | None = None,
    key_mask: torch.Tensor | None = None, log_gate: torch.Tensor | None = None, mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HybridState]:
    """One token (``T = 1`` in every input; ``key_mask`` [B, 1]; ``log_gate`` [B, Hk, 1]). Returns
    ``(y [B, H, 1, D], new_state)``."""
    acc = state.linear.dtype
    n_kv = k.shape[1]
    b = k.shape[0]
    real = key_mask if key_mask is not None else torch.ones(b, 1, dtype=torch.bool, device=k.device)
    kf, v = _real_keys(real, kf, v)
    keys = torch.cat([state.keys, k.to(state.keys.dtype)], dim=2)
    feats = torch.cat([state.key_features, kf.to(state.key_features.dtype)], dim=2)
    values = torch.cat([state.values, v.to(state.values.dtype)], dim=2)
    valid = torch.cat([state.valid, real], dim=1)
    linear = _faded(state.linear, log_gate)
    if keys.shape[2] > window:  # the oldest token leaves the window and joins the linear state
        old_f, old_v = feats[:, :, :1].to(acc), _augment(values[:, :, :1].to(acc), True)
        linear = linear + (old_f.transpose(-1, -2) @ old_v).unsqueeze(2)
        keys, feats, values, valid = keys[:, :, 1:], feats[:, :, 1:], values[:, :, 1:], valid[:, 1:]
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    mask = valid[:, None, None, None, :]
    scores = _scores(qg, keys.to(acc).unsqueeze(2), scale, softcap)  # in the autocast dtype under autocast
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    c = scores.amax(dim=-1, keepdim=True)
    a = g * torch.exp(scores - c) * mask
    y = _step_output(a @ _augment(values.to(acc), True).unsqueeze(2), qfg @ linear, mix, n_kv)
    b, hk, grp, _, d = y.shape
    return y.reshape(b, hk * grp, 1, d).to(q.dtype), HybridState(keys, feats, values, linear, valid)


def _step_output(window_out, linear_out, mix, n_kv):
    """A step's ``[B, Hk, G, 1, D]`` output from its window and linear sums (``_mixed``; the shared
    denominator is at least the window's own token)."""
    if mix is None:
        out = window_out + linear_out
        return out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(out.dtype).tiny)
    return _mixed(window_out, linear_out, _mix_shape(mix, n_kv, 2, window_out.dtype))


def pad_front(x: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """``x`` with ``pad`` zeros in front along ``dim``: a ring's empty slots before a prefill's window."""
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_zeros(shape), x], dim=dim)


@dataclass
class RingHybridState(HybridState):
    """A ``HybridState`` whose window is a fixed ring of exactly ``w`` slots, updated in place.

    The window's softmax does not depend on the order of its keys (RoPE is already applied), so a
    new token can overwrite the oldest slot instead of shifting the window: every decode step then
    has the same shapes and touches the same buffers (what a CUDA graph needs). Empty slots hold
    zeros and ``valid = False``; ``slot`` (a 0-d long tensor) is the next slot to overwrite.

    ``key_features`` may be empty (``[B, Hk, 0, F]``): the features of a key are then recomputed
    from the key when it leaves the window, which saves their memory (half the window's state
    with Hedgehog maps) at the price of one small feature map per layer and step.
    """

    slot: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.key_features, self.values, self.linear, self.valid, self.slot)

    def map(self, fn) -> "RingHybridState":
        return RingHybridState(*(fn(x) for x in self.tensors()[:5]), slot=self.slot.clone())

    @classmethod
    def from_state(cls, state: HybridState, window: int, keep_key_features: bool = True,
                   copy: bool = True) -> "RingHybridState":
        """A ring of ``window`` slots holding ``state``'s window (oldest first, empty slots in front):
        the oldest slot is slot 0, so overwriting 0, 1, ... evicts tokens in the order they came.
        ``keep_key_features=False`` drops the window's key features (see the class); ``copy=False``
        lets the ring own ``state``'s linear state (``state`` must not be used afterwards)."""
        have = state.keys.shape[2]
        if have > window:
            raise ValueError(f"the state holds {have} window tokens, more than the window ({window})")
        pad = window - have
        front = lambda x, dim: pad_front(x, dim, pad)  # noqa: E731

        valid = front(state.valid, 1)
        keep = valid[:, None, :, None]
        keys, values = (front(x, 2) * keep for x in (state.keys, state.values))
        # dropped features are neither padded first (a large batch's peak memory) nor kept as an empty
        # slice (a view would hold the prefill's whole feature tensor alive)
        kf = state.key_features
        feats = front(kf, 2) * keep if keep_key_features else kf.new_empty((*kf.shape[:2], 0, kf.shape[3]))
        slot = torch.zeros((), dtype=torch.long, device=state.keys.device)
        linear = state.linear.clone() if copy else state.linear.contiguous()
        return cls(keys.contiguous(), feats.contiguous(), values.contiguous(), linear, valid.contiguous(), slot=slot)


def _leaving(state: RingHybridState, key_feature_map=None) -> torch.Tensor:
    """``phi_k(k) [v, 1]`` ``[B, Hk, 1, F, D + 1]`` of the token in slot ``state.slot``: what it adds
    to the linear state when it leaves the window (zero for an empty slot)."""
    acc = state.linear.dtype
    idx = state.slot.view(1)
    if state.key_features.shape[2] > 0:
        old_f = state.key_features.index_select(2, idx).to(acc)
    else:
        if key_feature_map is None:
            raise ValueError("this ring state keeps no key features: pass key_feature_map")
        old_valid = state.valid.index_select(1, idx)[:, None, :, None]  # an empty slot's zeros are not a key
        old_f = key_feature_map(state.keys.index_select(2, idx)).to(acc) * old_valid
    old_v = _augment(state.values.index_select(2, idx).to(acc), True)
    return (old_f.transpose(-1, -2) @ old_v).unsqueeze(2)


@dataclass
class FusedRingState(HybridState):
    """A ``RingHybridState`` laid out for the fused Triton decode step
    (``ops.hybrid_step_triton.hybrid_step_fused_triton``). That kernel's programs run at once, so
    none may write what another reads:

    * ``linear`` ``[B, Hk, 2, F, D + 1]`` holds two linear states used by step parity. At tick ``t``
      the queries read buffer ``t % 2``: the ring's linear state *with* the token this step evicts
      (slot ``t % w``, which is therefore never read); the step writes buffer ``(t + 1) % 2``, the
      same plus the token the next step evicts. Between steps, buffer ``(t + 1) % 2`` is the ring's
      linear state.
    * With gates (``evict_features`` ``[B, Hk, 2, F]`` and ``evict_values`` ``[B, Hk, 2, D]`` set) the
      evicted token cannot be added ahead, since this step's gate fades the state before it: buffer
      ``t % 2`` holds the state after token ``t - 1`` and the evict buffers at ``t % 2`` the token this
      step evicts, both read at tick ``t``; the step writes ``g_t S + e`` and the next evicted token
      at ``(t + 1) % 2``. Between steps, buffer ``t % 2`` is the ring's linear state.
    * ``key_features`` is empty (the kernel recomputes a key's features from its rotated key) or,
      for features of the keys before RoPE (``feature_rope: false``), the window's ``[B, Hk, w, F]``.
    * ``ticks`` ``[B, H, S]`` int32: steps taken modulo ``2 w``, one copy per program (sequence,
      query head, part of the value columns), each advanced by its own program.
    * ``keys``, ``values``, ``valid`` and ``slot`` are kept as ``RingHybridState`` keeps them.
    """

    slot: torch.Tensor | None = None
    ticks: torch.Tensor | None = None
    evict_features: torch.Tensor | None = None
    evict_values: torch.Tensor | None = None

    @property
    def gated(self) -> bool:
        return self.evict_features is not None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        gates = (self.evict_features, self.evict_values) if self.gated else ()
        return (*super().tensors(), self.slot, self.ticks, *gates)

    def map(self, fn) -> "FusedRingState":
        gates = dict(evict_features=fn(self.evict_features), evict_values=fn(self.evict_values)) if self.gated else {}
        return FusedRingState(*(fn(x) for x in super().tensors()), slot=self.slot.clone(), ticks=fn(self.ticks),
                              **gates)

    @classmethod
    def from_ring(cls, ring: RingHybridState, key_feature_map, n_heads: int, splits: int = 1,
                  gated: bool = False) -> "FusedRingState":
        """``ring`` (its buffers are taken over; its key features kept where it has them) for a kernel
        with ``n_heads`` query heads and the value columns in ``splits`` parts; ``gated``: laid out for
        a gated linear state."""
        t = int(ring.slot)
        ticks = torch.full((ring.keys.shape[0], n_heads, splits), t, dtype=torch.int32, device=ring.keys.device)
        if gated:
            leaving = _leaving(ring, key_feature_map)[:, :, 0]  # [B, Hk, F, D + 1]: phi(k) [v, 1] of slot t
            feats = leaving[..., -1]  # phi(k) (the normaliser's column)
            idx = ring.slot.view(1)
            values = ring.values.index_select(2, idx)[:, :, 0].to(feats.dtype)  # zeros in an empty slot
            both = lambda x: torch.stack((x, torch.zeros_like(x)) if t % 2 == 0 else (torch.zeros_like(x), x), 2)  # noqa: E731
            linear = torch.cat((ring.linear, ring.linear.clone()), dim=2)
            return cls(ring.keys, ring.key_features, ring.values, linear, ring.valid, slot=ring.slot, ticks=ticks,
                       evict_features=both(feats).contiguous(), evict_values=both(values).contiguous())
        ahead = ring.linear + _leaving(ring, key_feature_map)
        linear = torch.cat((ahead, ring.linear) if t % 2 == 0 else (ring.linear, ahead), dim=2)
        return cls(ring.keys, ring.key_features, ring.values, linear, ring.valid, slot=ring.slot, ticks=ticks)

    def ring(self) -> RingHybridState:
        """The ``RingHybridState`` this holds (sharing the window's buffers; reads a tick on the host)."""
        t = int(self.ticks.view(-1)[0])
        linear = self.linear.narrow(2, t % 2 if self.gated else (t + 1) % 2, 1)
        return RingHybridState(self.keys, self.key_features, self.values, linear, self.valid, slot=self.slot)


def hybrid_attention_step_ring(
    q, k, qf, kf, v, gamma, state: RingHybridState, *, scale: float, softcap: float | None = None,
    key_feature_map=None, log_gate: torch.Tensor | None = None, mix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RingHybridState]:
    """``hybrid_attention_step`` on a ring state, in place and with fixed shapes (no padding: every
    decoded token is real). The evicted slot's features and values join the linear state (an empty
    slot adds zero), the new token takes its place. ``key_feature_map`` recomputes the evicted
    key's features when the state keeps none (``kf`` may then be None). Returns ``(y [B, H, 1, D], state)``."""
    acc = state.linear.dtype
    n_kv = k.shape[1]
    idx = state.slot.view(1)
    stored = state.key_features.shape[2] > 0
    if log_gate is not None:
        state.linear.mul_(log_gate.to(acc).exp()[..., None, None])
    state.linear.add_(_leaving(state, key_feature_map))
    state.keys.index_copy_(2, idx, k.to(state.keys.dtype))
    if stored:
        state.key_features.index_copy_(2, idx, kf.to(state.key_features.dtype))
    state.values.index_copy_(2, idx, v.to(state.values.dtype))
    state.valid.index_fill_(1, idx, True)
    state.slot.add_(1).remainder_(state.keys.shape[2])
    qg, qfg = _group(q, n_kv).to(acc), _group(qf, n_kv).to(acc)
    g = gamma.to(acc).reshape(n_kv, -1)[..., None, None]
    mask = state.valid[:, None, None, None, :]
    scores = _scores(qg, state.keys.to(acc).unsqueeze(2), scale, softcap)  # in the autocast dtype under autocast
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    c = scores.amax(dim=-1, keepdim=True)
    a = g * torch.exp(scores - c) * mask
    y = _step_output(a @ _augment(state.values.to(acc), True).unsqueeze(2), qfg @ state.linear, mix, n_kv)
    b, hk, grp, _, d = y.shape
    return y.reshape(b, hk * grp, 1, d).to(q.dtype), state


def hybrid_attention_recurrent(q, k, qf, kf, v, gamma, *, window, scale, softcap=None, initial_state=None,
                               key_mask=None, log_gate=None, mix=None):
    """Token by token through ``hybrid_attention_step`` (reference for the decoding form)."""
    b, h, t, d = q.shape
    state = initial_state or empty_hybrid_state(b, k.shape[1], d, kf.shape[-1], device=q.device, dtype=k.dtype)
    outs = []
    for i in range(t):
        sl = slice(i, i + 1)
        o, state = hybrid_attention_step(
            q[:, :, sl], k[:, :, sl], qf[:, :, sl], kf[:, :, sl], v[:, :, sl], gamma, state,
            window=window, scale=scale, softcap=softcap, key_mask=None if key_mask is None else key_mask[:, sl],
            log_gate=None if log_gate is None else log_gate[..., sl], mix=mix,
        )
        outs.append(o)
    return torch.cat(outs, dim=2), state
