"""Text corpora for training and evaluation: files, a held-out split, tokenisation, packing, sampling order.

- A corpus is a text file or a directory of ``.txt`` files (searched recursively, sorted by path).
- Held-out text is made of whole files, never lines of a file that is also trained on (a play's lines share
  names and phrasing, so a line-level split would leak).
- Text is tokenised with a checkpoint's own ``tokenizer.json`` (the ``tokenizers`` library, no special tokens
  added); files are joined into one stream with the checkpoint's end-of-sequence token between them, and the
  stream is cut into consecutive windows of ``seq_len + 1`` tokens that overlap by one token (inputs are the
  first ``seq_len``), so every token after the first is predicted exactly once, up to the last whole window (the
  up to ``seq_len - 1`` tokens after it are not). An empty file adds nothing, not even a separator.
- Each token carries the number of UTF-8 bytes of text it adds (separators add none), so a loss can be
  reported in bits per byte, which does not depend on the tokenizer.
- The training order is a pure function of (seed, position): sample number ``p`` is window
  ``permutation(seed, epoch)[p % n]`` with ``epoch = p // n``. Resuming, or changing how a global batch is
  split over ranks, therefore never changes which windows a step sees.
- The package ships a corpus, 36 of Shakespeare's plays (``shakespeare()``; benchmarks/make_corpus.py says which
  and how the archive is built), so that tests and quick studies need nothing beside the checkout.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .atomic import MARKER, atomic_dir, lock, named


@dataclass(frozen=True)
class TokenStream:
    """Tokens of a corpus: ``tokens`` (N,) int64 and ``nbytes`` (N,) int64, the UTF-8 bytes each token adds."""

    tokens: torch.Tensor
    nbytes: torch.Tensor
    files: tuple[str, ...]

    def __len__(self) -> int:
        return self.tokens.numel()

    def n_windows(self, seq_len: int) -> int:
        """Windows of ``seq_len`` predictions the stream holds (consecutive, overlapping by one token)."""
        return max(0, (len(self) - 1) // seq_len)

    def windows(self, index: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs (B, seq_len), targets (B, seq_len) and the targets' bytes (B, seq_len) of windows ``index``."""
        starts = index.to(torch.int64)[:, None] * seq_len + torch.arange(seq_len + 1)  # (B, seq_len + 1)
        chunk = self.tokens[starts]
        return chunk[:, :-1], chunk[:, 1:], self.nbytes[starts[:, 1:]]


def text_files(path: str | Path, flag: str = "--data") -> list[Path]:
    """The text files of a corpus: ``path`` itself, or the ``.txt`` files under the directory ``path``."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.exists():
        raise FileNotFoundError(f"{flag} {named(path)} not found")
    if not path.is_dir():  # a device, a FIFO, a socket (/dev/null read as "a directory without .txt files")
        raise ValueError(f"{flag} {path} is neither a text file nor a directory")

    def unreadable(err: OSError) -> None:  # rglob skipped such a directory without a word
        raise ValueError(
            f"{flag} {path}: cannot read {err.filename} ({err.strerror}); fix its permissions or move it"
        )

    found = []
    for root, _, names in os.walk(path, onerror=unreadable):  # symlinked directories not followed, as rglob
        found += [Path(root) / n for n in names if n.endswith(".txt")]
    files = sorted(p for p in found if p.is_file())
    if not files:
        raise ValueError(f"{flag} {path} is a directory without .txt files")
    return files


def fingerprint(paths: list[Path], how: str = "") -> str:
    """What a text is: every file's name and bytes, in order (and ``how`` they were split, if not by whole files);
    what ``attnlab sweep`` keys its data on and ``uptrain --resume`` compares."""
    h = hashlib.sha256(how.encode())
    for p in paths:
        h.update(str(p.name).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def split_held_out(files: list[Path], fraction: float = 0.1) -> tuple[list[Path], list[Path]]:
    """(train, held-out) by whole files: ``round(fraction * n)`` files (at least one when there are two or
    more), spread evenly over the sorted list. One file cannot be split: it is all training text."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    n = len(files)
    k = 0 if n < 2 or fraction == 0.0 else min(n - 1, max(1, round(fraction * n)))
    picked = {int((i + 0.5) * n / k) for i in range(k)} if k else set()
    return [f for i, f in enumerate(files) if i not in picked], [
        f for i, f in enumerate(files) if i in picked
    ]


def load_tokenizer(checkpoint: str | Path, vocab_size: int | None = None):
    """The ``tokenizers.Tokenizer`` saved with a checkpoint (its ``tokenizer.json``), checked to be readable and,
    given the model's ``vocab_size`` (its embedding rows), to produce no token id the embedding does not have."""
    from tokenizers import Tokenizer

    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"no tokenizer.json in {checkpoint}: the text is tokenised with the checkpoint's own tokenizer.json, "
            "which the checkpoint directory must hold"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = " ".join(str(err).split())[:200]
        raise ValueError(
            f"{path} is not a readable tokenizer ({reason}); re-download or re-export it"
        ) from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:  # every text would be no tokens at all, and the data was blamed ("fewer than one window")
        raise ValueError(f"{path} has an empty vocabulary: it tokenises nothing; re-download or re-export it")
    if vocab_size is not None:
        top = max(vocab.values())
        if top >= vocab_size:
            raise ValueError(
                f"{path} has token ids up to {top}, but the model's embedding has {vocab_size} rows (config.json): "
                "this tokenizer does not belong to this checkpoint"
            )
    return tok


def read_text(path: Path, flag: str = "--data") -> str:
    """A text file's contents as they are (line ends untranslated), with an error that names the file when it is
    not UTF-8."""
    try:
        # newline="": its own line ends (Python's translation turned a CRLF file's text into another text)
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{flag}: {path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8"
        ) from None


def train_byte_bpe(texts: list[str], vocab_size: int, end_token: str = "<|endoftext|>"):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2's scheme: every byte is a base symbol, so any text
    encodes) trained on ``texts``; ``end_token`` is its first token (id 0), used as end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[end_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, directory: str | Path, end_token: str = "<|endoftext|>") -> None:
    """Write ``tok`` (a ``tokenizers.Tokenizer``, as ``train_byte_bpe`` makes) into a checkpoint ``directory``:
    its ``tokenizer.json`` and a ``tokenizer_config.json`` that makes every loader tokenise as that file does.

    Why the second file: without it ``transformers.AutoTokenizer`` picks the class of the checkpoint's model_type,
    and some of those rebuild the pipeline (transformers 5's ``Qwen2Tokenizer`` replaces the pre-tokenizer with
    Qwen2's regex; Gemma's wants an ``<unk>`` token). ``PreTrainedTokenizerFast`` (transformers 4's name, kept in 5)
    loads tokenizer.json as it is: what llama.cpp's ``convert_hf_to_gguf.py`` reads the vocabulary through
    (``TextModel.get_vocab_base``) and what vLLM serves with. ``add_bos_token: false`` says what attnlab's own
    tokenisation does (no BOS before the text); gguf-py's ``SpecialVocab`` writes it into a GGUF as
    ``tokenizer.ggml.add_bos_token``, so llama.cpp adds none either."""
    directory = Path(directory)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": end_token,
        "eos_token": end_token,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def separator_id(checkpoint: str | Path) -> int | None:
    """The end-of-sequence token put between files: config.json's ``eos_token_id`` (the first of a list)."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and 0 <= eos < cfg.get("vocab_size", eos + 1) else None


def _byte_lengths(tok) -> np.ndarray | None:
    """Each token's bytes for a byte-level vocabulary (GPT-2's scheme: one symbol a byte, so a token's length in
    symbols), by id; None for any other."""
    if type(tok.decoder).__name__ != "ByteLevel":
        return None
    size = tok.get_vocab_size(with_added_tokens=True)
    return np.array([len(tok.id_to_token(i) or "") for i in range(size)], dtype=np.int64)


def _token_bytes(
    text: str, starts: np.ndarray, ends: np.ndarray, lengths: np.ndarray | None = None
) -> np.ndarray:
    """Bytes each token adds, from the tokens' offsets (characters of ``text``): the growth of the furthest byte
    covered so far, so overlapping offsets are counted once; the sum is the text's bytes. Tokens that split one
    character (byte-level tokens of a character outside their vocabulary share its offsets) share its bytes: by
    ``lengths`` (each token's own bytes, known for a byte-level vocabulary) where they add up, else evenly (byte
    fallback: one byte a token). In numpy, a few bytes a character (lists of Python ints took ~40)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    byte_at = np.zeros(len(text) + 1, dtype=np.int64)  # byte offset of each character position
    np.cumsum(1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000), out=byte_at[1:])
    del codes
    if not len(ends):
        return np.zeros(0, dtype=np.int64)
    if (
        lengths is not None and int(lengths.sum()) == byte_at[-1]
    ):  # the tokens spell the text: their own counts
        return lengths.copy()
    covered = byte_at[np.maximum.accumulate(ends)]
    out = np.diff(covered, prepend=0)
    # runs of tokens with the same (start, end): the first took the character's bytes, the others none
    new = np.ones(len(ends), dtype=bool)
    new[1:] = (starts[1:] != starts[:-1]) | (ends[1:] != ends[:-1])
    first = np.flatnonzero(new)
    count = np.diff(first, append=len(ends))
    if (count > 1).any():
        run = np.cumsum(new) - 1  # each token's run
        total = np.add.reduceat(out, first)
        k = count[run]
        share = total[run] // k + np.where(new, total[run] % k, 0)  # evenly, the remainder to the first
        if lengths is not None:
            exact = (np.add.reduceat(lengths, first) == total)[run]
            share = np.where(exact, lengths, share)
        out = np.where(k > 1, share, out)
    out[-1] += byte_at[-1] - covered[-1]  # text after the last token (stripped whitespace)
    return out


# A file is tokenised in pieces of about this many characters, cut after a newline where cutting changes no
# token, and ~BATCH_CHARS of pieces at a time: the tokenizer holds ~300 bytes per token of a text it encodes
# (5 MB of Shakespeare, byte-level BPE of 512 tokens: 0.8 GB), so encoding a corpus whole took ~270x its size.
PIECE_CHARS = 1 << 16
BATCH_CHARS = 1 << 18
_CONTEXT = 64  # characters each side of a cut that its check encodes


def _same_across(tok, text: str, at: int) -> bool:
    """Whether cutting ``text`` at ``at`` leaves the tokens around it as they are: the ~64 characters each side
    encode to the same ids apart as together (a pre-tokenizer merging a run of newlines, or one that puts a
    prefix at the start of every text, makes them differ)."""
    left, right = text[max(0, at - _CONTEXT) : at], text[at : at + _CONTEXT]
    apart = tok.encode(left, add_special_tokens=False).ids + tok.encode(right, add_special_tokens=False).ids
    return apart == tok.encode(left + right, add_special_tokens=False).ids


_TRIES = 16  # newlines checked for one cut; a tokenizer that keeps a newline inside its pieces passes none


def _pieces(tok, text: str, size: int) -> list[int]:
    """Where ``text`` is cut into pieces of about ``size`` characters: just after a newline whose line has text,
    where the next line starts with no whitespace and ``_same_across`` holds (else the next such newline). After
    ``_TRIES`` newlines that fail the check, the rest is one piece: a Metaspace pre-tokenizer (SentencePiece's
    models) joins the lines around a newline into one of its pieces, so no cut holds there."""
    starts, at = [0], size
    while at < len(text):
        cut, tries = text.find("\n", at), 0
        while cut != -1 and tries < _TRIES:
            after = cut + 1
            if after < len(text) and not text[after].isspace() and cut > 0 and not text[cut - 1].isspace():
                if _same_across(tok, text, after):
                    break
                tries += 1
            cut = text.find("\n", after)
        if cut == -1 or tries == _TRIES:
            break
        starts.append(cut + 1)
        at = cut + 1 + size
    return starts


def _encode(
    tok, texts: list[str], piece_chars: int | None = None, progress: Callable[[int, int], None] | None = None
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each text's token ids and start and end offsets (characters), the same as encoding it whole (checked at
    each cut, ``_same_across``), encoded ~BATCH_CHARS of pieces at a time and kept as int64 arrays;
    ``progress(characters done, characters in all)`` after each batch."""
    work = []  # (text index, piece start, piece end)
    for i, text in enumerate(texts):
        cuts = _pieces(tok, text, piece_chars or PIECE_CHARS)
        work += [(i, a, b) for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]
    ids: list[list[np.ndarray]] = [[] for _ in texts]
    starts: list[list[np.ndarray]] = [[] for _ in texts]
    ends: list[list[np.ndarray]] = [[] for _ in texts]
    j, done, total = 0, 0, sum(b - a for _, a, b in work)
    while j < len(work):
        k, chars = j, 0
        while k < len(work) and (k == j or chars + work[k][2] - work[k][1] <= BATCH_CHARS):
            chars += work[k][2] - work[k][1]
            k += 1
        batch = work[j:k]
        encodings = tok.encode_batch([texts[i][a:b] for i, a, b in batch], add_special_tokens=False)
        for (i, a, _), enc in zip(batch, encodings, strict=True):
            ids[i].append(np.asarray(enc.ids, dtype=np.int64))
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2) + a
            starts[i].append(offsets[:, 0])
            ends[i].append(offsets[:, 1])
        del encodings
        j, done = k, done + chars
        if progress is not None:
            progress(done, total)

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    return [(joined(i), joined(s), joined(e)) for i, s, e in zip(ids, starts, ends, strict=True)]


_CACHE: OrderedDict[tuple, TokenStream] = OrderedDict()


def tokenize_files(
    checkpoint: str | Path,
    files: list[Path],
    vocab_size: int | None = None,
    flag: str = "--data",
    progress: Callable[[int, int], None] | None = None,
) -> TokenStream:
    """Tokenise ``files`` with ``checkpoint``'s tokenizer into one stream (memoised on the tokenizer's and the
    files' contents, so that a study running many trainings on one corpus tokenises it once). ``vocab_size``:
    the model's, which the tokenizer is checked against (``load_tokenizer``). ``progress(characters done,
    characters in all)`` as the text is encoded."""
    checkpoint = Path(checkpoint)
    tok = load_tokenizer(checkpoint, vocab_size)
    sep = separator_id(checkpoint)
    texts = [read_text(f, flag) for f in files]
    key = (
        hashlib.sha256((checkpoint / "tokenizer.json").read_bytes()).hexdigest(),
        sep,
        tuple(hashlib.sha256(t.encode()).hexdigest() for t in texts),
    )
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    tok.no_padding()
    tok.no_truncation()
    ids, nbytes = [], []
    try:
        encoded = _encode(tok, texts, progress=progress)
    # the tokenizers library raises a bare Exception (e.g. a WordLevel unk not in its vocab)
    except Exception as err:
        raise ValueError(f"{flag}: {checkpoint / 'tokenizer.json'} cannot tokenise the text: {err}") from None
    lengths = _byte_lengths(tok)
    for text, (file_ids, starts, ends) in zip(texts, encoded, strict=True):
        # an empty file: no text, and no separator (each one added an end-of-text token to score)
        if not len(file_ids):
            continue
        if ids and sep is not None:
            ids.append(np.array([sep], dtype=np.int64))
            nbytes.append(np.zeros(1, dtype=np.int64))
        ids.append(file_ids)
        nbytes.append(_token_bytes(text, starts, ends, None if lengths is None else lengths[file_ids]))
    stream = TokenStream(
        tokens=torch.from_numpy(np.concatenate(ids)) if ids else torch.zeros(0, dtype=torch.int64),
        nbytes=torch.from_numpy(np.concatenate(nbytes)) if ids else torch.zeros(0, dtype=torch.int64),
        files=tuple(str(f) for f in files),
    )
    _CACHE[key] = stream
    if len(_CACHE) > 4:
        _CACHE.popitem(last=False)
    return stream


def load_stream(
    checkpoint: str | Path,
    path: str | Path,
    seq_len: int,
    flag: str = "--data",
    vocab_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TokenStream:
    """The stream of every text file at ``path``, checked to hold at least one window of ``seq_len``."""
    stream = tokenize_files(checkpoint, text_files(path, flag), vocab_size, flag, progress)
    return checked_stream(stream, seq_len, f"{flag} {path}")


def checked_stream(stream: TokenStream, seq_len: int, what: str) -> TokenStream:
    if stream.n_windows(seq_len) < 1:
        raise ValueError(
            f"{what} has {len(stream)} tokens: fewer than one window of --seq-len {seq_len} + 1 tokens"
        )
    return stream


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n))


_PERMS: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()


def sample_windows(n_windows: int, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Window indices of the samples at global ``positions`` of the training order (a pure function)."""
    if n_windows < 1:
        raise ValueError(f"n_windows must be >= 1, got {n_windows}")
    epochs, within = positions // n_windows, positions % n_windows
    out = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        key = (n_windows, seed, epoch)
        if key not in _PERMS:
            _PERMS[key] = _permutation(n_windows, seed, epoch)
            if len(_PERMS) > 4:
                _PERMS.popitem(last=False)
        chosen = epochs == epoch
        out[chosen] = _PERMS[key][within[chosen]]
    return out


# ------------------------------------------------------------------------------------------ the shipped corpus

_WORK_NAME = re.compile(r"[a-z0-9_]+\.txt")  # a plain file name: nothing an extraction could follow elsewhere


def _shipped() -> tuple[bytes, dict[str, str]]:
    """The packaged archive's bytes and ``{work: SHA-256}`` from the list beside it (``sha256sum``'s format)."""
    assets = resources.files("attnlab") / "assets"
    sums = {}
    for line in (assets / "shakespeare.sha256").read_text().splitlines():
        digest, name = line.split()
        if not _WORK_NAME.fullmatch(name):
            raise ValueError(f"shakespeare.sha256 lists {name!r}, not a plain .txt file name")
        sums[name] = digest
    return (assets / "shakespeare.tar.xz").read_bytes(), sums


def _holds(folder: Path, sums: dict[str, str]) -> bool:
    """Whether ``folder`` holds the listed works byte for byte and nothing else (but attnlab's marker)."""
    try:
        found = {p.name: p for p in folder.iterdir() if p.name != MARKER}
    except OSError:
        return False
    return found.keys() == sums.keys() and all(
        p.is_file() and not p.is_symlink() and hashlib.sha256(p.read_bytes()).hexdigest() == sums[name]
        for name, p in found.items()
    )


def _extract(archive: bytes, sums: dict[str, str], into: Path) -> None:
    """Write the works of ``archive`` into the directory ``into``, each checked against its listed SHA-256. Only
    regular files named in the list are accepted, and this function writes them (``tarfile`` never extracts), so
    no member can be a link or a device or land outside ``into``; every listed work must be there."""
    written = set()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:xz") as tar:
        for member in tar:
            if not member.isreg() or member.name not in sums:
                raise ValueError(
                    f"the corpus archive holds {member.name!r}, which is not one of its listed works"
                )
            if member.name in written:
                raise ValueError(f"the corpus archive holds {member.name} twice")
            data = tar.extractfile(member).read()
            if hashlib.sha256(data).hexdigest() != sums[member.name]:
                raise ValueError(f"the corpus archive's {member.name} does not match its SHA-256 in the list")
            (into / member.name).write_bytes(data)
            written.add(member.name)
    if missing := sorted(sums.keys() - written):
        raise ValueError(f"the corpus archive lacks {', '.join(missing)}")


def _cache_home() -> Path:
    env = os.environ.get("XDG_CACHE_HOME", "")
    return Path(env) if os.path.isabs(env) else Path.home() / ".cache"  # XDG: a relative path is ignored


def shakespeare(dest: str | Path | None = None) -> Path:
    """The directory of the shipped corpus's ``.txt`` works, extracted from the package on first use.

    ``dest``: where to extract (default ``$XDG_CACHE_HOME/attnlab/corpus/<archive SHA-256 prefix>``, ``~/.cache``
    without that variable; a new package version with another archive gets its own directory). A directory that
    holds exactly the shipped works, every file's SHA-256 checked, is used as it is. Anything else there (a damaged
    copy) is replaced under attnlab's write rule (``attnlab.atomic``): in the default place, which is attnlab's own;
    at a ``dest`` you give, only when attnlab extracted it there before (its ``.attnlab`` marker), else
    FileExistsError. The extraction is atomic (``attnlab.atomic.atomic_dir``): a process killed half way leaves no
    partial directory, and processes extracting at the same time take turns (the second finds the first one's copy).
    """
    archive, sums = _shipped()
    if dest is None:
        folder = _cache_home() / "attnlab" / "corpus" / hashlib.sha256(archive).hexdigest()[:16]
    else:
        folder = Path(dest)
    if _holds(folder, sums):
        return folder
    with lock(
        folder, "corpus directory", wait=True
    ):  # a second caller waits for the first, then finds its copy
        if not _holds(folder, sums):
            present = folder.exists() or folder.is_symlink()
            with atomic_dir(folder, present, kind="cache", what="corpus directory", ours=dest is None) as tmp:
                _extract(archive, sums, tmp)
    return folder
