import json
import os
import random

# Idle OpenMP threads sleep instead of spinning (before torch loads its OpenMP runtime; the interpreter and
# two-process scripts inherit it). The tiny tests run thousands of small parallel ops: with spinning workers, any
# other load on a small machine (a second job, a shared CI runner) makes each op wait for a descheduled thread,
# and tests/decode/test_route.py took 265-467 s instead of 44-54 s on 2 cores beside another test run.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Under pytest-xdist (`make test` runs `-n 2`) the workers share the machine's cores: each gets its share
# (1 thread on 2 cores), set before torch loads OpenMP so its pool never grows past it, and inherited by
# the subprocesses a test starts. Two workers of 2 threads each on 2 cores would slow every small op down.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if os.environ.get("PYTEST_XDIST_WORKER") else 1
TORCH_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(TORCH_THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import tiny_config, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(TORCH_THREADS)


@pytest.fixture
def tiny_model():
    from transformers import AutoModelForCausalLM

    def make(family="llama", dtype=torch.float32, seed=0, **overrides):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).to(dtype).eval()
        return model

    return make


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A tiny corpus (a counting language) and a tiny Llama teacher trained on it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lolcats")
    rng = random.Random(0)
    docs = []
    for _ in range(40):  # a learnable language: mostly counting upwards, some noise
        w = rng.randrange(2, 90)
        ids = []
        for _ in range(60):
            w = w + 1 if rng.random() < 0.8 else rng.randrange(2, 90)
            ids.append(2 + (w - 2) % 95)
        docs.append(ids)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": " ".join(f"w{i}" for i in d)}) + "\n" for d in docs))
    # A teacher that knows the language: a tiny Llama trained briefly on it.
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama"))
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    data = torch.tensor([d[i : i + 32] for d in docs for i in (0, 28)])
    for step in range(150):
        batch = data[torch.randint(0, len(data), (8,))]
        teacher(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    teacher.save_pretrained(root / "teacher")
    tiny_tokenizer().save_pretrained(root / "teacher")
    return root
