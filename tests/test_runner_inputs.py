"""The runner's preallocated step buffers (used on CUDA) hold exactly the inputs that the
per-step numpy path (used on CPU) builds, for mixed decode/prefill batches and for decode
steps padded with dummy rows."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.runner import ModelRunner, StepInputs
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
    ns = SimpleNamespace(block_size=BS, device=torch.device("cpu"))
    return ModelRunner._prepare(ns, batch)


def test_step_buffers_equal_numpy_path():
    rng = random.Random(0)
    inp = StepInputs(max_tokens=2048, max_seqs=64, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    cases = [(5, []), (0, [(40, 0), (250, 100), (7, 0)]), (9, [(300, 0), (130, 30)]), (1, [])]
    for num_decodes, prefills in cases * 2:  # twice: stale contents must not leak through
        batch = make_batch(rng, num_decodes, prefills)
        ids, pos, meta, rows, sample_seqs = reference(batch)
        ntok, nrows, seq_lens, sample_rows, got_seqs, width = inp.fill(batch)
        n = len(batch.seqs)
        assert (ntok, nrows) == (ids.shape[0], n)
        np.testing.assert_array_equal(inp.ids[:ntok], ids.numpy())
        np.testing.assert_array_equal(inp.pos[:ntok], pos.numpy())
        np.testing.assert_array_equal(inp.slots[:ntok], meta.slot_mapping.numpy())
        np.testing.assert_array_equal(inp.seq_lens[:n], meta.seq_lens.numpy())
        np.testing.assert_array_equal(inp.qsl[:n + 1], meta.query_start_loc.numpy())
        # each row's own pages (entries past them are never read and may be stale)
        want_tables = meta.block_tables.numpy()
        for i, seq in enumerate(batch.seqs):
            k = len(seq.block_table)
            np.testing.assert_array_equal(inp.tables[i, :k], want_tables[i, :k])
        assert seq_lens == meta.seq_lens_cpu
        assert sample_rows == rows.tolist() and got_seqs == sample_seqs


def test_decode_padding_rows_are_dummies():
    rng = random.Random(1)
    inp = StepInputs(max_tokens=64, max_seqs=64, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    inp.fill(make_batch(rng, 16, []))  # leaves real rows behind
    batch = make_batch(rng, 3, [])
    ntok, rows, _, sample_rows, _, width = inp.fill(batch, pad_to=8)
    assert (ntok, rows) == (8, 8) and sample_rows == [0, 1, 2]
    # padding: token 0 at position 0, slot 0 of the dummy block 0, context 1
    assert not inp.ids[3:8].any() and not inp.pos[3:8].any() and not inp.slots[3:8].any()
    assert (inp.seq_lens[3:8] == 1).all() and not inp.tables[3:8, 0].any()
    ids, _, meta, _, _ = reference(batch)
    np.testing.assert_array_equal(inp.slots[:3], meta.slot_mapping.numpy())
    np.testing.assert_array_equal(inp.ids[:3], ids.numpy())


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


def test_one_token_prompt_chunk_is_not_sampled():
    """A prompt chunk of one token counts as a decode (one new token) but must not sample."""
    rng = random.Random(3)
    inp = StepInputs(max_tokens=64, max_seqs=8, max_blocks=64, block_size=BS,
                     device=torch.device("cpu"))
    batch = make_batch(rng, 3, [])
    seq = batch.seqs[1]
    seq.num_computed_tokens -= 5  # 6 tokens left: this step's 1 token is mid-prompt
    _, _, _, sample_rows, sample_seqs, _ = inp.fill(batch)
    assert sample_seqs == [0, 2] and sample_rows == [0, 2]
    assert sample_rows == reference(batch)[3].tolist()
