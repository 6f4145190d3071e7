"""Corpora and their preparation into token arrays.

corpus.py     text documents for language models (Shakespeare, text files, JSONL)
pairs.py      sentence pairs for translation (the Bible, TSV, JSONL) and their split
bpe.py        the byte-level BPE trainer both use
prepare.py    documents -> token shards (`llmkit prepare`)
bitexts.py    sentence pairs -> token arrays, and the reader of a prepared folder
arrays.py     how token arrays are written
"""
