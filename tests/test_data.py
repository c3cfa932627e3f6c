"""Data: sources (default corpus, files, directories, JSONL, optional HF), tokenizers, split, batches."""

from __future__ import annotations

import json

import pytest
import torch

from swarm.errors import ConfigError
from swarm.train.data import (
    ByteTokenizer,
    DataConfig,
    TokenData,
    build_data,
    load_tokenizer,
    read_documents,
    stdlib_documents,
)


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_default_corpus_is_deterministic_capped_python():
    a = stdlib_documents(64 * 1024)
    b = stdlib_documents(64 * 1024)
    assert a == b
    total = sum(len(d.encode()) for d in a)
    assert 60 * 1024 <= total <= 64 * 1024
    assert any("def " in d for d in a)


def test_text_file_directory_and_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("second")
    (tmp_path / "d" / "a.txt").write_text("first")
    (tmp_path / "d" / "blob.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / "d" / "c.jsonl").write_text(
        json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "4"})
    )
    assert read_documents(str(tmp_path / "d")) == ["first", "second", "third", "4"]
    (tmp_path / "one.txt").write_text("x" * 5000)
    assert read_documents(str(tmp_path / "one.txt"), max_bytes=1024) == ["x" * 1024]


def test_bad_sources_raise_config_errors_naming_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="neither a file nor a directory"):
        read_documents(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no string field 'text'"):
        read_documents(str(bad))
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\x00" * 100)
    with pytest.raises(ConfigError, match="looks binary"):
        read_documents(str(binary))
    with pytest.raises(ConfigError, match="hub"):
        read_documents("hf:" + str(tmp_path / "nope"))


def test_split_and_batches_shift_targets_by_one():
    stream = torch.arange(1000)  # token value = position, so windows show where they come from
    data = TokenData(stream, seq_len=16, held_out_fraction=0.1)
    assert data.train.numel() == 900 and data.held_out.numel() == 100
    assert torch.equal(torch.cat([data.train, data.held_out]), stream)
    x, y = data.sample(4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 900  # training windows never reach into the held-out tail
    evals = data.eval_batches(2, 3)
    assert len(evals) == 3 and all(e[0].shape == (2, 16) for e in evals)
    assert int(evals[0][0][0, 0]) == 900  # held-out windows start in the tail
    assert all(torch.equal(a[0], b[0]) for a, b in zip(evals, data.eval_batches(2, 3), strict=True))


def test_stream_is_reproducible_by_seed():
    data = TokenData(torch.arange(5000) % 256, seq_len=8)
    s1, s2, s3 = data.stream(2, seed=7), data.stream(2, seed=7), data.stream(2, seed=8)
    a, b, c = next(s1)[0], next(s2)[0], next(s3)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_too_little_data_is_refused():
    with pytest.raises(ConfigError, match="too few"):
        TokenData(torch.arange(20), seq_len=16)


def test_build_data_from_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 500)
    data, tok = build_data(DataConfig(source=str(f)), seq_len=32, vocab_size=256)
    x, _ = data.sample(1, torch.Generator().manual_seed(0))
    assert "hello" in tok.decode(x[0].tolist()) or "world" in tok.decode(x[0].tolist())


def test_byte_tokenizer_needs_vocab_of_256():
    with pytest.raises(ConfigError, match="vocab_size"):
        load_tokenizer(None, vocab_size=128)


def test_config_is_checked():
    with pytest.raises(ConfigError, match="held_out_fraction"):
        DataConfig(held_out_fraction=0.0)
    with pytest.raises(ConfigError, match="max_bytes"):
        DataConfig(max_bytes=10)


def _train_local_tokenizer(corpus_file, out_dir):
    """A small BPE tokenizer trained on a local file (never downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus_file)], trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]"]))
    path = out_dir / "tokenizer.json"
    tok.save(str(path))
    return path


def test_optional_tokenizers_package_with_a_local_tokenizer_file(tmp_path):
    pytest.importorskip("tokenizers")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i} of text" for i in range(400)))
    tok_path = _train_local_tokenizer(corpus, tmp_path)
    data, tok = build_data(DataConfig(source=str(corpus), tokenizer=str(tok_path)), seq_len=8, vocab_size=256)
    assert 10 < tok.vocab_size <= 100 and int(data.train.max()) < tok.vocab_size
    assert "text" in tok.decode(tok.encode("line 3 of text"))
    with pytest.raises(ConfigError, match="vocab_size"):
        build_data(DataConfig(source=str(corpus), tokenizer=str(tok_path)), seq_len=8, vocab_size=50)


def test_optional_datasets_package_with_a_local_file(tmp_path):
    pytest.importorskip("datasets")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"record {i} of the dataset"}) for i in range(400)))
    docs = read_documents("hf:" + str(corpus))
    assert docs[0] == "record 0 of the dataset" and len(docs) == 400
    data, _ = build_data(DataConfig(source="hf:" + str(corpus)), seq_len=16, vocab_size=256)
    assert data.train.numel() > 1000
