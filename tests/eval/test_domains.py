"""The check across domains: the copy task's prompts and scoring, fidelity to a teacher (KL by position,
greedy agreement) against brute-force references, the domain records and their command-line flags.

Fast tests use the byte-level BPE of ``test_recall`` and tiny random Llamas of its vocabulary; the
corpora are replaced by a text file (the real ones are fetched in ``tests/data``)."""

import math

import pytest
import torch
import torch.nn.functional as F

from linearize.errors import LinearizeError
from linearize.eval import domains, fidelity
from linearize.eval.perplexity import LOGIT_BUDGET, token_nll
from linearize.eval.tasks import copy as copy_task
from linearize.eval.tasks import niah

from test_recall import PROSE, bpe, bpe_llama  # noqa: F401 (bpe is a fixture)


def stream(n=600):
    return list(range(1000, 1000 + n))  # distinct ids: a span's place in the stream is its content


def test_copy_prompt_repeats_the_passage_after_a_gap_that_never_holds_it():
    s = stream()
    for index in range(40):
        p = copy_task.make_prompt(s, 16, 100, index, seed=3, prefix=[1])
        assert p.ids[0] == 1 and len(p.ids) == 1 + 16 + 100 + 16
        passage, gap = p.ids[1:17], p.ids[17:117]
        assert p.ids[p.start : p.start + 16] == passage and p.start == 117 and p.first == 1
        assert not set(passage) & set(gap)
        assert passage == s[passage[0] - 1000 : passage[0] - 1000 + 16]  # a span of the text
    again = copy_task.make_prompt(s, 16, 100, 7, seed=3, prefix=[1])
    assert again.ids == copy_task.make_prompt(s, 16, 100, 7, seed=3, prefix=[1]).ids
    assert again.ids != copy_task.make_prompt(s, 16, 100, 7, seed=4, prefix=[1]).ids


def test_copy_gaps_fit_the_context_and_short_text_fails_in_one_line():
    assert copy_task.fit_gap(8192, 32, 1, 8192) == 8192 - 65
    assert copy_task.fit_gap(256, 32, 1, 8192) == 256 and copy_task.fit_gap(8192, 32, 1, None) == 8192
    with pytest.raises(LinearizeError, match="does not fit"):
        copy_task.fit_gap(256, 64, 1, 100)
    with pytest.raises(LinearizeError, match="too few"):
        copy_task.make_prompt(stream(100), 32, 64, 0, 1, [])


def test_copy_accuracy_is_the_argmax_of_a_full_forward(bpe):  # noqa: F811
    model = bpe_llama(bpe, seed=1)
    s = bpe(PROSE * 3, add_special_tokens=False).input_ids
    prompts = [copy_task.make_prompt(s, 12, 40, i, 0, []) for i in range(3)]
    repeat, first = copy_task.accuracy(model, prompts, batch_size=2)
    hits = first_hits = 0
    for p in prompts:
        guess = model(torch.tensor([p.ids])).logits[0].argmax(-1)
        hits += sum(int(guess[t - 1]) == p.ids[t] for t in range(p.start + 1, p.start + 12))
        first_hits += sum(int(guess[t - 1]) == p.ids[t] for t in range(p.first + 1, p.first + 12))
    assert repeat == hits / 33 and first == first_hits / 33


def test_copy_grid_beside_the_teacher(bpe):  # noqa: F811
    model, other = bpe_llama(bpe, seed=1), bpe_llama(bpe, seed=2, context=100)
    same = copy_task.run(model, bpe, 2, gaps=(16, 64), passages=(8,), teacher=model, text=PROSE * 3, progress=False)
    assert same["grid"] == same["teacher_grid"]
    assert same["of_teacher"] == [1.0 if t else None for t in same["teacher_by_gap"]]
    beside = copy_task.run(model, bpe, 2, gaps=(16, 200), passages=(8,), teacher=other, text=PROSE * 3,
                           progress=False)
    assert beside["fitted_gaps"] == [[16, 100 - 16]]  # the teacher's context cuts both models' gap
    alone = copy_task.run(other, bpe, 2, gaps=(16, 200), passages=(8,), text=PROSE * 3, progress=False)
    assert alone["grid"] == beside["teacher_grid"] and "of_teacher" not in alone


def brute_force(model, teacher, row):
    q = F.log_softmax(model(row).logits[0, :-1].double(), -1)
    p = F.log_softmax(teacher(row).logits[0, :-1].double(), -1)
    target = row[0, 1:, None]
    return -q.gather(-1, target)[:, 0], -p.gather(-1, target)[:, 0], (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("budget", [LOGIT_BUDGET, 512 * 4 * 7])  # whole rows; slices of 7 positions
def test_token_fidelity_matches_brute_force(bpe, budget, monkeypatch):  # noqa: F811
    monkeypatch.setattr(fidelity, "LOGIT_BUDGET", budget)
    model, teacher = bpe_llama(bpe, seed=1), bpe_llama(bpe, seed=2)
    row = torch.randint(0, len(bpe), (1, 40))
    with torch.no_grad():
        got, want = fidelity.token_fidelity(model, teacher, row), brute_force(model, teacher, row)
        same = fidelity.token_fidelity(model, model, row)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert same[2].abs().max() < 1e-9 and torch.equal(same[0], same[1])
    torch.testing.assert_close(got[0], token_nll(model, row)[0], rtol=1e-5, atol=1e-6)


def test_position_fidelity_buckets(bpe):  # noqa: F811
    model, teacher = bpe_llama(bpe, seed=1), bpe_llama(bpe, seed=2)
    blocks = torch.randint(0, len(bpe), (2, 48))
    buckets = fidelity.position_fidelity(model, teacher, blocks, [0, 16, 48], progress=False)
    with torch.no_grad():
        rows = [torch.stack(brute_force(model, teacher, b[None])) for b in blocks]
    values = torch.cat(rows, dim=1).view(3, 2, 47)
    for b, (lo, hi) in zip(buckets, [(1, 16), (16, 48)]):
        part = values[:, :, lo - 1 : hi - 1].reshape(3, -1).mean(-1)
        assert b["tokens"] == 2 * (hi - lo)
        assert b["loss"] == pytest.approx(part[0].item(), rel=1e-5)
        assert b["kl"] == pytest.approx(part[2].item(), rel=1e-4)
        assert b["of_teacher"] == pytest.approx(math.exp(part[0].item() - part[1].item()), rel=1e-5)


def test_greedy_agreement(bpe):  # noqa: F811
    model, teacher = bpe_llama(bpe, seed=1), bpe_llama(bpe, seed=2)
    prompts = torch.randint(2, len(bpe), (3, 10))
    same = fidelity.greedy_agreement(model, model, bpe, prompts, new_tokens=6, batch_size=2, progress=False)
    assert same["exact"] == 1.0 and same["tokens"] == 1.0 and same["prefix"] == 6.0
    got = fidelity.greedy_agreement(model, teacher, bpe, prompts, new_tokens=6, batch_size=2, progress=False)
    a = model.generate(prompts, max_new_tokens=6, do_sample=False, min_new_tokens=6)[:, 10:]
    b = teacher.generate(prompts, max_new_tokens=6, do_sample=False, min_new_tokens=6)[:, 10:]
    assert got["exact"] == (a == b).all(1).float().mean().item()
    assert got["tokens"] == pytest.approx((a == b).float().mean().item())
    assert got["prefix"] == pytest.approx((a == b).long().cumprod(1).sum(1).float().mean().item())


def test_fidelity_needs_one_vocabulary(bpe):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config

    other = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=100))
    with pytest.raises(LinearizeError, match="same tokenizer"):
        fidelity.check_same_vocabulary(bpe_llama(bpe), other)


def test_resolve_domains():
    assert [d.name for d in domains.resolve_domains("all")] == ["books", "speeches", "code", "technical"]
    assert [d.name for d in domains.resolve_domains("code, books,code")] == ["code", "books"]
    with pytest.raises(LinearizeError, match="unknown domain 'poetry'; available: all, books"):
        domains.resolve_domains("poetry")


def test_domain_record_beside_a_teacher(bpe, tmp_path, monkeypatch):  # noqa: F811
    text = tmp_path / "prose.txt"
    text.write_text(PROSE * 30)
    monkeypatch.setattr(domains, "PROMPT_LEN", 12)
    monkeypatch.setattr(domains, "NEW_TOKENS", 4)
    model, teacher = bpe_llama(bpe, seed=1, context=128), bpe_llama(bpe, seed=2, context=128)
    domain = domains.Domain("prose", str(text), "all", "test prose")
    record = domains.evaluate_domain(model, bpe, domain, teacher=teacher, whole_blocks=3, position_blocks=2,
                                     agreement_prompts=3, progress=False)
    assert record["by_position"]["block_len"] == 128 and record["by_position"]["blocks"] == 2  # the teacher's context
    assert [b["range"] for b in record["by_position"]["buckets"]] == ["0-128"]
    assert record["of_teacher"] == pytest.approx(record["perplexity"]["value"] / record["teacher_perplexity"])
    assert record["agreement"]["prompts"] == 3 and record["agreement"]["prompt_len"] == 12
    alone = domains.evaluate_domain(model, bpe, domain, whole_blocks=3, position_blocks=2, progress=False)
    assert alone["perplexity"] == {**record["perplexity"], "seconds": alone["perplexity"]["seconds"]}
    assert "agreement" not in alone and alone["by_position"]["buckets"][0]["perplexity"] == pytest.approx(
        record["by_position"]["buckets"][0]["perplexity"], rel=1e-5)
    lines = domains.domain_lines({"prose": record, "alone": alone})
    assert "x teacher" in lines[0] and "KL" in lines[0] and "greedy agreement" in lines[0]
    assert "by position: 0-128" in lines[1]


def test_eval_flags_fail_in_one_line(capsys):
    from linearize.cli import main

    assert main(["eval", "default", "--domains", "poetry"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown domain 'poetry'" in err[0]
    assert main(["eval", "default", "--tasks", "copy", "--gaps", "0"]) != 0
    assert "--gaps must be at least 1" in capsys.readouterr().err


def test_evaluate_and_report_domains_and_copy(bpe, tmp_path, monkeypatch):  # noqa: F811
    from linearize.eval.report import render
    from linearize.eval.results import evaluate, load_results, save_results

    text = tmp_path / "prose.txt"
    text.write_text(PROSE * 30)
    monkeypatch.setitem(domains.DOMAINS, "books", domains.Domain("books", str(text), "all", "test prose"))
    monkeypatch.setattr(domains, "PROMPT_LEN", 12)
    monkeypatch.setattr(domains, "NEW_TOKENS", 4)
    monkeypatch.setattr(domains, "AGREEMENT_PROMPTS", 2)
    monkeypatch.setattr(copy_task, "DEFAULT_PASSAGES", (8,))
    monkeypatch.setattr(niah, "validation_books", lambda: PROSE * 3)  # the copy task's default text
    model, teacher = bpe_llama(bpe, seed=1, context=128), bpe_llama(bpe, seed=2, context=128)
    record = evaluate(model, bpe, tasks="copy", limit=2, with_perplexity=False, domains="books", teacher=teacher,
                      gaps=(16, 32), domain_blocks=2, progress=False, name="student")
    assert record["settings"]["domains"] == ["books"] and record["settings"]["recall"]["gaps"] == [16, 32]
    assert record["recall"]["copy"]["teacher_by_gap"] and record["domains"]["books"]["agreement"]["prompts"] == 2
    path = save_results(record, tmp_path / "student.json")
    page = render([(path, load_results(path))])
    assert "## Across domains" in page and "| student | books |" in page
    assert "**copy** by gap" in page and "its teacher" in page
