"""EmbeddingBatcher scheduling with a fake encoder (no model): buckets, dispatch rules,
reassembly, priorities, timeouts, cancellation and stats."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from bucketserve.engine.embedding_batcher import (
    BatcherStoppedError,
    EmbeddingBatcher,
    QueueTimeoutError,
)
from bucketserve.engine.embedding_runner import FunctionRunner
from bucketserve.engine.outputs import QueueFullError

WAIT_S = 30.0  # generous bound for "this completes" (never a performance threshold)


class FakeEncoder:
    """Returns [sum of real ids, number of real tokens] per row; records each batch; can be
    held at a gate so the test can queue work while a batch is 'running'."""

    def __init__(self, gated: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []  # (B, L)
        self.batches: list[list[int]] = []  # first id of each row, per batch
        self.gate = threading.Event()
        self.entered = threading.Event()
        if not gated:
            self.gate.set()

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        assert ids.shape == mask.shape and mask[:, 0].all()
        # Right padding only: each row is real tokens then padding.
        n = mask.sum(1)
        assert torch.equal(mask, torch.arange(ids.shape[1])[None, :] < n[:, None])
        self.calls.append(tuple(ids.shape))
        self.batches.append(ids[:, 0].tolist())
        return torch.stack([(ids * mask).sum(1).float(), n.float()], dim=1)


def make_batcher(enc: FakeEncoder, **kw) -> EmbeddingBatcher:
    args = dict(boundaries=(4, 8, 16), preferred_batch_size=4, max_batch_tokens=64,
                max_queue_delay_ms=1.0)
    args.update(kw)
    b = EmbeddingBatcher(FunctionRunner(enc), **args)
    b.start()
    return b


def seq(first: int, n: int) -> list[int]:
    return [first] + [1] * (n - 1)


def expected(ids: list[int]) -> list[float]:
    return [float(sum(ids)), float(len(ids))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


def test_results_in_input_order_across_buckets():
    enc = FakeEncoder()

    async def main():
        b = make_batcher(enc)
        inputs = [seq(100 + i, n) for i, n in enumerate([1, 16, 5, 3, 9, 8, 4, 2, 12, 7])]
        out = await b.embed(inputs)
        await b.shutdown()
        return inputs, out, b

    inputs, out, b = run(main())
    assert [o.tolist() for o in out] == [expected(i) for i in inputs]
    # Each batch ran at a bucket length, with rows padded only up to that bucket.
    for (B, L), firsts in zip(enc.calls, enc.batches, strict=True):
        assert L in (4, 8, 16) and B == len(firsts)
        for f in firsts:
            n = len(inputs[f - 100])
            assert b.spec.lookup(n) == L
    assert b.stats.useful_tokens == sum(map(len, inputs))
    assert b.stats.computed_tokens == sum(B * L for B, L in enc.calls)
    assert b.stats.num_inputs == len(inputs)


def test_full_bucket_runs_without_waiting_for_the_delay():
    enc = FakeEncoder()

    async def main():
        # The delay alone would hold the batch for an hour; 4 inputs fill the bucket.
        b = make_batcher(enc, max_queue_delay_ms=3_600_000.0)
        out = await b.embed([seq(i, 3) for i in range(4)])
        await b.shutdown()
        return out

    assert len(run(main())) == 4
    assert enc.calls == [(4, 4)]


def test_token_budget_caps_the_batch():
    enc = FakeEncoder()

    async def main():
        # Bucket 16 with max_batch_tokens 32 holds 2 inputs per batch, though preferred is 4.
        b = make_batcher(enc, max_batch_tokens=32, max_queue_delay_ms=3_600_000.0)
        out = await b.embed([seq(i, 10) for i in range(4)])
        await b.shutdown()
        return out

    assert len(run(main())) == 4
    assert enc.calls == [(2, 16), (2, 16)]


def test_incomplete_bucket_runs_after_the_delay():
    enc = FakeEncoder()

    async def main():
        b = make_batcher(enc, max_queue_delay_ms=20.0)
        out = await b.embed([seq(7, 2)])
        await b.shutdown()
        return out, b

    out, b = run(main())
    assert out[0].tolist() == expected(seq(7, 2))
    assert enc.calls == [(1, 4)]
    delays = b.stats.queue_delay_counts
    assert sum(delays) == 1 and b.stats.queue_delay_sum_s >= 0.02


def test_concurrent_requests_share_batches():
    enc = FakeEncoder()

    async def main():
        b = make_batcher(enc, max_queue_delay_ms=3_600_000.0)
        outs = await asyncio.gather(*[b.embed([seq(10 + i, 3)]) for i in range(8)])
        await b.shutdown()
        return outs

    outs = run(main())
    assert [o[0].tolist() for o in outs] == [expected(seq(10 + i, 3)) for i in range(8)]
    assert enc.calls == [(4, 4), (4, 4)]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_orders_batches(policy):
    enc = FakeEncoder(gated=True)

    async def main():
        b = make_batcher(enc, preferred_batch_size=1, policy=policy)
        first = asyncio.ensure_future(b.embed([seq(1, 2)]))
        await asyncio.to_thread(enc.entered.wait, WAIT_S)  # the worker is busy with input 1
        later = [asyncio.ensure_future(b.embed([seq(first_id, 2)], priority=prio))
                 for first_id, prio in ((2, 5), (3, 0), (4, -1), (5, 5))]
        await asyncio.sleep(0.05)  # all queued before the worker frees up
        enc.gate.set()
        await asyncio.gather(first, *later)
        await b.shutdown()

    run(main())
    order = [firsts[0] for firsts in enc.batches]
    assert order == ([1, 4, 3, 2, 5] if policy == "priority" else [1, 2, 3, 4, 5])


def test_queue_timeout_fails_the_request():
    enc = FakeEncoder(gated=True)

    async def main():
        b = make_batcher(enc, preferred_batch_size=1, queue_timeout_s=0.05)
        first = asyncio.ensure_future(b.embed([seq(1, 2)]))
        await asyncio.to_thread(enc.entered.wait, WAIT_S)
        late = asyncio.ensure_future(b.embed([seq(2, 2), seq(3, 9)]))
        await asyncio.sleep(0.2)  # the worker is still blocked: both inputs time out
        enc.gate.set()
        await first
        with pytest.raises(QueueTimeoutError):
            await late
        assert b.num_waiting_requests == 0
        await b.shutdown()

    run(main())
    assert enc.batches == [[1]]


def test_queue_full_and_cancellation():
    enc = FakeEncoder(gated=True)

    async def main():
        b = make_batcher(enc, preferred_batch_size=1, max_waiting=2)
        first = asyncio.ensure_future(b.embed([seq(1, 2)]))
        await asyncio.to_thread(enc.entered.wait, WAIT_S)
        second = asyncio.ensure_future(b.embed([seq(2, 2)]))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await b.embed([seq(3, 2)])
        second.cancel()  # the client went away: its slot frees, its input is never run
        with pytest.raises(asyncio.CancelledError):
            await second
        assert b.num_waiting_requests == 1
        third = asyncio.ensure_future(b.embed([seq(4, 2)]))
        enc.gate.set()
        await asyncio.gather(first, third)
        await b.shutdown()

    run(main())
    assert enc.batches == [[1], [4]]


def test_shutdown_fails_queued_requests_and_refuses_new_ones():
    enc = FakeEncoder(gated=True)

    async def main():
        b = make_batcher(enc, preferred_batch_size=1)
        first = asyncio.ensure_future(b.embed([seq(1, 2)]))
        await asyncio.to_thread(enc.entered.wait, WAIT_S)
        queued = asyncio.ensure_future(b.embed([seq(2, 2)]))
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(b.shutdown(WAIT_S))
        await asyncio.sleep(0.05)
        enc.gate.set()
        await stopping
        with pytest.raises(BatcherStoppedError):
            await queued
        assert (await first)[0].tolist() == expected(seq(1, 2))  # the running batch finished
        with pytest.raises(BatcherStoppedError):
            await b.embed([seq(3, 2)])

    run(main())


def test_encoder_failure_fails_its_batch_only():
    calls = []

    def encode(ids, mask):
        calls.append(ids.shape)
        if ids[0, 0] == 13:
            raise RuntimeError("boom")
        return torch.zeros(ids.shape[0], 2)

    async def main():
        b = EmbeddingBatcher(FunctionRunner(encode), (4, 8), 1, 64, 1.0)
        b.start()
        with pytest.raises(RuntimeError, match="boom"):
            await b.embed([[13, 1]])
        assert len(await b.embed([[5, 1]])) == 1  # the worker survived
        await b.shutdown()

    run(main())


def test_bad_lengths_and_config():
    enc = FakeEncoder()

    async def main():
        b = make_batcher(enc)
        with pytest.raises(ValueError, match="input 1 has 17 tokens"):
            await b.embed([[1], [1] * 17])
        with pytest.raises(ValueError, match="input 0 has 0 tokens"):
            await b.embed([[]])
        await b.shutdown()

    run(main())
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EmbeddingBatcher(FunctionRunner(enc), (4, 8, 16), 4, 8, 1.0)


# ------------------------------------------------------------------ bucket merging
def _queue_while_busy(enc: FakeEncoder, b: EmbeddingBatcher, inputs: list[list[int]]):
    """Occupies the worker with a first input, queues `inputs` as single-input requests, then
    lets the worker go: every input is queued when the next batch is formed."""

    async def main():
        first = asyncio.ensure_future(b.embed([seq(1, 2)]))
        await asyncio.to_thread(enc.entered.wait, WAIT_S)
        rest = [asyncio.ensure_future(b.embed([ids])) for ids in inputs]
        await asyncio.sleep(0.05)
        enc.gate.set()
        outs = await asyncio.gather(first, *rest)
        await b.shutdown()
        return [o[0].tolist() for o in outs[1:]]

    return run(main())


def test_merging_tops_up_a_bucket_within_the_padding_bound():
    # Queued: 8 and 7 tokens (bucket 8), 4 and 2 (bucket 4), 16 (bucket 16).
    inputs = [seq(10, 8), seq(11, 7), seq(12, 4), seq(13, 2), seq(14, 16)]
    enc = FakeEncoder(gated=True)
    b = make_batcher(enc, max_merged_padding=0.25)
    assert _queue_while_busy(enc, b, inputs) == [expected(i) for i in inputs]
    # Bucket 8 runs first (earliest input) and takes the 4-token input: 1 - 19 / 24 = 0.21.
    # Adding the 2-token one (1 - 21 / 32) or padding to 16 (1 - 35 / 64) would pass 0.25.
    assert enc.calls == [(1, 4), (3, 8), (1, 4), (1, 16)]
    assert enc.batches == [[1], [10, 11, 12], [13], [14]]
    assert b.stats.merged_batches == 1
    assert b.stats.batches_per_bucket == {4: 2, 8: 1, 16: 1}
    assert b.stats.computed_tokens == 4 + 24 + 4 + 16


def test_merging_off_or_tighter_bound_keeps_buckets_apart():
    inputs = [seq(10, 8), seq(11, 7), seq(12, 4), seq(13, 2), seq(14, 16)]
    for bound in (0.0, 0.2):  # the 4-token input would make the batch 0.21 padding
        enc = FakeEncoder(gated=True)
        b = make_batcher(enc, max_merged_padding=bound)
        assert _queue_while_busy(enc, b, inputs) == [expected(i) for i in inputs]
        assert enc.batches == [[1], [10, 11], [12, 13], [14]]
        assert b.stats.merged_batches == 0


def test_merging_can_pad_up_to_a_larger_bucket():
    # 5 tokens alone in bucket 8; 16 and 15 in bucket 16. Padded to 16: 1 - 36 / 48 = 0.25.
    inputs = [seq(10, 5), seq(11, 16), seq(12, 15)]
    enc = FakeEncoder(gated=True)
    b = make_batcher(enc, max_merged_padding=0.25)
    assert _queue_while_busy(enc, b, inputs) == [expected(i) for i in inputs]
    assert enc.calls == [(1, 4), (3, 16)]
    assert sorted(enc.batches[1]) == [10, 11, 12]


def test_merging_respects_the_token_budget_and_full_buckets():
    # max_batch_tokens 32: bucket 8 holds 4 inputs, bucket 16 only 2. Even with no padding
    # bound, bucket 8's two inputs cannot be padded into a batch of 3 at length 16, and a full
    # bucket (4 inputs of bucket 4) runs as it is.
    inputs = [seq(10, 8), seq(11, 8), seq(12, 16), seq(13, 15)]
    enc = FakeEncoder(gated=True)
    b = make_batcher(enc, max_batch_tokens=32, max_merged_padding=1.0)
    assert _queue_while_busy(enc, b, inputs) == [expected(i) for i in inputs]
    assert enc.calls == [(1, 4), (2, 8), (2, 16)]

    full = [seq(20 + i, 4) for i in range(4)] + [seq(30, 3)]
    enc = FakeEncoder(gated=True)
    b = make_batcher(enc, max_merged_padding=1.0)
    assert _queue_while_busy(enc, b, full) == [expected(i) for i in full]
    assert enc.batches[1] == [20, 21, 22, 23]


@pytest.mark.parametrize("bound", [0.1, 0.2, 0.3])
def test_merged_batches_stay_within_the_bound(bound):
    import random

    rng = random.Random(int(bound * 100))
    boundaries = tuple(range(4, 65, 4))
    inputs = [seq(10 + i, rng.randint(1, 64)) for i in range(32)]
    enc = FakeEncoder(gated=True)
    b = make_batcher(enc, boundaries=boundaries, preferred_batch_size=8, max_batch_tokens=256,
                     max_merged_padding=bound)
    assert _queue_while_busy(enc, b, inputs) == [expected(i) for i in inputs]
    spec = b.spec
    merged = 0
    for (B, L), firsts in zip(enc.calls[1:], enc.batches[1:], strict=True):
        lengths = [len(inputs[f - 10]) for f in firsts]
        assert L in boundaries and max(spec.lookup(n) for n in lengths) == L
        assert B <= b.queue.capacity(L)
        if any(spec.lookup(n) != L for n in lengths):
            merged += 1
            assert 1 - sum(lengths) / (B * L) <= bound + 1e-12, (lengths, L)
    assert merged == b.stats.merged_batches > 0
    assert b.stats.num_inputs == len(inputs) + 1


def test_a_synchronous_encoder_answers_each_batch_before_the_next_runs():
    # A CPU encoder computes inside launch: its batch must be answered at once, not held
    # back until the next batch has run too (that overlap is for asynchronous runners).
    release = threading.Event()
    calls = []

    def encode(ids, mask):
        calls.append(ids.shape)
        if len(calls) == 2:
            assert release.wait(WAIT_S)
        return torch.zeros(ids.shape[0], 2)

    async def main():
        b = EmbeddingBatcher(FunctionRunner(encode), (4, 8), 1, 64, 0.0)
        b.start()
        first = asyncio.ensure_future(b.embed([[1, 1]]))
        second = asyncio.ensure_future(b.embed([[2, 1, 1, 1, 1]]))
        try:
            await asyncio.wait_for(asyncio.shield(first), 5.0)  # while batch 2 is blocked
            assert not second.done()
        finally:
            release.set()
        await second
        await b.shutdown()

    run(main())
    assert len(calls) == 2


def test_two_workers_run_batches_side_by_side_on_shares_of_the_threads():
    """workers=2: two batches are in the encoder at once (each waits at a barrier for the
    other), each on its share of the torch threads; a batch alone gets all of them. Every
    result arrives, in input order; the caller's own thread count is untouched."""
    pair = threading.Barrier(2, timeout=WAIT_S)  # breaks unless two forwards overlap
    seen: list[tuple[int, str, int]] = []  # (first id, worker, torch threads)

    def encode(ids, mask):
        first = int(ids[0, 0])
        seen.append((first, threading.current_thread().name, torch.get_num_threads()))
        if first >= 10:
            pair.wait()
        return torch.stack([ids.sum(1).float(), mask.sum(1).float()], dim=1)

    caller_threads = torch.get_num_threads()

    async def main():
        b = EmbeddingBatcher(FunctionRunner(encode), (4, 8), 1, 64, 0.0, workers=2)
        b.torch_threads = 4
        b.start()
        alone = await b.embed([[1, 1]])
        inputs = [seq(10 + i, 2 + i % 5) for i in range(8)]  # one input per batch
        out = await b.embed(inputs)
        await b.shutdown()
        assert not b.is_alive()
        return alone, inputs, out

    alone, inputs, out = run(main())
    assert alone[0].tolist() == [2.0, 2.0] and seen[0][2] == 4
    assert [o.tolist() for o in out] == [expected(i) for i in inputs]
    paired = seen[1:]
    assert len(paired) == 8 and {name for _, name, _ in paired} == {
        "embedding-batcher-0", "embedding-batcher-1"}
    # of each overlapping pair, the one that started second ran on its share
    assert {t for _, _, t in paired} <= {2, 4} and [t for _, _, t in paired].count(2) >= 4
    assert torch.get_num_threads() == caller_threads


def test_embed_texts_with_tokenizer_processes_matches_the_thread_path():
    """Offline embed_texts: tokenizing in worker processes (packed int32 arrays back) gives the
    same vectors, in text order, as the tokenizer function on a helper thread."""
    import random

    from conftest import minilm_dir

    from bench.embeddings_gpu import TokenizerProcesses, embed_texts
    from bucketserve.models.embedding_tokenizer import EmbeddingTokenizer

    tok = EmbeddingTokenizer(minilm_dir() / "tokenizer.json", do_lower_case=True)
    rng = random.Random(0)
    words = ["alpha", "Beta", "gamma", "delta", "[SEP]", "café", "x", "epsilon,", "zeta!"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))) for _ in range(150)]
    enc = FakeEncoder()
    b = make_batcher(enc, boundaries=(8, 16, 32), max_batch_tokens=256)

    async def both():
        thread = await embed_texts(b, tok.encode_batch, texts, chunk=16)
        with TokenizerProcesses(tok, 2, threads=1) as procs:
            packed = await embed_texts(b, procs, texts, chunk=16)
        await b.shutdown()
        return thread, packed

    thread, packed = run(both())
    want = [expected(ids) for ids in tok.encode_batch(texts)]
    assert [v.tolist() for v in thread] == want
    assert [v.tolist() for v in packed] == want
