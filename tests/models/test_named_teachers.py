"""The named real teachers (Gemma 3 270M and Qwen2.5-Coder 0.5B Instruct, dequantised from their Q4_K_M
GGUFs): their quirks reach the adapter, the LoLCATs hybrid whose window covers the block is the
teacher, checkpoints round-trip exactly, cached decoding follows full forwards, ``info`` is right.

Skipped unless the teacher's packages are installed (``make teachers``) or its cache is built; the
first load joins and dequantises (about a minute of CPU each), later ones read the cache.
"""

import math

import pytest
import torch

import linearize
from linearize import teacher as teachers
from linearize.cli import main
from linearize.errors import LinearizeError
from linearize.models import get_adapter
from linearize.teacher import NAMED_TEACHERS

from helpers import greedy_by_full_forwards, plain_generate

pytestmark = pytest.mark.slow

TEXT = (
    "Captain Wentworth had no fortune. He had been lucky in his profession; but spending freely what had "
    "come freely, had realized nothing. But he was confident that he should soon be rich: full of life and "
    "ardour, he knew that he should soon have a ship, and soon be on a station that would lead to everything "
    "he wanted. He had always been lucky; he knew he should be so still. Such confidence, powerful in its own "
    "warmth, and bewitching in the wit which often expressed it, must have been enough for Anne."
)

# what the real configs hold (Gemma 3 270M: google/gemma-3-270m's config.json; Qwen2.5-Coder-0.5B: Qwen's)
EXPECTED = {
    "gemma-3-270m": dict(model_type="gemma3_text", layers=18, hidden=640, vocab=262144, heads=4, kv_heads=1,
                         head_dim=256, scaling=256 ** -0.5, sliding_window=512, global_layers=[5, 11, 17],
                         rope={"sliding_attention": 10_000.0, "full_attention": 1_000_000.0},
                         tied=True, bias=False, qk_norm=True, embed_scale=math.sqrt(640), max_ppl=80, bos=True),
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", layers=24, hidden=896, vocab=151936, heads=14, kv_heads=2,
                               head_dim=64, scaling=64 ** -0.5, sliding_window=None, global_layers=list(range(24)),
                               rope={"full_attention": 1_000_000.0}, tied=False, bias=True, qk_norm=False,
                               embed_scale=None, max_ppl=200, bos=False),
}
KEEP = {"gemma-3-270m": [5], "qwen2.5-coder-0.5b": [0]}  # one kept softmax layer (a global one) in the round trip


def _available(name: str) -> bool:
    named = NAMED_TEACHERS[name]
    if teachers._cache_matches(teachers.cache_dir("teachers") / name, named.sha256):
        return True
    try:
        teachers._named_parts(named)
    except LinearizeError:
        return False
    return True


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def real(request):
    name = request.param
    if not _available(name):
        pytest.skip(f"{name}: its packages are not installed (make teachers)")
    model, tokenizer = linearize.load_teacher(name, dtype="float32", device="cpu")
    return name, model, tokenizer


def _ids(tokenizer, n: int) -> torch.Tensor:
    ids = tokenizer(" ".join([TEXT] * 8), return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n
    return ids


def _logit_positions(n: int) -> torch.Tensor:
    """Every fifth position and the last few: the whole vocabulary at every position is GBs."""
    return torch.unique(torch.cat([torch.arange(0, n, 5), torch.arange(n - 4, n)]))


def test_real_weights_reach_the_adapter(real):
    name, model, tokenizer = real
    want = EXPECTED[name]
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (
        want["model_type"], want["layers"], want["hidden"], want["vocab"])
    assert model.linearize_source == name and getattr(cfg, "quantization_config", None) is None
    adapter = get_adapter(cfg)
    for i, layer in enumerate(adapter.layers(model)):
        attn = adapter.attention(layer)
        g = adapter.geometry(attn, cfg)
        assert (g.n_heads, g.n_kv_heads, g.head_dim) == (want["heads"], want["kv_heads"], want["head_dim"])
        assert g.scaling == pytest.approx(want["scaling"]) and g.softcap is None
        assert g.sliding_window == (None if i in want["global_layers"] else want["sliding_window"]), i
        assert (attn.q_proj.bias is not None) == want["bias"] and (attn.k_proj.bias is not None) == want["bias"]
        assert (getattr(attn, "q_norm", None) is not None) == want["qk_norm"]
    rope = cfg.rope_parameters
    thetas = {kind: p["rope_theta"] for kind, p in rope.items()} if "rope_theta" not in rope else {
        "full_attention": rope["rope_theta"]}
    assert thetas == want["rope"]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == want["tied"]
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    if want["embed_scale"] is not None:
        assert model.model.embed_tokens.embed_scale.item() == pytest.approx(want["embed_scale"], rel=1e-6)
    assert tokenizer.pad_token is not None
    # Gemma's GGUF asks for BOS before every text (transformers < 5.23 built its tokenizer without it)
    assert (tokenizer("Hello").input_ids[0] == tokenizer.bos_token_id) == want["bos"]

    # the dequantised weights make a language model: a plain English paragraph is predictable (measured:
    # Gemma 3 270M 49.6, Qwen2.5-Coder 0.5B 108 (a code model, quantised twice), SmolLM2-135M 60.9;
    # broken weights give thousands)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        ppl = math.exp(model(ids, labels=ids).loss.item())
    print(f"\n{name}: perplexity {ppl:.1f} on the test paragraph ({ids.shape[1]} tokens)")
    assert ppl < want["max_ppl"]


def test_the_joined_gguf_as_a_path_is_the_same_teacher(real):
    name, model, tokenizer = real
    try:  # the fixture also accepts a teacher from the cache alone; joining needs its packages
        gguf = teachers.named_gguf_path(name)
    except LinearizeError:
        pytest.skip(f"{name}: its packages are not installed (make teachers)")
    assert teachers._sha256(gguf) == NAMED_TEACHERS[name].sha256
    again, tok = linearize.load_teacher(str(gguf), dtype="float32", device="cpu")  # reads the named cache
    assert again.linearize_source == str(gguf.resolve())
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert tok(TEXT, return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(again(ids[:, :24]).logits, model(ids[:, :24]).logits)


def test_full_window_hybrid_reproduces_the_teacher(real):
    """fp32, <= 1e-3. Gemma 3's block passes its 512-token sliding window: its sliding layers, which the
    window then covers, stay (the teacher never looks further back) and its global layers are hybrids;
    over a block inside the sliding window every layer is a hybrid."""
    name, model, tokenizer = real
    n = 600 if EXPECTED[name]["sliding_window"] else 320
    ids = _ids(tokenizer, n)
    keep = _logit_positions(n)
    short = 300
    with torch.no_grad():
        reference = model(ids, logits_to_keep=keep).logits
        student = linearize.convert(model, {"kind": "lolcats", "window": n})
        expected_kept = [] if EXPECTED[name]["sliding_window"] is None else [
            i for i in range(EXPECTED[name]["layers"]) if i not in EXPECTED[name]["global_layers"]]
        assert student.config.linearize["keep_softmax"] == expected_kept
        diff = (student(ids, logits_to_keep=keep).logits - reference).abs().max().item()
        assert diff <= 1e-3, diff
        del student
        student = linearize.convert(model, {"kind": "lolcats", "window": short})
        assert student.config.linearize["keep_softmax"] == []
        assert len(linearize.mixers(student)) == EXPECTED[name]["layers"]
        inside = keep[keep < short]
        got = student(ids[:, :short], logits_to_keep=inside).logits
        diff_short = (got - reference[:, : len(inside)]).abs().max().item()
    print(f"\n{name}: max |logit diff| {diff:.2e} over {n} tokens, {diff_short:.2e} over {short} (all hybrids)")
    assert diff_short <= 1e-3, diff_short


def test_roundtrip_decoding_and_info(real, tmp_path, capsys):
    """save -> load is exact; generate() (the recurrent cache) and the fast decoder give the greedy
    tokens of full forwards; ``linearize info`` reports the shapes and the state they imply."""
    from linearize.fast import fast_generate

    name, model, tokenizer = real
    want = EXPECTED[name]
    window, feature_dim = 16, 64
    student = linearize.convert(model, {"kind": "lolcats", "window": window, "feature_dim": feature_dim},
                                keep_softmax=KEEP[name])
    linearize.save(student, tokenizer, tmp_path / "ckpt")
    loaded, _ = linearize.load(tmp_path / "ckpt", dtype="float32", device="cpu")
    prompt = tokenizer(TEXT, return_tensors="pt").input_ids[:, :40]
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, student(prompt).logits)
        reference = greedy_by_full_forwards(loaded, prompt, 12)
        out = plain_generate(loaded, prompt, max_new_tokens=12, do_sample=False, pad_token_id=pad, eos_token_id=None)
        assert torch.equal(out, reference)
        fast = fast_generate(loaded, prompt, max_new_tokens=12, eos_token_id=None, pad_token_id=pad)
        assert torch.equal(fast, reference)
    del student

    assert main(["info", str(tmp_path / "ckpt"), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    kept = KEEP[name][0]
    n = want["layers"]
    runs = [f"lolcats [0-{kept - 1}]" if kept > 1 else "lolcats [0]" if kept == 1 else None, f"softmax [{kept}]",
            f"lolcats [{kept + 1}-{n - 1}]"]
    assert f"mixers:       {', '.join(r for r in runs if r)}" in text
    assert f"{want['model_type']} " in text and f", {n} layers, hidden {want['hidden']}, vocab {want['vocab']}" in text
    # per converted layer: the window's keys, values and key features, plus the fp32 linear state
    kv, d, f = want["kv_heads"], want["head_dim"], 2 * feature_dim
    hybrid = window * kv * (2 * d + f) * 4 + kv * f * (d + 1) * 4
    assert f"decode state: {(n - 1) * hybrid:,} bytes per sequence fixed + {2 * kv * d * 4:,} bytes per token" in text

    # the teacher itself: Gemma's sliding layers hold at most 511 tokens, only its global ones grow
    assert main(["info", name, "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert f"mixers:       softmax [0-{n - 1}]" in text
    sliding = n - len(want["global_layers"])
    fixed = sliding * ((want["sliding_window"] or 1) - 1) * 2 * kv * d * 4
    per_token = len(want["global_layers"]) * 2 * kv * d * 4
    assert f"decode state: {fixed:,} bytes per sequence fixed + {per_token:,} bytes per token" in text


def test_kept_local_layers_decode_fast_past_their_window(real):
    """``keep_sliding`` on the real Gemma 3: its 15 local layers stay softmax over 512 tokens and the 3
    global ones convert; from a prompt past the window, the fast decoder (the local layers in rings of
    512 slots) gives the greedy tokens of generate() and of full forwards."""
    from linearize.fast import fast_generate

    name, model, tokenizer = real
    want = EXPECTED[name]
    if want["sliding_window"] is None:
        pytest.skip(f"{name} has no sliding-window layers")
    student = linearize.convert(model, {"kind": "lolcats", "window": 16, "feature_dim": 64, "keep_sliding": True})
    assert sorted(linearize.mixers(student)) == want["global_layers"]
    prompt = _ids(tokenizer, want["sliding_window"] + 40)
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        reference = greedy_by_full_forwards(student, prompt, 8)
        out = plain_generate(student, prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                             pad_token_id=pad, eos_token_id=None)
        fast = fast_generate(student, prompt, max_new_tokens=8, eos_token_id=None, pad_token_id=pad)
    assert torch.equal(out, reference) and torch.equal(fast, reference)
