"""Continuous batching: which sequences run each step, and with how many tokens.

Pure bookkeeping, no tensors. Every step each running sequence advances once: a
sequence with more than one token to compute gets a prefill chunk (within the step's
prompt-token budget), one with exactly one (its last sampled token) joins the decode
batch. Waiting sequences are admitted in arrival order while there is a free tail page
and the device tier can hold what the running batch may still need (a reservation of
each sequence's pages up to its `max_new_tokens`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.compute.llm.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class StepPlan:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, page_size: int, max_running: int, max_prefill_tokens: int, capacity_pages: int) -> None:
        self.page_size = page_size
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.capacity_pages = capacity_pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved_pages = 0

    def pages_needed(self, seq: Sequence) -> int:
        """Pages `seq` may hold by its end: its tokens so far plus the ones it may still sample."""
        remaining = max(seq.params.max_new_tokens - seq.num_output, 0)
        return -(-(len(seq.token_ids) + remaining) // self.page_size)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the head of the queue."""
        self._drop_running(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def next_admissible(self, free_tails: int, pinned_pages: int) -> Sequence | None:
        """The head of the queue if it may start now, else None (it blocks those behind it)."""
        if not self.waiting or free_tails == 0 or len(self.running) >= self.max_running:
            return None
        seq = self.waiting[0]
        need = self.pages_needed(seq)
        if self.running and self.reserved_pages + need + pinned_pages > self.capacity_pages:
            return None
        return seq

    def start(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        seq.reserved_pages = self.pages_needed(seq)
        self.reserved_pages += seq.reserved_pages
        self.running.append(seq)

    def _drop_running(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.reserved_pages -= seq.reserved_pages
            seq.reserved_pages = 0

    def remove(self, seq: Sequence) -> None:
        self._drop_running(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def plan(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_prefill_tokens
        for seq in self.running:
            pending = seq.pending
            if pending == 1:
                plan.decode.append(seq)
            elif pending > 1 and budget > 0:
                chunk = min(pending, budget)
                budget -= chunk
                plan.prefill.append((seq, chunk))
        return plan

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
