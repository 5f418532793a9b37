"""Which phase of a training run sets its peak GPU memory.

    python dev/peak_phases.py RECIPE ARGS...      (e.g. lolcats --teacher shape:llama-3-8b --rows stage1-only ...)

Runs ``linearize RECIPE ARGS...`` and records the peak allocated CUDA memory of each call of the Trainer's
``training_step`` (forward and backward), of its optimizer steps, of its evaluations, and of the time
between them (the recipe's own work: caching, measuring, choosing layers), each from a fresh peak count.
As each Trainer (each stage) ends it prints the largest peak of each phase and the step it came in: a
stage whose steps peak below its recorded peak spends its memory elsewhere. (The counts are reset as it
goes: the recipe's own peak figures in its results.json mean nothing in such a run.)
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    import torch
    import transformers

    rows: list[dict] = []  # one per Trainer: {phase: (peak bytes, step)}
    current: dict = {}
    cuda = torch.cuda.is_available()

    def keep(phase: str, step) -> None:
        """The peak since the last reset as ``phase``'s (if larger than its earlier ones), and a fresh count."""
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            if peak > current.get(phase, (0, None))[0]:
                current[phase] = (peak, step)
            torch.cuda.reset_peak_memory_stats()

    def timed(phase: str, fn):
        def wrapped(self, *a, **k):
            keep("between", getattr(self.state, "global_step", None))  # what ran since the last phase ended
            try:
                return fn(self, *a, **k)
            finally:
                keep(phase, getattr(self.state, "global_step", None))
        return wrapped

    fit = transformers.Trainer.train

    def train(self, *a, **k):
        nonlocal current
        current = {}
        rows.append(current)
        keep("before", None)  # the recipe's work before this training (not this Trainer's: counted apart)
        current.pop("before", None)
        try:
            return fit(self, *a, **k)
        finally:
            keep("between", None)
            show(len(rows), current)

    transformers.Trainer.train = train
    transformers.Trainer.training_step = timed("training_step", transformers.Trainer.training_step)
    transformers.Trainer.evaluate = timed("evaluate", transformers.Trainer.evaluate)
    create = transformers.Trainer.create_optimizer

    def create_optimizer(self, *a, **k):
        optimizer = create(self, *a, **k)
        step = optimizer.step

        def stepped(*sa, **sk):
            keep("between", getattr(self.state, "global_step", None))
            try:
                return step(*sa, **sk)
            finally:
                keep("optimizer", getattr(self.state, "global_step", None))
        optimizer.step = stepped
        return optimizer

    transformers.Trainer.create_optimizer = create_optimizer

    def show(i: int, row: dict) -> None:
        parts = ", ".join(f"{phase} {peak / 1e9:.1f} GB (step {step})" for phase, (peak, step) in row.items())
        print(f"peak phases, trainer {i}: {parts or 'no CUDA'}", flush=True)

    sys.argv = ["linearize", *sys.argv[1:]]
    runpy.run_module("linearize", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
