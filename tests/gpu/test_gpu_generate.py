"""``data generate`` on CUDA (the softmax teacher's static KV path under a CUDA graph, sampling on the
device): the same seed gives the same shards, and a stopped run ends as an unstopped one."""

import pytest
import torch

from linearize import load_teacher
from linearize.data import generate
from linearize.data.generate import Settings, generate_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_HOME", str(tmp_path / "linearize-home"))


def _shards(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("part-*.jsonl"))}


def test_generated_text_on_cuda_is_deterministic_and_resumes(workspace, tmp_path, monkeypatch):
    model, tok = load_teacher(str(workspace / "teacher"), device="cuda", dtype="bfloat16")
    settings = Settings(teacher="tiny", batch_size=16, max_new_tokens=24, prompt_tokens=6,
                        prompts=str(workspace / "corpus.jsonl"), dtype="bfloat16", device="cuda")
    a = generate_text(model, tok, tmp_path / "a", 1200, settings, progress=False)
    generate_text(model, tok, tmp_path / "b", 1200, settings, progress=False)
    assert a["shards"] >= 3 and _shards(tmp_path / "a") == _shards(tmp_path / "b")

    write, calls = generate._write_shard, []

    def stop_after_one(path, records):
        if calls:
            raise KeyboardInterrupt
        calls.append(path)
        write(path, records)

    monkeypatch.setattr(generate, "_write_shard", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        generate_text(model, tok, tmp_path / "c", 1200, settings, progress=False)
    monkeypatch.setattr(generate, "_write_shard", write)
    generate_text(model, tok, tmp_path / "c", 1200, settings, progress=False)
    assert _shards(tmp_path / "c") == _shards(tmp_path / "a")
