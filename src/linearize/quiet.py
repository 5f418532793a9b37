"""Third-party output that says nothing to a linearize user, turned off where it starts.

Every line ``linearize`` prints is the project's or one the user needs (``tests/test_stray_lines.py``
runs the commands and fails on any other). What the libraries would add, and where it is stopped:

- transformers' "Loading weights" and "Writing model shards" bars: shown while they run and cleared
  after (``transient_bars``, around linearize's loads, saves and training), so a load leaves no line;
- transformers' warning that ``clean_up_tokenization_spaces`` is ignored for a BPE tokenizer, at the
  first decode: the setting is turned off where transformers ignores it (``without_bpe_cleanup``);
- peft's use of transformers' deprecated ``is_gradient_checkpointing`` and its check of the base
  model's vocabulary at every checkpoint (``recipes.lora``);
- lm-eval's ``git describe`` outside a repository ("fatal: not a git repository") and its
  "bootstrapping for stddev" line (``eval.harness``).
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def transient_bars():
    """transformers' own progress bars (``transformers.utils.logging.tqdm``: loading and writing
    weights) with ``leave=False`` inside the block: visible while a large model loads, gone after."""
    from transformers.utils import logging

    def hook(factory, args, kwargs):
        kwargs = {**kwargs, "leave": False}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        logging.set_tqdm_hook(previous)


def without_bpe_cleanup(tokenizer):
    """``tokenizer`` with ``clean_up_tokenization_spaces`` off where transformers ignores it: a fast BPE
    tokenizer (Llama 3's and GPT-2's configs set it) skips that clean-up at every decode and warns that
    it does. The decoded text is the same."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (getattr(tokenizer, "clean_up_tokenization_spaces", False) and backend is not None
            and type(backend.model).__name__ == "BPE"
            and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                            False)):
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer
