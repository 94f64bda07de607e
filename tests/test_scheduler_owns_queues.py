"""Only the scheduler touches its queues, and the wings read an engine only through its public surface.

Walked over the syntax tree of every file in minillm/ (but the scheduler's own two files), lessons/ and
gpu_check.py, with no import and no run:

- nothing outside `scheduler.py` and `chunked_prefill.py` assigns an attribute of a scheduler (its `running` or
  `waiting` queue, or a method replaced on a live one), mutates a queue (`append`, `remove`, `insert`, `extend`,
  `extendleft`, `appendleft`, `pop`, `popleft`, `clear`, `sort`, item or slice assignment, `+=`, `del`), or
  mutates a name bound to a queue; other files ask the scheduler with a verb (`add`, `remove`, `update`, `fork`,
  `start_running`, `requeue`);
- no file of the wings (minillm/serving, minillm/bench, minillm/classroom), of lessons/ or gpu_check.py reads an
  attribute whose name starts with `_` of an engine or a scheduler: they read `engine.stats()`.

A scheduler is an expression that ends in `scheduler` (`engine.scheduler`, `self.scheduler`, a parameter
`scheduler`), or a name bound to one; an engine one that ends in `engine`, or a name bound to an `LLMEngine(...)`.
The checker is itself checked on snippets that break each rule, and on ones that must pass. The verbs are
checked last, on a fake block space that only counts: `update` appends, applies the one stop rule and removes the
finished; `fork` seats samples after their parent while `max_num_seqs` allows; `requeue` and `start_running`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUEUES = {"running", "waiting"}
MUTATORS = {"append", "remove", "insert", "extend", "extendleft", "appendleft", "pop", "popleft", "clear", "sort"}
OWNERS = {ROOT / "minillm" / "scheduler.py", ROOT / "minillm" / "chunked_prefill.py"}
WINGS = ("serving", "bench", "classroom")


def checked_files() -> list[Path]:
    files = [*sorted((ROOT / "minillm").rglob("*.py")), *sorted((ROOT / "lessons").rglob("*.py")),
             ROOT / "gpu_check.py"]
    return [f for f in files if f not in OWNERS]


def is_wing(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return rel[0] in ("lessons", "gpu_check.py") or (rel[0] == "minillm" and len(rel) > 2 and rel[1] in WINGS)


def _ends_in(node: ast.AST, word: str) -> bool:
    return bool(re.search(rf"(^|\.){word}$", ast.unparse(node)))


def _bindings(tree: ast.AST, is_source) -> set[str]:
    """Names bound (by assignment, tuple unpacking included, or a `with ... as`) to an expression `is_source` accepts,
    and parameters named or annotated as one."""
    names = set()
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(target.elts, node.value.elts)
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((node.optional_vars, node.context_expr))
        elif isinstance(node, ast.arg):
            if is_source(ast.Name(node.arg)) or (node.annotation is not None and is_source(node.annotation)):
                names.add(node.arg)
        names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and is_source(v)}
    return names


def violations(source: str, wing: bool) -> list[str]:
    """Each breach of the two rules in `source`, as `line: what`."""
    tree = ast.parse(source)
    schedulers = _bindings(tree, lambda v: _ends_in(v, "scheduler") or _ends_in(v, "Scheduler")
                           or (isinstance(v, ast.Call) and _ends_in(v.func, r"\w*Scheduler")))
    schedulers |= _bindings(tree, lambda v: isinstance(v, ast.Name) and v.id in schedulers)

    def is_scheduler(node) -> bool:
        return _ends_in(node, "scheduler") or (isinstance(node, ast.Name) and node.id in schedulers)

    def is_queue(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in QUEUES and is_scheduler(node.value)

    queues = _bindings(tree, is_queue)
    engines = _bindings(tree, lambda v: _ends_in(v, "engine") or _ends_in(v, "LLMEngine")
                        or (isinstance(v, ast.Call) and _ends_in(v.func, "LLMEngine")))

    def is_engine(node) -> bool:
        return _ends_in(node, "engine") or (isinstance(node, ast.Name) and node.id in engines)

    def queue_or_alias(node) -> bool:
        return is_queue(node) or (isinstance(node, ast.Name) and node.id in queues)

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in [t for top in targets for t in ast.walk(top) if isinstance(t, (ast.Attribute, ast.Subscript))]:
            if isinstance(target, ast.Attribute) and is_scheduler(target.value) and isinstance(target.ctx, ast.Store):
                found.append(f"{node.lineno}: assigns {ast.unparse(target)}")
            elif isinstance(target, ast.Attribute) and isinstance(node, ast.Delete) and is_scheduler(target.value):
                found.append(f"{node.lineno}: deletes {ast.unparse(target)}")
            elif isinstance(target, ast.Subscript) and queue_or_alias(target.value) \
                    and isinstance(target.ctx, (ast.Store, ast.Del)):
                found.append(f"{node.lineno}: changes an item of {ast.unparse(target.value)}")
            elif isinstance(node, ast.AugAssign) and target is node.target and queue_or_alias(target):
                found.append(f"{node.lineno}: extends {ast.unparse(target)} in place")
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id in queues:
            found.append(f"{node.lineno}: extends {node.target.id} (a scheduler's queue) in place")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and queue_or_alias(node.func.value):
            found.append(f"{node.lineno}: calls {ast.unparse(node.func)}")
        if wing and isinstance(node, ast.Attribute) and re.match(r"_[a-z]", node.attr) \
                and (is_engine(node.value) or is_scheduler(node.value)):
            found.append(f"{node.lineno}: reads {ast.unparse(node)}, a private field")
        if wing and isinstance(node, ast.Call) and _ends_in(node.func, "getattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and re.match(r"_[a-z]", str(node.args[1].value)) \
                and (is_engine(node.args[0]) or is_scheduler(node.args[0])):
            found.append(f"{node.lineno}: reads {ast.unparse(node)}, a private field")
    return found


def test_only_the_scheduler_touches_its_queues_and_the_wings_read_no_private_field():
    broken = {str(f.relative_to(ROOT)): v for f in checked_files()
              if (v := violations(f.read_text(), is_wing(f)))}
    assert not broken, ("outside scheduler.py and chunked_prefill.py, ask the scheduler (add, remove, update, fork, "
                        "start_running, requeue) and read the engine through engine.stats(): "
                        + "; ".join(f"{path}:{line}" for path, lines in broken.items() for line in lines))


def test_the_walk_covers_the_book_the_wings_the_lessons_and_the_gpu_check():
    files = {str(f.relative_to(ROOT)) for f in checked_files()}
    assert {"minillm/engine.py", "minillm/rollback.py", "minillm/parallel_sampling.py", "minillm/bench/replay.py",
            "minillm/serving/disaggregated.py", "minillm/serving/live.py", "gpu_check.py"} <= files
    assert "minillm/scheduler.py" not in files and "minillm/chunked_prefill.py" not in files
    assert any(f.startswith("lessons/") for f in files)
    assert is_wing(ROOT / "minillm" / "serving" / "live.py") and is_wing(ROOT / "lessons" / "07_fragmentation.py")
    assert not is_wing(ROOT / "minillm" / "engine.py") and is_wing(ROOT / "gpu_check.py")


# Each snippet breaks a rule the way the code once did, or could: the checker must name it.
BREAKS = {
    "append to the running queue": "engine.scheduler.running.append(seq)",
    "a fork that inserts by hand": "def start(leader, scheduler):\n    scheduler.running.insert(1, leader)",
    "extendleft through an alias": "s, bm = engine.scheduler, engine.block_manager\ns.waiting.extendleft(back)",
    "assign the queue": "def recover(engine):\n    s = engine.scheduler\n    s.running = list(reversed(s.running))",
    "remove from waiting": "self.scheduler.waiting.remove(seq)",
    "popleft": "engine.scheduler.waiting.popleft()",
    "clear, through a name bound to the queue": "q = engine.scheduler.running\nq.clear()",
    "item assignment": "engine.scheduler.running[0] = seq",
    "slice assignment": "engine.scheduler.waiting[:] = []",
    "del an item": "del engine.scheduler.running[-1]",
    "+= on the queue": "engine.scheduler.running += [seq]",
    "sort": "sched = ChunkedPrefillScheduler(config, blocks)\nsched.running.sort(key=len)",
    "a monkeypatched schedule": "engine.scheduler.schedule = spy",
}
WING_BREAKS = {
    "a private field of the engine": "n = len(engine._unreported)",
    "a private field through the engine thread's name": "self.engine._remote.clear()",
    "a private field by getattr": "getattr(engine, '_remote')",
    "a private field of a built engine": "e = LLMEngine(model)\nprint(e._next_id)",
    "a private method of the scheduler": "engine.scheduler._plan(out)",
}
PASSES = [
    "len(engine.scheduler.running) + len(engine.scheduler.waiting)",
    "running, blocks = engine.scheduler.running, engine.block_manager\nn = sum(s.num_computed_tokens for s in running)",
    "class StepRecord:\n    def __init__(self, running, waiting):\n        self.running, self.waiting = running, waiting",
    "engine.scheduler.add(seq)\nengine.scheduler.update(sampled, now)\nengine.scheduler.requeue(back)",
    "now = engine.stats(64, tables=True)\nrunning = list(now.running)\nrunning.append('x')",
    "self._inbox.put(item)",
]


def test_the_checker_names_every_way_to_touch_a_queue_or_a_private_field():
    for what, source in BREAKS.items():
        assert violations(source, wing=False), f"not caught: {what}: {source!r}"
    for what, source in WING_BREAKS.items():
        assert violations(source, wing=True), f"not caught in a wing: {what}: {source!r}"
        assert not violations(source, wing=False), f"a book file may read its own engine's fields: {source!r}"
    for source in PASSES:
        assert not violations(source, wing=True), f"a false alarm: {source!r}: {violations(source, wing=True)}"


# ---- the verbs, on a fake block space that only counts: the scheduler side needs no model ----------------------

class CountingBlocks:
    """A block space of one-token blocks: what each sequence holds, and who forked from whom."""
    def __init__(self, size: int = 1000):
        self.size, self.held, self.forks = size, {}, []

    def match_prefix(self, seq): return 0
    def can_append(self, seq, n): return sum(self.held.values()) + n <= self.size
    def append_slots(self, seq, n): self.held[seq.seq_id] = self.held.get(seq.seq_id, 0) + n
    def free(self, seq): self.held.pop(seq.seq_id, None)

    def fork(self, parent, child):
        self.forks.append((parent.request_id, child.index))
        self.held[child.seq_id] = self.held[parent.seq_id]


def make(max_num_seqs: int = 4, n_ctx: int = 64, eos: int | None = 0):
    from minillm.chunked_prefill import ChunkedPrefillScheduler
    from minillm.scheduler import SchedulerConfig
    blocks = CountingBlocks()
    return ChunkedPrefillScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs), blocks,
                                   eos_token_id=eos, n_ctx=n_ctx), blocks


def request(rid: str, prompt: int = 4, **kwargs):
    from minillm.sampling_params import SamplingParams
    from minillm.sequence import RequestMetrics, Sequence
    params = SamplingParams(temperature=0.0, **kwargs)
    return Sequence(rid, tuple(range(1, prompt + 1)), params, RequestMetrics(0.0))


def test_update_appends_applies_the_one_stop_rule_and_removes_the_finished():
    s, blocks = make(eos=0)
    a, b, c = request("a", max_tokens=2), request("b", max_tokens=9), request("c", max_tokens=9, ignore_eos=True)
    for seq in (a, b, c):
        s.add(seq)
    s.schedule()
    for seq in (a, b, c):
        seq.num_computed_tokens = seq.num_tokens  # the step ran
    s.update([(a, 7, None), (b, 0, None), (c, 0, None)], now=1.0)  # b drew the end-of-text token; c ignores it
    assert [x.request_id for x in s.running] == ["a", "c"] and b.finish_reason == "stop"
    assert b.seq_id not in blocks.held and b.metrics.finished_time == 1.0 and b.output_token_ids == [0]
    s.schedule()
    a.num_computed_tokens, c.num_computed_tokens = a.num_tokens, c.num_tokens
    s.update([(a, 8, None), (c, 9, None)], now=2.0)  # a reached max_tokens
    assert [x.request_id for x in s.running] == ["c"] and a.finish_reason == "length"
    assert a.metrics.token_times == [1.0, 2.0] and a.seq_id not in blocks.held and c.finish_reason is None


def test_the_context_limit_is_the_stop_rule_too():
    s, _ = make(n_ctx=5)
    a = request("a", prompt=4, max_tokens=9, ignore_eos=True)
    s.add(a)
    s.schedule()
    a.num_computed_tokens = 4
    s.update([(a, 3, None)], now=0.0)
    assert a.finish_reason is None  # 5 tokens: the next step feeds position 4, the last there is
    s.schedule()
    a.num_computed_tokens = 5
    s.update([(a, 3, None)], now=0.0)
    assert a.finish_reason == "length" and not s.has_unfinished()


def test_fork_puts_the_samples_right_after_their_parent_and_the_rest_at_the_front_of_waiting():
    s, blocks = make(max_num_seqs=3)
    leader, other, late = request("a", max_tokens=9), request("b", max_tokens=9), request("z", max_tokens=9)
    samples = [request("a", max_tokens=9) for _ in range(2)]
    for j, seq in enumerate(samples, 1):
        seq.index = j
    leader.samples = samples
    for seq in (leader, other, late):
        s.add(seq)
    s.schedule()  # a, b and z run: max_num_seqs = 3
    assert len(s.running) == 3
    s.requeue([late])  # make room for one sample: z waits again, holding nothing
    assert [x.request_id for x in s.waiting] == ["z"] and late.seq_id not in blocks.held
    leader.num_computed_tokens = leader.num_tokens
    s.update([(leader, 5, None), (samples[0], 6, None), (samples[1], 7, None)], now=3.0)
    assert [(x.request_id, x.index) for x in s.running] == [("a", 0), ("a", 1), ("b", 0)]
    assert list(s.waiting) == [samples[1], late], "the sample with no seat waits first, before z"
    assert blocks.forks == [("a", 1)] and samples[0].num_computed_tokens == leader.num_computed_tokens
    assert samples[1].output_token_ids == [7] and samples[1].num_computed_tokens == 0


def test_requeue_keeps_the_order_given_and_a_waiting_sequence_keeps_its_place():
    s, blocks = make()
    a, b, c = (request(r, max_tokens=9) for r in "abc")
    for seq in (a, b, c):
        s.add(seq)
    s.schedule()
    s.requeue([b])
    s.requeue([a, b])  # b already waits: its place is kept, a goes in front of it
    assert [x.request_id for x in s.waiting] == ["a", "b"] and [x.request_id for x in s.running] == ["c"]
    assert a.num_computed_tokens == 0 and a.seq_id not in blocks.held


def test_start_running_joins_a_sequence_whose_kv_is_held_and_update_may_end_it_at_once():
    s, blocks = make(eos=0)
    a = request("a", max_tokens=9)
    blocks.append_slots(a, 4)
    a.num_computed_tokens = 4
    s.start_running(a)
    assert s.running == [a] and not s.waiting
    s.update([(a, 0, None)], now=5.0)  # its first token is the end-of-text token
    assert a.finish_reason == "stop" and not s.has_unfinished() and a.seq_id not in blocks.held
