"""Models the disaggregation tests build inside their worker processes (a worker imports them by name).

`failing_model` is the context-sensitive tiny model whose last layer raises on any step of exactly
`POISON_TOKENS` tokens: the prefill worker fails mid-forward, after its earlier layers were sent.
"""
from minillm import PRESETS

from models import context_model

POISON_TOKENS = 37


def failing_model():
    model = context_model(PRESETS["tiny"])

    def poison(module, args):
        if args[0].shape[1] == POISON_TOKENS:
            raise RuntimeError(f"poisoned: a step of {POISON_TOKENS} tokens")
    model.h[-1].register_forward_pre_hook(poison)
    return model
