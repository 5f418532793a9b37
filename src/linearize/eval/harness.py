"""lm-evaluation-harness on linearize models: the ``linearize`` model class and ``run_tasks``.

``LinearizeLM`` is lm-eval's own ``HFLM`` (its tokenisation, batching and log-likelihood scoring),
registered as ``linearize`` and adjusted for the students in two ways:

- the forward pass is ``model(input_ids, use_cache=False)``: no recurrent cache is built while scoring;
- log-likelihood batches are right-padded (HFLM's causal path pads on the right and passes no
  attention mask). The students' linear mixers ignore attention masks, which is harmless only
  there: in a causal model tokens after the scored ones cannot change their scores.

Generation is HFLM's, in batches: HFLM left-pads them and passes their attention mask, which the
students' ``generate()`` (the fast decoder) honours, so a batch gives each request's tokens alone.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from linearize.errors import LinearizeError

from . import tasks as suite

@register_model("linearize")
class LinearizeLM(HFLM):
    """lm-eval's HFLM around a loaded model (teacher or student) or a model spec.

    ``pretrained`` is a model instance (give ``tokenizer`` too) or a string accepted by
    :func:`linearize.eval.load_model` (a linearize checkpoint folder, a HF id, a folder, a .gguf,
    ``default``). Once this module is imported, lm-eval also knows it by name:
    ``lm_eval.simple_evaluate(model="linearize", model_args="pretrained=runs/x", tasks=[...])``.
    """

    def __init__(self, pretrained, tokenizer=None, batch_size: int | str = 8, max_length: int | None = None,
                 device: str | None = None, dtype: str | None = None, progress: bool = True, **kwargs):
        if isinstance(pretrained, str):
            from .loading import load_model

            pretrained, tokenizer = load_model(pretrained, dtype=dtype, device=device)
        if tokenizer is None:
            raise LinearizeError("LinearizeLM needs the model's tokenizer when given a model instance")
        hflm_logger = logging.getLogger("lm_eval.models.huggingface")
        level = hflm_logger.level
        hflm_logger.setLevel(logging.ERROR)  # "pretrained is not a str: arguments ignored" is expected here
        try:
            super().__init__(pretrained=pretrained, tokenizer=tokenizer, backend="causal",
                             batch_size=int(batch_size) if str(batch_size).isdigit() else batch_size,
                             max_length=max_length, **kwargs)
        finally:
            hflm_logger.setLevel(level)
        self.progress = progress

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits of a right-padded batch; never builds a (recurrent) cache."""
        if attn_mask is not None or labels is not None:
            raise LinearizeError("linearize models are causal LMs; seq2seq calls are not supported")
        with torch.no_grad():
            return self.model(inps, use_cache=False).logits

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=disable_tqdm or not self.progress)

    def get_model_info(self) -> dict:
        """Parameters and dtype (HFLM's version also asks the hub for a revision hash)."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}


def run_tasks(model, tokenizer, tasks, limit: int | float | None = None, batch_size: int = 8,
              max_length: int | None = None, bootstrap_iters: int = 1000, seed: int = 1234,
              progress: bool = True) -> dict:
    """Score ``model`` on suite ``tasks`` through lm-eval; ``{task: summary}`` in suite order (recall
    tasks among ``tasks`` are left to :func:`linearize.eval.recall.run_recall`).

    ``limit`` caps the documents per task (per subject for MMLU; a float < 1 is a fraction), as
    lm-eval's ``--limit``: the first N in order, so runs with the same limit see the same documents.
    ``model`` may also be a ready ``LinearizeLM`` (then ``batch_size``, ``max_length`` and
    ``progress`` are its own). Each summary holds the headline ``metric`` with its ``value`` and
    ``stderr``, every metric lm-eval reported, the number of documents scored, the shots, the task
    version and the data provenance.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    names, _ = suite.split_tasks(tasks)  # the recall tasks run through linearize.eval.recall
    if not names:
        return {}
    if limit is not None and (isinstance(limit, bool) or limit <= 0):
        raise LinearizeError(f"limit must be a positive number of documents per task, got {limit!r}")
    objects = {name: suite.build(name) for name in names}
    lm = model if isinstance(model, HFLM) else LinearizeLM(model, tokenizer, batch_size=batch_size,
                                                            max_length=max_length, progress=progress)
    with _quiet_lm_eval(progress=getattr(lm, "progress", True)):
        raw = lm_eval.simple_evaluate(
            model=lm, tasks=list(objects.values()), task_manager=TaskManager(include_defaults=False), limit=limit,
            bootstrap_iters=bootstrap_iters, log_samples=False, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed, verbosity=None)
    return {name: _summary(name, built, raw) for name, built in objects.items()}


@contextmanager
def _quiet_lm_eval(progress: bool = True):
    """``simple_evaluate`` with three of lm-eval's helpers replaced by quiet twins (``linearize.quiet``):
    the results' ``git_hash`` asked of git with its stderr kept (outside a repository git prints
    "fatal: not a git repository" to the terminal); the bootstrapped standard errors (LAMBADA's
    perplexity) without the "bootstrapping for stddev" line and its bar; and each task's bar over its
    documents while it builds their requests, unnamed, cleared when done (gone with ``progress`` off)."""
    import functools

    import lm_eval.api.metrics
    import lm_eval.api.task
    import lm_eval.evaluator

    building = functools.partial(lm_eval.api.task.tqdm, leave=False, disable=not progress)
    swaps = [(lm_eval.evaluator, "get_git_commit_hash", _git_commit_hash),
             (lm_eval.api.metrics, "bootstrap_stderr", _bootstrap_stderr),
             (lm_eval.api.task, "tqdm", building)]
    originals = [getattr(module, name) for module, name, _ in swaps]
    for module, name, twin in swaps:
        setattr(module, name, twin)
    try:
        yield
    finally:
        for (module, name, _), original in zip(swaps, originals):
            setattr(module, name, original)


def _git_commit_hash():
    """lm-eval's ``get_git_commit_hash``: ``git describe --always`` in the working directory, else the
    commit read from a ``.git`` folder there (None outside a repository); git's stderr stays unseen."""
    import os
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


def _bootstrap_stderr(f, xs, iters: int) -> float:
    """lm-eval's ``bootstrap_stderr`` with the same resamples (chunk i of at most 1000 draws from
    ``random.Random(i)``), in this process and without printing."""
    import random

    from lm_eval.api.metrics import sample_stddev

    chunk = min(1000, iters)
    draws = []
    for i in range(iters // chunk):
        rnd = random.Random(i)
        draws.extend(f(rnd.choices(xs, k=len(xs))) for _ in range(chunk))
    return sample_stddev(draws)


def _summary(name: str, built, raw: dict) -> dict:
    """One task's entry from lm-eval's results (a group's are aggregated over its subtasks)."""
    info = suite.SUITE[name]
    scores = raw["results"].get(name) or raw.get("groups", {}).get(name, {})
    metrics = {key.split(",")[0]: value for key, value in scores.items()
               if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
    stderrs = {key.split(",")[0].replace("_stderr", ""): value for key, value in scores.items()
               if "_stderr," in key and isinstance(value, (int, float))}
    samples = raw.get("n-samples", {})
    subtasks = [t.task_name for t in built.get_all_tasks()] if hasattr(built, "get_all_tasks") else [name]
    effective = sum(samples[k]["effective"] for k in subtasks)
    original = sum(samples[k]["original"] for k in subtasks)
    return {
        "title": info.title,
        "metric": info.metric,
        "value": metrics.get(info.metric),
        "stderr": stderrs.get(info.metric),
        "chance": info.chance,
        "metrics": metrics,
        "documents": effective,
        "documents_total": original,
        "num_fewshot": info.num_fewshot,
        "version": raw.get("versions", {}).get(name),
        "data": suite.data_provenance(name),
    }
