"""``passkey``: a five-digit pass key hidden in repeated filler sentences; the model must repeat it.

The format follows the passkey test of Mohtashami & Jaggi (landmark attention, 2023), with the key
stated once (their prompt repeats it) and the prompt ending in "The pass key is", so a base model
and an instruct model alike answer by continuing the sentence. Greedy generation; right when the
continuation's first number is the key (``needle.is_correct``).
"""

from __future__ import annotations

from .needle import Trial, fit_prompt, trial_rng

NAME = "passkey"
TITLE = "Passkey"
MAX_NEW_TOKENS = 12  # " 12345." is 7 tokens for SmolLM2's digit-by-digit tokenizer

HEAD = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it."
TAIL = "\nWhat is the pass key? The pass key is"


def make_trial(tokenizer, length: int, target: int, depth: int, index: int, seed: int) -> Trial:
    """Trial ``index`` of the cell (``length``, ``depth`` %): ``target`` tokens (within 2 %), the key
    drawn from the trial's own seeded generator."""
    key = str(trial_rng(NAME, seed, length, depth, index).randint(10000, 99999))
    filler = FILLER * (target // 12 + 4)  # ~20 tokens per repeat: more than enough
    prompt, ids = fit_prompt(tokenizer, HEAD, filler, NEEDLE.format(key=key), TAIL, target, depth / 100, key)
    return Trial(NAME, length, depth, index, prompt, key, ids)
