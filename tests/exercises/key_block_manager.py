"""The answer key of the block allocator's exercises (paged-allocate, paged-free): replays on plain lists.

Instructor only: `make` leaves every key_*.py out of a student copy, since a replay is a solution.

A case sets the allocator's free list and reference counts by hand and makes a few calls of one method. The
replay makes the same calls on a `Pool` of two plain lists and records, after each call, what it returned (or
that it raised) and both lists, in the form the check's `run` sends back. A mistake is a `Pool` with one
method written wrong, replayed the same way: when a submission's steps match a mistake's, the message names
the mistake.

The contract the replays hold: the free list is a queue. `allocate` takes the block at its head (freed
longest ago) and gives it one reference; `free` drops one reference and, at none left, puts the block at the
tail. An empty pool and a double free raise a RuntimeError and change nothing; the empty pool's message
names the pool size.
"""
from __future__ import annotations


class Raised(Exception):
    """What a replayed call raised: its exception type's name."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class Pool:
    """The allocator's state as two plain lists, and its two methods as the contract says."""

    def __init__(self, free: list[int], ref_counts: list[int]):
        self.free, self.refs = list(free), list(ref_counts)

    def allocate(self) -> int:
        if len(self.free) == 0:
            raise Raised("RuntimeError")
        taken = self.free[0]
        self.free = self.free[1:]
        self.refs[taken] = 1
        return taken

    def free_block(self, block: int) -> None:
        if self.refs[block] == 0:
            raise Raised("RuntimeError")
        self.refs[block] = self.refs[block] - 1
        if self.refs[block] == 0:
            self.free = self.free + [block]


# ---------------------------------------------------------------- plausible mistakes of allocate

class TakesTheTail(Pool):
    def allocate(self):
        if not self.free:
            raise Raised("RuntimeError")
        taken = self.free[-1]
        self.free = self.free[:-1]
        self.refs[taken] = 1
        return taken


class NoReference(Pool):
    def allocate(self):
        if not self.free:
            raise Raised("RuntimeError")
        taken = self.free[0]
        self.free = self.free[1:]
        return taken


class LeftOnTheFreeList(Pool):
    def allocate(self):
        if not self.free:
            raise Raised("RuntimeError")
        self.refs[self.free[0]] = 1
        return self.free[0]


class RefusesTheLastBlock(Pool):
    def allocate(self):
        if len(self.free) <= 1:
            raise Raised("RuntimeError")
        return Pool.allocate(self)


ALLOCATE_MISTAKES = {
    "it took the newest block on the free list (its tail); allocate() takes the one at its head, which was "
    "freed longest ago": TakesTheTail,
    "the block it handed out still has ref count 0: a block taken off the free list starts with one "
    "reference": NoReference,
    "the block it handed out is still on the free list, so a later allocate() hands it out again": LeftOnTheFreeList,
    "it refused the last free block: the pool is out of blocks only when the free list is empty": RefusesTheLastBlock,
}


# ---------------------------------------------------------------- plausible mistakes of free

class RecyclesAShared(Pool):
    def free_block(self, block):
        if self.refs[block] == 0:
            raise Raised("RuntimeError")
        self.refs[block] -= 1
        self.free = self.free + [block]


class NeverRecycles(Pool):
    def free_block(self, block):
        if self.refs[block] == 0:
            raise Raised("RuntimeError")
        self.refs[block] -= 1


class DropsEveryReference(Pool):
    def free_block(self, block):
        if self.refs[block] == 0:
            raise Raised("RuntimeError")
        self.refs[block] = 0
        self.free = self.free + [block]


class RecyclesAtTheHead(Pool):
    def free_block(self, block):
        if self.refs[block] == 0:
            raise Raised("RuntimeError")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free = [block] + self.free


class CountsBeforeRaising(Pool):
    def free_block(self, block):
        self.refs[block] -= 1
        if self.refs[block] < 0:
            raise Raised("RuntimeError")
        if self.refs[block] == 0:
            self.free = self.free + [block]


class RecyclesTwice(Pool):
    """No double-free check: a block at 0 references goes on the free list a second time."""

    def free_block(self, block):
        if self.refs[block] > 0:
            self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free = self.free + [block]


FREE_MISTAKES = {
    "a block still referenced by another sequence went back to the free list: only the last reference "
    "recycles it": RecyclesAShared,
    "the block's last reference went but the block never went back on the free list, so it is lost to the "
    "pool": NeverRecycles,
    "one free() dropped every reference of a shared block: it drops one, the other sequences still hold "
    "theirs": DropsEveryReference,
    "the recycled block went to the head of the free list; it joins the tail, so that allocate() takes the "
    "block freed longest ago": RecyclesAtTheHead,
    "the double free changed the ref count before raising: check first, then change": CountsBeforeRaising,
    "a double free put the block on the free list a second time instead of raising": RecyclesTwice,
}


# ---------------------------------------------------------------- replays

def replay(pool: Pool, method: str, args_per_call: list[tuple]) -> list[dict]:
    """Each call's step as the check's run records it: {"returned": value} or {"raised": type name}, with the
    state after the call; a raise ends the case."""
    steps = []
    for args in args_per_call:
        try:
            step = {"returned": getattr(pool, method)(*args)}
        except Raised as e:
            step = {"raised": e.name}
        steps.append({**step, "ref_counts": list(pool.refs), "free": list(pool.free)})
        if "raised" in step:
            break
    return steps


def answer(inputs: dict, method: str, args_per_call: list[tuple], mistakes: dict) -> dict:
    """The key of one case: the right steps, the pool size an empty pool's message names, and each mistake's
    steps (those that agree with the right ones on this case are left out: they cannot be told apart here)."""
    start = (inputs["free"], inputs["ref_counts"])
    want = replay(Pool(*start), method, args_per_call)
    wrong = {}
    for name, kind in mistakes.items():
        steps = replay(kind(*start), method, args_per_call)
        if steps != want:
            wrong[name] = steps
    return {"steps": want, "pool_size": len(inputs["ref_counts"]), "mistakes": wrong}


def allocate_key(inputs: dict) -> dict:
    return answer(inputs, "allocate", [()] * inputs["calls"], ALLOCATE_MISTAKES)


def free_key(inputs: dict) -> dict:
    return answer(inputs, "free_block", [(b,) for b in inputs["calls"]], FREE_MISTAKES)
