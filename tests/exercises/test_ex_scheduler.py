"""Exercises in the scheduler: preemption (lesson 05, minillm/scheduler.py) and the decode-first budget fill
(lesson 06, minillm/chunked_prefill.py).

No model and no real cache: the scheduler gets a fake block space that only
counts tokens, and the queues are set up by hand. A plan is written as
(request, tokens, kind) in the order the scheduler put it in the batch.
"""
import pytest

from minillm.chunked_prefill import ChunkedPrefillScheduler
from minillm.sampling import SamplingParams
from minillm.scheduler import ScheduledChunk, SchedulerConfig, SchedulerOutput
from minillm.sequence import RequestMetrics, Sequence, SequenceStatus

FILL = "minillm/chunked_prefill.py, ChunkedPrefillScheduler._plan"
PREEMPT = "minillm/scheduler.py, Scheduler._reserve"


class TokenCountingBlocks:
    """Stands in for the paged cache: room for `capacity` tokens in all, counted per sequence."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[int, int] = {}

    def num_cached_tokens(self, seq: Sequence) -> int:
        return 0  # no prefix cache

    def can_append(self, seq: Sequence, num_new: int) -> bool:
        return sum(self.held.values()) + num_new <= self.capacity

    def append_slots(self, seq: Sequence, num_new: int) -> None:
        assert self.can_append(seq, num_new), (f"append_slots({seq.request_id}, {num_new}) without room: "
                                               "check can_append first")
        self.held[seq.seq_id] = self.held.get(seq.seq_id, 0) + num_new

    def free(self, seq: Sequence) -> None:
        self.held.pop(seq.seq_id, None)


def prompt(name: str, length: int) -> Sequence:
    return Sequence(name, list(range(length)), SamplingParams(temperature=0.0, max_tokens=32),
                    RequestMetrics(arrival_time=0.0))


def decoding(name: str, prompt_len: int = 5) -> Sequence:
    """A running sequence whose prompt is in the cache and whose last sampled token waits to be fed."""
    seq = prompt(name, prompt_len)
    seq.output_token_ids = [1]
    seq.num_computed_tokens = prompt_len
    return seq


def partly_prefilled(name: str, prompt_len: int, computed: int) -> Sequence:
    seq = prompt(name, prompt_len)
    seq.num_computed_tokens = computed
    return seq


def scheduler(budget: int, running=(), waiting=(), max_num_seqs: int | None = None,
              capacity: int = 10_000) -> ChunkedPrefillScheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs or budget,
                             enable_chunked_prefill=True)
    sched = ChunkedPrefillScheduler(config, TokenCountingBlocks(capacity))
    for seq in running:   # in arrival order, already holding their computed tokens' KV
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        sched.blocks.held[seq.seq_id] = seq.num_computed_tokens
    for seq in waiting:
        sched.add(seq)
    return sched


def plan(out: SchedulerOutput) -> list[tuple[str, int, str]]:
    return [(c.seq.request_id, c.num_tokens, "decode" if c.is_decode else "prefill") for c in out.chunks]


def check_plan(sched: ChunkedPrefillScheduler, want: list[tuple[str, int, str]], situation: str) -> SchedulerOutput:
    out = sched.schedule()
    got = plan(out)
    budget = sched.config.max_num_batched_tokens
    assert got == want, (f"{situation}, budget {budget}:\n  expected the plan {want}\n  got          {got}\n"
                         f"Look at {FILL}.")
    return out


# ------------------------------------------------------------------ budget fill

@pytest.mark.exercise("scheduler-budget-fill")
def test_a_7_token_prompt_with_budget_3_runs_as_chunks_of_3_3_and_1():
    seq = prompt("p", 7)
    sched = scheduler(budget=3, waiting=[seq])
    chunks = []
    for _ in range(5):
        out = sched.schedule()
        chunks.append([c.num_tokens for c in out.chunks])
        for c in out.chunks:          # what the engine does after the forward pass
            c.seq.num_computed_tokens += c.num_tokens
        if seq.num_computed_tokens == 7:
            break
    assert chunks == [[3], [3], [1]], (f"a 7-token prompt alone, budget 3: expected chunks [[3], [3], [1]] over "
                                       f"three steps, got {chunks}. Look at {FILL}.")


@pytest.mark.exercise("scheduler-budget-fill")
def test_running_decodes_go_first_and_a_new_prompt_fills_the_rest():
    sched = scheduler(budget=4, running=[decoding("a"), decoding("b")], waiting=[prompt("long", 10)])
    check_plan(sched, [("a", 1, "decode"), ("b", 1, "decode"), ("long", 2, "prefill")],
               "two streams decoding when a 10-token prompt arrives")
    assert [s.request_id for s in sched.running] == ["a", "b", "long"] and not sched.waiting, (
        f"the admitted prompt should move from waiting to running; running is "
        f"{[s.request_id for s in sched.running]}, waiting {[s.request_id for s in sched.waiting]}. Look at {FILL}.")


@pytest.mark.exercise("scheduler-budget-fill")
def test_a_partly_prefilled_prompt_continues_before_a_new_one_starts():
    sched = scheduler(budget=7, running=[decoding("d"), partly_prefilled("half", 8, computed=3)],
                      waiting=[prompt("new", 5)])
    check_plan(sched, [("d", 1, "decode"), ("half", 5, "prefill"), ("new", 1, "prefill")],
               "one decode, a prompt with 5 of 8 tokens left, and a new 5-token prompt")


@pytest.mark.exercise("scheduler-budget-fill")
def test_waiting_prompts_are_admitted_in_arrival_order_until_the_budget_is_spent():
    sched = scheduler(budget=10, waiting=[prompt("x", 4), prompt("y", 4), prompt("z", 4), prompt("w", 4)])
    check_plan(sched, [("x", 4, "prefill"), ("y", 4, "prefill"), ("z", 2, "prefill")],
               "four 4-token prompts waiting, nothing running")
    assert [s.request_id for s in sched.waiting] == ["w"], (
        f"only w should still wait; waiting is {[s.request_id for s in sched.waiting]}. Look at {FILL}.")


@pytest.mark.exercise("scheduler-budget-fill")
def test_max_num_seqs_caps_how_many_sequences_run():
    sched = scheduler(budget=10, max_num_seqs=2, running=[decoding("a")], waiting=[prompt("b", 2), prompt("c", 2)])
    check_plan(sched, [("a", 1, "decode"), ("b", 2, "prefill")],
               "one decode and two short prompts waiting, max_num_seqs=2")


@pytest.mark.exercise("scheduler-budget-fill")
def test_decodes_that_use_the_whole_budget_leave_the_prompt_waiting():
    sched = scheduler(budget=3, running=[decoding("a"), decoding("b"), decoding("c")], waiting=[prompt("p", 4)])
    check_plan(sched, [("a", 1, "decode"), ("b", 1, "decode"), ("c", 1, "decode")],
               "three decodes with a budget of 3 and a prompt waiting")


@pytest.mark.exercise("scheduler-budget-fill")
def test_a_prompt_without_kv_room_is_not_overtaken():
    # d holds 5 tokens of a 10-token pool: its decode fits, then 4 tokens of room are left.
    sched = scheduler(budget=10, running=[decoding("d")], waiting=[prompt("big", 6), prompt("small", 2)], capacity=10)
    check_plan(sched, [("d", 1, "decode")],
               "a decode, then a 6-token prompt first in line with KV room for only 4 more tokens, and a 2-token "
               "prompt behind it (a later prompt must not overtake it, or a long prompt could wait forever)")
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


@pytest.mark.exercise("scheduler-budget-fill")
def test_a_step_that_preempted_admits_no_one():
    # a and b decode with 5 tokens each in a 10-token pool: a's decode preempts b. Two tokens of budget and four
    # of room are left, enough for a 2-token chunk of b's recompute, but memory is short: admit no one this step.
    a, b = decoding("a"), decoding("b")
    sched = scheduler(budget=3, max_num_seqs=2, running=[a, b], capacity=10)

    def reserve(seq, n, out):  # preemption done for you, so that this test needs only the budget fill
        if not sched.blocks.can_append(seq, n):
            sched._preempt(b, out)
        sched.blocks.append_slots(seq, n)
        return True
    sched._reserve = reserve
    out = check_plan(sched, [("a", 1, "decode")],
                     "a and b decoding in a full pool; a's decode preempts b, and 2 tokens of budget are left")
    assert [s.request_id for s in out.preempted] == ["b"] and [s.request_id for s in sched.waiting] == ["b"], (
        f"b should have been preempted and left waiting for a later step; preempted "
        f"{[s.request_id for s in out.preempted]}, waiting {[s.request_id for s in sched.waiting]}. Look at {FILL}.")


# ------------------------------------------------------------------ preemption

def full_scheduler(capacity: int, *seqs: Sequence) -> ChunkedPrefillScheduler:
    """Running sequences in arrival order, holding all the KV room there is."""
    return scheduler(budget=16, running=seqs, capacity=capacity)


def check_preempted(sched, out, want: list[str], situation: str) -> None:
    got = [s.request_id for s in out.preempted]
    assert got == want, (f"{situation}: expected to preempt {want} (the newest running sequences that are not "
                         f"already in this step's plan), preempted {got}. Look at {PREEMPT}.")
    for name in want:
        victim = next(s for s in out.preempted if s.request_id == name)
        assert victim not in sched.running and victim.seq_id not in sched.blocks.held, (
            f"preempted {name} must leave the running list and give its KV back (use self._preempt). Look at {PREEMPT}.")


@pytest.mark.exercise("scheduler-preempt")
def test_reserve_preempts_the_newest_running_sequence():
    a, b, c = decoding("a"), decoding("b"), decoding("c")
    sched, out = full_scheduler(15, a, b, c), SchedulerOutput()
    ok = sched._reserve(a, 1, out)
    check_preempted(sched, out, ["c"], "a, b, c running (oldest first) and the pool full; a needs one more token")
    assert ok is True and sched.blocks.held[a.seq_id] == 6, (
        f"after preempting c there is room, so _reserve(a, 1) should reserve a's token and return True; "
        f"returned {ok!r}, a holds {sched.blocks.held.get(a.seq_id)} tokens. Look at {PREEMPT}.")


@pytest.mark.exercise("scheduler-preempt")
def test_reserve_preempts_as_many_as_it_takes_newest_first():
    a, b, c = decoding("a"), decoding("b"), decoding("c")
    sched, out = full_scheduler(15, a, b, c), SchedulerOutput()
    assert sched._reserve(a, 7, out) is True
    check_preempted(sched, out, ["c", "b"], "a, b, c running with 5 tokens each in a pool of 15; a needs 7 more")
    assert [s.request_id for s in sched.waiting] == ["b", "c"]


@pytest.mark.exercise("scheduler-preempt")
def test_reserve_spares_sequences_already_in_this_steps_plan():
    a, b, c = decoding("a"), decoding("b"), decoding("c")
    sched, out = full_scheduler(15, a, b, c), SchedulerOutput()
    out.chunks.append(ScheduledChunk(c, 1, is_decode=True))
    assert sched._reserve(a, 1, out) is True
    check_preempted(sched, out, ["b"], "a, b, c running, c already planned for this step; a needs one more token")


@pytest.mark.exercise("scheduler-preempt")
def test_reserve_preempts_the_sequence_itself_when_no_one_else_can_go():
    a = decoding("a")
    sched, out = full_scheduler(5, a), SchedulerOutput()
    ok = sched._reserve(a, 1, out)
    check_preempted(sched, out, ["a"], "a alone fills the pool and needs one more token")
    assert ok is False and sched.waiting[0] is a, (
        f"when the sequence itself is preempted, _reserve must return False (it got no room); returned {ok!r}. "
        f"Look at {PREEMPT}.")
