"""Recall evaluation: does a model still find what is in its context? ``run_recall`` runs the recall
tasks of ``linearize.eval.tasks`` (``passkey``, ``niah``, ``mqar``) and returns their grids.

``passkey`` and ``niah`` are generated greedily, a batch of prompts of one grid row at a time,
left-padded with an attention mask, through ``linearize.fast.fast_generate`` for every model: the
students' recurrent states, the teachers' key/value buffers and sliding-window layers' rings alike
(a model the fast decoder does not handle falls back to transformers' ``generate``; the record says
which ran). ``mqar`` is scored teacher-forced: one forward pass per prompt, right-padded (causal:
padding after a token cannot change its logits).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from linearize.errors import LinearizeError

from .perplexity import is_student
from .tasks import recall_module, split_tasks
from .tasks.needle import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_TRIALS, is_correct, prompt_budget


def trials_per_cell(limit) -> int:
    """``--limit`` as recall trials per grid cell (prompts per N for mqar); None: ``DEFAULT_TRIALS``."""
    if limit is None:
        return DEFAULT_TRIALS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise LinearizeError(f"recall tasks take --limit as a whole number of trials per cell, got {limit!r}")
    return limit


def context_length(model) -> int | None:
    """The model's context (``max_position_embeddings``), None when its config has none."""
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if value else None


def run_recall(model, tokenizer, names, limit=None, lengths=None, depths=None, pairs=None, batch_size: int = 8,
               seed: int = 1234, haystack: str | None = None, progress: bool = True, teacher=None,
               gaps=None) -> dict[str, dict]:
    """``{task: result}`` for the recall tasks in ``names`` (a list or comma-separated; others ignored).

    ``limit``: trials per cell (prompts per N for mqar; default ``DEFAULT_TRIALS``); ``lengths`` /
    ``depths``: the passkey/niah grid (token lengths beyond a softmax model's context are dropped; a
    converted student runs them all, e.g. 16k and 32k); ``pairs``: mqar's N values (likewise);
    ``batch_size``: prompts per generation or forward batch; ``haystack``: niah's and copy's text (default: the
    validation books); ``gaps``: copy's gaps; ``teacher``: copy's teacher, scored on the same prompts.
    """
    trials = trials_per_cell(limit)
    wanted = split_tasks(names)[1]
    runner = _Generator(model, tokenizer)
    out = {}
    for name in wanted:
        module = recall_module(name)
        start = time.perf_counter()
        if name == "mqar":
            result = run_mqar(model, tokenizer, pairs or module.DEFAULT_PAIRS, trials, batch_size, seed, progress)
        elif name == "copy":
            result = module.run(model, tokenizer, trials, gaps=gaps or module.DEFAULT_GAPS, batch_size=batch_size,
                                seed=seed, teacher=teacher, text=haystack, progress=progress)
        else:
            extra = {"haystack": haystack} if name == "niah" and haystack is not None else {}
            result = run_grid(module, runner, lengths or DEFAULT_LENGTHS, depths or DEFAULT_DEPTHS, trials,
                              batch_size, seed, progress, **extra)
        result["seconds"] = round(time.perf_counter() - start, 1)
        out[name] = result
    return out


# ----------------------------------------------------------------------------- generation


class _Generator:
    """Greedy continuations of left-padded prompt batches: the fast decoder, or ``generate``."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.decoder = "fast"
        self.fallback_reason = None

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        new = self.generate_ids(ids, mask, max_new_tokens)[:, width:]
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in new.tolist()]

    @torch.no_grad()
    def generate_ids(self, ids, mask, max_new_tokens):
        """Greedy ``[B, T + n]`` ids of the left-padded ``ids`` (``mask`` its attention mask)."""
        if self.decoder == "fast":
            from linearize.fast import fast_generate

            try:
                return fast_generate(self.model, ids, mask, max_new_tokens=max_new_tokens, pad_token_id=self.pad)
            except LinearizeError as err:  # an architecture the fast decoder does not handle
                self.decoder, self.fallback_reason = "generate", str(err)
        from linearize.decode.route import plain_loop  # transformers' own loop, as the decoder says

        return self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=self.pad, **plain_loop(self.model))


# ----------------------------------------------------------------------------- passkey, niah


def run_grid(module, generate, lengths, depths, trials: int, batch_size: int, seed: int, progress: bool = True,
             **make_kwargs) -> dict:
    """A needle task on the grid ``lengths`` x ``depths`` with ``trials`` prompts per cell; the rows'
    prompts are generated ``batch_size`` at a time (one row per batch: similar lengths, little padding)."""
    tokenizer = generate.tokenizer
    rows = prompt_budget(lengths, context_length(generate.model), module.MAX_NEW_TOKENS,
                         past_context=is_student(generate.model))
    if not rows:
        raise LinearizeError(f"{module.NAME}: no length in {list(lengths)} fits the model's context of "
                             f"{context_length(generate.model)} tokens")
    correct = [[0] * len(depths) for _ in rows]
    tokens = [0] * len(rows)
    examples = []
    bar = tqdm(total=len(rows) * len(depths) * trials, desc=module.NAME, disable=not progress, leave=False)
    for r, (length, target) in enumerate(rows):
        cell = [module.make_trial(tokenizer, length, target, depth, i, seed, **make_kwargs)
                for depth in depths for i in range(trials)]
        for s in range(0, len(cell), batch_size):
            batch = cell[s : s + batch_size]
            completions = generate([t.ids for t in batch], module.MAX_NEW_TOKENS)
            for trial, completion in zip(batch, completions):
                ok = is_correct(completion, trial.answer)
                correct[r][depths.index(trial.depth)] += ok
                tokens[r] += len(trial.ids)
                if trial.index == 0 and trial.depth == depths[len(depths) // 2]:
                    examples.append({"length": length, "depth": trial.depth, "answer": trial.answer,
                                     "completion": completion, "correct": ok})
            bar.update(len(batch))
    bar.close()
    grid = [[c / trials for c in row] for row in correct]
    result = {
        "title": module.TITLE,
        "metric": "exact_match",
        "value": sum(map(sum, grid)) / (len(rows) * len(depths)),
        "lengths": [length for length, _ in rows],
        "depths": list(depths),
        "grid": grid,
        "correct": correct,
        "trials": trials,
        "by_length": [sum(row) / len(depths) for row in grid],
        "by_depth": [sum(row[d] for row in grid) / len(rows) for d in range(len(depths))],
        "prompt_tokens": [round(t / (trials * len(depths)), 1) for t in tokens],
        "dropped_lengths": [int(x) for x in lengths if x not in {length for length, _ in rows}],
        "max_new_tokens": module.MAX_NEW_TOKENS,
        "decoder": generate.decoder,
        "examples": examples,
    }
    if generate.fallback_reason:
        result["decoder_note"] = generate.fallback_reason
    return result


# ----------------------------------------------------------------------------- mqar


@torch.no_grad()
def greedy_guesses(model, prompts: list[list[int]], starts: list[int], device) -> list[list[int | None]]:
    """Per prompt, the model's argmax guess for each token from ``starts[i]`` on (``guess[t]`` for
    token ``t``, from the logits at ``t - 1``; None before ``starts[i]``), from one right-padded
    forward pass that keeps only the logits it needs."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p)
    keep = width - min(starts) + 1  # logits at positions width - keep .. width - 1
    logits = model(ids.to(device), use_cache=False, logits_to_keep=keep).logits
    guesses = logits[:, :-1].argmax(-1).cpu().tolist()  # guesses[r][j]: the guess for token width - keep + 1 + j
    offset = width - keep + 1
    return [[None] * start + ([None] * offset + g)[start : len(p)] for p, g, start in zip(prompts, guesses, starts)]


@torch.no_grad()
def run_mqar(model, tokenizer, pairs, prompts_per_n: int, batch_size: int, seed: int, progress: bool = True) -> dict:
    """mqar for each N in ``pairs`` (N too large for a softmax model's context dropped; a converted
    student runs every N): ``prompts_per_n`` prompts, teacher-forced in right-padded batches; accuracy
    by N x distance bucket (to 8k, and the later buckets where queries fall in them)."""
    from .tasks import mqar

    device = next(model.parameters()).device
    context = context_length(model)
    past_context = is_student(model)  # a converted student runs prompts of any length
    names = mqar.bucket_names()
    kept, grid_hits, grid_counts, tokens, dropped = [], [], [], [], []
    bar = tqdm(total=len(pairs) * prompts_per_n, desc="mqar", disable=not progress, leave=False)
    for n in pairs:
        prompts = [mqar.make_prompt(tokenizer, n, i, seed) for i in range(prompts_per_n)]
        if context is not None and not past_context and max(len(p.ids) for p in prompts) > context:
            dropped.append(int(n))
            bar.update(prompts_per_n)
            continue
        hits, counts = [0] * len(names), [0] * len(names)
        for s in range(0, len(prompts), batch_size):
            batch = prompts[s : s + batch_size]
            starts = [min(q["positions"][0] for q in p.queries) for p in batch]
            for p, predicted in zip(batch, greedy_guesses(model, [p.ids for p in batch], starts, device)):
                for q, ok in zip(p.queries, mqar.score(p, predicted)):
                    b = mqar.bucket(q["distance"])
                    hits[b] += ok
                    counts[b] += 1
            bar.update(len(batch))
        kept.append(int(n))
        grid_hits.append(hits)
        grid_counts.append(counts)
        tokens.append(round(sum(len(p.ids) for p in prompts) / len(prompts), 1))
    bar.close()
    if not kept:
        raise LinearizeError(f"mqar: no N in {list(pairs)} fits the model's context of {context} tokens")
    # the distance columns to 8k, and the later ones up to the farthest query (prompts past 8k tokens)
    used = max([mqar.DEFAULT_BUCKETS] + [b + 1 for cs in grid_counts for b, c in enumerate(cs) if c])
    names = names[:used]
    grid_hits, grid_counts = [hs[:used] for hs in grid_hits], [cs[:used] for cs in grid_counts]
    grid = [[h / c if c else None for h, c in zip(hs, cs)] for hs, cs in zip(grid_hits, grid_counts)]
    by_pairs = [sum(hs) / sum(cs) for hs, cs in zip(grid_hits, grid_counts)]
    col_hits = [sum(hs[b] for hs in grid_hits) for b in range(len(names))]
    col_counts = [sum(cs[b] for cs in grid_counts) for b in range(len(names))]
    return {
        "title": mqar.TITLE,
        "metric": "exact_match",
        "value": sum(by_pairs) / len(by_pairs),
        "pairs": kept,
        "distance_buckets": names,
        "grid": grid,
        "correct": grid_hits,
        "queries": grid_counts,
        "trials": prompts_per_n,
        "by_pairs": by_pairs,
        "by_distance": [h / c if c else None for h, c in zip(col_hits, col_counts)],
        "prompt_tokens": tokens,
        "dropped_pairs": dropped,
        "scoring": "teacher-forced greedy",
    }
