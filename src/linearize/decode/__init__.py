"""Fast constant-memory decoding: static state buffers, the whole decode step as one CUDA graph,
sampling on the device.

``generate()`` pays Python and kernel-launch overhead on every token (tens of milliseconds for a
30-layer model), while the GPU work of a recurrent step is well under a millisecond. The fast path
removes that overhead. By job:

* ``sampling``: greedy / temperature / top-k / top-p on the device (``Sampling``, ``next_tokens``);
* ``buffers``: the static cache the steps update in place (ring windows, preallocated KV);
* ``loop``: ``FastDecoder`` (prefill, buffers, the decode step, CUDA-graph capture and replay);
* ``fused``: q/k/v and gate/up as one product each during a call (the adapters' fused modules), and
  on CUDA the RMSNorms and gated activations as one Triton kernel each;
* ``generate``: ``fast_generate(model, input_ids, ...)`` and ``decode``, for
  ``model.generate(..., custom_generate=decode)``;
* ``route``: what a linearize model's own ``generate()`` runs: this decoder wherever it honours the
  call, else transformers' loop with one line saying why (``fast_decoding=False``: that loop).
"""

from .buffers import StaticCache, StaticKVLayer, StaticStateLayer, layer_tensors, static_cache
from .fused import fused_projections
from .generate import decode, fast_generate
from .loop import FastDecoder
from .sampling import Sampling, filter_logits, next_tokens

__all__ = ["FastDecoder", "Sampling", "StaticCache", "StaticKVLayer", "StaticStateLayer", "decode",
           "fast_generate", "filter_logits", "fused_projections", "layer_tensors", "next_tokens", "static_cache"]
