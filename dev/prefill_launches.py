"""Operators per decoder layer of one prefill, counted on the CPU: the teacher, the LoLCATs student
with its PyTorch chunked form, and the student with the Triton kernels (as it dispatches on CUDA).

    PYTHONPATH=src python dev/prefill_launches.py [--teacher default] [--prompt-len 128]

Counts what would be device work: every ATen operator that reaches the backend (below autograd,
composite operators already decomposed) except views and those that launch nothing (allocations,
metadata), through a TorchDispatchMode, plus the Triton launches. The kernel path cannot run on the CPU, so for the count its dispatch rule is
forced on and its three kernels replaced by counters (their outputs are left unwritten: counting
only). A prefill is the fast decoder's (last token's logits, a filled cache, fused projections).
On a GPU ``python -m linearize.bench.profile prefill`` counts the real kernels.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


# operators that launch nothing: allocations, reshapes of metadata, dtype arithmetic
NO_KERNEL = ("empty", "_unsafe_view", "_reshape_alias", "promote_types", "lift_fresh", "detach", "alias")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not func.__name__.startswith(NO_KERNEL):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class Launches:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts a launch and does nothing."""

    def __init__(self, name, counter):
        self.name, self.counter = name, counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[f"triton:{self.name}"] += 1
        return launch


def count(model, ids, layers: int) -> tuple[float, collections.Counter]:
    from linearize.bench.prefill import prefill_once
    from linearize.decode.fused import fused_projections

    with fused_projections(model):
        prefill_once(model, ids)  # warm (lazy initialisation)
        mode = Count()
        with mode:
            prefill_once(model, ids)
    return sum(mode.ops.values()) / layers, mode.ops


def main(argv=None) -> int:
    import linearize
    from linearize.ops.hybrid import chunk_triton

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    teacher, _ = linearize.load_teacher(args.teacher, dtype="float32", device="cpu")
    layers = teacher.config.num_hidden_layers
    ids = torch.randint(0, teacher.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    rows = [("teacher", *count(teacher, ids, layers))]
    student = linearize.convert(teacher, {"kind": "lolcats"})
    rows.append(("student, PyTorch chunked form", *count(student, ids, layers)))
    module = sys.modules["linearize.ops.hybrid"]
    rule = module.use_hybrid_kernel
    forced = lambda q, backend="auto", **kw: backend != "torch"  # noqa: E731
    linearize.ops.use_hybrid_kernel = module.use_hybrid_kernel = forced
    mode_ops = collections.Counter()
    saved = {n: getattr(chunk_triton, n) for n in ("_chunk_sums", "_scan", "_forward")}
    for n in saved:
        setattr(chunk_triton, n, Launches(n, mode_ops))
    try:
        per_layer, ops = count(student, ids, layers)
    finally:
        linearize.ops.use_hybrid_kernel = module.use_hybrid_kernel = rule
        for n, k in saved.items():
            setattr(chunk_triton, n, k)
    launches = collections.Counter({k: v // 2 for k, v in mode_ops.items()})  # the warm-up launched too
    ops.update(launches)
    rows.append(("student, Triton kernels", per_layer + sum(launches.values()) / layers, ops))
    print(f"operators per decoder layer of one prefill ({args.prompt_len} tokens, batch 1, {layers} layers; "
          "views and allocations not counted):")
    for name, n, ops in rows:
        print(f"  {name}: {n:.1f}")
        print("    " + ", ".join(f"{k} {v / layers:g}" for k, v in ops.most_common(args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
