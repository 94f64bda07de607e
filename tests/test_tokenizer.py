"""tokenizer.py: a real byte-level BPE built here with the `tokenizers` library, and the offline fallback."""
from __future__ import annotations

import json

import pytest
from tokenizers import ByteLevelBPETokenizer

from minillm import PRESETS
from minillm.checkpoints.tokenizer import ByteTokenizer, load_tokenizer
from minillm.checkpoints.load import config_to_hf

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "The KV cache stores the keys and the values of every token.",
    "Prefill is compute-bound; decode is memory-bound.",
    "the the the quick quick cache cache token token",
]
ROUND_TRIP = [
    "The quick brown fox",
    "  two leading spaces, a tab\tand\na newline",
    "unseen words: zygote, Ωmega, naïve café, 東京, 🙂",
    "",
]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A checkpoint-like folder holding a GPT-2-style byte-level BPE trained on CORPUS."""
    folder = tmp_path_factory.mktemp("ckpt") / "gpt2"
    folder.mkdir()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps(config_to_hf(PRESETS["tiny"])))
    return folder


def test_bpe_round_trips(bpe_folder):
    tok = load_tokenizer(bpe_folder)
    assert not tok.is_fallback and "BPE" in tok.name
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_bpe_merges_frequent_text_into_fewer_tokens(bpe_folder):
    tok = load_tokenizer(bpe_folder)
    text = "The KV cache stores the keys"
    assert len(tok.encode(text)) < len(text.encode("utf-8")) // 2


def test_bpe_eos_is_the_end_of_text_token(bpe_folder):
    tok = load_tokenizer(bpe_folder)
    assert tok.eos_token_id == tok._tok.token_to_id("<|endoftext|>") == 0  # first special token
    assert tok.decode(tok.encode("end") + [tok.eos_token_id]) == "end<|endoftext|>"


def test_preset_name_finds_the_tokenizer_in_weights_dir(bpe_folder):
    tok = load_tokenizer("gpt2", weights_dir=bpe_folder.parent)
    assert not tok.is_fallback and tok.decode(tok.encode("cache")) == "cache"


def test_fallback_round_trips_bytes(tmp_path):
    tok = load_tokenizer("tiny", weights_dir=tmp_path)
    assert tok.is_fallback and tok.eos_token_id == PRESETS["tiny"].eos_token_id == 256
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("é") == [0xC3, 0xA9]


def test_fallback_shows_ids_that_are_not_bytes():
    tok = ByteTokenizer(eos_token_id=256, vocab_size=512)
    assert tok.decode([104, 105, 256, 300, 0xC3]) == "hi<|endoftext|><|300|>\ufffd"


def test_fallback_warns_once_for_a_real_checkpoint(tmp_path, monkeypatch, capsys):
    a = load_tokenizer("gpt2", weights_dir=tmp_path)
    b = load_tokenizer("gpt2", weights_dir=tmp_path)
    err = capsys.readouterr().err
    assert err.count("byte fallback") == 1 and a.is_fallback and b.eos_token_id == 50256


def test_fallback_needs_a_vocabulary_that_holds_the_bytes():
    with pytest.raises(ValueError, match="vocab_size=100"):
        ByteTokenizer(eos_token_id=None, vocab_size=100)


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS["tiny"])))
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_folder_without_config_or_tokenizer_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_tokenizer(tmp_path)


def test_end_of_text_is_one_token_in_both_tokenizers(bpe_folder, tmp_path):
    """`<|endoftext|>` in a prompt is the end-of-text control token, for BPE and the fallback alike."""
    for tok in (load_tokenizer(bpe_folder), load_tokenizer("tiny", weights_dir=tmp_path)):
        ids = tok.encode("a<|endoftext|>b")
        assert ids.count(tok.eos_token_id) == 1, tok.name
        assert tok.decode(ids) == "a<|endoftext|>b"
        assert tok.encode("<|endoftext|>") == [tok.eos_token_id]


def test_ids_outside_the_vocabulary_are_shown_not_dropped(bpe_folder):
    tok = load_tokenizer(bpe_folder)
    a, b = tok.encode("cache"), tok.encode("token")
    assert tok.decode(a + [tok.vocab_size + 7] + b) == f"cache<|{tok.vocab_size + 7}|>token"
    assert tok.decode([-1]) == "<|-1|>"


def test_text_that_is_not_utf8_is_a_clear_error(bpe_folder, tmp_path):
    bad = b"caf\xe9".decode("utf-8", errors="surrogateescape")  # how Python hands over a Latin-1 argv
    for tok in (load_tokenizer(bpe_folder), load_tokenizer("tiny", weights_dir=tmp_path)):
        with pytest.raises(ValueError, match="not valid UTF-8 at character 3"):
            tok.encode(bad)
