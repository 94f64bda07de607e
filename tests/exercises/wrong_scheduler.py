"""Plausible wrong versions of the scheduler exercise regions (minillm/scheduler.py, minillm/chunked_prefill.py):
the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented. The answer key (key_scheduler.py) replays most of them, so that
a message can name the mistake.
"""

WRONG = {
    "scheduler-preempt": {
        "preempts the oldest running sequence first instead of the newest": """
victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
victim = victims[0] if victims else seq
self._preempt(victim, out)
if victim is seq:
    return False
""",
        "preempts a sequence already in this step's plan": """
victims = [s for s in self.running if s is not seq]
victim = victims[-1] if victims else seq
self._preempt(victim, out)
if victim is seq:
    return False
""",
        "stops after one preemption even without room": """
victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
victim = victims[-1] if victims else seq
self._preempt(victim, out)
if victim is seq:
    return False
break
""",
        "returns after the first preemption, room or not": """
victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
victim = victims[-1] if victims else seq
self._preempt(victim, out)
return victim is not seq
""",
        "forgets to give the sequence its room once there is some": """
victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
victim = victims[-1] if victims else seq
self._preempt(victim, out)
if victim is seq:
    return False
if self.blocks.can_append(seq, num_tokens):
    return True
""",
        "returns True when the sequence gave way itself": """
victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
victim = victims[-1] if victims else seq
self._preempt(victim, out)
if victim is seq:
    return True
""",
    },
    "scheduler-admit": {
        'admits only when the batch is empty (static batching)': """
budget = self.config.max_num_batched_tokens
if not self.running:
    while self.waiting and len(self.running) < self.config.max_num_seqs:
        seq = self._start_first_waiting()
        if seq.num_remaining > budget or not self.blocks.can_append(seq, seq.num_remaining):
            break
        budget -= seq.num_remaining
        self._admit(seq, seq.num_remaining, out)
if not out.chunks:
    self._schedule_decodes(out)
""",
        'admits one past max_num_seqs': """
budget = self.config.max_num_batched_tokens
while self.waiting and len(self.running) <= self.config.max_num_seqs:
    seq = self._start_first_waiting()
    if seq.num_remaining > budget or not self.blocks.can_append(seq, seq.num_remaining):
        break
    budget -= seq.num_remaining
    self._admit(seq, seq.num_remaining, out)
if not out.chunks:
    self._schedule_decodes(out)
""",
        'never spends the budget': """
budget = self.config.max_num_batched_tokens
while self.waiting and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    if seq.num_remaining > budget or not self.blocks.can_append(seq, seq.num_remaining):
        break
    self._admit(seq, seq.num_remaining, out)
if not out.chunks:
    self._schedule_decodes(out)
""",
        'ignores the token budget': """
budget = self.config.max_num_batched_tokens
while self.waiting and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    if not self.blocks.can_append(seq, seq.num_remaining):
        break
    budget -= seq.num_remaining
    self._admit(seq, seq.num_remaining, out)
if not out.chunks:
    self._schedule_decodes(out)
""",
        'runs the decodes in the step that admits': """
budget = self.config.max_num_batched_tokens
while self.waiting and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    if seq.num_remaining > budget or not self.blocks.can_append(seq, seq.num_remaining):
        break
    budget -= seq.num_remaining
    self._admit(seq, seq.num_remaining, out)
self._schedule_decodes(out)
""",
    },
    "scheduler-finish": {
        "frees a finished request's blocks a step late (at the next call)": """
for done in [s for s in self.running if s.is_finished]:
    self.remove(done)
reason = seq.end_reason(self.eos_token_id, self.n_ctx)
if reason:
    seq.finish(reason, now)
return bool(reason)
""",
        'takes it off the running queue but never frees its blocks': """
reason = seq.end_reason(self.eos_token_id, self.n_ctx)
if reason:
    self.running.remove(seq)
    seq.finish(reason, now)
return bool(reason)
""",
        'frees it but never marks it finished': """
reason = seq.end_reason(self.eos_token_id, self.n_ctx)
if reason:
    self.remove(seq)
return bool(reason)
""",
        'marks it finished and leaves it running': """
reason = seq.end_reason(self.eos_token_id, self.n_ctx)
if reason:
    seq.finish(reason, now)
return bool(reason)
""",
        'returns True whether or not it ended': """
reason = seq.end_reason(self.eos_token_id, self.n_ctx)
if reason:
    self.remove(seq)
    seq.finish(reason, now)
return True
""",
    },
    "scheduler-budget-fill": {
        "plans prompt chunks before the decodes": """
budget = self.config.max_num_batched_tokens
for seq in list(self.running):
    if budget == 0:
        break
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = min(seq.num_remaining, budget)
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
if not out.preempted:
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
        seq = self._start_first_waiting()
        n = min(seq.num_remaining, budget)
        if not self.blocks.can_append(seq, n):
            break
        self._admit(seq, n, out)
        budget -= n
self._schedule_decodes(out)
""",
        "does not take the decodes' tokens from the budget": """
self._schedule_decodes(out)
budget = self.config.max_num_batched_tokens
for seq in list(self.running):
    if budget == 0:
        return
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = min(seq.num_remaining, budget)
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
if out.preempted:
    return
while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    n = min(seq.num_remaining, budget)
    if not self.blocks.can_append(seq, n):
        return
    self._admit(seq, n, out)
    budget -= n
""",
        "admits waiting prompts before continuing partial prefills": """
budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
if not out.preempted:
    while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
        seq = self._start_first_waiting()
        n = min(seq.num_remaining, budget)
        if not self.blocks.can_append(seq, n):
            break
        self._admit(seq, n, out)
        budget -= n
for seq in list(self.running):
    if budget == 0:
        return
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = min(seq.num_remaining, budget)
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
""",
        "ignores max_num_seqs": """
budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
for seq in list(self.running):
    if budget == 0:
        return
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = min(seq.num_remaining, budget)
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
if out.preempted:
    return
while self.waiting and budget > 0:
    seq = self._start_first_waiting()
    n = min(seq.num_remaining, budget)
    if not self.blocks.can_append(seq, n):
        return
    self._admit(seq, n, out)
    budget -= n
""",
        "admits waiting prompts in a step that preempted": """
budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
for seq in list(self.running):
    if budget == 0:
        return
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = min(seq.num_remaining, budget)
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    n = min(seq.num_remaining, budget)
    if not self.blocks.can_append(seq, n):
        return
    self._admit(seq, n, out)
    budget -= n
""",
        "does not cap a chunk by the budget left": """
budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
for seq in list(self.running):
    if budget == 0:
        return
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = seq.num_remaining
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
if out.preempted:
    return
while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    n = seq.num_remaining
    if not self.blocks.can_append(seq, n):
        return
    self._admit(seq, n, out)
    budget -= n
""",
        "stops admitting with one token of budget left (off by one)": """
budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
for seq in list(self.running):
    if budget == 0:
        return
    if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
        n = min(seq.num_remaining, budget)
        if self._reserve(seq, n, out):
            out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
            budget -= n
if out.preempted:
    return
while self.waiting and budget > 1 and len(self.running) < self.config.max_num_seqs:
    seq = self._start_first_waiting()
    n = min(seq.num_remaining, budget)
    if not self.blocks.can_append(seq, n):
        return
    self._admit(seq, n, out)
    budget -= n
""",
    },
}
