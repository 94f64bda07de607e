"""Lesson 05 exercises in minillm/block_manager.py: the block allocator.

Each case sets the free list and reference counts by hand, makes a few calls,
and the check replays them on plain lists: `allocate` and `free` are each
tested alone.
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


def check_steps(output, expected_calls: int, where: str, what: str) -> list:
    if not isinstance(output, list) or not all(isinstance(s, dict) for s in output) or len(output) != expected_calls:
        raise AssertionError(f"{what}: the case makes {expected_calls} calls; the check got back {kind(output)}. "
                             f"Look at {where}.")
    return output


class Allocate(Check):
    exercise = "paged-allocate"
    where = "minillm/block_manager.py, BlockAllocator.allocate"

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

    def run(self, inputs):
        alloc = allocator(inputs)
        return observe(alloc, alloc.allocate, [()] * inputs["calls"])

    def verify(self, inputs, output):
        free, refs = list(inputs["free"]), list(inputs["ref_counts"])
        n = len(refs)
        steps = check_steps(output, inputs["calls"], self.where, f"allocate() from {state_text(free, refs)}")
        for i, got in enumerate(steps):
            situation = f"allocate() call {i + 1} with {state_text(free, refs)}"
            if not free:
                if not got.get("runtime_error"):
                    raise AssertionError(f"{situation}: no block is free, so it must raise a RuntimeError; it "
                                         f"{'raised ' + got['raised'] if raised(got) else 'returned ' + repr(got.get('returned'))}. "
                                         f"Look at {self.where}.")
                if str(n) not in got["message"]:
                    raise AssertionError(f"{situation}: the error for an empty pool should name the pool size ({n} "
                                         f"blocks) so the reader can act; it says {got['message']!r}. Look at {self.where}.")
                if (got["ref_counts"], got["free"]) != (refs, free):
                    raise AssertionError(f"{situation}: a failed allocate() must change nothing; it left "
                                         f"{state_text(got['free'], got['ref_counts'])}. Look at {self.where}.")
                return
            if raised(got):
                raise AssertionError(f"{situation}: raised {got['raised']}: {got['message']}. Look at {self.where}.")
            block = got["returned"]
            if not isinstance(block, int) or isinstance(block, bool) or block not in free:
                raise AssertionError(f"{situation}: expected one of the free blocks {free}, got {block!r}. "
                                     f"Look at {self.where}.")
            free.remove(block)
            refs[block] = 1
            if got["ref_counts"] != refs or sorted(got["free"]) != sorted(free):
                raise AssertionError(f"{situation} returned block {block}: it should leave {state_text(free, refs)} "
                                     f"(the block taken off the free list, with one reference); it left "
                                     f"{state_text(got['free'], got['ref_counts'])}. Look at {self.where}.")
            free = list(got["free"])


class Free(Check):
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

    def run(self, inputs):
        alloc = allocator(inputs)
        return observe(alloc, alloc.free, [(b,) for b in inputs["calls"]])

    def verify(self, inputs, output):
        free, refs = list(inputs["free"]), list(inputs["ref_counts"])
        steps = check_steps(output, len(inputs["calls"]), self.where, f"free() calls {inputs['calls']} from "
                            f"{state_text(free, refs)}")
        for block, got in zip(inputs["calls"], steps):
            situation = f"free({block}) with {state_text(free, refs)}"
            if refs[block] == 0:
                if not got.get("runtime_error"):
                    raise AssertionError(f"{situation}: block {block} has no reference left, so this is a double "
                                         f"free and must raise a RuntimeError; it "
                                         f"{'raised ' + got['raised'] if raised(got) else 'did not raise'}. Look at {self.where}.")
                if (got["ref_counts"], got["free"]) != (refs, free):
                    raise AssertionError(f"{situation}: a double free must raise before changing anything; it left "
                                         f"{state_text(got['free'], got['ref_counts'])}. Look at {self.where}.")
                return
            if raised(got):
                raise AssertionError(f"{situation}: raised {got['raised']}: {got['message']}. Look at {self.where}.")
            refs[block] -= 1
            if refs[block] == 0:
                free.append(block)
            recycled = "is recycled: back on the free list, once" if refs[block] == 0 else "is still in use: off the free list"
            if got["ref_counts"] != refs or sorted(got["free"]) != sorted(free):
                raise AssertionError(f"{situation}: it should drop one reference and leave {state_text(free, refs)} "
                                     f"(block {block} {recycled}); it left "
                                     f"{state_text(got['free'], got['ref_counts'])}. Look at {self.where}.")
            free = list(got["free"])


ALLOCATE, FREE = Allocate(), Free()
test_allocate = ALLOCATE.pytest_test()
test_free = FREE.pytest_test()
