"""Lesson 05 exercises in minillm/block_manager.py: the block allocator.

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
        def fresh(d):
            n = d.int(1, 8)
            return {"free": list(range(n)), "ref_counts": [0] * n, "calls": n}

        def in_use(d):
            n = d.int(3, 12)
            return {**random_state(d, n, d.int(1, n - 1)), "calls": 1}

        def runs_out(d):
            n = d.int(5, 40)   # a size that a message cannot name by accident
            state = random_state(d, n, d.int(0, 3))
            return {**state, "calls": len(state["free"]) + 1}

        return {"a fresh pool handed out in full": fresh, "a pool in use": in_use, "until the pool runs out": runs_out}

    def edges(self):
        return {
            # the free list as two sequences left it, finishing in another order than they were given blocks
            "blocks recycled out of order are reused in the order they were freed":
                {"free": [5, 1, 3], "ref_counts": [1, 0, 2, 0, 1, 0, 1], "calls": 3},
            "the last free block, then an empty pool": {"free": [6], "ref_counts": [1, 2, 1, 1, 3, 1, 0], "calls": 2},
            "interleaved sequences and a shared block, until the pool runs out":
                {"free": [4, 0, 7, 2], "ref_counts": [0, 1, 0, 2, 0, 1, 3, 0, 1, 1, 2], "calls": 5},
        }

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
        def held(d, n):
            state = random_state(d, n, d.int(0, n - 1))
            return state, [b for b in range(n) if state["ref_counts"][b]]

        def shared(d):
            state, used = held(d, d.int(3, 10))
            block = d.choice(used)
            state["ref_counts"][block] = d.int(2, 3)
            return {**state, "calls": [block]}

        def every_reference(d):
            state, used = held(d, d.int(2, 10))
            calls = [b for b in d.sample(used, min(len(used), 3)) for _ in range(state["ref_counts"][b])]
            d.random.shuffle(calls)
            return {**state, "calls": calls}

        def double(d):
            state, used = held(d, d.int(2, 10))
            block = d.choice(used)
            return {**state, "calls": [block] * (state["ref_counts"][block] + 1)}

        return {"a shared block": shared, "every reference of a few blocks": every_reference,
                "one free too many": double}

    def edges(self):
        return {
            "a block shared by two sequences, freed by one": {"free": [3], "ref_counts": [1, 2, 1, 0], "calls": [1]},
            "blocks freed in another order than they were allocated":
                {"free": [6], "ref_counts": [1, 1, 1, 1, 1, 1, 0], "calls": [3, 0, 5, 1]},
            "the last reference of a shared block, then one free too many":
                {"free": [0], "ref_counts": [0, 2, 1], "calls": [1, 2, 1, 1]},
        }

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
