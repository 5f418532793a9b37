"""The file suffixes the source reader (``sources``) takes for documents, apart from it so that
``corpora`` can name the files it keeps beside documents (licences) without importing the reader."""

TEXT_SUFFIXES = (".txt", ".md")
READABLE_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl")
