"""The answer key of the prefix-match exercise: which cached blocks a prompt starts from, and why.

Instructor only: `make` leaves every key_*.py out of a copy, and the check's `expect` imports it inside the
method. It never hashes. Two chained keys are equal exactly when they key the same block index of the
same token prefix. So the cache is seen as (block index, the tokens up to that block's end) → block id, and
the answer is a walk over plain lists. The answers of the plausible mistakes come from the same walk
with one rule changed, so that the judge can name a mistake when the output matches one.
"""


def cache_by_prefix(inputs) -> dict[tuple, int]:
    """The cache as the check sees it: (block index, the tokens up to the end of that block) → block id. Built in
    the entries' order, so a repeated key keeps its first place and its last id, as a dict of hashes does."""
    bs, cache = inputs["block_size"], {}
    for e in inputs["cache"]:
        cache[(e["block"], tuple(e["tokens"][:(e["block"] + 1) * bs]))] = e["id"]
    return cache


def walk(prompt: list[int], bs: int, cache: dict[tuple, int], usable: int, chained: bool = True,
         past_misses: bool = False) -> tuple[list[int], int | None]:
    """The blocks found for the first `usable` whole blocks, and the index of the first miss (None if none).
    `chained=False` looks each block up by its own tokens alone, as the first block of some prompt;
    `past_misses` goes on after a miss."""
    blocks, miss = [], None
    for i in range(usable):
        key = (i, tuple(prompt[:(i + 1) * bs])) if chained else (0, tuple(prompt[i * bs:(i + 1) * bs]))
        block = cache.get(key)
        if block is None:
            miss = i if miss is None else miss
            if past_misses:
                continue
            break
        blocks.append(block)
    return blocks, miss


def expected_blocks(inputs) -> tuple[list[int], str]:
    """The blocks to reuse, and why the walk stopped there."""
    prompt, bs, cache = inputs["prompt"], inputs["block_size"], cache_by_prefix(inputs)
    usable = (len(prompt) - 1) // bs   # whole blocks before the last token
    blocks, miss = walk(prompt, bs, cache, usable)
    if miss is not None:
        lacks = f"block {miss} after this prompt's first {miss * bs} tokens" if miss else "this prompt's first block"
        return blocks, f"the cache lacks {lacks}, so the walk ends there, whatever is cached after it"
    if usable * bs + bs <= len(prompt):
        return blocks, (f"block {usable} holds the prompt's last token, which is always computed for its logits, so "
                        f"it is never reused even when cached")
    return blocks, f"the prompt has {plural(usable, 'whole block')} before its last token"


def mistaken_blocks(inputs) -> dict[str, list[int]]:
    """What each plausible mistake returns for this case, by the message that names it."""
    prompt, bs, cache = inputs["prompt"], inputs["block_size"], cache_by_prefix(inputs)
    n, usable = len(prompt), (len(prompt) - 1) // bs
    short = max(0, -(-(n - bs - 1) // bs))   # the starts s < n - bs - 1: one block short after an edge
    return {
        "the block holding the prompt's last token was reused, so its logits would never be computed: the walk "
        "covers only the whole blocks before the last token":
            walk(prompt, bs, cache, n // bs)[0],
        "each block was looked up by its own tokens alone, not chained to the blocks before it, so the same "
        "tokens at another position, or after another prefix, matched keys and values computed for another "
        "context":
            walk(prompt, bs, cache, usable, chained=False)[0],
        "the walk went on past the first block the cache lacks: a block's keys depend on every token before it, "
        "so nothing after a miss can be reused":
            walk(prompt, bs, cache, usable, past_misses=True)[0],
        f"the walk stopped a block short: a prompt of {plural(n, 'token')} has {plural(usable, 'whole block')} "
        f"before its last token":
            walk(prompt, bs, cache, min(short, usable))[0],
    }


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
    s = "s" if len(own) > 1 else ""
    held = (f"this prompt's block{s} {', '.join(str(j) for j, _ in own)} in block id{s} "
            f"{', '.join(str(b) for _, b in own)}" if own else "none of this prompt's blocks")
    if other:
        held += f" and {plural(other, 'block')} of other token prefixes"
    return f"prefix_match(a prompt of {plural(len(prompt), 'token')}, block_size={bs}, a cache holding {held})"


def answer(inputs) -> dict:
    """The answer key of one case, as plain data: the blocks, why the walk stops there, the case in words,
    the cache the call must leave as it found it, and the answers of the named mistakes."""
    want, why = expected_blocks(inputs)
    cache = cache_by_prefix(inputs)
    return {"blocks": want, "why": why, "call": described(inputs), "cache_after": list(cache.values()),
            "cache_size": len(cache), "prompt_after": list(inputs["prompt"]),
            "mistakes": {name: blocks for name, blocks in mistaken_blocks(inputs).items() if blocks != want}}
