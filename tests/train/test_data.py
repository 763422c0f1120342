"""attnlab.data: whole-file held-out split, byte counts, windows, and a training order that is a pure function."""

from __future__ import annotations

import pytest
import torch

from attnlab import data


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
