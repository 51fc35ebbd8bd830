import gzip
import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from ftlab.runtime.training import data
from ftlab.runtime.training.data import Batches, WordTokenizer, load_text, load_tokens, tokenize_corpus

# sha256 of the original WikiText-2 splits, as listed in runtime/datasets/README.md.
WIKITEXT_SHA256 = {
    "wikitext-2-valid.txt.gz": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    "wikitext-2-test.txt.gz": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
}


def test_bundled_wikitext_is_unmodified_and_loaded_valid_then_test():
    texts = []
    for name, digest in WIKITEXT_SHA256.items():
        raw = gzip.decompress((data.BUNDLED_DIR / name).read_bytes())
        assert hashlib.sha256(raw).hexdigest() == digest
        texts.append(raw.decode("utf-8"))
    assert load_text(None) == texts[0] + texts[1]


def test_plain_and_gzip_files_read_alike(tmp_path):
    text = "one two\nthree\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    assert load_text(str(tmp_path / "a.txt")) == load_text(str(tmp_path / "a.txt.gz")) == text


def test_missing_file_names_the_path_and_the_setting(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(FileNotFoundError) as error:
        load_text(str(missing))
    assert str(missing) in str(error.value) and "train.data" in str(error.value)


def test_tokenizer_orders_words_by_frequency_then_alphabetically():
    tokenizer = WordTokenizer.fit("b a c\nc b\nc <unk> d\n", vocab_size=5)
    assert tokenizer.vocab == ["<unk>", "<eos>", "c", "b", "a"]  # "a" beats "d" on the tie; <unk> not a word


def test_tokenizer_round_trips_known_words_and_maps_the_rest_to_unk():
    tokenizer = WordTokenizer.fit("the cat sat\non the mat\n", vocab_size=20)
    ids = tokenizer.encode("the mat sat\non the cat\n")
    assert ids.dtype == np.int32
    assert tokenizer.decode(ids) == "the mat sat\non the cat\n"
    assert list(tokenizer.encode("the dog\n")) == [tokenizer.ids["the"], 0, 1]
    assert list(tokenizer.encode("the")) == [tokenizer.ids["the"]]  # no newline, no <eos>


def test_bundled_corpus_coverage():
    text = load_text(None)
    tokens = WordTokenizer.fit(text, vocab_size=8192).encode(text)
    assert len(tokens) == 463_215  # 455,097 words and 8,118 newlines
    assert (tokens == 1).sum() == text.count("\n")
    assert tokens.max() == 8191
    # WikiText-2 brings 5.8% <unk> of its own; an 8192-word vocabulary adds about 4%.
    assert 0.09 < (tokens == 0).mean() < 0.11


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"word{i % 37} word{i % 11} word{i % 5}\n" for i in range(400)), encoding="utf-8")
    return path


def test_corpus_cache_is_reused_and_keyed_by_vocab_size(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = tokenize_corpus(str(corpus), 16, cache)
    tokens = np.load(first)
    assert tokens.dtype == np.int32 and tokens.max() == 15
    mtime = first.stat().st_mtime_ns

    fits = []
    monkeypatch.setattr(WordTokenizer, "fit", classmethod(lambda cls, text, size: fits.append(size)))
    assert tokenize_corpus(str(corpus), 16, cache) == first
    assert fits == [] and first.stat().st_mtime_ns == mtime
    monkeypatch.undo()

    other = tokenize_corpus(str(corpus), 32, cache)
    assert other != first and np.load(other).max() == 31
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, other.name])  # no temporary files left


def test_concurrent_tokenization_yields_one_complete_file(corpus, tmp_path):
    cache = tmp_path / "cache"
    expected = WordTokenizer.fit(corpus.read_text(), 20).encode(corpus.read_text())
    results: list[Path] = []
    def tokenize() -> None:
        results.append(tokenize_corpus(str(corpus), 20, cache))

    threads = [threading.Thread(target=tokenize) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert np.array_equal(load_tokens(results[0]), expected)
    assert [p.name for p in cache.iterdir()] == [results[0].name]


@pytest.fixture
def tokens() -> np.ndarray:
    return np.arange(10_000, dtype=np.int32)  # token i at position i: a window's tokens name its offset


def test_same_seed_step_and_microbatch_give_the_same_tensors(tokens):
    one = Batches(tokens, seq_len=16, global_batch=8, micro_batch=2, seed=4)
    two = Batches(tokens.copy(), seq_len=16, global_batch=8, micro_batch=2, seed=4)
    for step, mb in ((0, 0), (5, 3), (5, 1)):
        a, b = one.microbatch(step, mb), two.microbatch(step, mb)
        assert a[0].dtype == np.int64 and a[0].shape == (2, 16)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(one.microbatch(5, 0)[0], one.microbatch(6, 0)[0])
    assert not np.array_equal(one.microbatch(5, 0)[0], one.microbatch(5, 1)[0])
    other_seed = Batches(tokens, seq_len=16, global_batch=8, micro_batch=2, seed=5)
    assert not np.array_equal(one.microbatch(5, 0)[0], other_seed.microbatch(5, 0)[0])


def test_labels_are_the_inputs_shifted_by_one(tokens):
    inputs, labels = Batches(tokens, seq_len=16, global_batch=4, micro_batch=4, seed=0).microbatch(2, 0)
    assert np.array_equal(labels, inputs + 1)  # with token i at position i, the next token is i + 1
    assert np.array_equal(inputs[:, 1:], labels[:, :-1])


def test_the_global_batch_does_not_depend_on_the_micro_batch_size(tokens):
    """Layouts that cut a step into different micro-batches still train on the same samples."""
    small = Batches(tokens, seq_len=16, global_batch=8, micro_batch=2, seed=1)
    large = Batches(tokens, seq_len=16, global_batch=8, micro_batch=4, seed=1)
    for half in range(2):
        joined = np.concatenate([small.microbatch(3, 2 * half + i)[0] for i in range(2)])
        assert np.array_equal(joined, large.microbatch(3, half)[0])


def test_memory_mapped_tokens_give_the_same_batches(tokens, tmp_path):
    np.save(tmp_path / "tokens.npy", tokens)
    mapped = load_tokens(tmp_path / "tokens.npy")
    assert isinstance(mapped, np.memmap)
    a = Batches(mapped, seq_len=8, global_batch=4, micro_batch=2, seed=0).microbatch(1, 1)
    b = Batches(tokens, seq_len=8, global_batch=4, micro_batch=2, seed=0).microbatch(1, 1)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_windows_stay_inside_the_corpus():
    batches = Batches(np.arange(20, dtype=np.int32), seq_len=16, global_batch=64, micro_batch=64, seed=0)
    inputs, labels = batches.microbatch(0, 0)
    assert labels.max() <= 19 and set(inputs[:, 0].tolist()) == {0, 1, 2, 3}


def test_invalid_batch_shapes_are_rejected(tokens):
    with pytest.raises(ValueError, match="multiple"):
        Batches(tokens, seq_len=16, global_batch=6, micro_batch=4, seed=0)
    with pytest.raises(ValueError, match="shorter"):
        Batches(tokens[:10], seq_len=16, global_batch=4, micro_batch=4, seed=0)
    with pytest.raises(IndexError):
        Batches(tokens, seq_len=16, global_batch=4, micro_batch=2, seed=0).microbatch(0, 2)
