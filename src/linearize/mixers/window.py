"""A kept softmax layer with a sliding window (``spec.softmax_window = W``, or its own ``W`` in
``spec.softmax_windows``): the teacher's own attention, q/k/v/o,
RoPE, scale and soft-cap, over each query's last ``W`` tokens only, so that it decodes in constant memory.

``convert`` puts one in place of each layer of ``spec.keep_softmax`` that has no sliding window of its own
(Gemma's local layers stay as they are) when ``spec.softmax_window`` is set; ``keep_softmax: auto:K`` then keeps
the K layers it chooses after stage 1 this way. Issue #53 asks for copying from context with constant memory:
a few such layers, chosen by how much their softmax matters (attention-output MSE, or the copy loss they lower),
see ``W`` tokens back exactly, at ``W`` keys and values per key head and layer.

It adds no parameters: attention transfer has nothing to train in it, LoRA trains its projections as any
other layer's. Inside ``W`` tokens it is exactly the teacher's attention (a window covering the sequence is the
teacher). With ``spec.softmax_window_sinks = S`` it also sees each sequence's first ``S`` real tokens once they have
left the window (attention sinks, ``ops/window/sinks.py``): ``S`` more slots of state. A query past the teacher's
context (``reach``: ``max_position_embeddings - 1``) scores the sinks as if it stood at ``reach``, a distance the
teacher's RoPE knows (``ops/window/sinks.py``, "reach"). The op is ``ops.window``: the
sequence form (SDPA on blocks), the state of the last ``W`` keys and values, the step, and the fast decoder's ring of
``W`` slots (updated in place, fixed shapes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import ops
from ..ops.hybrid import RingHybridState
from ..ops.window import window_softmax, window_softmax_step, window_softmax_step_ring, window_state
from ..ops.window.float8 import (Float8RingState, Float8WindowState, fake_quantize, float8_window_state,
                                 float8_window_step, float8_window_step_ring)
from ..ops.window.sinks import (SinkWindowState, settle_sinks, sink_index, sink_ring_state, sink_window_state,
                                sinks_window_step, window_softmax_sinks)
from ..models.base import rope_rotate_half, rotates_half
from .base import Mixer


# The fast decoder's ring step rotates q and k inside its Triton kernel where it can (``_fused_rope``), saving the
# layer's RoPE launches each token. False: RoPE in PyTorch before the kernel (the same numbers to rounding).
WINDOW_STEP_ROPE: bool = True
# The same for a prompt through the prefill kernel (``ops/window/parallel_triton.py``): q rotated inside it, the
# keys by ``rope_rotate_half``. False: the family's RoPE on both first.
WINDOW_PREFILL_ROPE: bool = True
# With sinks past the reach, that kernel also rotates the sinks' queries itself (``sink_rope``), as the ring step
# does. False: ``_sink_queries`` in PyTorch first (a pass over q a layer; the same numbers to rounding).
WINDOW_PREFILL_SINK_ROPE: bool = True


@contextmanager
def positions_below(model, n: int):
    """Inside, ``model``'s window layers know that no position reaches ``n`` (a decoder's prompt and new tokens):
    where ``n`` is within a layer's reach, its steps compute no queries of the sinks' own (no launches a step)."""
    layers = [m for m in model.modules() if isinstance(m, WindowSoftmax) and m.sinks]
    for m in layers:
        m.positions_below = n
    try:
        yield
    finally:
        for m in layers:
            m.positions_below = None


class WindowSoftmax(Mixer):
    kind = "window"
    _rotates_half: bool | None = None  # the family's RoPE rotates halves (asked once)
    # with sinks: the farthest position the sinks are scored from (``set_reach``) and the model's RoPE tables
    reach: int | None = None
    positions_below: int | None = None  # a caller's promise that positions stay below this (``positions_below``)

    def set_reach(self, reach: int | None, tables) -> None:
        """A query past position ``reach`` scores the sinks as if it stood at ``reach`` (at least ``window + sinks``:
        every sink has left such a query's window); ``tables`` (``Adapter.rope_tables``) gives the RoPE tables
        there (kept out of the module tree). ``reach`` None: the sinks at their own distance."""
        self.reach = max(reach, self.window + self.sinks) if reach is not None and tables is not None else None
        self.__dict__["_tables"] = tables
        self.__dict__["_reach_cache"] = None

    def _reach_rows(self, device):
        """The RoPE tables at ``reach`` ``(cos, sin)`` ``[R]`` in fp32 on ``device`` (computed once per device,
        outside graph capture: a prefill comes first)."""
        rows = self.__dict__.get("_reach_cache")
        if rows is None or rows[0].device != device:
            ids = torch.full((1, 1), self.reach, dtype=torch.long, device=device)
            cos, sin = self.__dict__["_tables"](ids)
            rows = (cos[0, 0].float(), sin[0, 0].float())
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self.__dict__["_reach_cache"] = rows
        return rows

    def _reach_positions(self, q, position_embeddings, state):
        """The positions ``[B or 1, T]`` whose queries may be past the reach (see ``_sink_queries``), or None where
        none can be or nothing is known of them."""
        if not self.sinks or self.reach is None or position_embeddings is None or self.geometry.rotary is None:
            return None
        if (self.positions_below is not None and self.positions_below <= self.reach + 1) or \
                (state is None and q.shape[2] <= self.reach + 1):
            self._reach_rows(q.device)  # cached before any graph capture
            return None
        positions = self.position_ids
        if positions is None and state is None:
            positions = torch.arange(q.shape[2], device=q.device)[None]
        return positions

    def _sink_queries(self, q, k, position_embeddings, state):
        """The queries that score the sinks (before RoPE in, rotated out): each query rotated as if at position
        ``min(p, reach)``; None where no query can pass ``reach`` (a prompt of at most ``reach + 1`` tokens from
        the start, or a decoder's promise: the model's own q then) or nothing is known of positions."""
        positions = self._reach_positions(q, position_embeddings, state)
        if positions is None:
            return None
        cos, sin = position_embeddings
        at_cos, at_sin = self._reach_rows(cos.device)
        over = (positions.to(cos.device) > self.reach)[..., None]  # [B or 1, T, 1]
        tables = (torch.where(over, at_cos.to(cos.dtype), cos), torch.where(over, at_sin.to(sin.dtype), sin))
        if self._half_rope():  # q alone, in fewer launches
            return rope_rotate_half(q, *tables)
        return self.adapter.rope(self, q, k, tables)[0]

    def _sink_rope(self, q, position_embeddings, state, whole: bool = False):
        """What the kernels take to rotate the sinks' queries themselves (``sink_rope``): the tables at the reach,
        each sequence's position (``whole``: every query's, ``[B or 1, T]``, for the prefill kernel; else the last,
        for the ring step) and the reach; None where ``_sink_queries`` would be."""
        positions = self._reach_positions(q, position_embeddings, state)
        if positions is None:
            return None
        at_cos, at_sin = self._reach_rows(q.device)
        return at_cos, at_sin, (positions.to(q.device) if whole else positions[:, -1]), self.reach

    @property
    def window(self) -> int:
        return self.spec.window_for(self.layer_idx)

    def _kw(self):
        g = self.geometry
        return dict(scale=g.scaling, softcap=g.softcap)

    @property
    def float8(self) -> bool:
        """Whether the window's keys and values are kept as float8 (``spec.softmax_window_dtype``)."""
        return self.spec.softmax_window_dtype == "float8"

    @property
    def sinks(self) -> int:
        """Each sequence's first real tokens the layer sees beside its window (``spec.softmax_window_sinks``)."""
        return self.spec.softmax_window_sinks

    def sequence(self, q, k, v, position_embeddings, state, want_state):
        fused = state is None and self._prefill_rope(q, k, v, position_embeddings)
        sink_q = sink_rope = None
        if fused and WINDOW_PREFILL_SINK_ROPE:  # the kernel makes the sinks' queries from q as it rotates it
            sink_rope = self._sink_rope(q, position_embeddings, state, whole=True)
        else:
            sink_q = self._sink_queries(q, k, position_embeddings, state)
        if fused:  # the keys rotated here (the state keeps them), q inside the prefill kernel
            k = rope_rotate_half(k, *position_embeddings)
        else:
            q, k = self.adapter.rope(self, q, k, position_embeddings)
        if state is None:
            if self.float8:  # attend over what the ring will give back
                k, k8, ks = fake_quantize(k)
                v, v8, vs = fake_quantize(v)
            if fused:
                from ..ops.window.parallel_triton import window_softmax_triton

                sinks = (sink_index(self.key_mask, q.shape[0], q.shape[2], self.sinks, q.device) if self.sinks
                         else None)
                o = window_softmax_triton(q, k, v, window=self.window, **self._kw(), key_mask=self.key_mask,
                                          position_embeddings=position_embeddings, sink_positions=sinks,
                                          sink_q=sink_q, sink_rope=sink_rope)
            elif self.sinks:  # the window and the sinks: SDPA on blocks, the sinks' keys appended to each block's
                o = window_softmax_sinks(q, k, v, window=self.window, sinks=self.sinks, **self._kw(),
                                         key_mask=self.key_mask, sink_q=sink_q)
            else:
                o = window_softmax(q, k, v, window=self.window, **self._kw(), key_mask=self.key_mask)
            if not want_state:
                return o, None
            if self.sinks:
                codes = (k8, ks, v8, vs) if self.float8 else None
                return o, sink_window_state(k, v, self.window, self.sinks, self.key_mask, codes)
            new = window_state(k, v, self.window, self.key_mask)
            return o, (float8_window_state(new, k8, ks, v8, vs) if self.float8 else new)
        outs = []  # continuing a sequence with several tokens at once: token by token from the state
        for i in range(q.shape[2]):
            sl = slice(i, i + 1)
            mask = None if self.key_mask is None else self.key_mask[:, sl]
            o, state = self._step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, mask,
                                  None if sink_q is None else sink_q[:, :, sl])
            outs.append(o)
        return torch.cat(outs, dim=2), state

    def _step(self, q, k, v, state, key_mask, sink_q=None):
        """One token from a ``window_state`` (rotated q and k; ``sink_q``: the queries that score the sinks)."""
        if isinstance(state, SinkWindowState):
            return sinks_window_step(q, k, v, state, window=self.window, **self._kw(), key_mask=key_mask,
                                     sink_q=sink_q)
        if isinstance(state, Float8WindowState):
            return float8_window_step(q, k, v, state, window_softmax_step, window=self.window, **self._kw(),
                                      key_mask=key_mask)
        return window_softmax_step(q, k, v, state, window=self.window, **self._kw(), key_mask=key_mask)

    def step(self, q, k, v, position_embeddings, state):
        o, state = self._step_any(q, k, v, position_embeddings, state)
        if isinstance(state, RingHybridState) and state.fill is not None:  # a ring lacking some sinks yet
            settle_sinks(state)
        return o, state

    def _step_any(self, q, k, v, position_embeddings, state):
        if type(state) in (ops.RingHybridState, Float8RingState) and self._fused_rope(q, state):
            from ..ops.window import step_triton  # RoPE, ring (a float8 one's quantising too) and softmax: one launch

            rope = position_embeddings if self.geometry.rotary is not None else None
            launch = (step_triton.window_step_ring_float8_triton if isinstance(state, Float8RingState)
                      else step_triton.window_step_ring_triton)
            return launch(q, k, v, state, **self._kw(), position_embeddings=rope,  # the sinks' queries rotated in it
                          sink_rope=self._sink_rope(q, position_embeddings, state))
        sink_q = self._sink_queries(q, k, position_embeddings, state)
        q, k = self.adapter.rope(self, q, k, position_embeddings)
        if isinstance(state, Float8RingState):
            return float8_window_step_ring(q, k, v, state, window_softmax_step_ring, **self._kw(), sink_q=sink_q)
        if isinstance(state, ops.RingHybridState):  # the fast decoder's fixed-shape, in-place window
            return window_softmax_step_ring(q, k, v, state, **self._kw(), sink_q=sink_q)
        return self._step(q, k, v, state, self.key_mask, sink_q)

    def _half_rope(self) -> bool:
        """Whether the family's RoPE rotates halves (or there is none): what the kernels compute (asked once)."""
        if self._rotates_half is None:
            self._rotates_half = rotates_half(self.geometry.rotary, self.geometry.head_dim)
        return self._rotates_half

    def _prefill_rope(self, q, k, v, position_embeddings) -> bool:
        """Whether a whole sequence goes through the prefill kernel (``ops.window``'s rule) with q rotated
        inside it: RoPE by rotating halves (asked of the family's RoPE once)."""
        from ..ops import window as window_ops

        if not (WINDOW_PREFILL_ROPE and position_embeddings is not None and self.geometry.rotary is not None):
            return False
        if window_ops._use_window_kernel(q, k, v, self.window) or not window_ops._use_window_triton(q, k, v,
                                                                                                     self.window):
            return False
        return self._half_rope()

    def _fused_rope(self, q, state) -> bool:
        """Whether the ring step's Triton kernel runs (``ops.window``'s rule, a float8 ring's
        ``_use_float8_step_kernel``) and can rotate q and k itself (RoPE by rotating halves, or none; asked of
        the family's RoPE once)."""
        from ..ops import window as window_ops
        from ..ops.window import float8 as float8_ops

        rule = (float8_ops._use_float8_step_kernel if isinstance(state, Float8RingState)
                else window_ops._use_window_step_kernel)
        if not (WINDOW_STEP_ROPE and rule(q, state)):
            return False
        return self._half_rope()

    def ring_state(self, state: ops.HybridState, keep_key_features: bool = False) -> ops.RingHybridState:
        """The fast decoder's ring of ``W`` slots from a prefill's state (its zero features not kept); with sinks
        ``S + W`` slots, the sinks first."""
        if isinstance(state, SinkWindowState):
            return sink_ring_state(state, self.window)
        if isinstance(state, Float8WindowState):
            return Float8RingState.from_state(state, self.window, copy=False)
        return ops.RingHybridState.from_state(state, self.window, keep_key_features=False, copy=False)

    def fused_decoding(self) -> bool:
        return False

    def state_bytes(self, dtype):
        g = self.geometry
        slots = self.window + self.sinks
        if self.float8:  # a byte per element and a float32 scale per token and key head, for keys and values
            return slots * (g.n_kv_heads * 2 * (g.head_dim + 4) + 1)
        elem = torch.tensor([], dtype=dtype).element_size()
        return slots * (g.n_kv_heads * 2 * g.head_dim * elem + 1)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.window}" + (f", sinks={self.sinks}" if self.sinks else "")
                + (", float8" if self.float8 else ""))
