"""Training data for trainers: text sources, tokenizers, a held-out split and micro-batch sampling.

Nothing here downloads anything. The default corpus is the Python standard library's own ``*.py``
sources found on this machine (``sysconfig.get_paths()["stdlib"]``, walked in sorted order, without
``site-packages`` and the ``test`` suites, capped at ``max_bytes``): every machine that runs
swarmpipe has it, and code is regular enough that a small byte-level model visibly learns it.

Sources (``DataConfig.source``):

- ``None``: the standard-library corpus above.
- a text file, or a ``.jsonl`` file whose lines are objects with a ``text`` field;
- a directory: every such file below it, in sorted order (binary files are skipped);
- ``hf:PATH``: a *local* Hugging Face ``datasets`` dataset (a ``save_to_disk`` directory or a
  json/text data file), read with the optional ``datasets`` package, never from the hub.

Tokenization is byte-level (ids 0..255, no vocabulary file) unless ``DataConfig.tokenizer`` names a
local ``tokenizer.json`` for the optional ``tokenizers`` package; its vocabulary must fit the run's.
A run that continues a checkpoint (``swarm init --from-pretrained``) uses the checkpoint's tokenizer,
checked against the sha256 in its spec (see :func:`load_tokenizer`).

Batches: ``targets`` is ``tokens`` shifted by one position. Training windows are drawn uniformly at
random from the training split with a seeded generator (two trainers with different seeds read
different windows); evaluation windows are fixed, evenly spaced windows of the held-out split, so
evaluation losses of different steps compare the same text.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from swarm.errors import ConfigError

if TYPE_CHECKING:
    from swarm.run.spec import PretrainedConfig

__all__ = [
    "DataConfig",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenData",
    "read_documents",
    "stdlib_documents",
    "load_tokenizer",
    "build_data",
    "DEFAULT_MAX_BYTES",
]

DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB of text: ~1000 micro-batches of 4k tokens before repeating much
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"}
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".xml", ".c", ".h"}


class Tokenizer(Protocol):
    """Turns text into token ids and back."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): no download, no vocabulary file, any text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` read with the optional ``tokenizers`` package."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _HFTokenizer  # optional dependency, imported lazily
        except ImportError:
            raise ConfigError(
                f"tokenizer {path!r} needs the optional `tokenizers` package: `pip install tokenizers`, "
                "or leave out --tokenizer to use bytes"
            ) from None
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer file {path!r} does not exist; give a local tokenizer.json")
        self._tok = _HFTokenizer.from_file(path)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(
    path: str | None, *, vocab_size: int, pretrained: PretrainedConfig | None = None
) -> Tokenizer:
    """The tokenizer for a run of vocabulary ``vocab_size``: bytes by default, ``path`` if given.

    A run that continues a checkpoint (``pretrained`` with a tokenizer digest) always uses the
    checkpoint's tokenizer: ``path`` (a tokenizer.json or the checkpoint's directory) must be that file,
    and without ``path`` the copy this machine remembers is used (``swarm.run.pretrained.run_tokenizer_file``).
    """
    if pretrained is not None and pretrained.tokenizer is not None:
        from swarm.run.pretrained import run_tokenizer_file

        path = str(run_tokenizer_file(path, pretrained.tokenizer, source=pretrained.source))
    if path is not None and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")  # a checkpoint directory
    tok: Tokenizer = ByteTokenizer() if path is None else HFTokenizer(path)
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {path or 'bytes'!r} has {tok.vocab_size} tokens but the run's model.vocab_size is "
            f"{vocab_size}; use a run spec with vocab_size >= {tok.vocab_size} or another tokenizer"
        )
    return tok


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where a trainer's text comes from and how it is split."""

    source: str | None = None
    """Text file, directory, .jsonl file, ``hf:PATH``, or None for the standard-library corpus."""
    tokenizer: str | None = None
    """Local ``tokenizer.json`` (needs ``tokenizers``); None = bytes."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Text read at most (bytes of UTF-8); bounds memory and start-up time."""
    held_out_fraction: float = 0.05
    """Fraction of tokens (the end of the stream) kept for evaluation."""

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1024:
            raise ConfigError(f"data max_bytes = {self.max_bytes!r} must be an integer >= 1024")
        if not (0.0 < self.held_out_fraction < 0.5):
            raise ConfigError(
                f"data held_out_fraction = {self.held_out_fraction} must lie in (0, 0.5), e.g. 0.05"
            )


# ------------------------------------------------------------------------------------- documents


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The standard library's ``*.py`` files in sorted path order, up to ``max_bytes`` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = _read_tree(root, max_bytes, suffixes={".py"})
    if not docs:
        raise ConfigError(
            f"no Python sources found under the standard library at {root}; pass --data PATH with a "
            "text file or a directory of text files"
        )
    return docs


def _read_tree(root: Path, max_bytes: int, *, suffixes: set[str] | None) -> list[str]:
    docs: list[str] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if suffixes is not None and path.suffix not in suffixes:
                continue
            for text in _read_file(path, skip_binary=True):
                docs.append(text)
                total += len(text.encode("utf-8", errors="replace"))
                if total >= max_bytes:
                    return _cap(docs, max_bytes)
    return docs


def _cap(docs: list[str], max_bytes: int) -> list[str]:
    """Cut the last document so that the UTF-8 total is at most ``max_bytes``."""
    total = sum(len(d.encode("utf-8", errors="replace")) for d in docs)
    if total > max_bytes and docs:
        extra = total - max_bytes
        last = docs[-1].encode("utf-8", errors="replace")
        docs[-1] = last[: max(0, len(last) - extra)].decode("utf-8", errors="ignore")
    return docs


def _read_file(path: Path, *, skip_binary: bool) -> list[str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        if skip_binary:
            return []
        raise ConfigError(f"cannot read data file {str(path)!r} ({e.strerror or e}); check the path") from e
    if b"\x00" in raw[:4096]:
        if skip_binary:
            return []
        raise ConfigError(f"data file {str(path)!r} looks binary (NUL bytes); give a text or .jsonl file")
    text = raw.decode("utf-8", errors="replace")
    if path.suffix == ".jsonl":
        return _jsonl_texts(text, str(path))
    return [text]


def _jsonl_texts(text: str, where: str) -> list[str]:
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(
                f"{where}:{lineno} is not valid JSON ({e}); each line must be one object"
            ) from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ConfigError(
                f"{where}:{lineno} has no string field 'text'; JSONL data needs one object per line "
                'like {"text": "..."}'
            )
        out.append(obj["text"])
    return out


def read_documents(source: str | None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Read the documents of ``source`` (see the module docstring), at most ``max_bytes`` of text."""
    if source is None:
        return stdlib_documents(max_bytes)
    if source.startswith("hf:"):
        return _cap(_hf_documents(source[3:], max_bytes), max_bytes)
    path = Path(source)
    if path.is_dir():
        docs = _read_tree(path, max_bytes, suffixes=None)
    elif path.is_file():
        docs = _cap(_read_file(path, skip_binary=False), max_bytes)
    else:
        raise ConfigError(
            f"--data {source!r} is neither a file nor a directory; give a text file, a directory of "
            "text files, a .jsonl file with a 'text' field, or leave --data out for the default corpus"
        )
    if not any(d.strip() for d in docs):
        raise ConfigError(f"--data {source!r} holds no text; point it at text files")
    return docs


def _hf_documents(path: str, max_bytes: int) -> list[str]:
    """Texts of a local Hugging Face dataset (never a hub download: the path must exist)."""
    if not os.path.exists(path):
        raise ConfigError(
            f"hf:{path} does not exist; hf: sources are local datasets (a save_to_disk directory or a "
            "json/text file), never hub downloads"
        )
    try:
        import datasets  # optional dependency, imported lazily
    except ImportError:
        raise ConfigError(
            f"--data hf:{path} needs the optional `datasets` package: `pip install datasets`"
        ) from None
    if os.path.isdir(path):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    else:
        kind = "json" if path.endswith((".json", ".jsonl")) else "text"
        ds = datasets.load_dataset(kind, data_files=path, split="train")
    if "text" not in ds.column_names:
        raise ConfigError(f"hf:{path} has columns {ds.column_names}; a 'text' column is required")
    docs, total = [], 0
    for text in ds["text"]:
        if not isinstance(text, str):
            continue
        docs.append(text)
        total += len(text.encode("utf-8", errors="replace"))
        if total >= max_bytes:
            break
    return docs


# ---------------------------------------------------------------------------------------- tokens


class TokenData:
    """One token stream split into a training part and a held-out tail."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, held_out_fraction: float = 0.05):
        if tokens.dim() != 1:
            raise ValueError(f"token stream must be 1-D, got shape {tuple(tokens.shape)}")
        self.seq_len = seq_len
        n = tokens.numel()
        n_eval = max(seq_len + 1, int(n * held_out_fraction))
        if n - n_eval < seq_len + 1:
            raise ConfigError(
                f"the data holds {n} tokens, too few for training windows of seq_len {seq_len} plus a "
                f"held-out part of {n_eval}; give more text (at least {2 * (seq_len + 1) * 20} bytes)"
            )
        self.train = tokens[: n - n_eval].to(torch.long)
        self.held_out = tokens[n - n_eval :].to(torch.long)

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]  # (B, T+1)
        win = stream[idx]
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()  # (B, T), (B, T)

    def sample(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A random training micro-batch: ``(tokens, targets)``, both ``(batch, seq_len)`` long."""
        high = self.train.numel() - self.seq_len  # last start whose window of T+1 fits
        starts = torch.randint(0, high, (batch,), generator=generator)
        return self._windows(self.train, starts)

    def eval_batches(self, batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` fixed held-out micro-batches (evenly spaced windows, overlapping if short)."""
        high = self.held_out.numel() - self.seq_len - 1
        count = batch * n_batches
        starts = torch.linspace(0, max(high, 0), count).round().to(torch.long)
        return [self._windows(self.held_out, starts[i * batch : (i + 1) * batch]) for i in range(n_batches)]

    def stream(self, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless random training micro-batches from a generator seeded with ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield self.sample(batch, gen)


def build_data(
    config: DataConfig, *, seq_len: int, vocab_size: int, pretrained: PretrainedConfig | None = None
) -> tuple[TokenData, Tokenizer]:
    """Read, tokenize and split the configured source for a run with this ``seq_len`` and vocabulary
    (``pretrained``: the run's checkpoint, whose tokenizer is used, see :func:`load_tokenizer`)."""
    tokenizer = load_tokenizer(config.tokenizer, vocab_size=vocab_size, pretrained=pretrained)
    docs = read_documents(config.source, max_bytes=config.max_bytes)
    if isinstance(tokenizer, ByteTokenizer):
        raw = "\n".join(docs).encode("utf-8", errors="replace")
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)
    else:
        ids: list[int] = []
        for doc in docs:
            ids.extend(tokenizer.encode(doc))
        tokens = torch.tensor(ids, dtype=torch.long)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"token id {int(tokens.max())} is outside the run's vocabulary of {vocab_size}; use a matching "
            "tokenizer"
        )
    return TokenData(tokens, seq_len=seq_len, held_out_fraction=config.held_out_fraction), tokenizer
