"""Where a training run's host waits for its GPU, counted per Python call site.

    python dev/sync_sites.py [--after N] RECIPE ARGS...       (any launcher: accelerate launch dev/sync_sites.py ...)

Runs ``linearize RECIPE ARGS...`` with CUDA's synchronisation debugging turned on from the (N+1)-th
call of ``Trainer.training_step`` (N = 2 by default: the set-up's steps compile and capture), and
counts each synchronising operation (``torch.cuda.set_sync_debug_mode``'s warning) by the innermost
frames of its Python stack. Without a GPU it counts what would wait for one: reads of a tensor's value. At exit every process prints its sites, most frequent first, with their
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
SKIP = ("/warnings.py", "sync_sites.py", "torch/_compile.py", "torch/_dynamo/", "torch/utils/_python_dispatch.py")


def _host_reads():
    """A dispatch mode counting, on the CPU, what would make the host wait for a GPU: reading a tensor's value
    (``.item()``, ``bool(t)``, ``.tolist()``) and the operations whose output size depends on values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch

    waits = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default}

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in waits:
                warnings.warn(f"called a synchronizing CUDA operation ({func}, on the CPU)")
            return func(*args, **(kwargs or {}))

    return HostReads


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
        if not counting[0]:
            return None
        stack = [f for f in traceback.extract_stack()[:-1] if not any(x in f.filename for x in SKIP)]
        sites[tuple(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno} {f.name}"
                    for f in stack[-FRAMES:])] += 1

    warnings.showwarning = count
    warnings.filterwarnings("always", message=".*synchroniz.*")
    step = transformers.Trainer.training_step

    def training_step(self, *a, **k):
        steps[0] += 1
        if steps[0] == after + 1:
            counting[0] = True
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            else:  # on the CPU: the operations that would wait for a GPU (a tensor's value read)
                reads.__enter__()
        return step(self, *a, **k)

    def train(self, *a, **k):  # what follows a training (evaluations, the sample) is not counted
        try:
            return fit(self, *a, **k)
        finally:
            if counting[0]:
                counting[0] = False
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode(0)
                else:
                    reads.__exit__(None, None, None)

    counting = [False]
    reads = _host_reads()()
    fit = transformers.Trainer.train
    transformers.Trainer.training_step = training_step
    transformers.Trainer.train = train

    def report():
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
