"""Parallel sampling: the n samples of one prompt share its KV blocks, copied only on write.

The waste it removes. A request for n samples of one prompt (`SamplingParams.n`,
OpenAI's `n`) could run as n requests: n prefills of the same prompt, and n
copies of the same keys and values in the pool. Instead the prompt is prefilled
once, by sample 0; when it samples its first token, the other samples draw
theirs from the same logits and *fork* from it (`Scheduler.fork`, which asks
`BlockManager.fork`; only the scheduler moves a sequence between queues): each holds
the very same blocks, one more reference apiece, and nothing is copied. This is
the second use of the reference counts that prefix caching (lesson 13) counts
with, and it comes from the PagedAttention paper itself (Kwon et al.), which
reports 6.1–9.8% of KV memory saved for parallel sampling and 37.6–55.2% for
beam search, whose beams share far more.

Copy-on-write. A full block never changes again, so n tables may hold it for
ever. The prompt's last block, partly filled, is where every sample writes its
next token: the first sample to write there gets a block of its own first, a
copy of the shared one (`append_slots` queues (source, copy); the engine copies
the block's K and V in the pool, `PagedKVCache.copy_blocks`, before the forward
pass writes), and the last sample left holding it writes in place. For a prompt
of P tokens, block size bs, n samples of up to T tokens each:

    prefill tokens          P                        instead of n · P
    blocks at the end       ⌊P/bs⌋ + n · (⌈(P+T−1)/bs⌉ − ⌊P/bs⌋)
                            instead of n · ⌈(P+T−1)/bs⌉: (n − 1) · ⌊P/bs⌋ saved
    copies of a block       n − 1 if P mod bs ≠ 0, else 0 (a new block each)

The decode steps are not shared: n samples are n rows of every decode step.

Log-probabilities. Each sample has its own (`CompletionOutput.logprobs`): its
own list from the start, never shared with a sibling, drawn from the very row
of logits its token was (its first token's row is sample 0's, repeated). The
prompt's are the request's: sample 0 scores the prompt once, and only sample 0
asks to (`sample_params`), so a preempted sibling recomputes no prompt rows.

Seeds. Sample j of a request seeded s draws from its own stream seeded s + j, as
vLLM's samples do: so sample j is exactly what the same request with n = 1 and
seed s + j returns, and the n samples differ. Unseeded samples draw from the
global stream. Greedy samples are n copies of one text (as OpenAI's are).

Preemption and abort. After the fork each sample is a sequence of its own in
the running queue, right after sample 0, and the scheduler preempts it alone,
as vLLM's V1 engine preempts the child requests of an n > 1 request: a victim
frees its references and is recomputed from its prompt and output, sharing
only what prefix caching finds. (vLLM's V0 swapped whole groups out instead,
since recompute would have broken their sharing; freeing the newest sample
frees less, but never stalls a group.) A sample that finds no free place in the
batch at the fork (`max_num_seqs`) waits at the front of the queue with its
first token, as a preempted one does. Aborting the request finishes all its
samples and frees every block they hold; a sample that ends frees its own, and
so does one aborted alone once they have forked (`abort_request(id, index)`:
the server's way to stop a sample whose text a stop string ended).

Invariants held by the tests: each sample equals its seed run alone, with
prefix caching, chunked prefill, preemption, and steps that fail; a block
that several tables hold holds the same computed tokens in each, so no step
writes a block another sequence reads (`check_shared_blocks`); when every
request has finished, every block is free.
"""
from __future__ import annotations

from dataclasses import replace

from .block_manager import BlockManager
from .sampling_params import SamplingParams
from .sequence import CompletionOutput, RequestOutput, Sequence, SequenceStatus


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of a request's n samples: one sample each, sample j seeded seed + j (n = 1: the
    request's own params, unchanged)."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, best_of=None, seed=None if params.seed is None else params.seed + j,
                    prompt_logprobs=params.prompt_logprobs if j == 0 else None)  # sample 0 scores the prompt
            for j in range(params.n)]


def group_blocks(num_prompt: int, max_total: int, n: int, block_size: int) -> int:
    """Blocks that n samples of a prompt hold at most, sharing its full blocks: ⌊P/bs⌋ + n · (own blocks)."""
    shared = num_prompt // block_size
    return shared + n * (-(-max_total // block_size) - shared)


def fan_out(logits, samplers: list[Sequence]):
    """The step's rows of logits (a tensor) and whose they are, one row per token to draw: a sample 0 whose prompt
    is done draws for every sample of its request, its row repeated, each sample from its own stream."""
    rows, seqs = [], []
    for i, seq in enumerate(samplers):
        group = [seq, *seq.samples] if seq.samples and not seq.output_token_ids else [seq]
        rows += [i] * len(group)
        seqs += group
    return (logits[rows] if len(seqs) > len(samplers) else logits), seqs


def abort_samples(leader: Sequence, scheduler, reason: str, now: float, index: int | None = None) -> bool:
    """Finish every sample of a request not yet finished (or only sample `index`, once the samples have forked),
    freeing its blocks; False if none was left to finish."""
    samples = [leader, *leader.samples]
    if index is not None and not 0 <= index < len(samples):
        raise ValueError(f"index={index!r}: request {leader.request_id} has samples 0 to {len(samples) - 1}")
    if index is not None and not leader.output_token_ids:  # unforked: sample 0 computes the prompt for all
        return False
    left = [seq for seq in samples if not seq.is_finished and index in (None, seq.index)]
    for seq in left:
        scheduler.remove(seq)
        seq.finish(reason, now)
    return bool(left)


def is_unstarted(seq: Sequence) -> bool:
    """A sample that waits for sample 0 to finish the prompt: it has drawn no token and is in no queue."""
    return seq.index > 0 and not seq.output_token_ids and seq.status is SequenceStatus.WAITING


def group_output(leader: Sequence) -> RequestOutput:
    """The caller's copy of a request's state, its samples by index."""
    samples = [leader, *leader.samples]
    finished = all(s.is_finished for s in samples)
    metrics = leader.metrics.copy()
    metrics.finished_time = max(s.metrics.finished_time for s in samples) if finished else None
    outputs = [CompletionOutput(s.index, list(s.output_token_ids), s.finish_reason,
                                None if s.output_logprobs is None else list(s.output_logprobs))  # frozen items
               for s in samples]
    prompt_logprobs = None if leader.prompt_logprobs is None else list(leader.prompt_logprobs)
    return RequestOutput(leader.request_id, leader.prompt_token_ids, outputs, finished, metrics,
                         sum(s.num_preemptions for s in samples), leader.num_cached_tokens, prompt_logprobs)


def check_shared_blocks(blocks: BlockManager, seqs: list[Sequence]) -> None:
    """A block that several tables hold holds the same computed tokens in each: no sequence wrote into a block
    that another one reads (copy-on-write made it a copy first)."""
    seen: dict[int, tuple[int, list[int]]] = {}  # block → (first holder, its computed tokens in it)
    bs = blocks.block_size
    for seq in seqs:
        tokens = seq.token_ids[:seq.num_computed_tokens]
        for i, block in enumerate(blocks.block_tables.get(seq.seq_id, ())):
            mine = tokens[i * bs:(i + 1) * bs]
            first = seen.setdefault(block, (seq.seq_id, mine))
            assert first[1] == mine, (f"block {block} is shared by sequences {first[0]} and {seq.seq_id}, which "
                                      f"hold different tokens in it: {first[1]} and {mine}")
