"""Evaluation: perplexity now; lm-evaluation-harness tasks and reports build on it."""

from .perplexity import perplexity

__all__ = ["perplexity"]
