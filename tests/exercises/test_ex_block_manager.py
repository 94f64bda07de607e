"""Lesson 07 exercises in minillm/block_manager.py: the block allocator.

Each case sets the free list and reference counts by hand and makes a few calls of one method, so `allocate`
and `free` are each tested alone. After every call the check records what came back and both lists, and
compares them with the answer key: the free list is a queue (`allocate` takes its head, `free` recycles a
block to its tail), so every step has one right state.
"""
from exercise_checks import Check, call_recording_errors, kind, raised


def observe(alloc, function, args_per_call) -> list:
    """Call function(*args) for each args; after each call record what it returned and the allocator's state.
    An error is recorded and ends the case."""
    steps = []
    for args in args_per_call:
        result = call_recording_errors(function, *args)
        state = {"ref_counts": list(alloc.ref_counts), "free": list(alloc.free_blocks)}
        steps.append({**result, **state} if raised(result) else {"returned": result, **state})
        if raised(result):
            break
    return steps


def allocator(inputs):
    from collections import deque

    from minillm.block_manager import BlockAllocator
    alloc = BlockAllocator(len(inputs["ref_counts"]))
    alloc.free_blocks = deque(inputs["free"])
    alloc.ref_counts = list(inputs["ref_counts"])
    return alloc


def random_state(d, num_blocks: int, num_free: int) -> dict:
    """A consistent allocator state: `num_free` blocks free (in a random order, ref count 0), the rest held 1-3 times."""
    free = d.sample(range(num_blocks), num_free)
    return {"free": free, "ref_counts": [0 if b in free else d.int(1, 3) for b in range(num_blocks)]}


def held(d, num_blocks: int, num_free: int | None = None) -> tuple[dict, list[int]]:
    """A random state of `num_free` free blocks (drawn if None, at least one block held) and the held blocks' ids."""
    num_free = d.int(0, num_blocks - 1) if num_free is None else num_free
    state = random_state(d, num_blocks, num_free)
    return state, [b for b in range(num_blocks) if state["ref_counts"][b]]


def state_text(free, refs) -> str:
    return f"ref counts {refs}, free list {free}"


def same(a, b) -> bool:
    """Equal as plain data, types included: the integer 3 is not True, 3.0 or a tensor holding 3."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def same_step(key_step: dict, got: dict) -> bool:
    """A step of the key and a step that came back agree: the same exception type raised, or the same value
    returned, and the same state after it."""
    if raised(key_step) != raised(got):
        return False
    if raised(key_step):
        outcome = got.get("raised") == key_step["raised"]
    else:
        outcome = same(got.get("returned"), key_step["returned"])
    return outcome and same(got.get("ref_counts"), key_step["ref_counts"]) and same(got.get("free"), key_step["free"])


def mistake_named(mistakes: dict, steps: list, upto: int) -> str:
    """The sentence naming the key's mistakes whose steps match those that came back, up to and including step
    `upto` ("" if none does; a case may not tell two apart, and then it names both)."""
    names = [name for name, wrong in mistakes.items()
             if len(wrong) > upto and all(same_step(wrong[i], steps[i]) for i in range(upto + 1))]
    if len(names) > 1:
        return f" This is what more than one known mistake does: {'; or '.join(names)}."
    return f" This is a known mistake: {names[0]}." if names else ""


class AllocatorCheck(Check):
    """What allocate's and free's checks share: a case is a few calls on a state set by hand, judged step by step."""

    returns_a_block = False   # whether each call's returned value is judged too

    def call_text(self, inputs: dict, i: int) -> str:
        raise TypeError(f"{type(self).__name__} must define call_text()")

    def must_raise(self, inputs: dict, i: int, expected: dict) -> tuple[str, str]:
        """Why call i must raise, and what its message must name: (why, the text the message must hold or "")."""
        raise TypeError(f"{type(self).__name__} must define must_raise()")

    def judge(self, inputs, output, expected):
        want = expected["steps"]
        if not isinstance(output, list) or not all(isinstance(s, dict) for s in output) or not output:
            raise AssertionError(f"{self.call_text(inputs, 0)}: the check records each call's result and state; "
                                 f"it got back {kind(output)}. Look at {self.where}.")
        for i, key_step in enumerate(want):
            before = inputs if i == 0 else want[i - 1]
            situation = f"{self.call_text(inputs, i)} with {state_text(before['free'], before['ref_counts'])}"
            got = output[i] if i < len(output) else None
            if got is None:
                raise AssertionError(f"{situation}: no result came back for it. Look at {self.where}.")
            problem = self.problem(inputs, i, key_step, got, expected)
            if problem:
                raise AssertionError(f"{situation}: {problem}{mistake_named(expected['mistakes'], output, i)} "
                                     f"Look at {self.where}.")

    def problem(self, inputs, i, key_step, got, expected) -> str:
        """What is wrong with step i that came back, or "" when it matches the key."""
        left = f"it left {state_text(got.get('free'), got.get('ref_counts'))}"
        should = f"it should leave {state_text(key_step['free'], key_step['ref_counts'])}"
        state_ok = same(got.get("ref_counts"), key_step["ref_counts"]) and same(got.get("free"), key_step["free"])
        if raised(key_step):
            why, named = self.must_raise(inputs, i, expected)
            if not got.get("runtime_error"):
                did = f"raised {got['raised']}: {got.get('message')}" if raised(got) else f"returned {got.get('returned')!r}"
                return f"{why}, so it must raise a RuntimeError; it {did}, and {left}."
            if named and named not in str(got.get("message")):
                return (f"{why}; the error should name the pool size ({named} blocks) so the reader can act; it "
                        f"says {got.get('message')!r}.")
            return "" if state_ok else f"a call that raises must change nothing first; {left}."
        if raised(got):
            return f"raised {got['raised']}: {got.get('message')}."
        if self.returns_a_block and not same(got.get("returned"), key_step["returned"]):
            return (f"expected block {key_step['returned']}, the head of the free list (the block freed longest "
                    f"ago), got {got.get('returned')!r}; {left}.")
        return "" if state_ok else f"{should}; {left}."


class Allocate(AllocatorCheck):
    exercise = "paged-allocate"
    where = "minillm/block_manager.py, BlockAllocator.allocate"
    returns_a_block = True

    def visible(self):
        return {"every block handed out once, with one reference": {"free": [0, 1, 2, 3], "ref_counts": [0] * 4, "calls": 4},
                "a recycled block is reused": {"free": [2], "ref_counts": [1, 3, 0], "calls": 1},
                "an empty pool raises, naming its size": {"free": [], "ref_counts": [1, 2, 1], "calls": 1}}

    def situations(self):
        def all_free(d):
            # every block free, in the order the pool's history left them
            n = d.int(6, 12)
            return {"free": d.sample(range(n), n), "ref_counts": [0] * n, "calls": n}

        def in_use(d):
            n = d.int(6, 14)
            return {**random_state(d, n, d.int(1, n - 1)), "calls": 1}

        def runs_out(d):
            n = d.int(5, 40)   # a size that a message cannot name by accident
            state = random_state(d, n, d.int(0, 3))
            return {**state, "calls": len(state["free"]) + 1}

        return {"every block free, handed out in full": all_free, "a pool in use": in_use, "until the pool runs out": runs_out}

    def edges(self):
        def out_of_order(d):
            # the free list as a few sequences left it: neither in id order nor in reverse
            n = d.int(7, 14)
            state = random_state(d, n, d.int(3, 4))
            if state["free"] in (sorted(state["free"]), sorted(state["free"], reverse=True)):
                state["free"] = state["free"][1:] + state["free"][:1]
            return {**state, "calls": len(state["free"])}

        def last_block(d):
            n = d.int(5, 40)
            return {**random_state(d, n, 1), "calls": 2}

        def interleaved(d):
            # blocks held once, a block shared by two or three sequences, and a free list in no particular order
            n = d.int(8, 16)
            state = random_state(d, n, d.int(3, 5))
            shared = d.choice([b for b in range(n) if state["ref_counts"][b]])
            state["ref_counts"][shared] = d.int(2, 3)
            return {**state, "calls": len(state["free"]) + 1}

        return {"blocks recycled out of order are reused in the order they were freed": out_of_order,
                "the last free block, then an empty pool": last_block,
                "interleaved sequences and a shared block, until the pool runs out": interleaved}

    def run(self, inputs):
        alloc = allocator(inputs)
        return observe(alloc, alloc.allocate, [()] * inputs["calls"])

    def expect(self, inputs):
        from key_block_manager import allocate_key
        return allocate_key(inputs)

    def call_text(self, inputs, i):
        return f"allocate() call {i + 1}"

    def must_raise(self, inputs, i, expected):
        return "no block is free", str(expected["pool_size"])


class Free(AllocatorCheck):
    exercise = "paged-free"
    where = "minillm/block_manager.py, BlockAllocator.free"

    def visible(self):
        return {"a shared block only drops a reference": {"free": [0], "ref_counts": [0, 2, 1], "calls": [1]},
                "the last reference recycles the block, once": {"free": [0], "ref_counts": [0, 2, 1], "calls": [2, 1, 1]},
                "a double free raises and changes nothing": {"free": [0, 2], "ref_counts": [0, 1, 0], "calls": [2]}}

    def situations(self):
        def shared(d):
            state, used = held(d, d.int(6, 14))
            block = d.choice(used)
            state["ref_counts"][block] = d.int(2, 3)
            return {**state, "calls": [block]}

        def every_reference(d):
            state, used = held(d, d.int(6, 14))
            calls = [b for b in d.sample(used, min(len(used), 3)) for _ in range(state["ref_counts"][b])]
            d.random.shuffle(calls)
            return {**state, "calls": calls}

        def double(d):
            state, used = held(d, d.int(6, 14))
            block = d.choice(used)
            return {**state, "calls": [block] * (state["ref_counts"][block] + 1)}

        return {"a shared block": shared, "every reference of a few blocks": every_reference,
                "one free too many": double}

    def edges(self):
        def shared_by_two(d):
            state, used = held(d, d.int(6, 14))
            block = d.choice(used)
            state["ref_counts"][block] = 2
            return {**state, "calls": [block]}

        def another_order(d):
            # every held block has one reference; four of them freed in an order that is not their id order
            n = d.int(6, 14)
            state = random_state(d, n, d.int(1, 2))
            state["ref_counts"] = [min(r, 1) for r in state["ref_counts"]]
            calls = d.sample([b for b in range(n) if state["ref_counts"][b]], 4)
            if calls == sorted(calls):
                calls = calls[1:] + calls[:1]
            return {**state, "calls": calls}

        def last_then_too_many(d):
            # block a held twice, block b once: a, b, a recycle them; a's next free is a double free
            n = d.int(4, 12)
            state, used = held(d, n, d.int(0, n - 2))
            a, b = d.sample(used, 2)
            state["ref_counts"][a], state["ref_counts"][b] = 2, 1
            return {**state, "calls": [a, b, a, a]}

        return {"a block shared by two sequences, freed by one": shared_by_two,
                "blocks freed in another order than they were allocated": another_order,
                "the last reference of a shared block, then one free too many": last_then_too_many}

    def run(self, inputs):
        alloc = allocator(inputs)
        return observe(alloc, alloc.free, [(b,) for b in inputs["calls"]])

    def expect(self, inputs):
        from key_block_manager import free_key
        return free_key(inputs)

    def call_text(self, inputs, i):
        return f"free({inputs['calls'][i]})"

    def must_raise(self, inputs, i, expected):
        return f"block {inputs['calls'][i]} has no reference left: this is a double free", ""


ALLOCATE, FREE = Allocate(), Free()
test_allocate = ALLOCATE.pytest_test()
test_free = FREE.pytest_test()
