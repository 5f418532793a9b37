"""Run a module's ``main`` with kernel constants set from a sweep's record, in one process:

    python dev/with_knobs.py RECORD KEY MODULE [ARGS...]

``RECORD[KEY]["knobs"]`` maps ``"module.NAME"`` (a module under ``linearize.ops``, or any named in full from
``linearize.``, e.g. ``linearize.mixers.window.WINDOW_PREFILL_SINK_ROPE``) to a value, as
``hybrid_bench.py --sweep`` (key ``best``) and ``--sweep-prefill`` (``best_prefill``) write it; ``RECORD``
``none`` runs with the defaults, and a JSON object given inline is the knobs themselves (``KEY`` unread),
e.g. ``'{"hybrid.step_triton.STEP_WARPS": 2}' -``. ``MODULE`` is e.g. ``linearize.bench.train`` or
``linearize.cli``, run with ``ARGS`` as its command line.
"""

import importlib
import json
import sys


def main(argv) -> int:
    record, key, module, *args = argv
    if record == "none":
        knobs = {}
    elif record.lstrip().startswith("{"):
        knobs = json.loads(record)
    else:
        knobs = json.load(open(record))[key]["knobs"]
    for name, value in knobs.items():
        owner, constant = name.rsplit(".", 1)
        module_name = owner if owner.startswith("linearize.") else f"linearize.ops.{owner}"
        setattr(importlib.import_module(module_name), constant, value)
    print("knobs", knobs or "(the defaults)", flush=True)
    return importlib.import_module(module).main(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
