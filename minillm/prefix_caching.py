"""Prefix caching: requests that start alike share the KV blocks of their common start.

The waste it removes. Real traffic repeats itself (a system prompt in every
chat request, the history resent every turn, few-shot headers), and without a
cache each request computes the same keys and values again. Prefill work grows
with the tokens computed (lesson 02), so a request of P prompt tokens whose
first S are in the pool pays only for the rest:

    tokens prefilled on a hit   P − S                (they still attend over all P)
    TTFT of a hit               ≈ t(prefill of the uncached suffix)
    KV blocks of n requests     ⌊S/bs⌋ shared + n · (their own blocks after S)

Decode is untouched. This file follows vLLM's automatic prefix caching:

*Whole blocks only.* A full block never changes again; the last, partly filled
block is still being written, and sharing it would let two sequences write the
same slots. The block is already the unit the pool hands out and counts
references to, so a hit is one more reference. The price: a common prefix of S
tokens shares only ⌊S/bs⌋ · bs of them.

*A hash chain, not the block's tokens alone.* A block's keys and values depend
on every token before it, so the same 16 tokens after another prefix make
different keys. Hence hash(block i) = H(hash(block i − 1), tokens of block i),
H = SHA-256, and equal keys mean equal *whole prefixes*. Matching walks a prompt
block by block and stops at the first miss. SHA-256 rather than Python's 64-bit
`hash`: a collision would hand one request another's keys (wrong text, and
across users a leak), which is why vLLM moved to SHA-256.

*The last prompt token is always computed,* for its logits: matching looks only
at the first P − 1 tokens (as vLLM does), so a fully cached prompt recomputes
its last block into a fresh block of its own. Prefill thus always starts on a
block boundary, in a block no one else holds, and no shared block is written.

*When a block is cached.* A block is hashed as soon as a step is planned to
fill it: the forward pass writes every new token's K/V before any layer's
attention reads (`paged_attention.py`), so a request admitted in the same step
already shares it. Of two sequences computing the same block side by side, the
one registered second keeps no hash: one block per key.

*A hash is a promise, kept only by a step that returns.* Until the engine
`commit()`s the step its hashes are on probation: if it raises, `rollback` takes
them back, so a block whose K/V were never written is never served, and the
sequences that shared one in the failed step are handed back to be recomputed.

*Eviction, and why its order decides the hit rate.* A block whose last
reference goes keeps its contents and hash on an *evictable* list, least
recently used first. Allocation takes truly free blocks first and evicts only
when none is left; an evicted block loses its hash at once. LRU keeps what is
in use (a hot system prompt stays), and a finished request frees its blocks
tail first: a chain is reachable only through its head, so evicting a parent
before its children would strand them. (SGLang's RadixAttention does the same
at token granularity, a radix tree evicted leaf first: up to bs − 1 more tokens
shared per match, for a tree kept in step with the memory.)

What it costs: a SHA-256 per block filled or matched, a dictionary lookup per
block at admission, an ordered dict of evictable blocks; nothing per token.

Invariants held by the tests: greedy tokens and their logits are identical with
caching on and off; after every step each block is exactly one of free (no
hash), evictable (no reference, a hash) or referenced (as often as the tables
hold it); hashes and blocks map one to one; a hashed block a sequence holds
holds that sequence's computed tokens; when every request has finished, every
block is free or evictable.
"""
from __future__ import annotations

import hashlib
from array import array
from itertools import takewhile
from typing import Protocol

from .block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from .cached_blocks import CachingAllocator

ROOT = b""  # the parent hash of a sequence's first block


class HoldsTokens(Protocol):
    """What prefix caching needs to know of a sequence: the block manager's view, and its tokens."""
    seq_id: int
    num_computed_tokens: int
    token_ids: list[int]
    prompt_token_ids: tuple[int, ...]
    num_cached_tokens: int | None  # None until its first admission


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block: its own tokens, chained through `parent` to every token before them."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def prefix_match(token_ids: list[int], block_size: int, cached: dict[bytes, int]) -> list[int]:
    """The cached blocks that hold the longest whole-block prefix of `token_ids`, short of its last token.

    `cached` maps a block's chained hash (`hash_block`, starting from ROOT) to the block that holds it.
    Returns the blocks in order; reusing them, a sequence starts computing at len(result) · block_size.
    Reads `token_ids` and `cached`, and changes neither.
    """
    # >>> exercise prefix-match (lesson 13, 2 pts): find the cached blocks that start a prompt
    # hint: walk whole blocks from the start, each one's key chained to the key before it; the walk ends at the first key the cache lacks, and never reaches the block that holds the last token, which must be computed for its logits
    blocks, parent = [], ROOT
    for start in range(0, len(token_ids) - block_size, block_size):  # whole blocks within token_ids[:-1]
        parent = hash_block(parent, token_ids[start:start + block_size])
        if parent not in cached:
            break
        blocks.append(cached[parent])
    return blocks
    # <<< exercise


class PrefixCachingBlockManager(BlockManager):
    """Block tables whose full blocks are cached by their hash chain and shared by whoever starts alike.

    `match_prefix(seq)` walks the hash chain of a sequence about to be admitted, once, keeps the blocks it
    found and tells the scheduler how many tokens they hold; the scheduler starts the sequence there, and
    `append_slots` hands it those blocks before any new one.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__(num_blocks, block_size)
        self.allocator = CachingAllocator(num_blocks)
        self.chains: dict[int, list[bytes]] = {}  # seq_id → the hashes of its full blocks so far, in order
        self.uncommitted: set[int] = set()  # blocks hashed since the last commit(): their KV not yet written
        self.admitted: dict[int, int] = {}  # seq_id → cached tokens, of first admissions since the last commit()
        self.matched: dict[int, list[tuple[int, bytes]]] = {}  # seq_id → (block, hash) match_prefix found
        self.num_prompt_tokens = 0         # of every request admitted so far
        self.num_cached_prompt_tokens = 0  # of those, found cached at its first admission

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached ÷ prompt tokens of every request admitted so far."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def match_prefix(self, seq: HoldsTokens) -> int:
        """Leading tokens of a sequence about to be admitted whose KV the pool holds (whole blocks, never its
        last token); the blocks that hold them are kept for its admission."""
        blocks = prefix_match(seq.token_ids, self.block_size, self.allocator.cached)
        self.matched[seq.seq_id] = [(block, self.allocator.block_hash[block]) for block in blocks]
        return len(blocks) * self.block_size

    def _hits(self, seq: HoldsTokens) -> list[int]:
        """The cached blocks that a sequence admitted at num_computed_tokens > 0 starts from: those that
        `match_prefix` found, each still cached (no hash is recomputed)."""
        matched = self.matched.get(seq.seq_id, [])[:seq.num_computed_tokens // self.block_size]
        blocks = [block for block, _ in takewhile(lambda m: self.allocator.block_hash.get(m[0]) == m[1], matched)]
        want, rest = divmod(seq.num_computed_tokens, self.block_size)
        if rest or len(blocks) < want:
            raise RuntimeError(f"sequence {seq.seq_id} is admitted at {seq.num_computed_tokens} cached tokens, but "
                               f"the pool holds {len(blocks) * self.block_size} of them; ask match_prefix "
                               "right before admitting it")
        return blocks

    def blocks_needed(self, seq: HoldsTokens, num_new: int) -> int:
        """Blocks `append_slots(seq, num_new)` takes from the free count: new ones, and, at admission, the
        cached blocks it shares that were evictable."""
        if seq.seq_id in self.block_tables or not seq.num_computed_tokens:
            return super().blocks_needed(seq, num_new)
        hits = self._hits(seq)
        idle = sum(self.allocator.ref_counts[block] == 0 for block in hits)
        return self.blocks_for(seq.num_computed_tokens + num_new) - len(hits) + idle

    def append_slots(self, seq: HoldsTokens, num_new: int) -> None:
        """Room for `num_new` more tokens after the computed ones; a sequence admitted after a cache hit first
        shares its cached blocks. Blocks these tokens fill are cached by their hash. A request's first
        admission counts its prompt tokens, and those it found cached, in the hit rate."""
        first_admission = seq.seq_id not in self.block_tables and seq.num_cached_tokens is None
        if seq.seq_id not in self.block_tables and seq.num_computed_tokens:
            needed = self.blocks_needed(seq, num_new)
            if needed > self.num_free_blocks:
                raise RuntimeError(f"sequence {seq.seq_id} needs {needed} blocks but {self.num_free_blocks} are "
                                   "free; check can_append first")
            hits = self._hits(seq)
            for block in hits:
                self.allocator.share(block)
            self.block_tables[seq.seq_id] = hits
            self.chains[seq.seq_id] = [self.allocator.block_hash[block] for block in hits]
        self.matched.pop(seq.seq_id, None)
        super().append_slots(seq, num_new)
        self._cache_full_blocks(seq, seq.num_computed_tokens + num_new)
        if first_admission:
            self.num_prompt_tokens += len(seq.prompt_token_ids)
            self.num_cached_prompt_tokens += seq.num_computed_tokens
            self.admitted[seq.seq_id] = seq.num_computed_tokens

    def _cache_full_blocks(self, seq: HoldsTokens, num_tokens: int) -> None:
        """Hash every block that the first `num_tokens` tokens fill and that is not hashed yet."""
        chain = self.chains.setdefault(seq.seq_id, [])
        full = num_tokens // self.block_size
        if full <= len(chain):  # the common case, a decode inside a block: nothing to hash
            return
        tokens, table, bs = seq.token_ids, self.block_tables[seq.seq_id], self.block_size
        for i in range(len(chain), full):
            chain.append(hash_block(chain[-1] if chain else ROOT, tokens[i * bs:(i + 1) * bs]))
            if self.allocator.cache(table[i], chain[-1]):
                self.uncommitted.add(table[i])

    def commit(self) -> None:
        """The step planned since the last commit wrote its keys and values: the blocks it hashed stay hashed."""
        self.uncommitted.clear()
        self.admitted.clear()

    def rollback(self, seqs: list[HoldsTokens]) -> list[HoldsTokens]:
        """The step planned since the last commit failed: take back every hash it gave, and cut each of
        `seqs`' chains back to its computed tokens. Returns those of `seqs` whose computed tokens lie partly in
        a block just unhashed (they shared it in the failed step): they must be recomputed."""
        bs, undone, uncopied = self.block_size, self.uncommitted, super().rollback(seqs)
        for block in undone:
            self.allocator.uncache(block)
        lost = [seq for seq in seqs if seq in uncopied
                or not undone.isdisjoint(self.block_tables.get(seq.seq_id, ())[:seq.num_computed_tokens // bs])]
        for seq in seqs:
            del self.chains.get(seq.seq_id, [])[seq.num_computed_tokens // bs:]
        self.uncommitted = set()
        return lost

    def forget_admission(self, seq: HoldsTokens) -> bool:
        """A sequence first admitted by a failed step goes back to wait: take its admission out of the hit rate,
        to be counted when it is admitted again. Returns whether there was one to take out."""
        cached = self.admitted.pop(seq.seq_id, None)
        if cached is None:
            return False
        self.num_prompt_tokens -= len(seq.prompt_token_ids)
        self.num_cached_prompt_tokens -= cached
        return True

    def fork(self, parent: HoldsTokens, child: HoldsTokens) -> None:
        """The child shares the parent's blocks, and so its hash chain."""
        super().fork(parent, child)
        self.chains[child.seq_id] = list(self.chains.get(parent.seq_id, []))

    def free(self, seq: HoldsTokens) -> None:
        """Release a sequence's blocks tail first, so that its last blocks are evicted before its first."""
        self.chains.pop(seq.seq_id, None)
        self.matched.pop(seq.seq_id, None)
        for block in reversed(self.block_tables.pop(seq.seq_id, ())):
            self.allocator.free(block)

    def check_invariants(self, seqs: list[HoldsTokens] | None = None) -> None:
        """The base checks, and, given the sequences that hold KV: each hashed block they hold is full of their
        computed tokens, under the hash of exactly those tokens and all before them."""
        super().check_invariants(seqs)
        if seqs is None:
            return
        assert set(self.chains) <= {s.seq_id for s in seqs}, "a hash chain outlived its sequence"
        bs = self.block_size
        for seq in seqs:
            parent, tokens, chain = ROOT, seq.token_ids, []
            for i, block in enumerate(self.block_tables.get(seq.seq_id, ())):
                if (i + 1) * bs > seq.num_computed_tokens:
                    assert block not in self.allocator.block_hash, \
                        f"sequence {seq.seq_id}'s block {block} is hashed but not full of computed tokens"
                    continue
                parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
                chain.append(parent)
                held = self.allocator.block_hash.get(block)
                assert held in (None, parent), f"sequence {seq.seq_id}'s block {block} carries another prefix's hash"
            assert self.chains.get(seq.seq_id, []) == chain, \
                f"sequence {seq.seq_id}'s hash chain does not match its computed tokens"
