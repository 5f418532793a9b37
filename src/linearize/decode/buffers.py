"""The fast decoder's cache: every layer's decoding state in buffers of fixed shape.

After the prefill (an ordinary ``LinearizeCache``), ``static_cache`` turns each layer's entry into
a static one: a converted layer's state (the LoLCATs window becomes a ring of exactly ``window``
slots, ``ops.RingHybridState``, or ``ops.FusedRingState`` where its fused CUDA kernel runs; the delta
rule's window ``ops.RingDeltaState``), a
kept softmax layer's keys and values, preallocated for the prompt plus every new token, and a kept
sliding-window softmax layer's (Gemma's local layers) in a ring of exactly its window. Decode
steps overwrite these buffers in place and advance one shared device ``position``, so a step reads
nothing back to the host and can be replayed as a CUDA graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from .. import ops
from ..ops.window.sinks import SinkWindowState
from ..cache import LinearizeCache, RecurrentLayer, state_tensors
from ..convert.layers import mixers


class StaticStateLayer(RecurrentLayer):
    """A converted layer's state in fixed buffers; decode steps overwrite them in place."""

    static = True

    def __init__(self, state, position: torch.Tensor):
        super().__init__()
        self.state = state
        self.position = position  # 0-d long: tokens absorbed so far (shared by every layer)

    def store(self, state, n_tokens: int) -> None:
        # ``seen`` stays as the prefill left it: the count lives on the device (``position``), and a
        # Python counter would be frozen by a CUDA graph and recompile a compiled step every token
        if state is not self.state:  # an out-of-place step: copy into the buffers the graph reads
            for buf, new in zip(state_tensors(self.state), state_tensors(state)):
                buf.copy_(new)


class StaticKVLayer(CacheLayerMixin):
    """A kept softmax layer's keys and values, preallocated for the prompt plus every new token."""

    is_compileable = False
    is_sliding = False
    static = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, total: int, position: torch.Tensor):
        super().__init__()
        b, h, t, d = keys.shape
        self.keys = keys.new_zeros(b, h, total, d)
        self.values = values.new_zeros(b, h, total, values.shape[-1])
        self.keys[:, :, :t], self.values[:, :, :t] = keys, values
        self.position = position
        self.is_initialized = True

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        idx = self.position.view(1)
        self.keys.index_copy_(2, idx, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, idx, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self, *args) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticRingKVLayer(CacheLayerMixin):
    """A kept sliding-window softmax layer's keys and values in a ring of ``window`` slots: the token of
    column c (padding included) sits in slot c % window, so each step overwrites the one leaving the window
    and the layer's memory does not grow. Which slots hold real tokens is ``DecodeStep``'s ring mask
    (attention is blind to the slots' order: the keys carry their rotation)."""

    is_compileable = False
    is_sliding = True
    static = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, window: int, prompt_len: int,
                 position: torch.Tensor):
        super().__init__()
        b, h, n, d = keys.shape  # the prompt's last n columns (transformers keeps window - 1 of them)
        if n > window:
            keys, values, n = keys[:, :, -window:], values[:, :, -window:], window
        self.window = window
        self.keys = keys.new_zeros(b, h, window, d)
        self.values = values.new_zeros(b, h, window, values.shape[-1])
        slots = torch.arange(prompt_len - n, prompt_len, device=keys.device) % window
        self.keys[:, :, slots], self.values[:, :, slots] = keys, values
        self.position = position
        self.is_initialized = True

    @staticmethod
    def prompt_columns(prompt_len: int, window: int) -> range:
        """The prompt's columns in the ring when decoding starts (the newest window - 1: the first
        step's token makes the window)."""
        return range(max(0, prompt_len - window + 1), prompt_len)

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        idx = torch.remainder(self.position, self.window).view(1)
        self.keys.index_copy_(2, idx, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, idx, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        return self.window, 0

    def get_seq_length(self, *args) -> int:
        return self.window

    def get_max_length(self) -> int:
        return self.window


class StaticCache(DynamicCache):
    """The fast decoder's cache: every layer static, one shared device position."""

    def __init__(self, layers: list, config):
        super().__init__(config=config)
        self.layers[:] = layers


def static_cache(model, cache: LinearizeCache, total: int, position: torch.Tensor, *,
                 keep_key_features: bool = False) -> StaticCache:
    """The decoding buffers from the prefill's ``cache``, which is emptied layer by layer as its
    tensors are taken over or copied, so a large batch never holds both whole. (The prefill's
    states own their memory: ``cache.own_storage``; views of the prompt's activations once
    doubled a large batch's peak.) ``total``: the prompt's length plus every new token."""
    converted, layers = mixers(model), []
    prompt_len = int(position)  # the position is the prompt's length when decoding starts
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, RecurrentLayer):
            state, layer.state = layer.state, None
            if isinstance(state, (ops.HybridState, ops.SparseHybridState, ops.DeltaWindowState, SinkWindowState)):
                state = converted[i].ring_state(state, keep_key_features=keep_key_features)
            else:
                state = state.contiguous()
            layers.append(StaticStateLayer(state, position))
        elif getattr(layer, "is_sliding", False):
            layers.append(StaticRingKVLayer(layer.keys, layer.values, layer.sliding_window, prompt_len, position))
            layer.keys = layer.values = None
        else:
            layers.append(StaticKVLayer(layer.keys, layer.values, total, position))
            layer.keys = layer.values = None
    return StaticCache(layers, model.config)


def join_caches(caches: list) -> LinearizeCache:
    """One cache from the caches of consecutive slices of a batch (the first one, extended)."""
    if len(caches) == 1:
        return caches[0]
    joined = caches[0]
    for i, layer in enumerate(joined.layers):
        parts = [c.layers[i] for c in caches]
        if isinstance(layer, RecurrentLayer):
            states = [p.state for p in parts]
            if isinstance(layer.state, SinkWindowState):
                layer.state = SinkWindowState.cat(states)
            elif isinstance(layer.state, (ops.HybridState, ops.SparseHybridState, ops.DeltaWindowState)):
                kind = type(layer.state)
                layer.state = kind(*(torch.cat(xs) for xs in zip(*(s.tensors() for s in states))))
            else:
                layer.state = torch.cat(states)
        else:
            layer.keys = torch.cat([p.keys for p in parts])
            layer.values = torch.cat([p.values for p in parts])
        for p in parts[1:]:  # free each piece as soon as it is joined
            if isinstance(p, RecurrentLayer):
                p.state = None
            else:
                p.keys = p.values = None
    return joined


def layer_tensors(layer) -> list[torch.Tensor]:
    """The buffers a static layer holds."""
    if isinstance(layer, (StaticKVLayer, StaticRingKVLayer)):
        return [layer.keys, layer.values]
    return state_tensors(layer.state)


def state_nbytes(cache: StaticCache) -> int:
    """Bytes of every buffer of the decoding state."""
    return sum(x.numel() * x.element_size() for layer in cache.layers for x in layer_tensors(layer))
