"""Training text, a word-level tokenizer, and the sample order.

The data order is a function of (seed, step) alone: any process can compute any micro-batch of any step without
talking to the others, so a micro-batch rerouted to another worker, or replayed after a recovery, is the same
tokens. The corpus is tokenized once per machine into a cached .npy that workers open with mmap.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

BUNDLED_DIR = Path(__file__).parent / "datasets"
# The default corpus: WikiText-2's validation then test split (see datasets/README.md).
BUNDLED_FILES = ("wikitext-2-valid.txt.gz", "wikitext-2-test.txt.gz")
UNK, EOS = "<unk>", "<eos>"
# Bump when encoding changes, so stale caches are not reused.
TOKENIZER_VERSION = 1


def _read(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def load_text(path: str | None) -> str:
    """The text of a local file (gzip or plain), or the bundled WikiText-2 when `path` is None."""
    if path is None:
        return "".join(_read(BUNDLED_DIR / name) for name in BUNDLED_FILES)
    return _read(text_file(path))


def text_file(path: str) -> Path:
    """The local file ``train.data`` names, or a FileNotFoundError that says what to give instead."""
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "is not a regular file" if file.exists() else "does not exist"
        raise FileNotFoundError(
            f"training text {str(file)!r} {what}; set train.data to an existing local text file "
            "(plain or .gz), or leave it unset for the bundled WikiText-2"
        )
    return file


class WordTokenizer:
    """Whitespace-separated words; each newline is an <eos> token, words outside the vocabulary are <unk>."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab
        self.ids = {word: i for i, word in enumerate(vocab)}

    @classmethod
    def fit(cls, text: str, vocab_size: int) -> WordTokenizer:
        """<unk>, <eos>, then the vocab_size - 2 most frequent words, by frequency then alphabetically."""
        if vocab_size < 3:
            raise ValueError(f"vocab_size {vocab_size} leaves no room for words next to {UNK} and {EOS}")
        counts = collections.Counter(text.split())
        for special in (UNK, EOS):
            counts.pop(special, None)
        words = sorted(counts, key=lambda word: (-counts[word], word))[: vocab_size - 2]
        return cls([UNK, EOS, *words])

    def encode(self, text: str) -> np.ndarray:
        unk, eos = self.ids[UNK], self.ids[EOS]
        lines = text.split("\n")
        ids: list[int] = []
        for number, line in enumerate(lines):
            ids.extend(self.ids.get(word, unk) for word in line.split())
            if number < len(lines) - 1:  # a newline follows this line
                ids.append(eos)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        """Words joined by single spaces, <eos> back to newlines."""
        eos = self.ids[EOS]
        lines: list[str] = []
        words: list[str] = []
        for i in ids:
            if i == eos:
                lines.append(" ".join(words))
                words = []
            else:
                words.append(self.vocab[i])
        return "\n".join([*lines, " ".join(words)])


def tokenize_corpus(path: str | None, vocab_size: int, cache_dir: Path) -> Path:
    """A .npy of the corpus's int32 token ids, tokenized once and cached by (text hash, vocab size, tokenizer
    version). Several processes may ask at once: each writes a private temporary file and renames it into place,
    so a reader never sees a partial file (a concurrent duplicate write is wasted work, not an error)."""
    text = load_text(path)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    target = cache_dir / f"tokens-{digest}-vocab{vocab_size}-v{TOKENIZER_VERSION}.npy"
    if target.is_file():
        return target
    tokens = WordTokenizer.fit(text, vocab_size).encode(text)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=cache_dir, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, tokens)
        os.replace(temp, target)
    except BaseException:
        os.unlink(temp)
        raise
    return target


def load_tokens(path: Path) -> np.ndarray:
    """The cached token ids, memory-mapped: every worker on a machine shares one copy in the page cache."""
    return np.load(path, mmap_mode="r")


class Batches:
    """The global batch of every step, cut into micro-batches.

    A step's global batch is `global_batch` windows of seq_len + 1 tokens at offsets drawn from
    numpy's default_rng((seed, step)); micro-batch m is windows [m * micro_batch, (m + 1) * micro_batch).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, micro_batch: int, seed: int) -> None:
        if micro_batch < 1 or global_batch % micro_batch:
            raise ValueError(f"global batch {global_batch} is not a multiple of micro-batch {micro_batch}")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one sample of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.seed = seed
        self.num_microbatches = global_batch // micro_batch

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the step's global batch."""
        rng = np.random.default_rng((self.seed, step))
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def microbatch(self, step: int, microbatch: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels), int64 [micro_batch, seq_len]; labels are the inputs shifted by one token."""
        if not 0 <= microbatch < self.num_microbatches:
            raise IndexError(f"micro-batch {microbatch} out of range: a step has {self.num_microbatches}")
        starts = self.offsets(step)[microbatch * self.micro_batch : (microbatch + 1) * self.micro_batch]
        windows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], dtype=np.int64)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])
