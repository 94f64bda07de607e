"""Exercises in the scheduler: preemption (lesson 05, minillm/scheduler.py) and the decode-first budget fill
(lesson 07, minillm/chunked_prefill.py).

No model and no real cache: the scheduler gets a fake block space that only
counts tokens, and the queues are set up by hand. A case lists its sequences
as plain data; a plan is written as (request, tokens, kind) in the order the
scheduler put it in the batch. The checks replay each case on plain lists.
"""
from exercise_checks import Check, kind


class TokenCountingBlocks:
    """Stands in for the paged cache: room for `capacity` tokens in all, counted per sequence."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[int, int] = {}

    def match_prefix(self, seq) -> int:
        return 0  # no prefix cache

    def can_append(self, seq, num_new: int) -> bool:
        return sum(self.held.values()) + num_new <= self.capacity

    def append_slots(self, seq, num_new: int) -> None:
        if not self.can_append(seq, num_new):
            raise RuntimeError(f"append_slots({seq.request_id}, {num_new}) without room: check can_append first")
        self.held[seq.seq_id] = self.held.get(seq.seq_id, 0) + num_new

    def free(self, seq) -> None:
        self.held.pop(seq.seq_id, None)


def seq(name: str, prompt: int, computed: int = 0, output: int = 0) -> dict:
    """A sequence as data: `prompt` tokens, `output` sampled ones, the first `computed` of them in the KV cache."""
    return {"name": name, "prompt": prompt, "computed": computed, "output": output}


def decoding(name: str, prompt: int = 5) -> dict:
    """Running, its prompt in the cache, its last sampled token waiting to be fed."""
    return seq(name, prompt, computed=prompt, output=1)


def build(case: dict, scheduler_class: str):
    """The scheduler of a case, with its queues and a token-counting block space; and its sequences by name."""
    from minillm.sampling import SamplingParams
    from minillm.scheduler import SchedulerConfig
    from minillm.sequence import RequestMetrics, Sequence, SequenceStatus
    if scheduler_class == "chunked":
        from minillm.chunked_prefill import ChunkedPrefillScheduler as cls
    else:
        from minillm.scheduler import Scheduler as cls
    config = SchedulerConfig(max_num_batched_tokens=case["budget"], max_num_seqs=case["max_num_seqs"],
                             enable_chunked_prefill=cls.chunked_prefill)
    sched = cls(config, TokenCountingBlocks(case["capacity"]))
    by_name = {}
    for queue in ("running", "waiting"):
        for s in case[queue]:
            made = Sequence(s["name"], list(range(s["prompt"])), SamplingParams(temperature=0.0, max_tokens=32),
                            RequestMetrics(arrival_time=0.0))
            made.output_token_ids = [1] * s["output"]
            made.num_computed_tokens = s["computed"]
            by_name[s["name"]] = made
            if queue == "running":   # in arrival order, already holding their computed tokens' KV
                made.status = SequenceStatus.RUNNING
                sched.running.append(made)
                sched.blocks.held[made.seq_id] = s["computed"]
            else:
                sched.add(made)
    return sched, by_name


def queues(sched, out) -> dict:
    names = {s.seq_id: s.request_id for s in [*sched.running, *sched.waiting]}
    return {"preempted": [s.request_id for s in out.preempted], "running": [s.request_id for s in sched.running],
            "waiting": [s.request_id for s in sched.waiting],
            "held": {names.get(i, str(i)): n for i, n in sched.blocks.held.items()}}


class Replay:
    """A case's queues on plain data, for the checks' own replay of a step."""

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

    def preempt(self, name: str) -> None:
        """Recompute mode: off the running list, its KV freed, to the front of the waiting queue."""
        self.running.remove(name)
        self.held.pop(name, None)
        self.seqs[name]["computed"] = 0
        self.waiting.insert(0, name)
        self.preempted.append(name)

    def queues(self) -> dict:
        return {"preempted": self.preempted, "running": self.running, "waiting": self.waiting, "held": self.held}


def first_difference(got: dict, want: dict, keys: list[str]) -> str | None:
    for key in keys:
        if got.get(key) != want[key]:
            return f"{key}: expected {want[key]}, got {got.get(key)}"
    return None


def describe(r: "Replay") -> str:
    """The queues of a replay as a sentence: who runs, who waits, and the KV room."""
    def show(name):
        return f"{name} (decoding)" if r.decoding(name) else f"{name} ({r.remaining(name)} tokens to prefill)"
    return (f"running {[show(n) for n in r.running]}, waiting {[show(n) for n in r.waiting]}, "
            f"KV room for {r.capacity} tokens, {sum(r.held.values())} held")


# ------------------------------------------------------------------ preemption

class Preempt(Check):
    exercise = "scheduler-preempt"
    where = "minillm/scheduler.py, Scheduler._reserve"

    @staticmethod
    def case(capacity, running, n, planned=(), waiting=(), who="a"):
        return {"budget": 16, "max_num_seqs": 16, "capacity": capacity, "running": list(running),
                "waiting": list(waiting), "planned": list(planned), "reserve": who, "tokens": n}

    def visible(self):
        abc = [decoding("a"), decoding("b"), decoding("c")]
        return {"the newest running sequence goes first": self.case(15, abc, 1),
                "as many as it takes, newest first": self.case(15, abc, 7, waiting=[seq("w", 3)]),
                "sequences already in this step's plan are spared": self.case(15, abc, 1, planned=["c"]),
                "the sequence preempts itself when no one else can go": self.case(5, [decoding("a")], 1)}

    def situations(self):
        def running(d, count):
            return [seq(f"s{i}", p, computed=p, output=1) if d.int(0, 1) else seq(f"s{i}", p + 3, computed=p)
                    for i, p in enumerate(d.int(2, 8) for _ in range(count))]

        def waiting(d):
            return [seq(f"w{i}", d.int(1, 6)) for i in range(d.int(0, 2))]

        def newest(d):
            r = running(d, d.int(2, 5))
            total, n = sum(s["computed"] for s in r), d.int(1, 2)
            return self.case(total + n - 1, r, n, waiting=waiting(d), who=r[0]["name"])

        def several(d):
            r = running(d, d.int(3, 5))
            total = sum(s["computed"] for s in r)
            n = r[-1]["computed"] + r[-2]["computed"] - d.int(0, 1)
            return self.case(total, r, n, waiting=waiting(d), who=r[0]["name"])

        def planned(d):
            r = running(d, d.int(3, 5))
            total, who = sum(s["computed"] for s in r), d.int(0, len(r) - 2)
            spared = d.sample([s["name"] for i, s in enumerate(r) if i != who], d.int(1, len(r) - 2))
            return self.case(total, r, d.int(1, 3), planned=spared, waiting=waiting(d), who=r[who]["name"])

        def itself(d):
            r = running(d, d.int(1, 3))
            total, who = sum(s["computed"] for s in r), d.int(0, len(r) - 1)
            others = [s["name"] for i, s in enumerate(r) if i != who]
            return self.case(total, r, d.int(1, 3), planned=others, waiting=waiting(d), who=r[who]["name"])

        return {"the newest running sequence goes first": newest, "as many as it takes": several,
                "sequences in this step's plan are spared": planned, "no one else can go": itself}

    def run(self, case):
        from minillm.scheduler import ScheduledChunk, SchedulerOutput
        sched, by_name = build(case, "base")
        out = SchedulerOutput()
        for name in case["planned"]:
            out.chunks.append(ScheduledChunk(by_name[name], 1, is_decode=True))
        ok = sched._reserve(by_name[case["reserve"]], case["tokens"], out)
        return {"returned": ok, **queues(sched, out)}

    def verify(self, case, output):
        who, n = case["reserve"], case["tokens"]
        replay, ok = Replay(case), True
        # Oracle: free room by preempting, newest first, the running sequences that are neither `who` nor planned;
        # with none left, `who` gives way itself and gets no room.
        while not replay.room(n):
            victims = [s for s in replay.running if s not in case["planned"] and s != who]
            replay.preempt(victims[-1] if victims else who)
            if not victims:
                ok = False
                break
        if ok:
            replay.held[who] += n
        want = {"returned": ok, **replay.queues()}
        situation = (f"_reserve({who}, {n}) with {describe(Replay(case))}"
                     + (f", {case['planned']} already in this step's plan" if case["planned"] else ""))
        if not isinstance(output, dict):
            raise AssertionError(f"{situation}: the check got back {kind(output)}. Look at {self.where}.")
        problem = first_difference(output, want, ["preempted", "returned", "running", "waiting", "held"])
        if problem:
            raise AssertionError(f"{situation}:\n  {problem}\n(the victims are the newest running sequences not in this "
                                 f"step's plan, preempted one at a time until there is room; the return value says "
                                 f"whether {who} got its room). Look at {self.where}.")


# ------------------------------------------------------------------ budget fill

class BudgetFill(Check):
    exercise = "scheduler-budget-fill"
    where = "minillm/chunked_prefill.py, ChunkedPrefillScheduler._plan"

    @staticmethod
    def case(budget, running=(), waiting=(), max_num_seqs=None, capacity=10_000, steps=1, victim=None):
        return {"budget": budget, "max_num_seqs": max_num_seqs or budget, "capacity": capacity, "running": list(running),
                "waiting": list(waiting), "steps": steps, "victim": victim}

    def visible(self):
        return {
            "a 7-token prompt with budget 3 runs as chunks of 3, 3 and 1": self.case(3, waiting=[seq("p", 7)], steps=3),
            "running decodes go first and a new prompt fills the rest":
                self.case(4, [decoding("a"), decoding("b")], [seq("long", 10)]),
            "a partly prefilled prompt continues before a new one starts":
                self.case(7, [decoding("d"), seq("half", 8, computed=3)], [seq("new", 5)]),
            "waiting prompts join in arrival order until the budget is spent":
                self.case(10, waiting=[seq("x", 4), seq("y", 4), seq("z", 4), seq("w", 4)]),
            "max_num_seqs caps how many sequences run":
                self.case(10, [decoding("a")], [seq("b", 2), seq("c", 2)], max_num_seqs=2),
            "decodes that use the whole budget leave the prompt waiting":
                self.case(3, [decoding("a"), decoding("b"), decoding("c")], [seq("p", 4)]),
            # d holds 5 tokens of a 10-token pool: its decode fits, then 4 tokens of room are left.
            "a prompt without KV room is not overtaken by a later one":
                self.case(10, [decoding("d")], [seq("big", 6), seq("small", 2)], capacity=10),
            # a and b decode with 5 tokens each in a 10-token pool: a's decode preempts b. Budget and room are left
            # for a chunk of someone, but memory is short: admit no one this step.
            "a step that preempted admits no one":
                self.case(3, [decoding("a"), decoding("b")], [seq("w", 2)], max_num_seqs=2, capacity=10, victim="b"),
        }

    def situations(self):
        def decodes(d, count):
            return [decoding(f"d{i}", d.int(2, 6)) for i in range(count)]

        def prompts(d, count, first=0):
            return [seq(f"p{first + i}", d.int(1, 9)) for i in range(count)]

        def fill_the_rest(d):
            k = d.int(1, 4)
            return self.case(k + d.int(1, 5), decodes(d, k), [seq("p0", d.int(6, 20))] + prompts(d, d.int(0, 1), 1))

        def partly_prefilled(d):
            prompt = d.int(4, 12)
            running = decodes(d, d.int(0, 2)) + [seq("half", prompt, computed=d.int(1, prompt - 1))]
            return self.case(d.int(3, 12), running, prompts(d, d.int(1, 2)))

        def arrival_order(d):
            waiting = prompts(d, d.int(3, 5))
            return self.case(d.int(3, sum(s["prompt"] for s in waiting) - 1), waiting=waiting)

        def max_num_seqs(d):
            k = d.int(1, 3)
            return self.case(12, decodes(d, k), prompts(d, d.int(2, 3)), max_num_seqs=k + d.int(0, 1))

        def whole_budget(d):
            k = d.int(2, 5)
            return self.case(k, decodes(d, k), prompts(d, d.int(1, 2)))

        def no_room(d):
            running = decodes(d, d.int(1, 2))
            held = sum(s["computed"] for s in running) + len(running)
            room = d.int(1, 4)
            waiting = [seq("big", room + d.int(1, 4)), seq("small", d.int(1, room))]
            return self.case(20, running, waiting, capacity=held + room)

        def preempted(d):
            running = decodes(d, d.int(2, 3))
            held = sum(s["computed"] for s in running)
            return self.case(d.int(len(running), 8), running, prompts(d, d.int(1, 2)), max_num_seqs=len(running),
                             capacity=held, victim=running[-1]["name"])

        def chunks(d):
            prompt, budget = d.int(5, 20), d.int(2, 6)
            return self.case(budget, waiting=[seq("p", prompt)], steps=-(-prompt // budget))

        return {"decodes first, then a new prompt fills the rest": fill_the_rest,
                "a partly prefilled prompt continues before a new one": partly_prefilled,
                "waiting prompts join in arrival order": arrival_order, "max_num_seqs caps the running set": max_num_seqs,
                "decodes use the whole budget": whole_budget, "a prompt without room is not overtaken": no_room,
                "a step that preempted admits no one": preempted, "a long prompt in chunks over several steps": chunks}

    def run(self, case):
        sched, by_name = build(case, "chunked")
        victim = by_name.get(case["victim"])

        def reserve(s, n, out):
            """Stands in for _reserve (exercise scheduler-preempt): when room is short it preempts the case's victim."""
            if not sched.blocks.can_append(s, n) and victim in sched.running and victim is not s:
                sched._preempt(victim, out)
            if not sched.blocks.can_append(s, n):
                return False
            sched.blocks.append_slots(s, n)
            return True

        sched._reserve = reserve
        steps = []
        for _ in range(case["steps"]):
            out = sched.schedule()
            steps.append({"plan": [[c.seq.request_id, c.num_tokens, "decode" if c.is_decode else "prefill"]
                                   for c in out.chunks], **queues(sched, out)})
            for c in out.chunks:   # what the engine does after the forward pass
                c.seq.num_computed_tokens += c.num_tokens
                if c.seq.num_remaining == 0:
                    c.seq.output_token_ids.append(1)
        return steps

    def replay_step(self, case: dict, r: Replay) -> dict:
        """Oracle: one step of the decode-first policy on plain data, with the check's stand-in for _reserve."""
        plan, r.preempted = [], []
        status = {name: "running" for name in r.running}

        def reserve(name, n):
            victim = case["victim"]
            if not r.room(n) and victim in r.running and victim != name:
                r.preempt(victim)
                status[victim] = "waiting"
            if not r.room(n):
                return False
            r.held[name] += n
            return True

        for name in list(r.running):      # 1. every running decode, oldest first
            if status[name] == "running" and r.decoding(name) and reserve(name, 1):
                plan.append([name, 1, "decode"])
        budget = case["budget"] - len(plan)
        for name in list(r.running):      # 2. the next chunk of each partly prefilled prompt, oldest first
            if budget and status[name] == "running" and not r.decoding(name):
                n = min(r.remaining(name), budget)
                if reserve(name, n):
                    plan.append([name, n, "prefill"])
                    budget -= n
        while not r.preempted and r.waiting and budget > 0 and len(r.running) < case["max_num_seqs"]:
            name = r.waiting[0]           # 3. waiting prompts in arrival order, while budget, seats and room last
            n = min(r.remaining(name), budget)
            if not r.room(n):
                break
            r.waiting.pop(0)
            r.running.append(name)
            r.held[name] = r.held.get(name, 0) + n
            plan.append([name, n, "prefill"])
            budget -= n
        return {"plan": plan, **{k: list(v) if isinstance(v, list) else dict(v) for k, v in r.queues().items()}}

    def verify(self, case, output):
        r = Replay(case)
        if not isinstance(output, list) or len(output) != case["steps"]:
            raise AssertionError(f"the check runs {case['steps']} step(s); it got back {kind(output)}. Look at {self.where}.")
        for i, got in enumerate(output):
            situation = f"budget {case['budget']}, max_num_seqs {case['max_num_seqs']}, {describe(r)}"
            want = self.replay_step(case, r)
            problem = first_difference(got, want, ["plan", "preempted", "running", "waiting"]) \
                if isinstance(got, dict) else f"got {kind(got)}"
            if problem:
                step = f"step {i + 1} of {case['steps']}: " if case["steps"] > 1 else ""
                raise AssertionError(f"{step}{situation}:\n  {problem}\n(a plan is [request, tokens, kind] in batch "
                                     f"order: decodes first, then chunks of partly prefilled prompts, then waiting "
                                     f"prompts in arrival order; no admission in a step that preempted). "
                                     f"Look at {self.where}.")
            for name, n, _ in want["plan"]:   # what the engine does after the forward pass
                r.seqs[name]["computed"] += n
                if r.remaining(name) == 0:
                    r.seqs[name]["output"] += 1


PREEMPT, BUDGET_FILL = Preempt(), BudgetFill()
test_preempt = PREEMPT.pytest_test()
test_budget_fill = BUDGET_FILL.pytest_test()
