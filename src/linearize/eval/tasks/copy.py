"""``copy``: copying from context. A passage of held-out text, then a gap of other held-out text, then
the same passage again; the score is next-token accuracy on the repeat.

Attention re-reads a name, a command or a sentence met earlier at any distance; a fixed-size state
has to have kept it. The prompt is ``BOS + passage + gap + passage`` in token ids (the passage and
the gap are spans of one tokenized text at seeded offsets that do not overlap, so the gap never
holds the passage). Scoring is teacher-forced, as for ``mqar``: the model's greedy choice (argmax)
at each token of the repeat but its first (which nothing in the text announces) against the true
token. ``first_pass`` is the same accuracy on the passage's first occurrence (no copy possible):
what the model gets from the text alone, the floor the repeat is read against.

The grid is passage length x gap (tokens between the end of the first copy and the start of the
repeat). A model with a context (``max_position_embeddings``) gets its gaps cut to fit it; a
converted student takes its teacher's context from its config, so both see the same prompts. With a
``teacher`` the teacher's grid is measured on the same prompts and ``of_teacher`` is the student's
accuracy as a share of the teacher's, by gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from linearize.errors import LinearizeError

from .needle import trial_rng

NAME = "copy"
TITLE = "Copy from context"
DEFAULT_GAPS = (256, 1024, 4096, 8192)
DEFAULT_PASSAGES = (32, 128)


@dataclass
class CopyPrompt:
    passage_len: int
    gap: int  # tokens between the two copies (after fitting the context)
    ids: list[int] = field(repr=False)
    start: int  # position of the repeat's first token
    first: int  # position of the first copy's first token


def fit_gap(gap: int, passage_len: int, prefix: int, context: int | None) -> int:
    """``gap``, cut so that ``prefix + passage + gap + passage`` fits ``context`` (None: no cut)."""
    if context is None:
        return gap
    fitted = min(gap, context - 2 * passage_len - prefix)
    if fitted < 1:
        raise LinearizeError(f"{NAME}: a {passage_len}-token passage repeated does not fit a context of {context} "
                             "tokens")
    return fitted


def make_prompt(stream: list[int], passage_len: int, gap: int, index: int, seed: int,
                prefix: list[int]) -> CopyPrompt:
    """Prompt ``index`` of the cell (``passage_len``, ``gap``): the passage and the gap drawn from
    ``stream`` (token ids of held-out text) by the trial's own seeded generator, never overlapping."""
    need = passage_len + gap
    if len(stream) < need + passage_len:
        raise LinearizeError(f"{NAME}: the text has {len(stream):,} tokens, too few for a {passage_len}-token passage "
                             f"and a {gap}-token gap that does not hold it")
    rng = trial_rng(NAME, seed, gap, passage_len, index)
    p0 = rng.randrange(len(stream) - passage_len + 1)
    # the gap starts anywhere its span stays clear of the passage's (positions on a circle of the stream)
    g0 = (p0 + passage_len + rng.randrange(len(stream) - need + 1)) % len(stream)
    doubled = stream + stream
    passage, filler = stream[p0 : p0 + passage_len], doubled[g0 : g0 + gap]
    ids = [*prefix, *passage, *filler, *passage]
    return CopyPrompt(passage_len, gap, ids, start=len(prefix) + passage_len + gap, first=len(prefix))


@torch.no_grad()
def accuracy(model, prompts: list[CopyPrompt], batch_size: int, bar=None) -> tuple[float, float]:
    """(accuracy on the repeats, accuracy on the first copies) of ``model`` over ``prompts`` (one cell:
    equal lengths), teacher-forced."""
    from ..recall import greedy_guesses

    device = next(model.parameters()).device
    hits = first_hits = count = 0
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s : s + batch_size]
        guesses = greedy_guesses(model, [p.ids for p in batch], [p.start + 1 for p in batch], device)
        firsts = greedy_guesses(model, [p.ids[: p.first + p.passage_len] for p in batch],
                                [p.first + 1 for p in batch], device)
        for p, g, f in zip(batch, guesses, firsts):
            hits += sum(g[t] == p.ids[t] for t in range(p.start + 1, p.start + p.passage_len))
            first_hits += sum(f[t] == p.ids[t] for t in range(p.first + 1, p.first + p.passage_len))
            count += p.passage_len - 1
        if bar is not None:
            bar.update(len(batch))
    return hits / count, first_hits / count


def held_out_ids(tokenizer, text: str | None = None) -> list[int]:
    """Token ids of ``text`` (default: the default corpus's held-out books, as ``niah`` reads them)."""
    from .niah import normalise, validation_books

    text = validation_books() if text is None else normalise(text)
    return tokenizer(text, add_special_tokens=False).input_ids


def run(model, tokenizer, trials: int, gaps=DEFAULT_GAPS, passages=None, batch_size: int = 8,
        seed: int = 1234, teacher=None, text: str | None = None, progress: bool = True) -> dict:
    """The copy grid (passage length x gap, ``trials`` prompts per cell) of ``model`` and, given, of
    ``teacher`` on the same prompts (``passages``: the passage lengths, default ``DEFAULT_PASSAGES``)."""
    from ..recall import context_length

    passages = passages or DEFAULT_PASSAGES
    stream = held_out_ids(tokenizer, text)
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    contexts = [c for c in (context_length(model), teacher is not None and context_length(teacher)) if c]
    context = min(contexts) if contexts else None
    models = {"model": model, **({"teacher": teacher} if teacher is not None else {})}
    grids = {who: [] for who in models}
    floors = {who: [] for who in models}
    fitted = []
    start = time.perf_counter()
    bar = tqdm(total=len(passages) * len(gaps) * trials * len(models), desc=NAME, disable=not progress, leave=False)
    for length in passages:
        row_gaps = [fit_gap(g, length, len(prefix), context) for g in gaps]
        fitted.append(row_gaps)
        cells = [[make_prompt(stream, length, g, i, seed, prefix) for i in range(trials)] for g in row_gaps]
        for who, m in models.items():
            scores = [accuracy(m, cell, batch_size, bar) for cell in cells]
            grids[who].append([a for a, _ in scores])
            floors[who].append([f for _, f in scores])
    bar.close()

    def by_gap(grid):
        return [sum(row[j] for row in grid) / len(grid) for j in range(len(gaps))]

    result = {
        "title": TITLE,
        "metric": "accuracy",
        "value": sum(map(sum, grids["model"])) / (len(passages) * len(gaps)),
        "gaps": list(gaps),
        "fitted_gaps": fitted,
        "passages": list(passages),
        "grid": grids["model"],
        "by_gap": by_gap(grids["model"]),
        "first_pass": floors["model"],
        "trials": trials,
        "scoring": "teacher-forced greedy",
    }
    if teacher is not None:
        teacher_by_gap = by_gap(grids["teacher"])
        result.update({
            "teacher_value": sum(map(sum, grids["teacher"])) / (len(passages) * len(gaps)),
            "teacher_grid": grids["teacher"],
            "teacher_by_gap": teacher_by_gap,
            "teacher_first_pass": floors["teacher"],
            "of_teacher": [s / t if t else None for s, t in zip(result["by_gap"], teacher_by_gap)],
        })
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result
