"""Evaluation: perplexity (overall and by position), zero-shot tasks through lm-evaluation-harness
(offline), recall tasks (passkey, needle in a haystack, multi-query associative recall), JSON records
and a Markdown report.

``evaluate(model, tokenizer, tasks="all,recall", limit=40)`` is the one-call API; ``text_perplexity``,
``run_tasks`` and ``run_recall`` are its parts; ``LinearizeLM`` is the lm-eval model class (registered
as ``linearize``).
The lm-eval parts import lazily, so perplexity works without lm-eval installed.
"""

from .perplexity import perplexity, text_perplexity

__all__ = [
    "LinearizeLM", "available_tasks", "evaluate", "load_model", "load_results", "model_identity", "perplexity",
    "run_recall", "run_tasks", "save_results", "text_perplexity", "write_report",
]


def __getattr__(name):
    if name in ("LinearizeLM", "run_tasks"):
        from . import harness

        return getattr(harness, name)
    if name == "load_model":
        from .loading import load_model

        return load_model
    if name in ("evaluate", "load_results", "model_identity", "save_results"):
        from . import results

        return getattr(results, name)
    if name == "run_recall":
        from .recall import run_recall

        return run_recall
    if name == "available_tasks":
        from .tasks import available_tasks

        return available_tasks
    if name == "write_report":
        from .report import write_report

        return write_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
