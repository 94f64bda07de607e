"""The answer keys of the scheduler exercises: each case replayed on plain lists of names.

Instructor only: `make` leaves every key_*.py out of a copy, and writes the visible cases' answers into it as
literal data instead. A case is the data of tests/exercises/test_ex_scheduler.py (sequences as dicts, the queues
as lists of names), and so is an answer: the queues after the call, and for the budget fill each step's plan as
[request, tokens, "decode" | "prefill"] in batch order.

Besides the right answer, each key replays the same case under a few common mistakes (one policy switch each),
so that a judge seeing the output of one can name it. A mistake whose answer is the right one for a case is left
out: that case cannot show it.
"""
from __future__ import annotations


class Replay:
    """A case's queues on plain data: who runs, who waits, how many tokens each holds in a pool of `capacity`."""

    def __init__(self, case: dict):
        self.seqs = {s["name"]: dict(s) for s in [*case["running"], *case["waiting"]]}
        self.running = [s["name"] for s in case["running"]]
        self.waiting = [s["name"] for s in case["waiting"]]
        self.held = {s["name"]: s["computed"] for s in case["running"]}
        self.capacity = case["capacity"]
        self.preempted: list[str] = []

    def remaining(self, name: str) -> int:
        s = self.seqs[name]
        return s["prompt"] + s["output"] - s["computed"]

    def decoding(self, name: str) -> bool:
        return self.remaining(name) == 1 and self.seqs[name]["output"] > 0

    def room(self, n: int) -> bool:
        return sum(self.held.values()) + n <= self.capacity

    def take(self, name: str, n: int) -> None:
        self.held[name] = self.held.get(name, 0) + n

    def preempt(self, name: str) -> None:
        """Recompute mode: off the running list, its KV freed, to the front of the waiting queue."""
        self.running.remove(name)
        self.held.pop(name, None)
        self.seqs[name]["computed"] = 0
        self.waiting.insert(0, name)
        self.preempted.append(name)

    def queues(self) -> dict:
        return {"preempted": list(self.preempted), "running": list(self.running), "waiting": list(self.waiting),
                "held": dict(self.held)}


def with_mistakes(want, replay, mistakes: dict[str, dict]) -> dict:
    """{"want": the right answer, "mistakes": {what the mistake is: its answer}} for the mistakes this case shows."""
    answers = {what: replay(**switches) for what, switches in mistakes.items()}
    return {"want": want, "mistakes": {what: got for what, got in answers.items() if got != want}}


# ------------------------------------------------------------------ scheduler-preempt

PREEMPT_MISTAKES = {
    "the oldest running sequence was preempted: preemption takes the newest first (it has the least work to lose)":
        {"newest_first": False},
    "a sequence already in this step's plan was preempted: its tokens are planned, so it keeps its blocks":
        {"spare_planned": False},
    "it stopped preempting before there was room (append_slots was called without it): "
    "one preemption is not always enough": {"until_room": False},
    "it returned after the first preemption, room or not: _reserve returns only once the tokens have their room "
    "or the sequence gave way": {"returns_after_one": False},
    "room was freed but never taken: the sequence's new tokens got no slots, yet _reserve returned True":
        {"takes_room": False},
    "it returned True although the sequence gave way itself: True means the sequence got its room":
        {"false_when_gave_way": False},
}


def reserve(case: dict, newest_first=True, spare_planned=True, until_room=True, returns_after_one=True,
            takes_room=True, false_when_gave_way=True) -> dict:
    """The queues after _reserve(who, n) and what it returned. The rule: while the pool has no room for n more
    tokens, preempt the newest running sequence that is neither `who` nor in this step's plan; with none left,
    `who` gives way itself and gets no room (False). A raised error is {"raised": its type}."""
    r, who, n = Replay(case), case["reserve"], case["tokens"]
    while not r.room(n):
        victims = [s for s in r.running if s != who and not (spare_planned and s in case["planned"])]
        victim = (victims[-1] if newest_first else victims[0]) if victims else who
        r.preempt(victim)
        if victim == who:
            return {"returned": not false_when_gave_way, **r.queues()}
        if not returns_after_one:
            return {"returned": True, **r.queues()}
        if not until_room:
            break
        if not takes_room and r.room(n):
            return {"returned": True, **r.queues()}
    if not r.room(n):
        return {"raised": "RuntimeError"}
    r.take(who, n)
    return {"returned": True, **r.queues()}


def preempt_key(case: dict) -> dict:
    """scheduler-preempt's answer for one case: the queues and return value of `reserve`, and its mistakes'."""
    return with_mistakes(reserve(case), lambda **switches: reserve(case, **switches), PREEMPT_MISTAKES)


# ------------------------------------------------------------------ scheduler-budget-fill

BUDGET_FILL_MISTAKES = {
    "prompt chunks were planned before decodes: the running decodes come first, one token each, and the "
    "prompts share what is left of the budget": {"decodes_first": False},
    "the decodes' tokens were not taken from the budget: the prompts get only what the decodes leave":
        {"decodes_counted": False},
    "a waiting prompt was admitted before a partly prefilled one continued: a prompt already running goes first":
        {"partials_first": False},
    "more sequences run than max_num_seqs allows: a waiting prompt joins only while a seat is free":
        {"seat_limit": False},
    "a waiting prompt was admitted in a step that preempted: memory is short, so that step admits no one":
        {"none_after_preempt": False},
    "a chunk was larger than what was left of the budget: each chunk is capped by the budget left":
        {"capped": False},
    "the last token of the budget went unused: a chunk of a single token still fits a budget of one":
        {"last_token": False},
}


def plan_steps(case: dict, decodes_first=True, decodes_counted=True, partials_first=True, seat_limit=True,
               none_after_preempt=True, capped=True, last_token=True) -> list[dict]:
    """Each step's plan and queues under the decode-first policy, with the check's stand-in for _reserve (when
    room is short it preempts the case's victim), and the engine's update after each step's forward pass."""
    r, steps = Replay(case), []
    for _ in range(case["steps"]):
        r.preempted = []
        plan = step(case, r, decodes_first, decodes_counted, partials_first, seat_limit, none_after_preempt,
                    capped, last_token)
        queues = r.queues()
        del queues["held"]
        steps.append({"plan": plan, **queues})
        for name, n, _ in plan:
            r.seqs[name]["computed"] += n
            if r.remaining(name) == 0:
                r.seqs[name]["output"] += 1
    return steps


def step(case, r: Replay, decodes_first, decodes_counted, partials_first, seat_limit, none_after_preempt,
         capped, last_token) -> list:
    """One step's plan on `r`: 1. every running decode, oldest first; 2. the next chunk of each partly prefilled
    prompt, oldest first; 3. waiting prompts in arrival order, while budget, seats and room last, and only in a
    step that preempted no one. Each chunk is what the sequence still needs, capped by the budget left."""
    plan, budget = [], case["budget"]
    running = set(r.running)   # a victim leaves it, and is planned no more this step

    def reserve(name, n):
        victim = case["victim"]
        if not r.room(n) and victim in r.running and victim != name:
            r.preempt(victim)
            running.discard(victim)
        if not r.room(n):
            return False
        r.take(name, n)
        return True

    def decodes():
        for name in list(r.running):
            if name in running and r.decoding(name) and reserve(name, 1):
                plan.append([name, 1, "decode"])
        return len([c for c in plan if c[2] == "decode"])

    def chunk(name, budget):
        return min(r.remaining(name), budget) if capped else r.remaining(name)

    def partials(budget):
        for name in list(r.running):
            if budget == 0:
                break
            if name in running and not r.decoding(name):
                n = chunk(name, budget)
                if reserve(name, n):
                    plan.append([name, n, "prefill"])
                    budget -= n
        return budget

    def admissions(budget):
        if none_after_preempt and r.preempted:
            return budget
        while r.waiting and budget > (0 if last_token else 1) and \
                (len(r.running) < case["max_num_seqs"] or not seat_limit):
            name = r.waiting[0]
            n = chunk(name, budget)
            if not r.room(n):
                break
            r.waiting.pop(0)
            r.running.append(name)
            running.add(name)
            r.take(name, n)
            plan.append([name, n, "prefill"])
            budget -= n
        return budget

    if not decodes_first:
        admissions(partials(budget)) if partials_first else partials(admissions(budget))
        decodes()   # unbudgeted: they come after the prompts took the whole budget
        return plan
    used = decodes()
    if decodes_counted:
        budget -= used
    if partials_first:
        admissions(partials(budget))
    else:
        partials(admissions(budget))
    return plan


def budget_fill_key(case: dict) -> dict:
    """scheduler-budget-fill's answer for one case: each step's plan and queues, and its mistakes'."""
    return with_mistakes(plan_steps(case), lambda **switches: plan_steps(case, **switches), BUDGET_FILL_MISTAKES)


# ------------------------------------------------------------------ scheduler-admit

ADMIT_MISTAKES = {
    "it admitted only into an empty batch (static batching): a seat a finished request leaves is taken at the very "
    "next step, while the others still run": {"empty_only": True},
    "it admitted past max_num_seqs": {"seat_limit": False},
    "a prompt longer than the token budget left was admitted": {"budget_limit": False},
    "the budget was not spent by the prompts admitted: together they may not pass max_num_batched_tokens":
        {"budget_spent": False},
    "the running decodes ran in the step that admitted prompts: prefill-first gives new prompts a step of their own":
        {"decodes_too": True},
    "a later prompt overtook one that did not fit": {"in_order": False},
}


def admit_steps(case: dict, empty_only=False, seat_limit=True, budget_limit=True, budget_spent=True,
                decodes_too=False, in_order=True) -> list[dict]:
    """Each step's plan and queues under the prefill-first policy, then the engine's update: every sequence whose
    tokens are all computed samples one, and one that reaches its max_tokens finishes, its blocks freed at once."""
    r, steps = Replay(case), []
    for _ in range(case["steps"]):
        plan, budget, i = [], case["budget"], 0
        while not (empty_only and r.running) and i < len(r.waiting) and \
                (len(r.running) < case["max_num_seqs"] or not seat_limit):
            name = r.waiting[i]
            n = r.remaining(name)
            if (budget_limit and n > budget) or not r.room(n):
                if in_order:
                    break
                i += 1
                continue
            r.waiting.pop(i)
            r.running.append(name)
            r.take(name, n)
            plan.append([name, n, "prefill"])
            budget -= n if budget_spent else 0
        if not plan or decodes_too:
            for name in list(r.running):
                if r.decoding(name) and r.room(1):
                    r.take(name, 1)
                    plan.append([name, 1, "decode"])
        queues = r.queues()
        del queues["preempted"]
        finished = []
        for name, n, _ in plan:   # the engine's forward pass and update
            s = r.seqs[name]
            s["computed"] += n
            if r.remaining(name) == 0:
                s["output"] += 1
                if s["output"] >= s["max_tokens"]:
                    r.running.remove(name)
                    r.held.pop(name, None)
                    finished.append(name)
        steps.append({"plan": plan, **queues, "finished": finished})
    return steps


def admit_key(case: dict) -> dict:
    """scheduler-admit's answer for one case: each step's plan, queues and finished requests, and its mistakes'."""
    return with_mistakes(admit_steps(case), lambda **switches: admit_steps(case, **switches), ADMIT_MISTAKES)


# ------------------------------------------------------------------ scheduler-finish

FINISH_MISTAKES = {
    "a finished request kept its seat and blocks until a later call: free them in the call that ends it, so that a "
    "waiting request can have them at the very next step": {"late": True},
    "its blocks were never freed": {"frees": False},
    "it left the queues but was never marked finished": {"marks": False},
    "it was marked finished but stayed in the running queue, holding its blocks": {"leaves": False, "frees": False},
    "it returned True for a request that goes on": {"returns": False},
}


def finish_steps_key(case: dict, late=False, frees=True, marks=True, leaves=True, returns=True) -> list[dict]:
    """After each step's calls (each sampled token appended, then the stop rule): the queues, the tokens held, who
    is finished (reason and time) and what each call returned."""
    r, steps, finished = Replay(case), [], {}
    for now, sampled in enumerate(case["steps"]):
        returned = {}
        for name, token in sampled:
            if late:   # the wrong version's clean-up of those finished earlier
                for done in [n for n in r.running if n in finished]:
                    r.running.remove(done)
                    r.held.pop(done, None)
            s = r.seqs[name]
            s["output"] += 1
            reason = "stop" if token == case["eos"] else "length" if s["output"] >= s["max_tokens"] else None
            if reason and not late:
                if leaves:
                    r.running.remove(name)
                if frees:
                    r.held.pop(name, None)
            if reason and marks:
                finished[name] = [reason, float(now)]
            returned[name] = bool(reason) or not returns
        queues = r.queues()
        del queues["preempted"]
        steps.append({**queues, "finished": dict(finished), "returned": returned})
    return steps


def finish_key(case: dict) -> dict:
    """scheduler-finish's answer for one case, and its mistakes'."""
    return with_mistakes(finish_steps_key(case), lambda **switches: finish_steps_key(case, **switches),
                         FINISH_MISTAKES)
