"""The runner's input builder (StepInputs, on every device) holds exactly the inputs of a
batch, built token by token in plain Python here, for mixed decode/prefill batches, with
stale buffers, and with decode tokens still on the device (overlapped scheduling)."""

from __future__ import annotations

import random

import pytest
import torch

from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.runner import StepInputs
from bucketserve.engine.scheduler import ScheduledBatch
from bucketserve.engine.sequence import SamplingParams, Sequence

BS = 16


def make_batch(rng: random.Random, num_decodes: int, prefills: list[tuple[int, int]]):
    """Decodes with random contexts; prefills as (prompt length, tokens already computed)."""
    bm = BlockManager(2000, BS)
    seqs, counts = [], []
    for _ in range(num_decodes):
        n = rng.randint(1, 300)
        s = Sequence([rng.randrange(5000) for _ in range(n)], SamplingParams(max_tokens=4))
        bm.allocate(s, n)
        s.num_computed_tokens = n - 1
        seqs.append(s)
        counts.append(1)
    for length, done in prefills:
        s = Sequence([rng.randrange(5000) for _ in range(length)], SamplingParams(max_tokens=4))
        chunk = min(length - done, 100)  # some chunks stop before the prompt's end
        bm.allocate(s, done + chunk)
        s.num_computed_tokens = done
        seqs.append(s)
        counts.append(chunk)
    rng.shuffle(bm._free)  # later allocations get scattered blocks
    kind = "mixed" if num_decodes and prefills else ("decode" if num_decodes else "prefill")
    return ScheduledBatch(seqs, counts, num_decodes, kind, 0, 0, sum(counts))


def reference(batch: ScheduledBatch):
    """Per token, in plain Python: ids, positions, slots, seq_lens, query_start_loc and the
    (row, batch index) pairs to sample. A sequence samples when the step computes its last
    known token."""
    ids, pos, slots, seq_lens, qsl, rows, seqs = [], [], [], [], [0], [], []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        for p in range(start, start + n):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // BS] * BS + p % BS)
        seq_lens.append(start + n)
        qsl.append(len(ids))
        if start + n == seq.num_tokens:
            rows.append(len(ids) - 1)
            seqs.append(i)
    return ids, pos, slots, seq_lens, qsl, rows, seqs


def step_inputs(batch: ScheduledBatch, device: str = "cpu"):
    """(ids, positions, metadata) of a batch as the runner builds them."""
    width = max(len(s.block_table) for s in batch.seqs)
    inp = StepInputs(max_tokens=4096, max_seqs=64, max_blocks=width, block_size=BS,
                     device=torch.device(device))
    return inp.to_device(inp.fill(batch))


def test_step_buffers_hold_the_batch():
    rng = random.Random(0)
    inp = StepInputs(max_tokens=2048, max_seqs=64, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    cases = [(5, []), (0, [(40, 0), (250, 100), (7, 0)]), (9, [(300, 0), (130, 30)]), (1, [])]
    for num_decodes, prefills in cases * 2:  # twice: stale contents must not leak through
        batch = make_batch(rng, num_decodes, prefills)
        ids, pos, slots, seq_lens, qsl, rows, seqs = reference(batch)
        plan = inp.fill(batch)
        ntok, n = plan.num_tokens, len(batch.seqs)
        assert (ntok, plan.num_seqs, plan.num_decodes) == (len(ids), n, num_decodes)
        assert inp.ids[:ntok].tolist() == ids and inp.pos[:ntok].tolist() == pos
        assert inp.slots[:ntok].tolist() == slots
        assert inp.seq_lens[:n].tolist() == seq_lens == plan.seq_lens
        assert inp.qsl[:n + 1].tolist() == qsl
        assert plan.query_lens == batch.num_new_tokens
        # each row's own pages (entries past them are never read and may be stale)
        for i, seq in enumerate(batch.seqs):
            k = len(seq.block_table)
            assert inp.tables[i, :k].tolist() == seq.block_table
        assert (plan.sample_rows, plan.sample_seqs) == (rows, seqs)
        assert inp.h_sample_rows[:len(rows)].tolist() == rows
        assert plan.placeholder_rows == plan.placeholder_src == []
        # on the CPU the "device" tensors are the host buffers themselves
        d_ids, d_pos, meta = inp.to_device(plan)
        assert d_ids.tolist() == ids and meta.slot_mapping.tolist() == slots
        assert meta.seq_lens_cpu == seq_lens and meta.max_query_len == max(batch.num_new_tokens)


def test_pending_tokens_become_placeholders():
    """A decode whose newest token is still on the device (overlapped scheduling) gets id 0 on
    the host and a placeholder pointing at that token's index in the previous step's sampled
    ids; it samples once its pending token is computed."""
    rng = random.Random(4)
    inp = StepInputs(max_tokens=256, max_seqs=8, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    batch = make_batch(rng, 4, [(30, 0)])
    a, b = batch.seqs[1], batch.seqs[3]
    for seq in (a, b):  # their newest token: sampled by the last step, not on the host yet
        seq.token_ids.pop()
        seq.num_pending = 1
    prev = {b: 0, a: 5}
    plan = inp.fill(batch, prev)
    assert plan.placeholder_rows == [1, 3] and plan.placeholder_src == [5, 0]
    assert inp.ids[1] == 0 and inp.ids[3] == 0
    assert inp.h_ph_rows[:2].tolist() == [1, 3] and inp.h_ph_src[:2].tolist() == [5, 0]
    assert inp.pos[1] == a.num_computed_tokens and inp.pos[3] == b.num_computed_tokens
    assert plan.sample_seqs == [0, 1, 2, 3, 4]
    # not sampled by the previous step: an error, not a silent token 0
    with pytest.raises(ValueError, match="neither on the host"):
        inp.fill(batch, {a: 5})


def test_overlapped_decode_step_every_token_pending():
    """The usual overlapped decode step: every row's newest token is on the device, in another
    order than the previous step's, after a step of other sizes (stale buffers). Then a row
    caught up (on the host) and a row the previous step did not sample."""
    rng = random.Random(5)
    inp = StepInputs(max_tokens=2048, max_seqs=64, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    inp.fill(make_batch(rng, 3, [(200, 0)]))
    batch = make_batch(rng, 12, [])
    ids, pos, slots, seq_lens, qsl, rows, seqs = reference(batch)
    for seq in batch.seqs:
        seq.token_ids.pop()
        seq.num_pending = 1
    order = list(range(12))
    rng.shuffle(order)
    prev = {batch.seqs[i]: j for j, i in enumerate(order)}
    plan = inp.fill(batch, prev)
    src = [prev[s] for s in batch.seqs]
    assert plan.placeholder_rows == list(range(12)) and plan.placeholder_src == src
    assert inp.h_ph_rows[:12].tolist() == list(range(12)) and inp.h_ph_src[:12].tolist() == src
    assert inp.ids[:12].tolist() == [0] * 12
    assert inp.pos[:12].tolist() == pos and inp.slots[:12].tolist() == slots
    assert inp.seq_lens[:12].tolist() == seq_lens == plan.seq_lens
    assert inp.qsl[:13].tolist() == qsl and plan.query_lens == [1] * 12
    assert (plan.sample_rows, plan.sample_seqs) == (rows, seqs) == (list(range(12)),) * 2
    assert inp.h_sample_rows[:12].tolist() == rows
    # row 4's token reached the host: a real id, not a placeholder
    b4 = batch.seqs[4]
    b4.token_ids.append(ids[4])
    b4.num_pending = 0
    plan = inp.fill(batch, prev)
    assert plan.placeholder_rows == [r for r in range(12) if r != 4]
    assert plan.placeholder_src == [src[r] for r in range(12) if r != 4]
    assert inp.ids[:12].tolist() == [ids[4] if r == 4 else 0 for r in range(12)]
    assert plan.sample_seqs == list(range(12))
    # a pending row the previous step did not sample: the first such row is named
    del prev[batch.seqs[7]], prev[batch.seqs[9]]
    with pytest.raises(ValueError, match=f"{batch.seqs[7].request_id}: its newest token"):
        inp.fill(batch, prev)


def test_block_table_rows_follow_growth_and_replacement():
    rng = random.Random(2)
    inp = StepInputs(max_tokens=64, max_seqs=8, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    batch = make_batch(rng, 4, [])
    inp.fill(batch)
    seq = batch.seqs[1]
    seq.block_table.append(999)  # grew (same list object)
    batch.seqs[2].block_table = [7, 8, 9]  # replaced (e.g. freed and reallocated)
    inp.fill(batch)
    for i, s in enumerate(batch.seqs):
        assert inp.tables[i, :len(s.block_table)].tolist() == s.block_table


def test_block_table_rows_that_move_keep_their_tables():
    """Sequences leave the batch and the rows after them move up (copied within the buffer,
    not rewritten); at the same time a moved table grows, another row's table is replaced,
    a new sequence comes in among them and a row moves down. Every row holds its own
    table's pages after each step, with stale entries behind them."""
    rng = random.Random(6)
    inp = StepInputs(max_tokens=256, max_seqs=32, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    seqs = make_batch(rng, 24, []).seqs

    def step(rows):
        inp.fill(ScheduledBatch(rows, [1] * len(rows), len(rows), "decode", 0, 0, len(rows)))
        for i, s in enumerate(rows):
            assert inp.tables[i, :len(s.block_table)].tolist() == s.block_table, i

    step(seqs)
    rows = [s for i, s in enumerate(seqs) if i not in (2, 3, 9, 17)]  # four leave
    step(rows)
    rows[5].block_table.append(1999)  # moved and grew
    rows[12].block_table = [11, 12, 13]  # replaced
    step(rows)
    rows.insert(8, make_batch(rng, 1, []).seqs[0])  # a newcomer: the rows after it move down
    step(rows)
    del rows[0]
    rows.insert(8, make_batch(rng, 1, []).seqs[0])  # up before it, in place after it
    step(rows)
    step(rows[::-1])  # every row moves
    step(rows[1:])


def test_one_token_prompt_chunk_is_not_sampled():
    """A prompt chunk of one token counts as a decode (one new token) but must not sample."""
    rng = random.Random(3)
    inp = StepInputs(max_tokens=64, max_seqs=8, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    batch = make_batch(rng, 3, [])
    seq = batch.seqs[1]
    seq.num_computed_tokens -= 5  # 6 tokens left: this step's 1 token is mid-prompt
    plan = inp.fill(batch)
    assert plan.sample_seqs == [0, 2] and plan.sample_rows == [0, 2]
    assert (plan.sample_rows, plan.sample_seqs) == reference(batch)[5:]


class _Replays:
    """A stand-in for a captured graph (DecodeGraphs' static-input handling needs no GPU)."""

    def __init__(self, log: list[int], bs: int) -> None:
        self.log, self.bs = log, bs

    def replay(self) -> None:
        self.log.append(self.bs)


def test_decode_graph_load_fills_the_static_inputs_as_run_does():
    """DecodeGraphs.load (the runner's host buffers copied straight into the static inputs)
    leaves the static inputs as DecodeGraphs.run (device tensors of the step) does, step after
    step (growing, shrinking: the rows past the step that its graph reads are dummies), reads only
    the step's rows of longer buffers, and replays the same padded graph. On a GPU,
    tests/test_cuda_graphs_gpu.py checks both against the eager forward."""
    from bucketserve.kernels.attention import AttentionMetadata
    from bucketserve.kernels.cuda_graphs import DecodeGraphs

    sizes, width, rows = [2, 4, 8], 6, 12
    pair, logs = [], []
    for _ in range(2):
        g = DecodeGraphs(torch.nn.Identity(), sizes, max_blocks_per_seq=width, max_seq_len=64,
                         device="cpu")
        log: list[int] = []
        g.graphs = {bs: _Replays(log, bs) for bs in sizes}
        g.outputs = {bs: torch.zeros(bs, 3) for bs in sizes}
        pair.append(g)
        logs.append(log)
    by_run, by_load = pair
    gen = torch.Generator().manual_seed(0)
    for n in [3, 8, 1, 5, 2, 4]:
        def junk(shape, dtype):  # a host buffer: the step's rows, then junk
            return torch.randint(1, 50, shape, generator=gen, dtype=dtype)

        ids, pos, slots = (junk((rows,), torch.int64) for _ in range(3))
        lens, tables = junk((rows,), torch.int32), junk((rows, width), torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slots[:n].clone(), query_start_loc=torch.arange(n + 1),
            seq_lens=lens[:n].clone(), block_tables=tables[:n].clone(), num_decodes=n,
            max_query_len=1, max_seq_len=64, query_lens_cpu=[1] * n, seq_lens_cpu=[64] * n)
        by_run.run(ids[:n].clone(), pos[:n].clone(), meta)
        loaded = by_load.load(n, ids, pos, slots, lens, tables)
        assert torch.equal(loaded, ids[:n])
        by_load.replay(n)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            assert torch.equal(getattr(by_load, name), getattr(by_run, name)), (n, name)
        bs = by_load.padded_size(n)  # the rows the replayed graph reads past the step's
        assert by_load.seq_lens[n:bs].eq(1).all() and by_load.input_ids[n:bs].eq(0).all(), n
    assert logs[0] == logs[1] == [4, 8, 2, 8, 2, 4]
    with pytest.raises(ValueError, match="wide"):
        by_load.load(2, ids, pos, slots, lens, torch.zeros(rows, width + 1, dtype=torch.int32))
