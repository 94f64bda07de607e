"""Lesson 10 exercise in minillm/prefix_caching.py: which cached blocks a prompt can start from.

A case describes the cache by what its blocks hold: each entry is "block j of
these tokens, in block id b". `run` turns the entries into the real cache, keyed
by the module's own `hash_block` chain (the key format is given code, not the
exercise), and calls `prefix_match`. The check never hashes: two chained keys
are equal exactly when they key the same block index of the same token prefix,
so the expected answer is a walk over plain lists.
"""
from exercise_checks import Check, kind

PROMPT = list(range(100, 120))   # 20 distinct token ids


def entries(tokens: list[int], block_ids: dict[int, int]) -> list[dict]:
    """A cache holding block j of `tokens` in block id block_ids[j]."""
    return [{"tokens": list(tokens), "block": j, "id": b} for j, b in block_ids.items()]


def cache_by_prefix(inputs) -> dict[tuple, int]:
    """The cache as the check sees it: (block index, the tokens up to the end of that block) → block id. Built in
    the entries' order, so a repeated key keeps its first place and its last id, as a dict of hashes does."""
    bs, cache = inputs["block_size"], {}
    for e in inputs["cache"]:
        cache[(e["block"], tuple(e["tokens"][:(e["block"] + 1) * bs]))] = e["id"]
    return cache


def expected_blocks(inputs) -> tuple[list[int], str]:
    """The blocks to reuse, and why the walk stopped there."""
    prompt, bs, cache = inputs["prompt"], inputs["block_size"], cache_by_prefix(inputs)
    usable = (len(prompt) - 1) // bs   # whole blocks before the last token
    blocks = []
    for i in range(usable):
        block = cache.get((i, tuple(prompt[:(i + 1) * bs])))
        if block is None:
            lacks = f"block {i} after this prompt's first {i * bs} tokens" if i else "this prompt's first block"
            return blocks, f"the cache lacks {lacks}, so the walk ends there, whatever is cached after it"
        blocks.append(block)
    if usable * bs + bs <= len(prompt):
        return blocks, (f"block {usable} holds the prompt's last token, which is always computed for its logits, so "
                        f"it is never reused even when cached")
    return blocks, f"the prompt has {plural(usable, 'whole block')} before its last token"


def plural(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def described(inputs) -> str:
    """The case in words: which of the prompt's own blocks the cache holds, and how many other entries."""
    prompt, bs = inputs["prompt"], inputs["block_size"]
    own, other = [], 0
    for (j, prefix), block in cache_by_prefix(inputs).items():
        if list(prefix) == prompt[:(j + 1) * bs]:
            own.append((j, block))
        else:
            other += 1
    own.sort()
    held = (f"this prompt's block{'s' if len(own) > 1 else ''} {', '.join(str(j) for j, _ in own)} in block id"
            f"{'s' if len(own) > 1 else ''} {', '.join(str(b) for _, b in own)}" if own else "none of this prompt's blocks")
    if other:
        held += f" and {plural(other, 'block')} of other token prefixes"
    return f"prefix_match(a prompt of {plural(len(prompt), 'token')}, block_size={bs}, a cache holding {held})"


class PrefixMatch(Check):
    exercise = "prefix-match"
    where = "minillm/prefix_caching.py, prefix_match"

    def visible(self):
        def case(prompt, bs, cache):
            return {"prompt": list(prompt), "block_size": bs, "cache": cache}

        p = PROMPT
        return {
            "nothing cached": case(p[:10], 4, []),
            "two cached blocks, the prompt goes on": case(p[:10], 4, entries(p, {0: 7, 1: 3})),
            "one token past a block edge": case(p[:9], 4, entries(p, {0: 7, 1: 3})),
            "the whole prompt cached: its last block holds the last token and is recomputed":
                case(p[:8], 4, entries(p, {0: 7, 1: 3})),
            "a miss ends the walk, even if later blocks are cached": case(p[:13], 4, entries(p, {0: 7, 2: 5})),
            "a miss in the first block": case(p[:13], 4, entries(p, {1: 3, 2: 5})),
            # p[4:8] cached as the first block of another prompt: the same tokens, another prefix, another key.
            "the same tokens after another prefix are another block":
                case(p[:13], 4, entries(p, {0: 7}) + entries(p[4:8], {0: 9})),
            "a partly filled block is never matched": case(p[:6], 4, entries(p, {0: 7})),
            "block_size 1": case(p[:3], 1, entries(p, {0: 4, 1: 0, 2: 2})),
            "a one-token prompt": case(p[:1], 1, entries(p, {0: 4})),
            "a prompt shorter than a block": case(p[:3], 4, []),
            "a cached block is found by its key, not by its position":
                case(p[:8] + [1, 2, 3, 4, 5], 4, entries(p, {0: 11, 1: 12, 2: 13})),
        }

    def situations(self):
        def prompt_and_size(d, min_blocks=1, max_blocks=5):
            bs = d.int(1, 6)
            tokens = [d.int(0, 9) for _ in range(bs * d.int(min_blocks, max_blocks) + d.int(0, bs - 1))]
            return tokens or [d.int(0, 9)], bs

        def ids(d, n):
            return d.sample(range(100), n)   # block ids unrelated to positions

        def others(d, prompt, bs, n):
            """Blocks of other prompts: each differs from this one at or before its block's end."""
            out = []
            for _ in range(n):
                tokens = [d.int(0, 9) for _ in range(bs * d.int(1, 4))]
                j = d.int(0, len(tokens) // bs - 1)
                diff = d.int(0, (j + 1) * bs - 1)
                tokens[diff] = (prompt[diff] + d.int(1, 9)) % 10 if diff < len(prompt) else tokens[diff]
                out.append({"tokens": tokens, "block": j, "id": d.int(100, 199)})
            return out

        def shuffled(d, cache):
            d.random.shuffle(cache)
            return cache

        def nothing(d):
            prompt, bs = prompt_and_size(d)
            return {"prompt": prompt, "block_size": bs, "cache": others(d, prompt, bs, d.int(0, 4))}

        def goes_on(d):
            prompt, bs = prompt_and_size(d, 2)
            m = d.int(1, (len(prompt) - 1) // bs)
            cache = entries(prompt, dict(enumerate(ids(d, m)))) + others(d, prompt, bs, d.int(0, 3))
            return {"prompt": prompt, "block_size": bs, "cache": shuffled(d, cache)}

        def whole(d):
            prompt, bs = prompt_and_size(d, 1)
            n = len(prompt) // bs
            prompt = prompt[:n * bs] if d.int(0, 1) else prompt   # often ending exactly on a block edge
            return {"prompt": prompt, "block_size": bs,
                    "cache": shuffled(d, entries(prompt, dict(enumerate(ids(d, len(prompt) // bs)))))}

        def miss(d):
            prompt, bs = prompt_and_size(d, 3)
            n = (len(prompt) - 1) // bs
            gap = d.int(0, n - 2)
            kept = {j: b for j, b in enumerate(ids(d, n)) if j != gap}
            return {"prompt": prompt, "block_size": bs, "cache": shuffled(d, entries(prompt, kept))}

        def other_prefix(d):
            prompt, bs = prompt_and_size(d, 3)
            a = d.int(1, (len(prompt) - 1) // bs - 1)
            same = prompt[a * bs:(a + 1) * bs]
            elsewhere = [(t + 1) % 10 for t in prompt[:a * bs]] + same   # block a's tokens after another prefix
            cache = (entries(prompt, dict(enumerate(ids(d, a)))) + entries(same, {0: d.int(100, 149)})
                     + entries(elsewhere, {a: d.int(150, 199)}))
            return {"prompt": prompt, "block_size": bs, "cache": shuffled(d, cache)}

        def partial(d):
            bs = d.int(2, 6)
            prompt = [d.int(0, 9) for _ in range(bs * d.int(1, 4) + d.int(1, bs - 1))]
            longer = prompt + [d.int(0, 9) for _ in range(2 * bs)]
            return {"prompt": prompt, "block_size": bs,
                    "cache": shuffled(d, entries(longer, dict(enumerate(ids(d, len(longer) // bs)))))}

        def shared_start(d):
            prompt, bs = prompt_and_size(d, 2)
            s = d.int(1, len(prompt))
            other = prompt[:s] + [(t + 1) % 10 for t in prompt[s:]] + [d.int(0, 9) for _ in range(bs)]
            return {"prompt": prompt, "block_size": bs,
                    "cache": shuffled(d, entries(other, dict(enumerate(ids(d, len(other) // bs)))))}

        def short(d):
            bs = d.int(1, 5)
            prompt = [d.int(0, 9) for _ in range(d.int(1, bs + 1))]
            longer = prompt + [d.int(0, 9) for _ in range(bs)]
            return {"prompt": prompt, "block_size": bs,
                    "cache": entries(longer, dict(enumerate(ids(d, len(longer) // bs))))}

        def on_the_edge(d):
            bs = d.int(2, 6)
            prompt = [d.int(0, 9) for _ in range(bs * d.int(2, 5))]   # ends exactly on a block boundary
            return {"prompt": prompt, "block_size": bs,
                    "cache": shuffled(d, entries(prompt, dict(enumerate(ids(d, len(prompt) // bs)))))}

        return {"a prompt ending exactly on a block boundary, all of it cached": on_the_edge,
                "nothing of the prompt cached": nothing, "cached blocks, the prompt goes on": goes_on,
                "the whole prompt cached": whole, "a miss ends the walk": miss,
                "the same tokens after another prefix": other_prefix, "a partly filled block": partial,
                "another prompt sharing the start": shared_start, "a prompt of a block or less": short}

    def run(self, inputs):
        from minillm.prefix_caching import ROOT, hash_block
        from minillm.prefix_caching import prefix_match
        bs = inputs["block_size"]
        cached = {}
        for e in inputs["cache"]:
            key = ROOT
            for j in range(e["block"] + 1):
                key = hash_block(key, e["tokens"][j * bs:(j + 1) * bs])
            cached[key] = e["id"]
        keys, prompt = list(cached), list(inputs["prompt"])
        blocks = prefix_match(prompt, bs, cached)
        return {"blocks": blocks, "cache_after": [cached.get(k) for k in keys], "cache_size": len(cached),
                "prompt_after": prompt}

    def verify(self, inputs, output):
        want, why = expected_blocks(inputs)
        call = described(inputs)
        got = output["blocks"]
        ok = isinstance(got, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in got)
        if not ok or got != want:
            raise AssertionError(f"{call} should return the block ids {want} ({why}); got "
                                 f"{got!r:.200}{'' if ok else f' ({kind(got)}, not a list of block ids)'}. "
                                 f"Look at {self.where}.")
        cache = cache_by_prefix(inputs)
        if output["cache_after"] != list(cache.values()) or output["cache_size"] != len(cache):
            raise AssertionError(f"{call} changed the cache it was given (it held {len(cache)} "
                                 f"{'entry' if len(cache) == 1 else 'entries'}, "
                                 f"{output['cache_size']} after the call): matching only reads it. "
                                 f"Look at {self.where}.")
        if output["prompt_after"] != inputs["prompt"]:
            raise AssertionError(f"{call} changed the prompt it was given: matching only reads it. "
                                 f"Look at {self.where}.")


PREFIX_MATCH = PrefixMatch()
test_prefix_match = PREFIX_MATCH.pytest_test()
