"""Every recurrent state of the LoLCATs hybrid (``ops/hybrid/__init__.py`` has the math), and how
each is built; shared by the PyTorch forms (``chunk.py``, ``recurrent.py``) and the Triton kernels
(``chunk_triton.py``, ``step_triton.py``):

* ``HybridState``: the window's last ``w`` raw keys, key features and values, and the linear state of
  the tokens that have left it (``empty_hybrid_state``; after a prompt, ``hybrid_final_state``);
* ``SparseHybridState``: the same beside the sparse cache of ``S`` exact tokens, with the priorities
  and positions its selection reads (``empty_sparse_hybrid_state``; after a prompt, the chunked form's);
* ``RingHybridState``, ``RingSparseState``: those with the window as a fixed ring of ``w`` slots,
  updated in place (the fast decoder's: what a CUDA graph needs);
* ``FusedRingState``, ``FusedSinkState``: a ring laid out for the fused Triton decode step
  (``step_triton.py``), the latter beside a cache of attention sinks that no longer changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..linear_attention import _augment, accum_dtype
from .shared import _real_keys, pad_front


@dataclass
class HybridState:
    keys: torch.Tensor  # [B, Hk, <=w, D] raw keys still in the window
    key_features: torch.Tensor  # [B, Hk, <=w, F]
    values: torch.Tensor  # [B, Hk, <=w, D]
    linear: torch.Tensor  # [B, Hk, 1, F, D + 1] fp32: sum over tokens older than the window
    valid: torch.Tensor  # [B, <=w] bool: False for padding tokens still in the window

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.key_features, self.values, self.linear, self.valid)

    def map(self, fn) -> "HybridState":
        """Apply ``fn`` to every tensor (e.g. to select or repeat sequences of the batch)."""
        return HybridState(*(fn(x) for x in self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())


@dataclass
class SparseHybridState:
    """Decoding state of the hybrid with a sparse cache (per sequence; sizes fixed but the window's,
    which grows to ``w`` over the first tokens as the hybrid's does)."""

    keys: torch.Tensor  # [B, Hk, <=w, D] the window's raw keys
    key_features: torch.Tensor  # [B, Hk, <=w, F]
    values: torch.Tensor  # [B, Hk, <=w, D]
    valid: torch.Tensor  # [B, <=w] bool: False for padding in the window
    window_scores: torch.Tensor  # [B, Hk, <=w] priority of each window token from the last boundary
    linear: torch.Tensor  # [B, Hk, 1, F, D + 1] (fp32 or wider): the folded tokens
    cache_keys: torch.Tensor  # [B, Hk, S, D]
    cache_features: torch.Tensor  # [B, Hk, S, F]
    cache_values: torch.Tensor  # [B, Hk, S, D]
    cache_valid: torch.Tensor  # [B, Hk, S] bool: an occupied slot
    cache_scores: torch.Tensor  # [B, Hk, S] priority from the last boundary
    cache_pos: torch.Tensor  # [B, Hk, S] int64: position from the origin (ties)
    count: torch.Tensor  # [B] int64: tokens since the origin (0 before the first real token)
    # with gates (a fading linear state) only: [B, Hk, S] (as ``linear``) the log fade each cached token
    # has gathered since it left the window, applied when it is folded; None without gates
    cache_fade: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        fade = () if self.cache_fade is None else (self.cache_fade,)
        return (self.keys, self.key_features, self.values, self.valid, self.window_scores, self.linear,
                self.cache_keys, self.cache_features, self.cache_values, self.cache_valid, self.cache_scores,
                self.cache_pos, self.count, *fade)

    def map(self, fn) -> "SparseHybridState":
        """Apply ``fn`` to every tensor (each has the batch first)."""
        return SparseHybridState(*(fn(x) for x in self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())


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


def empty_sparse_hybrid_state(batch, n_kv, head_dim, feature_dim, cache_size, *, device=None,
                              dtype=torch.float32, gated: bool = False) -> SparseHybridState:
    """An empty state; ``gated``: with the cached tokens' fades (a fading linear state)."""
    acc = accum_dtype(dtype)
    z = lambda *s, dt=dtype: torch.zeros(batch, n_kv, *s, device=device, dtype=dt)  # noqa: E731
    return SparseHybridState(
        z(0, head_dim), z(0, feature_dim), z(0, head_dim), torch.zeros(batch, 0, dtype=torch.bool, device=device),
        z(0, dt=acc), z(1, feature_dim, head_dim + 1, dt=acc),
        z(cache_size, head_dim), z(cache_size, feature_dim), z(cache_size, head_dim), z(cache_size, dt=torch.bool),
        z(cache_size, dt=acc), z(cache_size, dt=torch.long), torch.zeros(batch, dtype=torch.long, device=device),
        z(cache_size, dt=acc) if gated else None)


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
    # attention sinks (a window-softmax layer's, ``ops/window/sinks.py``): the first ``sinks`` slots hold each
    # sequence's first real tokens and never move, the ring is the other slots; ``fill`` [B] long: the sinks
    # each sequence holds, while some sequence still lacks some (else None: nothing to do per step)
    sinks: int = 0
    fill: torch.Tensor | None = None
    # the window step kernel's arrival counts (``ops/window/step_triton.py``), int32 zeros between steps; made by
    # the first step, never part of the state's contents (``map`` leaves them to be made again)
    counters: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.key_features, self.values, self.linear, self.valid, self.slot)

    def map(self, fn) -> "RingHybridState":
        return RingHybridState(*(fn(x) for x in self.tensors()[:5]), slot=self.slot.clone(), sinks=self.sinks,
                               fill=None if self.fill is None else fn(self.fill))

    def advance(self) -> None:
        """The next slot to overwrite, in place: the oldest of the ring's slots (after its ``sinks`` fixed ones)."""
        if self.sinks:
            self.slot.sub_(self.sinks).add_(1).remainder_(self.keys.shape[2] - self.sinks).add_(self.sinks)
        else:
            self.slot.add_(1).remainder_(self.keys.shape[2])

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


# The fused step's linear-state rows start every ROW_ALIGN elements (16 bytes of fp32): with rows of D + 1
# (the values, then the normaliser) the kernel could only read and write them an element at a time
# (sm_90 PTX of the step at head dim 128: scalar ``ld.global.b32`` for every state load). The padding
# (3 elements a row at head dim 128, 2.3 %) is never read.
ROW_ALIGN = 4


def aligned_rows(linear: torch.Tensor) -> torch.Tensor:
    """``linear`` ``[..., F, D + 1]`` as a view of a zero-padded buffer whose rows start every ``ROW_ALIGN``
    elements (a copy; ``linear`` itself when it is laid out so already)."""
    width = linear.shape[-1]
    padded = -(-width // ROW_ALIGN) * ROW_ALIGN
    strides, step = [1], padded  # innermost first: an element, a padded row, then rows one after another
    for size in reversed(linear.shape[:-1]):
        strides.append(step)
        step *= size
    if linear.stride() == tuple(reversed(strides)):
        return linear
    out = torch.zeros(*linear.shape[:-1], padded, dtype=linear.dtype, device=linear.device)
    out[..., :width] = linear
    return out[..., :width]


@dataclass
class FusedRingState(HybridState):
    """A ``RingHybridState`` laid out for the fused Triton decode step
    (``step_triton.hybrid_step_fused_triton``). That kernel's programs run at once, so
    none may write what another reads:

    * ``linear`` ``[B, Hk, 2, F, D + 1]`` (a view of rows padded to ``ROW_ALIGN`` elements, ``aligned_rows``)
      holds two linear states used by step parity. At tick ``t``
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

    def __post_init__(self):
        self.linear = aligned_rows(self.linear)  # however made (from_ring, map, a joined batch)

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


@dataclass
class RingSparseState(SparseHybridState):
    """A ``SparseHybridState`` whose window is a fixed ring of exactly ``w`` slots, updated in place with
    the cache (the fast decoder's form: every step has the same shapes and touches the same buffers,
    what a CUDA graph needs). Empty slots hold zeros and ``valid = False``; ``slot`` (a 0-d long
    tensor) is the next slot to overwrite, whose token is the one leaving the window."""

    slot: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.slot)

    def map(self, fn) -> "RingSparseState":
        return RingSparseState(*(fn(x) for x in super().tensors()), slot=self.slot.clone())

    @classmethod
    def from_state(cls, state: SparseHybridState, window: int) -> "RingSparseState":
        """A ring holding ``state``'s window, oldest first with the empty slots in front (slot 0 is
        overwritten first); the ring owns ``state``'s tensors afterwards."""
        have = state.keys.shape[2]
        if have > window:
            raise ValueError(f"the state holds {have} window tokens, more than the window ({window})")
        front = lambda x, dim: pad_front(x, dim, window - have).contiguous()  # noqa: E731

        rest = [x.contiguous() for x in state.tensors()[5:]]
        return cls(front(state.keys, 2), front(state.key_features, 2), front(state.values, 2), front(state.valid, 1),
                   front(state.window_scores, 2), *rest,
                   slot=torch.zeros((), dtype=torch.long, device=state.keys.device))


@dataclass
class FusedSinkState(FusedRingState):
    """The fused decode step's state (``FusedRingState``) beside a cache that no longer changes: the
    sequence's first ``S`` tokens under ``priority="first"`` once every sequence's have left the window
    (a newcomer then never outranks them: each token leaving the window is folded into the linear
    state, as in the hybrid without a cache). ``hybrid_step_fused_triton`` adds them to the window's
    softmax, the same step as ``sparse_hybrid_attention_step_ring`` on that state.

    * ``sink_keys``, ``sink_values`` ``[B, Hk, S, D]``: the cached tokens (keys after RoPE);
    * ``sink_valid`` ``[B, Hk, S]`` bool.
    """

    sink_keys: torch.Tensor | None = None
    sink_values: torch.Tensor | None = None
    sink_valid: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.sink_keys, self.sink_values, self.sink_valid)

    def map(self, fn) -> "FusedSinkState":
        ring = super().map(fn)
        return FusedSinkState(*HybridState.tensors(ring), slot=ring.slot, ticks=ring.ticks,
                              sink_keys=fn(self.sink_keys), sink_values=fn(self.sink_values),
                              sink_valid=fn(self.sink_valid))

    @staticmethod
    def settled(state: SparseHybridState, priority: str) -> bool:
        """Whether ``state``'s cache will not change again: ``priority="first"`` with every slot of
        every sequence and key head taken (reads a flag on the host)."""
        return priority == "first" and state.cache_keys.shape[2] > 0 and bool(state.cache_valid.all())

    @classmethod
    def from_sparse(cls, state: SparseHybridState, window: int, key_feature_map, n_heads: int,
                    splits: int = 1) -> "FusedSinkState":
        """The fused step's state from a prefill's ``state`` whose cache is ``settled`` (its window, linear
        state and cache are taken over; the window's key features are dropped)."""
        plain = HybridState(state.keys, state.key_features, state.values, state.linear, state.valid)
        ring = RingHybridState.from_state(plain, window, keep_key_features=False, copy=False)
        fused = FusedRingState.from_ring(ring, key_feature_map, n_heads, splits)
        return cls(*HybridState.tensors(fused), slot=fused.slot, ticks=fused.ticks,
                   sink_keys=state.cache_keys.contiguous(), sink_values=state.cache_values.contiguous(),
                   sink_valid=state.cache_valid.contiguous())
