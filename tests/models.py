"""Test models that can tell a wrong answer from a right one.

GPT-2's own init (std 0.02) gives a random model that repeats the last prompt
token whatever came before it, so two decoding paths "agree" even when one of
them reads the wrong keys. A seeded init at std 0.3 gives a model whose next
token depends on the whole context (tests/test_model.py asserts it), and every
equivalence test compares paths on such a model. Timing tests and lessons keep
GPT-2's own init: time does not depend on the values.
"""
from __future__ import annotations

import random

from minillm import GPT2, PRESETS
from minillm.config import GPT2Config

CONTEXT_STD = 0.3


def context_model(config: GPT2Config = PRESETS["tiny"], seed: int = 0, std: float = CONTEXT_STD) -> GPT2:
    """A seeded random GPT-2 whose greedy tokens depend on the context they follow."""
    model = GPT2(config, seed=None).eval()
    model.init_weights(seed, std=std)
    return model


def random_prompts(n: int, lengths, vocab_size: int = PRESETS["tiny"].vocab_size, seed: int = 0) -> list[list[int]]:
    """n prompts of lengths drawn from `lengths`, with seeded random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.choice(list(lengths)))] for _ in range(n)]
