"""Where a training run's host waits for its GPU, counted per Python call site.

    python dev/sync_sites.py [--after N] RECIPE ARGS...       (any launcher: accelerate launch dev/sync_sites.py ...)

Runs ``linearize RECIPE ARGS...`` with CUDA's synchronisation debugging turned on from the (N+1)-th
call of ``Trainer.training_step`` (N = 2 by default: the set-up's steps compile and capture), and
counts each synchronising operation (``torch.cuda.set_sync_debug_mode``'s warning) by the innermost
frames of its Python stack. At exit every process prints its sites, most frequent first, with their
count per training step: a site that fires every step stalls the host's lead over the GPU (under
FSDP, the prefetch of the next layer's weights too).
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import sys
import traceback
import warnings

FRAMES = 5


def main() -> None:
    args = sys.argv[1:]
    after = 2
    if args[:1] == ["--after"]:
        after, args = int(args[1]), args[2:]
    import torch
    import transformers

    sites: collections.Counter = collections.Counter()
    steps = [0]
    shown = warnings.showwarning

    def count(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        sites[tuple(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno} {f.name}"
                    for f in stack[-FRAMES:])] += 1

    warnings.showwarning = count
    warnings.filterwarnings("always", message=".*synchroniz.*")
    step = transformers.Trainer.training_step

    def training_step(self, *a, **k):
        steps[0] += 1
        if steps[0] == after + 1 and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        if steps[0] == after + 1 and os.environ.get("SYNC_SITES_SELFTEST"):  # the counting, without a GPU
            warnings.warn("called a synchronizing CUDA operation")
        return step(self, *a, **k)

    transformers.Trainer.training_step = training_step

    def report():
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        counted = max(steps[0] - after, 1)
        rank = os.environ.get("RANK", "0")
        print(f"sync sites, rank {rank}: {sum(sites.values())} synchronisations over {counted} steps "
              f"(after {after})", flush=True)
        for where, n in sites.most_common(12):
            print(f"  {n / counted:6.2f} a step ({n}):", flush=True)
            for frame in where:
                print(f"      {frame}", flush=True)

    atexit.register(report)
    sys.argv = ["linearize", *args]
    runpy.run_module("linearize", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
