"""Fidelity to the teacher: how close a student's predictions stay to its teacher's on the same text.

A student tuned toward its training text can beat its teacher's perplexity there and still have lost
what the teacher did elsewhere; these figures cannot be won so:

* :func:`position_fidelity`: per position bucket, the student's and the teacher's next-token loss and
  the KL divergence KL(teacher || student) of their next-token distributions, from one pass of each
  model over the same blocks (logits formed a slice of time at a time, as ``perplexity.token_nll``
  does, so 8k-token blocks of a 49k vocabulary fit);
* :func:`greedy_agreement`: the share of greedy continuations of held-out prompts that are the
  teacher's token for token, and how far they agree before they part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from linearize.errors import LinearizeError

from .perplexity import LOGIT_BUDGET, POSITION_EDGES, output_head


def check_same_vocabulary(model, teacher) -> None:
    """One line unless ``model`` and ``teacher`` predict over the same vocabulary."""
    sizes = [m.config.get_text_config().vocab_size for m in (model, teacher)]
    if sizes[0] != sizes[1]:
        raise LinearizeError(f"the teacher predicts over {sizes[1]:,} tokens and the model over {sizes[0]:,}: "
                             "fidelity needs the model's own teacher (the same tokenizer)")


def _logit_slices(model, row: torch.Tensor, step: int):
    """``(s, e, logits[:, s:e])`` over the positions of ``row`` ``[1, T]`` that predict a next token,
    ``step`` positions at a time: the output layer over the last hidden states a slice at a time where
    the model is built so (``perplexity.output_head``), else slices of one whole forward's logits."""
    end = row.shape[1] - 1
    head = output_head(model, row[:, :8])
    if head is None:
        logits = model(row, use_cache=False).logits
        for s in range(0, end, step):
            yield s, min(s + step, end), logits[:, s : min(s + step, end)]
        return
    trunk, out = head
    hidden = trunk(row, use_cache=False).last_hidden_state
    for s in range(0, end, step):
        yield s, min(s + step, end), out(hidden[:, s : min(s + step, end)])


@torch.no_grad()
def token_fidelity(model, teacher, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(model NLL, teacher NLL, KL(teacher || model))``, each ``[T - 1]`` in float64, for one block
    ``row`` ``[1, T]`` (token ``p`` predicted from the ``p`` before it is column ``p - 1``)."""
    vocab = model.config.get_text_config().vocab_size
    step = max(1, LOGIT_BUDGET // (4 * vocab))  # two models' logits and their log-probabilities at once
    target = row[0, 1:]
    out = torch.empty(3, row.shape[1] - 1, dtype=torch.float64, device=row.device)
    for (s, e, student), (_, _, reference) in zip(_logit_slices(model, row, step), _logit_slices(teacher, row, step)):
        log_q = F.log_softmax(student[0].double(), dim=-1)
        log_p = F.log_softmax(reference[0].double(), dim=-1)
        out[0, s:e] = -log_q.gather(-1, target[s:e, None])[:, 0]
        out[1, s:e] = -log_p.gather(-1, target[s:e, None])[:, 0]
        out[2, s:e] = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0)
        del log_q, log_p
    return out[0], out[1], out[2]


def position_fidelity(model, teacher, blocks: torch.Tensor, edges=POSITION_EDGES,
                      progress: bool = True) -> list[dict]:
    """Per bucket ``[edges[i], edges[i + 1])`` of ``blocks`` ``[N, T]``: tokens, the model's and the
    teacher's mean loss and perplexity, their ratio, and the mean KL(teacher || model) in nats."""
    import math

    check_same_vocabulary(model, teacher)
    device = next(model.parameters()).device
    sums = torch.zeros(3, len(edges) - 1, dtype=torch.float64)
    counts = [0] * (len(edges) - 1)
    for row in tqdm(blocks, desc="fidelity by position", disable=not progress, leave=False):
        values = torch.stack(token_fidelity(model, teacher, row[None].to(device))).cpu()
        for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
            part = values[:, max(lo, 1) - 1 : hi - 1]
            sums[:, b] += part.sum(-1)
            counts[b] += part.shape[1]
    buckets = []
    for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
        n = counts[b]
        loss, teacher_loss, kl = (sums[:, b] / n).tolist() if n else (None, None, None)
        buckets.append({"start": lo, "end": hi, "tokens": n, "loss": loss, "teacher_loss": teacher_loss,
                        "perplexity": math.exp(loss) if n else None,
                        "teacher_perplexity": math.exp(teacher_loss) if n else None,
                        "of_teacher": math.exp(loss - teacher_loss) if n else None, "kl": kl})
    return buckets


@torch.no_grad()
def greedy_agreement(model, teacher, tokenizer, prompts: torch.Tensor, new_tokens: int = 64, batch_size: int = 8,
                     progress: bool = True) -> dict:
    """Greedy continuations of ``new_tokens`` from each row of ``prompts`` ``[N, P]`` (no padding) by
    ``model`` and ``teacher``: the share identical token for token (``exact``), the mean share of
    positions where they agree (``tokens``) and the mean number of tokens before they part
    (``prefix``). A continuation that stops early (an end-of-sequence token) is compared as far as it
    goes, the rest counting as different."""
    from .recall import _Generator

    check_same_vocabulary(model, teacher)
    device = next(model.parameters()).device
    runners = [_Generator(m, tokenizer) for m in (model, teacher)]
    exact = agree = prefix = 0
    for s in tqdm(range(0, len(prompts), batch_size), desc="greedy agreement", disable=not progress, leave=False):
        ids = prompts[s : s + batch_size].to(device)
        mask = torch.ones_like(ids)
        outs = []
        for runner in runners:
            new = runner.generate_ids(ids, mask, new_tokens)[:, ids.shape[1] :]
            padded = torch.full((ids.shape[0], new_tokens), -1, dtype=torch.long, device=device)
            padded[:, : new.shape[1]] = new[:, :new_tokens]
            outs.append(padded)
        same = (outs[0] == outs[1]) & (outs[0] >= 0)
        exact += int(same.all(1).sum())
        agree += int(same.sum())
        prefix += int(same.long().cumprod(1).sum())
    n = len(prompts)
    return {"prompts": n, "prompt_len": int(prompts.shape[1]), "new_tokens": new_tokens, "exact": exact / n,
            "tokens": agree / (n * new_tokens), "prefix": prefix / n,
            "decoders": [runner.decoder for runner in runners]}
