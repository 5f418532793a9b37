"""What the needle tasks (``passkey``, ``niah``) share: the length x depth grid, prompts fitted to a
token length with the model's own tokenizer, seeded trials and the answer rule.

A trial's prompt is ``head + filler[:i] + needle + filler[i:] + tail``: ``filler`` is cut (at a word
boundary) so that the whole prompt, tokenized as the model will see it, is at most the target length
and at most ``TOLERANCE`` below it, and the needle goes in at the sentence boundary nearest ``depth`` percent of
the filler (0: right after the head, 100: right before the question). The answer is in the
needle and nowhere else in the prompt; :func:`fit_prompt` checks this and fails otherwise.

A completion is right when its first number equals the answer: the first run of digits, where
commas between digits are ignored ("1,234,567" reads as "1234567"), compared as a string.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from linearize.errors import LinearizeError

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_TRIALS = 10  # trials per cell when --limit is not given
TOLERANCE = 0.02  # prompts are within 2 % of their target token length

_NUMBER = re.compile(r"\d(?:,?\d)*")
_SENTENCE_END = re.compile(r"(?<=[.!?;])[\"')\]]*\s+|\n+")


@dataclass
class Trial:
    """One prompt of a grid cell and the answer a completion must contain."""

    task: str
    length: int  # the cell's nominal length (a prompt may be a little shorter near the model's context)
    depth: int  # percent
    index: int
    prompt: str
    answer: str
    ids: list[int] = field(repr=False)
    extra: dict = field(default_factory=dict)


def first_number(text: str) -> str | None:
    """The first run of digits in ``text`` (commas between digits dropped), or None."""
    match = _NUMBER.search(text)
    return None if match is None else match.group().replace(",", "")


def is_correct(completion: str, answer: str) -> bool:
    """The answer rule of the needle tasks: the completion's first number is the answer."""
    return first_number(completion) == answer


def trial_rng(task: str, seed: int, length: int, depth: int, index: int) -> random.Random:
    """The random source of one trial: the same for the same task, seed and cell, on any machine
    (a string seed is hashed with SHA-512 by ``random.Random``, not with Python's salted ``hash``)."""
    return random.Random(f"{task}:{seed}:{length}:{depth}:{index}")


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` as the model sees it (with the tokenizer's special tokens, if it adds any)."""
    return len(tokenizer(text).input_ids)


def prompt_budget(lengths, max_positions: int | None, reserve: int,
                  past_context: bool = False) -> list[tuple[int, int]]:
    """``(nominal, target)`` token lengths of the grid's rows: lengths beyond the model's context
    are dropped (kept whole with ``past_context``: a converted student, whose linear state runs any
    length), and a length within it whose prompt plus ``reserve`` new tokens would not fit is
    shortened to ``max_positions - reserve`` (so 8192 stays in the grid of an 8192-token model, and
    a student's 8192 row is its teacher's)."""
    rows = []
    for length in lengths:
        if max_positions is not None and length > max_positions:
            if past_context:
                rows.append((int(length), int(length)))
            continue
        target = length if max_positions is None else min(length, max_positions - reserve)
        if target < 16:
            continue
        rows.append((int(length), int(target)))
    return rows


def _word_cuts(text: str) -> list[int]:
    """Offsets where ``text`` may be cut: after each run of whitespace (and its end)."""
    return [m.end() for m in re.finditer(r"\s+", text)] + [len(text)]


def _sentence_starts(text: str) -> list[int]:
    """Offsets where a sentence (or line) of ``text`` starts, with 0 and ``len(text)``."""
    return sorted({0, len(text), *(m.end() for m in _SENTENCE_END.finditer(text))})


def fit_prompt(tokenizer, head: str, filler: str, needle: str, tail: str, target: int, depth: float,
               answer: str, tolerance: float = TOLERANCE) -> tuple[str, list[int]]:
    """``(prompt, ids)``: head, filler with the needle at ``depth`` (0..1), tail, of at most ``target``
    and at least ``(1 - tolerance) * target`` tokens. ``filler`` must be long enough; it is cut at a
    word boundary (at a token boundary where whole words cannot hit the window), the needle placed
    at the sentence boundary nearest ``depth`` of it, and the answer must occur exactly once in the
    prompt (LinearizeError otherwise, as for a filler too short to fit)."""
    if not 0 <= depth <= 1:
        raise LinearizeError(f"depth must be between 0 and 100 %, got {100 * depth:g}")
    offsets = tokenizer(filler, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cuts = _word_cuts(filler)
    fixed = count_tokens(tokenizer, head + needle + tail)
    low = target * (1 - tolerance)  # and never above the target: it may be the model's whole context
    best = None  # the longest prompt within the target so far
    for whole_words in (True, False):  # cut between words; between tokens if words are too coarse
        budget = target - fixed
        for _ in range(8):  # tokens merge across the joins; a few corrections settle the count
            if budget < 0:
                break
            if budget > len(offsets):
                raise LinearizeError(f"the filler text has {len(offsets)} tokens, too few for a {target}-token prompt")
            end = offsets[budget - 1][1] if budget else 0
            cut = max((c for c in cuts if c <= end), default=0) if whole_words else end
            prompt = _place(head, filler[:cut].rstrip(), needle, tail, depth)
            ids = tokenizer(prompt).input_ids
            if len(ids) <= target and (best is None or len(ids) > len(best[1])):
                best = (prompt, ids)
            if low <= len(ids) <= target:
                break
            budget += target - len(ids)
        if best is not None and len(best[1]) >= low:
            break
    if best is None or len(best[1]) < low:
        raise LinearizeError(f"could not fit a prompt to {target} tokens (head, needle and question take {fixed})")
    prompt, ids = best
    if prompt.count(answer) != 1:
        raise LinearizeError(f"the answer {answer!r} occurs {prompt.count(answer)} times in the prompt, not once")
    return prompt, ids


def _place(head: str, body: str, needle: str, tail: str, depth: float) -> str:
    """``body`` with ``needle`` at the sentence start nearest ``depth`` of it, between head and tail."""
    starts = _sentence_starts(body)
    at = min(starts, key=lambda s: (abs(s - depth * len(body)), s))
    before, after = body[:at].rstrip(), body[at:].lstrip()
    return head + " ".join(part for part in (before, needle.strip(), after) if part) + tail


def parse_grid(text: str | None, default, what: str, low: int = 1, high: int | None = None) -> tuple[int, ...]:
    """Comma-separated integers (``1k`` = 1024) for ``--lengths`` / ``--depths`` / ``--pairs``."""
    if text is None:
        return tuple(default)
    values = []
    for raw in str(text).split(","):
        item = raw.strip().lower()
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item.removesuffix("k")) * scale
        except ValueError:
            raise LinearizeError(f"{what} must be comma-separated integers, got {raw.strip()!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise LinearizeError(f"{what} must be {bound}, got {value}")
        if value not in values:
            values.append(value)
    if not values:
        raise LinearizeError(f"{what} is empty; give comma-separated integers")
    return tuple(values)
