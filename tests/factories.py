"""Small builders for CPU-only engine tests."""

from __future__ import annotations

from bucketserve.buckets import BucketSpec
from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.scheduler import Scheduler
from bucketserve.engine.sequence import SamplingParams, Sequence

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_running: int = 8,
                   max_batched_tokens: int = 64, max_model_len: int = 1024,
                   policy: str = "priority",
                   boundaries: tuple[int, ...] = (8, 16, 32, 64),
                   prefix_caching: bool = False,
                   max_prefill_tokens: int | None = None) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_caching=prefix_caching),
                     BucketSpec(boundaries),
                     BucketSpec((1, 2, 4, 8)), max_running, max_batched_tokens, max_model_len,
                     eos_token_ids={EOS}, policy=policy, max_prefill_tokens=max_prefill_tokens)


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, priority: int = 0,
                  **params) -> list[Sequence]:
    return [Sequence([10 + (i + j) % 50 for j in range(prompt_len)],
                     SamplingParams(max_tokens=max_tokens, **params), priority=priority)
            for i in range(n)]


def run_to_end(sched: Scheduler, token: int = 7, max_steps: int = 10_000) -> list:
    """Steps with a fake model that always samples `token`; returns the batches."""
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return batches
        batch = sched.schedule()
        batches.append(batch)
        sampled = [token if s.num_computed_tokens + n == s.num_tokens else None
                   for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        update(sched, batch, sampled)
    raise AssertionError("scheduler did not finish")


def update(sched: Scheduler, batch, sampled: list[int | None]) -> list:
    """A step run synchronously: `on_launched` then `on_sampled` for each token.
    `sampled[i]` is the new token of batch.seqs[i] (None when it is still in its prompt).
    Returns the sequences that finished."""
    sched.on_launched(batch, [i for i, t in enumerate(sampled) if t is not None])
    finished = []
    for seq, token in zip(batch.seqs, sampled, strict=True):
        if token is not None and sched.on_sampled(seq, token):
            finished.append(seq)
    return finished
