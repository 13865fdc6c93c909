"""Iteration-level scheduler: decides, every model step, which tokens of which sequences run.

Policy (one `schedule()` call = one step):

1. Housekeeping. Cancelled requests (``abort``) and waiting requests past their queue
   deadline leave here, at the step boundary, and give their blocks back.
2. Running sequences go first, in admission order (priority, then arrival). A decoding
   sequence needs one token; one still in its prompt (chunked prefill) needs the rest of
   it, cut to the step's token budget (``max_batched_tokens``) and to the per-sequence
   chunk limit (``max_prefill_tokens``: a share of the budget, so that one long prompt
   never fills a whole step and arrivals are admitted next step). If the pool has no block
   for it, the lowest-ranked running sequence (highest priority value, newest arrival) is
   preempted by recompute: its blocks are freed, its computed count drops to 0 and it
   goes back to the waiting queue with its generated tokens kept; when readmitted, prompt
   and generated tokens are recomputed in one prefill, so its output is unchanged.
3. Waiting sequences are admitted by (priority, arrival) while the token budget, the
   running limit (``max_running``) and the free blocks allow. Prompts are grouped by
   length bucket: the first admitted prompt fixes the step's bucket and later candidates
   of another bucket wait for a later step (the queue head is always admitted first, so
   no one starves). A prompt longer than the remaining budget or the chunk limit is
   admitted with a chunk and continues in later steps (chunked prefill). No admission
   happens in a step that had to preempt: the pool is the bottleneck then. With prefix
   caching on, an admitted sequence starts from the cached full blocks of its tokens
   (block_manager.py) and only the uncached rest counts against the budget, the chunk
   limit and its bucket.
4. Under ``policy = "fcfs"`` the request priority is ignored: arrival order alone.

The scheduler never touches tensors. A step's bookkeeping comes in two calls: `on_launched()`
when the step has been handed to the runner (its tokens count as computed; a sequence that
samples owes one token, `seq.num_pending`), and `on_sampled()` when a sampled token reaches
the host: it is appended, the token-level stops apply (EOS unless ignore_eos after
min_tokens, stop token ids, max_tokens, the model's context length) and a finished
sequence's blocks are freed at once. `update()` does both for a step run synchronously.

Overlapped scheduling calls `schedule()` for step N+1 before step N's tokens are on the
host, so a decoding sequence is scheduled on its pending token (its id is read on the
device). Its stops are learnt one step late: the token computed for it in step N+1 is
dropped (`on_sampled` ignores finished sequences). A sequence whose pending token is
certainly its last (max_tokens, context length) is not scheduled again.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from bucketserve.buckets import BucketSpec
from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.sequence import FinishReason, Sequence, SequenceStatus

_FINISHED = SequenceStatus.FINISHED


@dataclass
class ScheduledBatch:
    """One step's work. Sequences with one new token come first (decodes), then prefills."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int
    kind: str  # "prefill" | "decode" | "mixed"
    bucket: int
    num_preemptions: int
    useful_tokens: int
    finished: list[Sequence] = field(default_factory=list)  # left at the step boundary (abort, timeout)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        prefill_buckets: BucketSpec,
        decode_buckets: BucketSpec,
        max_running: int,
        max_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        policy: str = "priority",
        max_prefill_tokens: int | None = None,
    ) -> None:
        self.blocks = block_manager
        self.prefill_buckets = prefill_buckets
        self.decode_buckets = decode_buckets
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        # most new tokens of one sequence in one step (None: the whole budget)
        self.max_prefill_tokens = max_prefill_tokens or max_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.use_priority = policy == "priority"
        self.waiting: list[Sequence] = []  # kept sorted by rank
        self.running: list[Sequence] = []  # kept sorted by rank
        self._aborted: set[str] = set()

    # ---- queue -------------------------------------------------------------------------

    def rank(self, seq: Sequence) -> tuple:
        return seq.sort_key() if self.use_priority else seq.sort_key()[1:]

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        # after every sequence of equal rank, as a stable sort of the appended list would
        bisect.insort_right(self.waiting, seq, key=self.rank)

    def abort(self, request_id: str) -> None:
        """Marks a request for removal at the next step boundary."""
        self._aborted.add(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence now and gives its blocks back."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        left = self._drop_aborted_and_expired()
        budget = self.max_batched_tokens
        # the batch, built in the running loop (rank order): decodes (one new token), then
        # prefill chunks; `useful`: tokens whose K/V is computed for the first time (not
        # recomputed after a preemption)
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        prefill_new: list[int] = []
        useful = 0
        preempted = 0

        running_status = SequenceStatus.RUNNING
        bs, max_len = self.blocks.block_size, self.max_model_len
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running_status:
                continue  # preempted earlier in this loop
            total = len(seq.token_ids) + seq.num_pending
            # its pending token is its last (_length_done, inline): it finishes when that
            # arrives
            if seq.num_pending and (total - seq.num_prompt_tokens >= seq.params.max_tokens
                                    or total >= max_len):
                continue
            computed = seq.num_computed_tokens
            n = total - computed
            if n == 1 and computed < len(seq.block_table) * bs:
                decodes.append(seq)  # a decode in its last block: nothing to allocate
                if computed >= seq.num_ever_computed:
                    useful += computed + 1 - seq.num_ever_computed
                budget -= 1
                continue
            n = min(n, budget, self.max_prefill_tokens)
            while not self.blocks.can_allocate(seq, n):
                # the lowest-ranked running sequence: never one chosen before in this loop
                # (it goes in rank order), possibly this one
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is not running_status:
                continue
            self.blocks.allocate(seq, n)
            if n == 1:
                decodes.append(seq)
            else:
                prefills.append(seq)
                prefill_new.append(n)
            u = computed + n - seq.num_ever_computed
            if u > 0:
                useful += u
            budget -= n

        if not preempted:
            useful += self._admit(decodes, prefills, prefill_new, budget)

        nd = len(decodes)
        if prefills:
            longest = max(prefill_new)
            bucket = self.prefill_buckets.lookup(longest) or longest
            kind = "mixed" if decodes else "prefill"
        else:
            bucket = self.decode_buckets.lookup(nd) or nd
            kind = "decode"
        return ScheduledBatch(decodes + prefills, [1] * nd + prefill_new, nd, kind, bucket,
                              preempted, useful, left)

    def _drop_aborted_and_expired(self) -> list[Sequence]:
        left: list[Sequence] = []
        if self._aborted:
            for seq in self.running + self.waiting:
                if seq.request_id in self._aborted:
                    self.finish(seq, FinishReason.ABORT)
                    left.append(seq)
            self._aborted.clear()
        now = time.monotonic()
        for seq in list(self.waiting):
            g = seq.grammar
            if g is not None and g.ready() and g.error is not None:
                self.finish(seq, FinishReason.ERROR)  # its grammar failed to compile
                left.append(seq)
                continue
            if seq.deadline is not None and now > seq.deadline and seq.first_scheduled_time is None:
                self.finish(seq, FinishReason.TIMEOUT)
                left.append(seq)
        return left

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.add(seq)

    def _admit(self, decodes: list[Sequence], prefills: list[Sequence], prefill_new: list[int],
               budget: int) -> int:
        """Admits waiting sequences into the step's lists (each at its rank among the running
        ones: a higher-priority arrival may rank before them); returns their new tokens."""
        bucket: int | None = None
        admitted: list[tuple[Sequence, int]] = []
        for seq in self.waiting:
            if budget == 0 or len(self.running) + len(admitted) >= self.max_running:
                break
            if seq.num_pending:
                break  # preempted with a token in flight: readmitted once it has arrived
            if seq.grammar is not None and not seq.grammar.ready():
                continue  # its grammar is still compiling (a thread): the others go on
            # prefix cache: the cached full blocks it starts from ([] when caching is off);
            # only the uncached rest counts against the budget and picks the bucket
            prefix = self.blocks.lookup(seq)
            n = min(seq.num_uncomputed_tokens - len(prefix) * self.blocks.block_size, budget,
                    self.max_prefill_tokens)
            seq_bucket = self.prefill_buckets.lookup(n) or self.prefill_buckets.boundaries[-1]
            if bucket is not None and seq_bucket != bucket:
                continue
            if not self.blocks.can_allocate(seq, n, prefix):
                break  # admission keeps rank order: nobody jumps a head that does not fit
            self.blocks.allocate(seq, n, prefix)
            budget -= n
            bucket = seq_bucket
            admitted.append((seq, n))
        now = time.monotonic()
        useful = 0
        rank = self.rank
        for seq, n in admitted:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.prefill_bucket = bucket
            bisect.insort_right(self.running, seq, key=rank)
            if n == 1:  # (a prompt whose rest is one token: a decode row)
                decodes.insert(bisect.bisect_right(decodes, rank(seq), key=rank), seq)
            else:
                i = bisect.bisect_right(prefills, rank(seq), key=rank)
                prefills.insert(i, seq)
                prefill_new.insert(i, n)
            u = seq.num_computed_tokens + n - seq.num_ever_computed
            if u > 0:
                useful += u
        return useful

    def on_launched(self, batch: ScheduledBatch, samples: list[int]) -> None:
        """The runner has taken the step: its tokens count as computed, and the sequences at
        batch indices `samples` each owe one sampled token (num_pending)."""
        finished_status = SequenceStatus.FINISHED
        caching, cache_computed = self.blocks.enable_caching, self.blocks.cache_computed
        seqs = batch.seqs
        every_row = len(samples) == len(seqs)  # (the usual decode step: one pass)
        for seq, n in zip(seqs, batch.num_new_tokens, strict=True):
            if every_row:
                seq.num_pending += 1
            if seq.status is finished_status:
                continue
            computed = seq.num_computed_tokens + n
            seq.num_computed_tokens = computed
            if computed > seq.num_ever_computed:
                seq.num_ever_computed = computed
            if caching:  # prefix cache: full blocks whose K/V this step wrote become reusable
                cache_computed(seq)  # (launched steps run in order: later readers wait)
        if not every_row:
            for i in samples:
                seqs[i].num_pending += 1

    def on_sampled(self, seq: Sequence, token: int) -> bool:
        """A sampled token reached the host: appends it and applies the token stops. True when
        the sequence finished now. A sequence that finished before (a stop learnt one step
        late, an abort) ignores it: the token was computed after its end and is dropped."""
        if seq.status is _FINISHED:
            return False
        seq.num_pending -= 1
        toks = seq.token_ids
        toks.append(token)
        p = seq.params
        num_output = len(toks) - seq.num_prompt_tokens
        # the usual token (no stop token ids, EOS ignored or not EOS, below every length
        # limit) leaves here; any other goes through _token_stop
        if (num_output < p.max_tokens and len(toks) < self.max_model_len and not p.stop_token_ids
                and (p.ignore_eos or token not in self.eos_token_ids)):
            return False
        reason = self._token_stop(seq, token)
        if reason is None:
            return False
        self.finish(seq, reason)
        return True

    def _length_done(self, seq: Sequence, num_tokens: int) -> bool:
        """A sequence of num_tokens tokens (pending ones included) needs no more."""
        return (num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens
                or num_tokens >= self.max_model_len)

    def _token_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if p.stop_token_ids and token in p.stop_token_ids:
                return FinishReason.STOP
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if num_output >= p.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
