"""``python dev/sparse_anchor_e2e.py CHECKPOINT [S]`` (CPU): a LoLCATs checkpoint's teacher-forced passkey
answers (4 prompts per length, depths 0/25/50/75, needle outside the window) with a sparse cache of S
tokens (default 256) under each ``sparse_anchor``, through the real op (``sparse_needle.answer_score``):
exact answers, digits right, the answer's mean log-probability."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import linearize  # noqa: E402
from linearize.eval.tasks import passkey  # noqa: E402
from sparse_needle import answer_score  # noqa: E402

model, tok = linearize.load(sys.argv[1], device="cpu")
model.eval()
size = int(sys.argv[2]) if len(sys.argv) > 2 else 256
for length in (512, 1024):
    for anchor in ("joint", "window"):
        linearize.respec(model, sparse_cache=size, sparse_priority="recall", sparse_anchor=anchor)
        t0 = time.time(); sc = []
        for depth in (0, 25, 50, 75):
            trial = passkey.make_trial(tok, length, length, depth, 0, 1234)
            sc.append(answer_score(model, tok, trial))
        print(length, anchor, "exact", sum(x[0] for x in sc), "/4 digits", sum(x[1] for x in sc), "/20 logp",
              round(sum(x[2] for x in sc) / 4, 2), f"{time.time()-t0:.0f}s", flush=True)
