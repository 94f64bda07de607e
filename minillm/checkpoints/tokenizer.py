"""Text ↔ token ids: GPT-2's byte-level BPE, or an offline byte fallback.

What GPT-2's tokenizer does
---------------------------
Byte-level BPE starts from the 256 byte values, so any text encodes with no
unknown token, and then applies ~50,000 learned merges of frequent byte pairs,
so common words become one id (" the" → 262). English averages ~4 characters
per token. The vocabulary and merges live in the checkpoint's `tokenizer.json`,
which the `tokenizers` library (Rust, the same one transformers uses) runs.

The fallback
------------
With no `tokenizer.json` (offline, or the `tiny`/`mini` shapes that never had
one) `ByteTokenizer` maps each UTF-8 byte to its own id 0..255: about 4× more
tokens than BPE for English, and meaningless to the real GPT-2 weights, whose
ids 0..255 are not bytes. It exists so every lesson runs offline; a model
with random weights produces noise either way.

The two agree where they can: the text `<|endoftext|>` is the end-of-text
token in both (as in GPT-2's own tokenizer, so a prompt can start a new
document), and an id with no text (outside the vocabulary, or not a byte for
the fallback) decodes as `<|id|>`, so nothing is silently lost. Text that is
not valid Unicode (a byte that is not UTF-8 in a command line) is an error
that says where.

Invariant held by the tests: decode(encode(text)) == text, for the BPE
tokenizer and for the fallback.
"""
from __future__ import annotations

from pathlib import Path

from ..config import HF_CHECKPOINTS, PRESETS, GPT2Config
from .hf_format import CONFIG_FILE, TOKENIZER_FILE, read_config
from .load import is_complete, locate, warn_absent, warn_once
EOS_TEXT = "<|endoftext|>"


def check_text(text: str) -> str:
    """`text`, or a ValueError if it cannot become UTF-8 (a lone surrogate: how Python keeps a
    command-line byte that is not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid UTF-8 at character {e.start} ({text[e.start]!r}); "
                         "pass text in UTF-8 (check the terminal's encoding)") from None
    return text


def decode_in_runs(ids, decodable, decode, name=lambda i: f"<|{i}|>") -> str:
    """Decode each run of ids that `decodable` accepts with `decode`; any other id becomes `name(id)`."""
    out, run = [], []
    for i in ids:
        if decodable(i):
            run.append(i)
            continue
        out += [decode(run), name(i)]
        run = []
    return "".join(out) + decode(run)


class BPETokenizer:
    """GPT-2's byte-level BPE from a `tokenizer.json`."""

    is_fallback = False

    def __init__(self, path: str | Path, eos_token_id: int | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a plain Exception for malformed files
            raise ValueError(f"{self.path} is not a valid tokenizer.json ({e}); delete it and re-download "
                             "with `python weights_download.py <name>`") from e
        found = self._tok.token_to_id(EOS_TEXT)
        self.eos_token_id = found if found is not None else eos_token_id
        self.name = f"byte-level BPE ({self.path})"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(check_text(text)).ids

    def decode(self, ids: list[int]) -> str:
        return decode_in_runs(ids, lambda i: 0 <= i < self.vocab_size,
                              lambda run: self._tok.decode(run, skip_special_tokens=False))


class ByteTokenizer:
    """The offline fallback: one id per UTF-8 byte; `eos_token_id` from the model's config."""

    is_fallback = True

    def __init__(self, eos_token_id: int | None, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"the byte fallback needs a vocabulary of at least 256 ids, the model has "
                             f"vocab_size={vocab_size}; give the model a tokenizer.json instead")
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.name = f"byte fallback (UTF-8 bytes as ids 0..255, eos={eos_token_id})"

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes; each `<|endoftext|>` is the end-of-text id, as GPT-2's own tokenizer reads it."""
        if self.eos_token_id is None:
            return list(check_text(text).encode("utf-8"))
        ids = []
        for i, part in enumerate(check_text(text).split(EOS_TEXT)):
            ids += ([self.eos_token_id] if i else []) + list(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        return decode_in_runs(ids, lambda i: 0 <= i < 256, lambda run: bytes(run).decode("utf-8", errors="replace"),
                              lambda i: EOS_TEXT if i == self.eos_token_id else f"<|{i}|>")


def _config(folder: Path) -> GPT2Config:
    if (folder / CONFIG_FILE).is_file():
        return read_config(folder)
    raise ValueError(f"{folder} has no {CONFIG_FILE}, so the fallback tokenizer cannot know the "
                     "vocabulary size or end-of-text id; point at a checkpoint folder")


def load_tokenizer(name_or_path: str | Path, weights_dir: str | Path | None = None):
    """The tokenizer for a preset (looked up in `<weights_dir>/<name>/`) or a checkpoint folder.

    Returns a BPETokenizer when `tokenizer.json` is there, else a ByteTokenizer
    (with one warning line per folder). Both offer encode, decode, eos_token_id,
    is_fallback and name. A preset whose folder is not a complete checkpoint is
    treated as absent, as load_model treats it, and shares its warning line.
    """
    folder, preset = locate(name_or_path, weights_dir)
    if preset is not None and not is_complete(folder):  # the model is a random init of the preset's shape
        warn_absent(preset, folder)
        config = PRESETS[preset]
        if (folder / TOKENIZER_FILE).is_file():  # a verified file of the download that stopped later
            return BPETokenizer(folder / TOKENIZER_FILE, config.eos_token_id)
        return ByteTokenizer(config.eos_token_id, config.vocab_size)
    config = _config(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return BPETokenizer(folder / TOKENIZER_FILE, config.eos_token_id)
    if preset is None or preset in HF_CHECKPOINTS:  # tiny and mini never had a tokenizer.json to miss
        warn_once(folder, f"no {TOKENIZER_FILE} in {folder}; using the byte fallback tokenizer "
                          "(UTF-8 bytes as ids; not GPT-2's vocabulary)")
    return ByteTokenizer(config.eos_token_id, config.vocab_size)


__all__ = ["BPETokenizer", "ByteTokenizer", "load_tokenizer", "TOKENIZER_FILE"]
