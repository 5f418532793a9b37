"""Evaluation: perplexity (overall and by position), zero-shot tasks through lm-evaluation-harness
(offline), recall tasks (passkey, needle in a haystack, multi-query associative recall), JSON records
and a Markdown report.

``evaluate(model, tokenizer, tasks="all,recall", limit=40)`` is the one-call API; ``text_perplexity``,
``run_tasks`` and ``run_recall`` are its parts; ``LinearizeLM`` is the lm-eval model class (registered
as ``linearize``).
Every name imports its module on first use (``linearize.lazy``): perplexity works without lm-eval installed,
and ``linearize eval --help`` without torch.
"""

from ..lazy import lazy_names

__all__ = [
    "LinearizeLM", "available_tasks", "evaluate", "load_model", "load_results", "model_identity", "perplexity",
    "run_recall", "run_tasks", "save_results", "text_perplexity", "write_report",
]

lazy_names(__name__, {
    "perplexity": "perplexity", "text_perplexity": "perplexity", "LinearizeLM": "harness", "run_tasks": "harness",
    "load_model": "loading", "evaluate": "results", "load_results": "results", "model_identity": "results",
    "save_results": "results", "run_recall": "recall", "available_tasks": "tasks", "write_report": "report",
})
