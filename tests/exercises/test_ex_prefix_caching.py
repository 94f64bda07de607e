"""Lesson 13 exercise in minillm/prefix_caching.py: which cached blocks a prompt can start from.

A case describes the cache by what its blocks hold: each entry is "block j of
these tokens, in block id b". `run` turns the entries into the real cache, keyed
by the module's own `hash_block` chain (the key format is given code, not the
exercise), and calls `prefix_match`. The answer key
(tests/exercises/key_prefix_caching.py, instructor only) never hashes: two
chained keys are equal exactly when they key the same block index of the same
token prefix, so the expected answer is a walk over plain lists. It also
carries the answers of the plausible mistakes, so that a message can name the
one a wrong output matches.

Edges, graded on every seed: a prompt that ends exactly on a block boundary
(its last block is recomputed), one exactly a block long, one shorter than a
block, a miss with cached blocks after it, the same tokens in every block (only
the chain tells the blocks apart), and block_size 16 one token past an edge.
Each situation is fixed; its token ids and block ids are drawn from the seed.
"""
from exercise_checks import Check, kind

PROMPT = list(range(100, 120))   # 20 distinct token ids
VOCAB = 50257                    # GPT-2's: the edges draw their token ids from it


def entries(tokens: list[int], block_ids: dict[int, int]) -> list[dict]:
    """A cache holding block j of `tokens` in block id block_ids[j]."""
    return [{"tokens": list(tokens), "block": j, "id": b} for j, b in block_ids.items()]


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

    def edges(self):
        def case(prompt, bs, cache):
            return {"prompt": list(prompt), "block_size": bs, "cache": cache}

        def tokens(d, n):
            return d.sample(range(VOCAB), n)   # n distinct token ids

        def ids(d, n):
            return d.sample(range(100), n)     # block ids unrelated to positions

        def on_the_edge(d):
            # the last block holds the last token: cached, yet recomputed for its logits
            p, b = tokens(d, 20), ids(d, 3)
            return case(p[:12], 4, entries(p, dict(enumerate(b))))

        def one_block(d):
            p, b = tokens(d, 10), ids(d, 2)
            return case(p[:5], 5, entries(p, dict(enumerate(b))))

        def shorter(d):
            p, b = tokens(d, 16), ids(d, 2)
            return case(p[:3], 8, entries(p, dict(enumerate(b))))

        def miss(d):
            p, b = tokens(d, 20), ids(d, 4)
            return case(p[:16], 3, entries(p, dict(zip([0, 1, 3, 4], b))))

        def same_tokens(d):
            # five blocks of the same three tokens, then one more; only its first block is cached: a key of the
            # tokens alone would match every block of it. Its block 1 is cached too, after another first block.
            a, b, c, last, *other = tokens(d, 7)
            same, first = [a, b, c] * 5 + [last], ids(d, 2)
            return case(same, 3, entries(same, {0: first[0]}) + entries(other + same, {1: first[1]}))

        def past_the_edge(d):
            # and the tokens of its block 1 cached as the first block of another prompt
            long, b = tokens(d, 50), ids(d, 4)
            return case(long[:33], 16, entries(long, dict(enumerate(b[:3]))) + entries(long[16:32], {0: b[3]}))

        return {"a prompt ending exactly on a block boundary, all of it cached": on_the_edge,
                "a prompt exactly one block long, cached": one_block, "a prompt shorter than one block": shorter,
                "a miss in the middle, cached blocks after it": miss, "the same tokens in every block": same_tokens,
                "block_size 16, one token past a block edge": past_the_edge}

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

    def expect(self, inputs):
        from key_prefix_caching import answer
        return answer(inputs)

    def judge(self, inputs, output, expected):
        want, call = expected["blocks"], expected["call"]
        got = output["blocks"]
        ok = isinstance(got, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in got)
        if not ok or got != want:
            like = [mistake for mistake, blocks in expected["mistakes"].items() if got == blocks]
            named = (f" It looks like this mistake: {like[0]}." if len(like) == 1 else
                     f" It looks like one of these mistakes: {'; or '.join(like)}." if like else "")
            raise AssertionError(f"{call} should return the block ids {want} ({expected['why']}); got "
                                 f"{got!r:.200}{'' if ok else f' ({kind(got)}, not a list of block ids)'}."
                                 f"{named} Look at {self.where}.")
        size = expected["cache_size"]
        if output["cache_after"] != expected["cache_after"] or output["cache_size"] != size:
            raise AssertionError(f"{call} changed the cache it was given (it held {size} "
                                 f"{'entry' if size == 1 else 'entries'}, "
                                 f"{output['cache_size']} after the call): matching only reads it. "
                                 f"Look at {self.where}.")
        if output["prompt_after"] != expected["prompt_after"]:
            raise AssertionError(f"{call} changed the prompt it was given: matching only reads it. "
                                 f"Look at {self.where}.")


PREFIX_MATCH = PrefixMatch()
test_prefix_match = PREFIX_MATCH.pytest_test()
