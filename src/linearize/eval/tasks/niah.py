"""``niah``: needle in a haystack. One sentence stating a seven-digit "magic number" for a city is
placed inside held-out natural text; the prompt ends by asking for it.

The haystack is a seeded passage of the default corpus's validation books (austen-persuasion,
carroll-alice: text no recipe trains on), line-wrapped paragraphs joined. The needle and question
follow RULER's single-needle task (Hsieh et al., 2024) in spirit, and the prompt ends in "The
special magic number for <city> is" so a base or instruct model answers by continuing it. Right
when the continuation's first number is the value (``needle.is_correct``).
"""

from __future__ import annotations

import functools
import re

from .needle import Trial, fit_prompt, trial_rng

NAME = "niah"
TITLE = "Needle in a haystack"
MAX_NEW_TOKENS = 14  # " 1234567." is 9 tokens for SmolLM2

HEAD = "A special magic number is hidden in the following text. Remember it: you will be asked about it.\n"
NEEDLE = "The special magic number for {key} is {value}."
TAIL = "\nWhat is the special magic number for {key}? The special magic number for {key} is"
KEYS = ("Lisbon", "Nairobi", "Toronto", "Osaka", "Santiago", "Helsinki", "Marrakesh", "Reykjavik", "Hanoi",
        "Montevideo", "Tbilisi", "Auckland", "Bogota", "Krakow", "Winnipeg", "Zanzibar", "Valparaiso", "Tallinn",
        "Kyoto", "Cusco", "Ljubljana", "Mombasa", "Halifax", "Seville", "Bergen", "Tashkent", "Perth", "Quito")


def normalise(text: str) -> str:
    """Paragraphs on one line each (a book's hard line breaks joined), runs of spaces collapsed."""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n".join(p for p in paragraphs if p)


@functools.cache
def validation_books() -> str:
    """The default corpus's validation books, normalised and joined (fetched on first use)."""
    from linearize.data import GUTENBERG_VALIDATION, gutenberg_dir, read_texts

    folder = gutenberg_dir()
    return "\n".join(normalise(t) for book in GUTENBERG_VALIDATION for t in read_texts(folder / f"{book}.txt"))


def passage(haystack: str, chars: int, rng) -> str:
    """``chars`` characters of ``haystack`` from a random paragraph start (wrapping round its end)."""
    starts = [0, *(m.end() for m in re.finditer("\n", haystack))]
    start = rng.choice(starts)
    text = haystack[start:]
    while len(text) < chars:
        text += "\n" + haystack
    return text[:chars]


def make_trial(tokenizer, length: int, target: int, depth: int, index: int, seed: int,
               haystack: str | None = None) -> Trial:
    """Trial ``index`` of the cell (``length``, ``depth`` %): a passage of ``haystack`` (default:
    the validation books; the same passage at every depth) fitted to ``target`` tokens with the
    needle, its city and number drawn per cell, at ``depth`` % of it."""
    text = validation_books() if haystack is None else normalise(haystack)
    # one passage per (length, trial) for every depth, so a row's cells differ in the depth only
    filler = passage(text, target * 8 + 400, trial_rng(NAME, seed, length, -1, index))  # ~4-5 characters per token
    rng = trial_rng(NAME, seed, length, depth, index)
    key = rng.choice(KEYS)
    value = str(rng.randint(1_000_000, 9_999_999))
    while value in filler:  # never (10^-6 per position), but the answer must occur once
        value = str(rng.randint(1_000_000, 9_999_999))
    prompt, ids = fit_prompt(tokenizer, HEAD, filler, NEEDLE.format(key=key, value=value),
                             TAIL.format(key=key), target, depth / 100, value)
    return Trial(NAME, length, depth, index, prompt, value, ids, {"key": key})
