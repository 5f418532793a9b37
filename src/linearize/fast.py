"""``linearize.fast``: the fast decoder's public names, kept where the README has always imported
them from (``from linearize.fast import decode, fast_generate``). The code lives in
``linearize.decode``."""

from .decode import FastDecoder, Sampling, decode, fast_generate, filter_logits, next_tokens

__all__ = ["FastDecoder", "Sampling", "decode", "fast_generate", "filter_logits", "next_tokens"]
