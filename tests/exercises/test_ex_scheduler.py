"""Exercises in the scheduler: preemption (lesson 07, minillm/scheduler.py), admission between steps (lesson 09,
minillm/scheduler.py) and the decode-first budget fill (lesson 10, minillm/chunked_prefill.py).

No model and no real cache: the scheduler gets a fake block space that only
counts tokens, and the queues are set up by hand. A case lists its sequences
as plain data; a plan is written as (request, tokens, kind) in the order the
scheduler put it in the batch. The answers come from replaying each case on
plain lists (tests/exercises/key_scheduler.py, which stays with the
instructor); a check compares, and names a mistake it recognises.
"""
from exercise_checks import Check, call_recording_errors, kind, raised


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


def drawn_names(d) -> iter:
    """Distinct request ids drawn from the seed ("r417", ...), taken with next(): a held-out case's sequences
    are named afresh on every seed, so a table of answers built offline for one seed fits no case of another."""
    return iter(f"r{n}" for n in d.sample(range(100, 1000), 16))


def build(case: dict, scheduler_class: str):
    """The scheduler of a case, with its queues and a token-counting block space; and its sequences by name."""
    from minillm.sampling_params import SamplingParams
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


def first_difference(got: dict, want: dict, keys: list[str]) -> str | None:
    for key in keys:
        if got.get(key) != want[key]:
            return f"{key}: expected {want[key]}, got {got.get(key)}"
    return None


def same(got, answer: dict, keys: list[str]) -> bool:
    """`got` is the answer `answer` on `keys` (or raised the same type of error)."""
    if "raised" in answer:
        return raised(got) and got["raised"] == answer["raised"]
    return isinstance(got, dict) and not raised(got) and all(got.get(key) == answer[key] for key in keys)


def describe(case: dict) -> str:
    """A case's queues as a sentence, read off its inputs: who runs, who waits, and the KV room."""
    def show(s):
        left = s["prompt"] + s["output"] - s["computed"]
        return f"{s['name']} (decoding)" if left == 1 and s["output"] else f"{s['name']} ({left} tokens to prefill)"
    return (f"running {[show(s) for s in case['running']]}, waiting {[show(s) for s in case['waiting']]}, "
            f"KV room for {case['capacity']} tokens, {sum(s['computed'] for s in case['running'])} held")


def naming(mistakes: list[str]) -> str:
    """The mistakes whose answers the output matches, as the first lines of a message."""
    if len(mistakes) < 2:
        return "".join(f"\n  {what}" for what in mistakes)
    return "\n  one of these mistakes:" + "".join(f"\n  - {what}" for what in mistakes)


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
        def running(d, count, names):
            """`count` running sequences, each decoding or partway through its prompt, holding 2..8 tokens."""
            return [seq(next(names), p, computed=p, output=1) if d.int(0, 1) else seq(next(names), p + 3, computed=p)
                    for p in (d.int(2, 8) for _ in range(count))]

        def waiting(d, names, most=2):
            return [seq(next(names), d.int(1, 6)) for _ in range(d.int(0, most))]

        def held(r):
            return sum(s["computed"] for s in r)

        def newest(d):
            names = drawn_names(d)
            r = running(d, d.int(2, 5), names)
            n = d.int(1, 2)
            return self.case(held(r) + n - 1, r, n, waiting=waiting(d, names), who=r[0]["name"])

        def several(d):
            names = drawn_names(d)
            r = running(d, d.int(3, 5), names)
            n = r[-1]["computed"] + r[-2]["computed"] - d.int(0, 1)
            return self.case(held(r), r, n, waiting=waiting(d, names), who=r[0]["name"])

        def planned(d):
            names = drawn_names(d)
            r = running(d, d.int(3, 5), names)
            who = d.int(0, len(r) - 2)
            spared = d.sample([s["name"] for i, s in enumerate(r) if i != who], d.int(1, len(r) - 2))
            return self.case(held(r), r, d.int(1, 3), planned=spared, waiting=waiting(d, names), who=r[who]["name"])

        def itself(d):
            names = drawn_names(d)
            r = running(d, d.int(1, 3), names)
            who = d.int(0, len(r) - 1)
            others = [s["name"] for i, s in enumerate(r) if i != who]
            return self.case(held(r), r, d.int(1, 3), planned=others, waiting=waiting(d, names), who=r[who]["name"])

        return {"the newest running sequence goes first": newest, "as many as it takes": several,
                "sequences in this step's plan are spared": planned, "no one else can go": itself}

    def edges(self):
        """Each edge's situation is fixed (who reserves, who is planned, how many preemptions make room); the
        names, the lengths, the slack in the pool and the tokens asked for are drawn."""
        def decodes(d, count, names):
            return [decoding(next(names), d.int(2, 8)) for _ in range(count)]

        def held(r):
            return sum(s["computed"] for s in r)

        def newest_planned(d):
            # the newest has its token in this step's plan: the one before it goes, not the oldest (`who`)
            # nor any in between; one preemption makes room.
            names = drawn_names(d)
            r, slack = decodes(d, d.int(4, 5), names), d.int(0, 1)
            n = d.int(slack + 1, slack + r[-2]["computed"])
            return self.case(held(r) + slack, r, n, planned=[r[-1]["name"]],
                             waiting=[seq(next(names), d.int(1, 6))], who=r[0]["name"])

        def only_itself(d):
            # every other running sequence is in this step's plan: `who` gives way itself and returns False.
            names = drawn_names(d)
            r, slack = decodes(d, d.int(2, 3), names), d.int(0, 1)
            who = d.int(0, len(r) - 1)
            others = [s["name"] for i, s in enumerate(r) if i != who]
            return self.case(held(r) + slack, r, d.int(slack + 1, slack + 3), planned=others,
                             waiting=[seq(next(names), d.int(1, 6))], who=r[who]["name"])

        def exactly_one(d):
            # the newest's tokens freed leave exactly the room asked for.
            names = drawn_names(d)
            r, slack = decodes(d, d.int(3, 4), names), d.int(0, 2)
            return self.case(held(r) + slack, r, slack + r[-1]["computed"], who=r[0]["name"])

        def in_the_middle(d):
            # `who` has older and newer sequences: the newest two go, one is not enough; the older ones stay.
            names = drawn_names(d)
            count, slack = d.int(4, 5), d.int(0, 1)
            r = decodes(d, count, names)
            partial = d.int(0, count - 1)   # one of them is partway through its prompt
            r[partial] = seq(r[partial]["name"], r[partial]["computed"] + d.int(1, 4), computed=r[partial]["computed"])
            who = d.int(1, count - 3)
            n = d.int(slack + r[-1]["computed"] + 1, slack + r[-1]["computed"] + r[-2]["computed"])
            return self.case(held(r) + slack, r, n, who=r[who]["name"])

        def everyone_then_itself(d):
            # freeing every other sequence is still not enough: they all go, then `who` itself.
            names = drawn_names(d)
            r, slack = decodes(d, d.int(3, 4), names), d.int(0, 1)
            n = slack + held(r[1:]) + d.int(1, 3)
            return self.case(held(r) + slack, r, n, waiting=[seq(next(names), d.int(1, 6))], who=r[0]["name"])

        return {"the newest running sequence is in this step's plan": newest_planned,
                "the only victim is the sequence itself": only_itself,
                "room after exactly one preemption": exactly_one,
                "several preemptions, the sequence in the middle": in_the_middle,
                "everyone else goes, then the sequence itself": everyone_then_itself}

    def run(self, case):
        from minillm.scheduler import ScheduledChunk, SchedulerOutput
        sched, by_name = build(case, "base")
        out = SchedulerOutput()
        for name in case["planned"]:
            out.chunks.append(ScheduledChunk(by_name[name], 1, is_decode=True))
        ok = call_recording_errors(sched._reserve, by_name[case["reserve"]], case["tokens"], out)
        return ok if raised(ok) else {"returned": ok, **queues(sched, out)}

    def expect(self, case):
        from key_scheduler import preempt_key
        return preempt_key(case)

    KEYS = ["preempted", "returned", "running", "waiting", "held"]

    def judge(self, case, output, expected):
        who, n, want = case["reserve"], case["tokens"], expected["want"]
        situation = (f"_reserve({who}, {n}) with {describe(case)}"
                     + (f", {case['planned']} already in this step's plan" if case["planned"] else ""))
        if same(output, want, self.KEYS):
            return
        named = naming([what for what, answer in expected["mistakes"].items() if same(output, answer, self.KEYS)])
        if raised(output):
            problem = f"it raised {output['raised']}: {output['message']}"
        elif isinstance(output, dict):
            problem = first_difference(output, want, self.KEYS)
        else:
            problem = f"the check got back {kind(output)}"
        raise AssertionError(f"{situation}:{named}\n  {problem}\n(the victims are the newest running sequences "
                             f"not in this step's plan, preempted one at a time until there is room; the return "
                             f"value says whether {who} got its room). Look at {self.where}.")


# ------------------------------------------------------------------ budget fill

class BudgetFill(Check):
    exercise = "scheduler-budget-fill"
    where = "minillm/chunked_prefill.py, ChunkedPrefillScheduler._plan"
    calls = ("scheduler-preempt",)   # it makes room as the scheduler does: by preempting

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
        def decodes(d, count, names):
            return [decoding(next(names), d.int(2, 6)) for _ in range(count)]

        def prompts(d, count, names):
            return [seq(next(names), d.int(1, 9)) for _ in range(count)]

        def fill_the_rest(d):
            names, k = drawn_names(d), d.int(1, 4)
            return self.case(k + d.int(1, 5), decodes(d, k, names),
                             [seq(next(names), d.int(6, 20))] + prompts(d, d.int(0, 1), names))

        def partly_prefilled(d):
            names, prompt = drawn_names(d), d.int(4, 12)
            running = decodes(d, d.int(0, 2), names) + [seq(next(names), prompt, computed=d.int(1, prompt - 1))]
            return self.case(d.int(3, 12), running, prompts(d, d.int(1, 2), names))

        def arrival_order(d):
            waiting = prompts(d, d.int(3, 5), drawn_names(d))
            total = sum(s["prompt"] for s in waiting)
            return self.case(d.int(min(3, total - 1), total - 1), waiting=waiting)  # a budget below them all

        def max_num_seqs(d):
            names, k = drawn_names(d), d.int(1, 3)
            return self.case(12, decodes(d, k, names), prompts(d, d.int(2, 3), names), max_num_seqs=k + d.int(0, 1))

        def whole_budget(d):
            names, k = drawn_names(d), d.int(2, 5)
            return self.case(k, decodes(d, k, names), prompts(d, d.int(1, 2), names))

        def no_room(d):
            names = drawn_names(d)
            running = decodes(d, d.int(1, 2), names)
            held = sum(s["computed"] for s in running) + len(running)
            room = d.int(1, 4)
            waiting = [seq(next(names), room + d.int(1, 4)), seq(next(names), d.int(1, room))]
            return self.case(20, running, waiting, capacity=held + room)

        def preempted(d):
            names = drawn_names(d)
            running = decodes(d, d.int(2, 3), names)
            held = sum(s["computed"] for s in running)
            return self.case(d.int(len(running), 8), running, prompts(d, d.int(1, 2), names),
                             max_num_seqs=len(running), capacity=held, victim=running[-1]["name"])

        def chunks(d):
            prompt, budget = d.int(5, 20), d.int(2, 6)
            return self.case(budget, waiting=[seq(next(drawn_names(d)), prompt)], steps=-(-prompt // budget))

        return {"decodes first, then a new prompt fills the rest": fill_the_rest,
                "a partly prefilled prompt continues before a new one": partly_prefilled,
                "waiting prompts join in arrival order": arrival_order, "max_num_seqs caps the running set": max_num_seqs,
                "decodes use the whole budget": whole_budget, "a prompt without room is not overtaken": no_room,
                "a step that preempted admits no one": preempted, "a long prompt in chunks over several steps": chunks}

    def edges(self):
        """Each edge's situation is fixed (the decodes spend the budget, a chunk fits it exactly, the seats run
        out, a step preempts, a budget of 1); the names, the lengths and the budget around them are drawn."""
        def decodes(d, count, names):
            return [decoding(next(names), d.int(2, 6)) for _ in range(count)]

        def partial(d, names):
            """A running prompt partway through its prefill, with 2..6 tokens left."""
            computed = d.int(1, 5)
            return seq(next(names), computed + d.int(2, 6), computed=computed)

        def left(s):
            return s["prompt"] + s["output"] - s["computed"]

        def whole_budget(d):
            # as many decodes as the budget (max_num_seqs may not exceed it): a waiting prompt gets no token.
            names, k = drawn_names(d), d.int(2, 6)
            return self.case(k, decodes(d, k, names), [seq(next(names), d.int(1, 6))])

        def chunk_fits(d):
            # what the decodes leave is exactly the first waiting prompt: the next one waits.
            names, k = drawn_names(d), d.int(1, 3)
            running, first = decodes(d, k, names), seq(next(names), d.int(2, 8))
            return self.case(k + first["prompt"], running, [first, seq(next(names), d.int(1, 5))],
                             max_num_seqs=k + 2)

        def partial_fits(d):
            # what the decodes leave is exactly the partly prefilled prompt's rest: the waiting one waits.
            names, k = drawn_names(d), d.int(1, 2)
            running = decodes(d, k, names) + [partial(d, names)]
            return self.case(k + left(running[-1]), running, [seq(next(names), d.int(1, 5))], max_num_seqs=k + 2)

        def seats(d):
            # budget for every prompt, seats for only some: the first ones in arrival order join.
            names, k, free = drawn_names(d), d.int(1, 3), d.int(1, 2)
            running, waiting = decodes(d, k, names), [seq(next(names), d.int(1, 4)) for _ in range(free + d.int(1, 2))]
            return self.case(k + sum(s["prompt"] for s in waiting), running, waiting, max_num_seqs=k + free)

        def partial_first(d):
            # the partly prefilled prompt takes its rest before the waiting one gets what is left, in part.
            names, k = drawn_names(d), d.int(1, 2)
            running, new = decodes(d, k, names) + [partial(d, names)], seq(next(names), d.int(2, 6))
            return self.case(k + left(running[-1]) + d.int(1, new["prompt"] - 1), running, [new], max_num_seqs=k + 2)

        def preempted(d):
            # the pool is full: the first decode preempts the newest (the victim), which frees room, and the
            # budget has tokens left for a chunk of the victim or the waiting prompt; yet no one is admitted.
            names = drawn_names(d)
            running = decodes(d, d.int(1, 2), names) + [decoding(next(names), d.int(4, 8))]
            victim = running[-1]
            budget = d.int(len(running), victim["prompt"])   # what the decodes leave fits the room they leave
            return self.case(budget, running, [seq(next(names), d.int(1, 3))], max_num_seqs=budget,
                             capacity=sum(s["computed"] for s in running), victim=victim["name"])

        def budget_of_1(d):
            # one token a step: a prompt of p tokens takes p steps, then it decodes.
            prompt = d.int(2, 5)
            return self.case(1, waiting=[seq(next(drawn_names(d)), prompt)], steps=prompt + 1)

        def steps_in_a_row(d):
            # a decode and two prompts over four steps: chunks, a prompt finishing mid-budget, the next joining.
            names, budget = drawn_names(d), d.int(3, 5)
            return self.case(budget, decodes(d, 1, names), [seq(next(names), d.int(budget + 2, 2 * budget + 1)),
                                                            seq(next(names), d.int(1, 3))], steps=4)

        return {"decodes fill the whole budget": whole_budget,
                "a prompt chunk exactly fits the budget left": chunk_fits,
                "a partial prefill exactly fits the budget left": partial_fits,
                "max_num_seqs reached": seats,
                "a partly prefilled prompt continues before a waiting one": partial_first,
                "no admission in a step that preempted": preempted,
                "a budget of 1": budget_of_1,
                "several steps in a row": steps_in_a_row}

    def run(self, case):
        sched, by_name = build(case, "chunked")
        victim = by_name.get(case["victim"])

        def reserve(s, n, out):
            """Stands in for _reserve (exercise scheduler-preempt): when room is short it preempts the case's victim."""
            if victim in sched.running and victim is not s and not sched.blocks.can_append(s, n):
                sched._preempt(victim, out)
            fits = sched.blocks.can_append(s, n)
            if fits:
                sched.blocks.append_slots(s, n)
            return fits

        sched._reserve = reserve
        steps = []
        for _ in range(case["steps"]):
            out = call_recording_errors(sched.schedule)
            if raised(out):
                return steps + [out]
            steps.append({"plan": [[c.seq.request_id, c.num_tokens, "decode" if c.is_decode else "prefill"]
                                   for c in out.chunks], **queues(sched, out)})
            for c in out.chunks:   # what the engine does after the forward pass
                c.seq.num_computed_tokens += c.num_tokens
                if c.seq.num_remaining == 0:
                    c.seq.output_token_ids.append(1)
        return steps

    def expect(self, case):
        from key_scheduler import budget_fill_key
        return budget_fill_key(case)

    KEYS = ["plan", "preempted", "running", "waiting"]

    def judge(self, case, output, expected):
        situation = f"budget {case['budget']}, max_num_seqs {case['max_num_seqs']}, {describe(case)}"
        if not isinstance(output, list) or not 0 < len(output) <= case["steps"]:
            raise AssertionError(f"{situation}: the check runs {case['steps']} step(s); it got back {kind(output)}. "
                                 f"Look at {self.where}.")
        for i, got in enumerate(output):
            want = expected["want"][i]
            if same(got, want, self.KEYS):
                continue
            named = naming([what for what, answer in expected["mistakes"].items()
                            if all(same(g, a, self.KEYS) for g, a in zip(output[:i + 1], answer[:i + 1]))])
            if raised(got):
                problem = f"schedule() raised {got['raised']}: {got['message']}"
            elif isinstance(got, dict):
                problem = first_difference(got, want, self.KEYS)
            else:
                problem = f"got {kind(got)}"
            step = f"; at step {i + 1} of {case['steps']}" if case["steps"] > 1 else ""
            raise AssertionError(f"{situation}{step}:{named}\n  {problem}\n(a plan is [request, tokens, kind] in "
                                 f"batch order: decodes first, then chunks of partly prefilled prompts, then waiting "
                                 f"prompts in arrival order; no admission in a step that preempted). "
                                 f"Look at {self.where}.")
        if len(output) < case["steps"]:
            raise AssertionError(f"{situation}: the check runs {case['steps']} steps; it got back {len(output)}. "
                                 f"Look at {self.where}.")


# ------------------------------------------------------------------ admission between steps

def ending(name: str, prompt: int, output: int, max_tokens: int) -> dict:
    """Running and decoding, `output` tokens sampled of its `max_tokens`: it finishes when it samples the last."""
    return {**seq(name, prompt, computed=prompt + output - 1, output=output), "max_tokens": max_tokens}


def new(name: str, prompt: int, max_tokens: int = 32) -> dict:
    """Waiting, holding no KV yet."""
    return {**seq(name, prompt), "max_tokens": max_tokens}


class Admit(Check):
    exercise = "scheduler-admit"
    where = "minillm/scheduler.py, Scheduler._plan"

    @staticmethod
    def case(budget, running=(), waiting=(), max_num_seqs=None, capacity=10_000, steps=1):
        return {"budget": budget, "max_num_seqs": max_num_seqs or min(8, budget), "capacity": capacity,
                "running": list(running),
                "waiting": list(waiting), "steps": steps}

    def visible(self):
        return {
            "a seat a finished request leaves is taken at the next step":
                self.case(16, [ending("a", 4, 2, 3), ending("b", 5, 1, 9)], [new("w", 3)], max_num_seqs=2, steps=2),
            "waiting prompts join whole, in arrival order, while the budget lasts":
                self.case(8, waiting=[new("x", 3), new("y", 4), new("z", 3)]),
            "max_num_seqs caps the batch": self.case(16, [ending("a", 4, 1, 9)], [new("b", 2), new("c", 2)],
                                                    max_num_seqs=2),
            "a step that admits runs no decode; the next runs them all":
                self.case(16, [ending("a", 4, 1, 9), ending("b", 3, 2, 9)], [new("w", 2)], steps=2),
            # a holds 5 tokens of a 9-token pool: big (6) has no room, small (2) would, but may not overtake it.
            "a prompt without KV room is not overtaken; the decodes run":
                self.case(16, [ending("a", 4, 2, 9)], [new("big", 6), new("small", 2)], capacity=9),
            "a prompt longer than the budget waits; the decodes run":
                self.case(4, [ending("a", 3, 1, 9)], [new("long", 6)]),
        }

    def situations(self):
        def decodes(d, count, names, finish=False):
            return [ending(next(names), d.int(2, 6), out := d.int(1, 3), out + (1 if finish else d.int(3, 9)))
                    for _ in range(count)]

        def prompts(d, count, names, lo=1, hi=6):
            return [new(next(names), d.int(lo, hi), d.int(2, 6)) for _ in range(count)]

        def seat_freed(d):
            names, k = drawn_names(d), d.int(1, 3)
            running = decodes(d, k, names)
            running.insert(d.int(0, k), decodes(d, 1, names, finish=True)[0])
            return self.case(16, running, prompts(d, d.int(1, 2), names), max_num_seqs=k + 1, steps=d.int(2, 3))

        def arrival_order(d):
            waiting = prompts(d, d.int(3, 5), drawn_names(d), lo=2)  # at least 6 tokens: a budget below them all
            return self.case(d.int(3, sum(s["prompt"] for s in waiting) - 1), waiting=waiting)

        def seats(d):
            names, k = drawn_names(d), d.int(1, 3)
            return self.case(20, decodes(d, k, names), prompts(d, d.int(2, 3), names), max_num_seqs=k + d.int(0, 1))

        def no_decode(d):
            names = drawn_names(d)
            return self.case(20, decodes(d, d.int(1, 3), names), prompts(d, 1, names), steps=2)

        def no_room(d):
            names = drawn_names(d)
            running = decodes(d, d.int(1, 2), names)
            held, room = sum(s["computed"] for s in running), d.int(2, 4)
            waiting = [new(next(names), room + d.int(1, 4)), new(next(names), d.int(1, room - 1))]
            return self.case(20, running, waiting, capacity=held + room)

        def over_budget(d):
            names, budget = drawn_names(d), d.int(2, 6)
            return self.case(budget, decodes(d, d.int(1, 2), names), [new(next(names), budget + d.int(1, 4))])

        return {"a seat a finished request leaves is taken at the next step": seat_freed,
                "waiting prompts join in arrival order": arrival_order, "max_num_seqs caps the batch": seats,
                "a step that admits runs no decode": no_decode, "a prompt without room is not overtaken": no_room,
                "a prompt over the budget waits": over_budget}

    def edges(self):
        """Each edge's situation is fixed (a seat freed while others run, the seats full, the budget spent by two
        prompts, a prompt over the budget, one without room before one with); names and lengths are drawn."""
        def decodes(d, count, names):
            return [ending(next(names), d.int(2, 6), out := d.int(1, 3), out + d.int(4, 9)) for _ in range(count)]

        def seat_freed(d):
            # one of the batch finishes at step 1; the others run on: the waiting prompt joins at step 2.
            names, k = drawn_names(d), d.int(1, 3)
            running = decodes(d, k, names)
            running.insert(d.int(0, k), ending(next(names), d.int(2, 6), 1, 2))
            return self.case(16, running, [new(next(names), d.int(1, 6))], max_num_seqs=k + 1, steps=2)

        def seats_full(d):
            # every seat taken: the prompt waits, though budget and room are there.
            names, k = drawn_names(d), d.int(1, 4)
            return self.case(16, decodes(d, k, names), [new(next(names), d.int(1, 6))], max_num_seqs=k)

        def budget_spent(d):
            # each prompt fits the budget alone, not both together: only the first joins.
            names, budget = drawn_names(d), d.int(4, 8)
            first = d.int(1, budget - 1)
            return self.case(budget, [], [new(next(names), first), new(next(names), d.int(budget - first + 1, budget))])

        def over_budget(d):
            # a prompt over the budget waits, and the decodes run.
            names, budget = drawn_names(d), d.int(2, 6)
            return self.case(budget, decodes(d, d.int(1, 2), names), [new(next(names), budget + d.int(1, 3))])

        def admits_alone(d):
            # a prompt joins: its step runs it alone, the decodes wait a step.
            names = drawn_names(d)
            return self.case(16, decodes(d, d.int(1, 3), names), [new(next(names), d.int(1, 6))])

        def not_overtaken(d):
            # the first prompt has no room, the second would: neither joins, the decodes run.
            names = drawn_names(d)
            running = decodes(d, 1, names)
            room = d.int(2, 4)
            return self.case(16, running, [new(next(names), room + d.int(1, 3)), new(next(names), d.int(1, room - 1))],
                             capacity=running[0]["computed"] + room)

        return {"a seat freed while the others run": seat_freed, "every seat taken": seats_full,
                "the budget spent by the first prompt": budget_spent, "a prompt over the budget": over_budget,
                "a step of its own for an admitted prompt": admits_alone, "no overtaking": not_overtaken}

    def run(self, case):
        from minillm.sampling_params import SamplingParams
        from minillm.scheduler import Scheduler, SchedulerConfig
        from minillm.sequence import RequestMetrics, Sequence, SequenceStatus
        config = SchedulerConfig(max_num_batched_tokens=case["budget"], max_num_seqs=case["max_num_seqs"],
                                 enable_chunked_prefill=False)
        sched = Scheduler(config, TokenCountingBlocks(case["capacity"]))
        for queue in ("running", "waiting"):
            for s in case[queue]:
                made = Sequence(s["name"], list(range(s["prompt"])),
                                SamplingParams(temperature=0.0, max_tokens=s["max_tokens"]), RequestMetrics(0.0))
                made.output_token_ids = [1] * s["output"]
                made.num_computed_tokens = s["computed"]
                if queue == "running":
                    made.status = SequenceStatus.RUNNING
                    sched.running.append(made)
                    sched.blocks.held[made.seq_id] = s["computed"]
                else:
                    sched.add(made)
        steps = []
        for i in range(case["steps"]):
            out = call_recording_errors(sched.schedule)
            if raised(out):
                return steps + [out]
            names = {x.seq_id: x.request_id for x in [*sched.running, *sched.waiting]}
            step = {"plan": [[c.seq.request_id, c.num_tokens, "decode" if c.is_decode else "prefill"]
                             for c in out.chunks], "running": [x.request_id for x in sched.running],
                    "waiting": [x.request_id for x in sched.waiting],
                    "held": {names.get(k, str(k)): n for k, n in sched.blocks.held.items()}}
            finished = []
            for c in out.chunks:   # the engine's forward pass and update (the stop rule: max_tokens, here)
                c.seq.num_computed_tokens += c.num_tokens
                if c.seq.num_remaining == 0:
                    c.seq.output_token_ids.append(1)
                    if len(c.seq.output_token_ids) >= c.seq.params.max_tokens:
                        sched.remove(c.seq)   # its seat and blocks back at once (exercise scheduler-finish's part)
                        c.seq.finish("length", float(i))
                        finished.append(c.seq.request_id)
            steps.append({**step, "finished": finished})
        return steps

    def expect(self, case):
        from key_scheduler import admit_key
        return admit_key(case)

    KEYS = ["plan", "running", "waiting", "held", "finished"]

    def judge(self, case, output, expected):
        situation = f"budget {case['budget']}, max_num_seqs {case['max_num_seqs']}, {describe(case)}"
        if not isinstance(output, list) or not 0 < len(output) <= case["steps"]:
            raise AssertionError(f"{situation}: the check runs {case['steps']} step(s); it got back {kind(output)}. "
                                 f"Look at {self.where}.")
        for i, got in enumerate(output):
            want = expected["want"][i]
            if same(got, want, self.KEYS):
                continue
            named = naming([what for what, answer in expected["mistakes"].items()
                            if all(same(g, a, self.KEYS) for g, a in zip(output[:i + 1], answer[:i + 1]))])
            if raised(got):
                problem = f"schedule() raised {got['raised']}: {got['message']}"
            elif isinstance(got, dict):
                problem = first_difference(got, want, self.KEYS)
            else:
                problem = f"got {kind(got)}"
            step = f"; at step {i + 1} of {case['steps']}" if case["steps"] > 1 else ""
            raise AssertionError(f"{situation}{step}:{named}\n  {problem}\n(a plan is [request, tokens, kind]: a "
                                 f"step admits waiting prompts whole, in arrival order, into the seats free now; a "
                                 f"step that admits none runs every decode). Look at {self.where}.")
        if len(output) < case["steps"]:
            raise AssertionError(f"{situation}: the check runs {case['steps']} steps; it got back {len(output)}. "
                                 f"Look at {self.where}.")


# ------------------------------------------------------------------ the end of a request

class Finish(Check):
    exercise = "scheduler-finish"
    where = "minillm/scheduler.py, Scheduler.finish_if_done"

    @staticmethod
    def case(running, steps, waiting=(), eos=0):
        """`steps`: each step's sampled tokens as [request, token], in the order the step checks them."""
        return {"eos": eos, "running": list(running), "waiting": list(waiting), "steps": [list(s) for s in steps],
                "capacity": 10_000}

    def visible(self):
        return {
            "max_tokens reached: it leaves the queue and frees its blocks in the same call":
                self.case([ending("a", 4, 2, 3), ending("b", 5, 1, 9)], [[["b", 7], ["a", 5]]]),
            "the end-of-text token ends it, whatever max_tokens says":
                self.case([ending("a", 3, 1, 9), ending("b", 4, 1, 9)], [[["a", 0], ["b", 3]], [["b", 4]]]),
            "a request that goes on stays, holding its blocks":
                self.case([ending("a", 3, 1, 9)], [[["a", 5]], [["a", 6]]], waiting=[new("w", 4)]),
            "several end in one step; a waiting request is untouched":
                self.case([ending("a", 2, 1, 2), ending("b", 3, 2, 9), ending("c", 2, 1, 9)],
                          [[["a", 4], ["b", 0], ["c", 8]]], waiting=[new("w", 2)]),
        }

    @staticmethod
    def play(d, running, count):
        """`count` steps in which every request not yet ended samples a token: the end-of-text token (0) now and
        then, any other token otherwise; each step checks them in a drawn order."""
        left, steps = {s["name"]: s["max_tokens"] - s["output"] for s in running}, []
        for _ in range(count):
            names = d.sample(sorted(left), len(left))
            if not names:
                break
            step = [[n, 0 if d.int(0, 4) == 0 else d.int(1, 99)] for n in names]
            for n, token in step:
                left[n] -= 1
                if token == 0 or left[n] == 0:
                    del left[n]
            steps.append(step)
        return steps

    def situations(self):
        def running(d, count, names):
            return [ending(next(names), d.int(2, 6), out := d.int(1, 3), out + d.int(1, 4)) for _ in range(count)]

        def steps_of(d):
            names = drawn_names(d)
            r = running(d, d.int(1, 4), names)
            return self.case(r, self.play(d, r, d.int(1, 4)), waiting=[new(next(names), d.int(1, 6))])

        def one_step(d):
            names = drawn_names(d)
            r = running(d, d.int(2, 5), names)
            return self.case(r, self.play(d, r, 1))

        def goes_on(d):
            names = drawn_names(d)
            r = [ending(next(names), d.int(2, 6), out := d.int(1, 3), out + 5) for _ in range(d.int(1, 3))]
            return self.case(r, [[[s["name"], d.int(1, 99)] for s in r]], waiting=[new(next(names), d.int(1, 6))])

        def eos(d):
            names = drawn_names(d)
            r = running(d, d.int(1, 3), names)
            return self.case(r, [[[s["name"], 0] for s in r]])

        return {"max_tokens reached": one_step, "the end-of-text token ends it": eos,
                "a request that goes on stays": goes_on, "several steps, several ends": steps_of}

    def edges(self):
        """Each edge's situation is fixed (who ends, and that it is checked last in its step); the names, the
        lengths and the tokens are drawn."""
        def last_ends(d):
            # the last request a step checks reaches max_tokens; the others go on: it must leave in that call.
            names = drawn_names(d)
            others = [ending(next(names), d.int(2, 6), out := d.int(1, 3), out + 5) for _ in range(d.int(1, 3))]
            last = ending(next(names), d.int(2, 6), out := d.int(1, 3), out + 1)
            order = others + [last]
            return self.case(d.sample(order, len(order)), [[[s["name"], d.int(1, 99)] for s in order]])

        def eos_alone(d):
            # the only running request draws the end-of-text token far from its max_tokens.
            names = drawn_names(d)
            name = next(names)
            return self.case([ending(name, d.int(2, 6), d.int(1, 3), 20)], [[[name, 0]]],
                             waiting=[new(next(names), d.int(1, 6))])

        def goes_on(d):
            # no token ends anyone: every call returns False and nothing moves.
            names = drawn_names(d)
            r = [ending(next(names), d.int(2, 6), out := d.int(1, 3), out + 5) for _ in range(d.int(1, 3))]
            return self.case(r, [[[s["name"], d.int(1, 99)] for s in r]])
        return {"the last request of a step ends": last_ends, "the end-of-text token, far from max_tokens": eos_alone,
                "nobody ends": goes_on}

    def run(self, case):
        from minillm.sampling_params import SamplingParams
        from minillm.scheduler import Scheduler, SchedulerConfig
        from minillm.sequence import RequestMetrics, Sequence, SequenceStatus
        sched = Scheduler(SchedulerConfig(enable_chunked_prefill=False), TokenCountingBlocks(case["capacity"]),
                          eos_token_id=case["eos"])
        by_name = {}
        for queue in ("running", "waiting"):
            for s in case[queue]:
                made = Sequence(s["name"], list(range(s["prompt"])),
                                SamplingParams(temperature=0.0, max_tokens=s["max_tokens"]), RequestMetrics(0.0))
                made.output_token_ids = [1] * s["output"]
                made.num_computed_tokens = s["computed"]
                by_name[s["name"]] = made
                if queue == "running":
                    made.status = SequenceStatus.RUNNING
                    sched.running.append(made)
                    sched.blocks.held[made.seq_id] = s["computed"]
                else:
                    sched.add(made)
        names = {x.seq_id: x.request_id for x in by_name.values()}
        steps = []
        for now, sampled in enumerate(case["steps"]):
            returned = {}
            for name, token in sampled:   # what update does for each sampled token, then the stop rule
                seq = by_name[name]
                seq.output_token_ids.append(token)
                got = call_recording_errors(sched.finish_if_done, seq, float(now))
                if raised(got):
                    return steps + [got]
                returned[name] = got
            steps.append({"running": [x.request_id for x in sched.running],
                          "waiting": [x.request_id for x in sched.waiting],
                          "held": {names[k]: n for k, n in sched.blocks.held.items()},
                          "finished": {x.request_id: [x.finish_reason, x.metrics.finished_time]
                                       for x in by_name.values() if x.is_finished},
                          "returned": returned})
        return steps

    def expect(self, case):
        from key_scheduler import finish_key
        return finish_key(case)

    KEYS = ["running", "waiting", "held", "finished", "returned"]

    def judge(self, case, output, expected):
        situation = f"end-of-text token {case['eos']}, {describe(case)}, sampled {case['steps']}"
        count = len(case["steps"])
        if not isinstance(output, list) or not 0 < len(output) <= count:
            raise AssertionError(f"{situation}: the check runs {count} step(s); it got back {kind(output)}. "
                                 f"Look at {self.where}.")
        for i, got in enumerate(output):
            want = expected["want"][i]
            if same(got, want, self.KEYS):
                continue
            named = naming([what for what, answer in expected["mistakes"].items()
                            if all(same(g, a, self.KEYS) for g, a in zip(output[:i + 1], answer[:i + 1]))])
            if raised(got):
                problem = f"finish_if_done raised {got['raised']}: {got['message']}"
            elif isinstance(got, dict):
                problem = first_difference(got, want, self.KEYS)
            else:
                problem = f"got {kind(got)}"
            raise AssertionError(f"{situation}; after step {i + 1} of {count}:{named}\n  {problem}\n(a request the "
                                 f"stop rule ends leaves the queues, gives back its blocks and is finished, all in "
                                 f"the call that ends it). Look at {self.where}.")
        if len(output) < count:
            raise AssertionError(f"{situation}: the check runs {count} steps; it got back {len(output)}. "
                                 f"Look at {self.where}.")


PREEMPT, ADMIT, FINISH, BUDGET_FILL = Preempt(), Admit(), Finish(), BudgetFill()
test_preempt = PREEMPT.pytest_test()
test_admit = ADMIT.pytest_test()
test_finish = FINISH.pytest_test()
test_budget_fill = BUDGET_FILL.pytest_test()
