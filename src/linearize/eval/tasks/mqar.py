"""``mqar``: multi-query associative recall. N keys (two-word names) each get a three-digit number;
then some of the keys are asked again, in a new order, each followed by its number.

The task is Zoology's MQAR (Arora et al., 2023) written as text a pretrained model reads:

    Each name below has a number. Remember them.
    copper lantern: 417
    ...
    Now the same names again, with their numbers:
    copper lantern: 417

Scoring is teacher-forced: one forward pass over the whole prompt, and a query is right when the
model's greedy choice (argmax over the vocabulary) is the true token at every token of its number,
given the prompt up to there, which is exactly what greedy decoding would write. Each query
counts under its ``N`` and its distance: the tokens from the number's first token in the list to
the same token in the query.

Up to ``SHORT_PAIRS`` (900) pairs the numbers have three digits and the names two words (a few
thousand tokens); beyond, for prompts to 32k tokens and more (N = 3,000 is about 30k tokens with
SmolLM2's tokenizer), the numbers have four digits and names a third word as well (``SIZES``), up
to ``MAX_PAIRS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .needle import trial_rng

NAME = "mqar"
TITLE = "Multi-query associative recall"
DEFAULT_PAIRS = (8, 32, 128, 512)
MAX_QUERIES = 64  # keys asked per prompt (all of them when N is smaller)
DISTANCE_EDGES = (0, 256, 1024, 4096, 8192, 16384, 32768)  # the last bucket is open
DEFAULT_BUCKETS = 4  # distance columns always recorded (to 8k); the later ones where a query falls in them

HEAD = "Each name below has a number. Remember them.\n"
MIDDLE = "Now the same names again, with their numbers:\n"
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "silver", "golden", "copper", "purple", "orange",
           "pink", "grey", "brown", "violet", "scarlet", "amber", "ivory", "crimson", "azure", "emerald", "bronze",
           "olive", "navy", "maroon", "teal", "coral", "indigo", "lilac", "rusty", "pale", "dark")
THINGS = ("lantern", "river", "castle", "horse", "garden", "window", "anchor", "basket", "candle", "dragon",
          "engine", "feather", "forest", "hammer", "island", "jacket", "kettle", "ladder", "mirror", "needle",
          "orchard", "pillow", "rabbit", "saddle", "tower", "violin", "wagon", "whistle", "barrel", "bridge",
          "cabin", "desk", "falcon", "glove", "harbor", "lamp", "meadow", "nest", "otter", "parrot", "quilt",
          "ribbon", "shovel", "teapot", "umbrella", "valley", "walnut", "yacht", "bucket", "cloak", "drum",
          "fox", "goat", "helmet", "kite", "lemon", "mask", "oven", "pebble", "rocket", "sail", "tent", "vase",
          "wheel")
NAMES = len(COLOURS) * len(THINGS)  # two-word names
SIZES = ("small", "big", "old", "new")  # a first word more, for N beyond NAMES
SHORT_PAIRS = 900  # three-digit numbers, 100..999, up to here
MAX_PAIRS = 9000  # four-digit numbers, 1000..9999, beyond


def key_name(index: int) -> str:
    """Name ``index``: ``colour thing`` below ``NAMES``, then ``size colour thing``."""
    size, rest = divmod(index, NAMES)
    name = f"{COLOURS[rest // len(THINGS)]} {THINGS[rest % len(THINGS)]}"
    return name if size == 0 else f"{SIZES[size - 1]} {name}"


@dataclass
class Prompt:
    """One mqar prompt: its ids, and per query the positions of its number's tokens and its distance."""

    pairs: int
    index: int
    text: str
    ids: list[int] = field(repr=False)
    queries: list[dict] = field(default_factory=list)  # {"key", "value", "positions", "distance"}


def bucket(distance: int) -> int:
    """Index of the distance bucket ``[DISTANCE_EDGES[i], DISTANCE_EDGES[i + 1])`` (the last is open)."""
    for i in range(len(DISTANCE_EDGES) - 1):
        if distance < DISTANCE_EDGES[i + 1]:
            return i
    return len(DISTANCE_EDGES) - 2


def bucket_names(n: int | None = None) -> list[str]:
    """The names of the first ``n`` distance buckets (all of them by default)."""
    names = [f"{_short(a)}-{_short(b)}" for a, b in zip(DISTANCE_EDGES, DISTANCE_EDGES[1:])]
    return names if n is None else names[:n]


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def make_prompt(tokenizer, pairs: int, index: int, seed: int) -> Prompt:
    """Prompt ``index`` with ``pairs`` keys: keys, numbers and the asked subset from its own seed.
    Numbers are distinct, so each query's answer occurs exactly once before it. Up to
    ``SHORT_PAIRS`` the prompts are as they always were (two-word names, three-digit numbers)."""
    if not 1 <= pairs <= MAX_PAIRS:
        raise ValueError(f"pairs must be between 1 and {MAX_PAIRS}")
    rng = trial_rng(NAME, seed, pairs, 0, index)
    pool = NAMES if pairs <= NAMES else NAMES * (len(SIZES) + 1)
    keys = [key_name(i) for i in rng.sample(range(pool), pairs)]
    numbers = range(100, 1000) if pairs <= SHORT_PAIRS else range(1000, 10000)
    values = [str(v) for v in rng.sample(numbers, pairs)]
    asked = rng.sample(range(pairs), min(pairs, MAX_QUERIES))
    text, spans = HEAD, {}
    for i, (key, value) in enumerate(zip(keys, values)):
        line = f"{key}: "
        spans[("list", i)] = (len(text) + len(line), len(text) + len(line) + len(value))
        text += line + value + "\n"
    text += MIDDLE
    for i in asked:
        line = f"{keys[i]}: "
        spans[("query", i)] = (len(text) + len(line), len(text) + len(line) + len(values[i]))
        text += line + values[i] + "\n"
    encoded = tokenizer(text, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    ids = list(encoded["input_ids"])

    def tokens(span):  # the tokens overlapping a character span (special tokens have empty offsets)
        return [t for t, (a, b) in enumerate(offsets) if b > a and a < span[1] and b > span[0]]

    queries = []
    for i in asked:
        listed, positions = tokens(spans[("list", i)]), tokens(spans[("query", i)])
        queries.append({"key": keys[i], "value": values[i], "positions": positions,
                        "distance": positions[0] - listed[0]})
    return Prompt(pairs, index, text, ids, queries)


def score(prompt: Prompt, predicted: list[int]) -> list[bool]:
    """Per query: the greedy prediction for every token of its number (``predicted[t]``: the argmax
    of the logits at position ``t - 1``, i.e. the model's guess for token ``t``) is that token."""
    return [all(predicted[t] == prompt.ids[t] for t in q["positions"]) for q in prompt.queries]
