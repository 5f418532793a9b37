"""A ``transformers`` Cache whose linear layers hold a fixed-size recurrent state.

Converted layers keep a ``RecurrentLayer`` (the mixer's state: a [F, D] matrix per head, plus the
last ``window`` keys/values for the LoLCATs hybrid); kept softmax layers keep an ordinary growing
``DynamicLayer``. Memory held by the converted layers does not grow with the generated length.

``generate()`` works with no extra argument: it creates a ``DynamicCache`` and each mixer swaps its
own slot for a ``RecurrentLayer`` on first use (``recurrent_slot``). ``LinearizeCache`` builds the
right layers up front, for callers that manage the cache themselves.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer



def _map(state, fn):
    if state is None:
        return None
    return state.map(fn) if hasattr(state, "map") else fn(state)  # a state dataclass, or one tensor


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it owns exactly its memory, else a compact copy. A prompt's state is often a
    view (the last ``window`` keys of the whole prompt's, values split from one fused q/k/v
    projection) that would keep the whole prompt's activations alive while decoding: for SmolLM2's
    LoLCATs student at a 128-token prompt, 15 MB per sequence held where the state is 7."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def state_tensors(state) -> list[torch.Tensor]:
    if state is None:
        return []
    if hasattr(state, "tensors"):  # HybridState, SparseHybridState, DeltaWindowState ...
        return list(state.tensors())
    return [state]


class RecurrentLayer(CacheLayerMixin):
    """One converted layer's decoding state and the number of tokens it has absorbed."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state = None
        self.seen = 0
        self.is_initialized = True

    def store(self, state, n_tokens: int) -> None:
        # a prefill's state may view the prompt's activations; a decode step's tensors are new
        self.state = _map(state, own_storage) if n_tokens > 1 else state
        self.seen += n_tokens

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in state_tensors(self.state))

    # --- CacheLayerMixin contract ---
    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a RecurrentLayer holds a linear-attention state, not keys and values")

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # transformers passes an int (5.2x) or the cache_position tensor (earlier 5.x)
        q = query_length.shape[0] if torch.is_tensor(query_length) else int(query_length)
        return self.seen + q, 0

    def get_seq_length(self, *args) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = _map(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = _map(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = _map(self.state, lambda t: t[indices])

    def crop(self, max_length: int) -> None:
        raise RuntimeError("a recurrent state cannot be cropped back to an earlier length")


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes a cache: ``cache`` (transformers >= 5.2x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier 5.x)."""
    import inspect

    forward = getattr(type(model), "forward", None)
    try:
        return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


def layer_cache(*candidates):
    """The cache an attention module was called with, whichever name the decoder layer used:
    ``cache`` (transformers >= 5.2x), ``past_key_values`` (earlier 5.x) or ``layer_past`` (GPT-NeoX)."""
    return next((c for c in candidates if c is not None), None)


def recurrent_slot(cache, layer_idx: int) -> RecurrentLayer:
    """The ``RecurrentLayer`` for ``layer_idx`` in any transformers Cache, put there on first use."""
    layers = cache.layers
    while len(layers) <= layer_idx:  # caches that grow their layer list lazily
        layers.append(DynamicLayer())
    layer = layers[layer_idx]
    if not isinstance(layer, RecurrentLayer):
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            raise RuntimeError(f"cache layer {layer_idx} already holds softmax keys; it cannot feed a linear mixer")
        layer = layers[layer_idx] = RecurrentLayer()
    return layer


class LinearizeCache(DynamicCache):
    """A DynamicCache whose converted layers are ``RecurrentLayer``s from the start."""

    def __init__(self, model=None, config=None, **kwargs):
        config = config if config is not None else model.config
        super().__init__(config=config, **kwargs)
        kept = set(config.linearize["keep_softmax"]) if getattr(config, "linearize", None) else set(range(config.num_hidden_layers))
        for i in range(config.num_hidden_layers):
            while len(self.layers) <= i:
                self.layers.append(DynamicLayer())
            if i not in kept:
                self.layers[i] = RecurrentLayer()

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's state, keys and values."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentLayer):
                total += layer.nbytes
            elif getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total


def cache_nbytes(cache) -> int:
    """Bytes held by any transformers Cache (recurrent states plus softmax keys and values)."""
    return LinearizeCache.nbytes.fget(cache)
