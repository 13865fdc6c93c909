#!/usr/bin/env python3
"""Host (Python) time of one guided decode step's engine parts, per call, on the CPU.

A decode step of 256 rows, 128 of them guided by a real xgrammar JSON-schema grammar (every
guided row's matcher part-way through its document, none terminated), all greedy, as in
`structured_gpu.py`'s schema run with overlapped scheduling (every row has one token pending).
The logits are small ([256, 128]: a made-up vocabulary of 107 tokens of ASCII characters and
JSON pieces), so the tensor work costs little and the per-call times are the Python and
xgrammar host work that the H200 engine core waits on each step (there the tensor work runs
on the GPU, asynchronously). Timed, with the real classes:

  masks.apply      GrammarMasks.apply on the 128 guided rows (xgrammar's batch fill included)
  mask_fill        xgrammar's batch fill alone (in masks.apply; xgrammar's C++, not ours)
  mask_kernel      xgrammar's apply_token_bitmask_inplace alone (in masks.apply; on the
                   GPU a kernel launch, here its CPU implementation)
  process_logits   Sampler.process_logits (bias, masks, min_tokens, penalties) on all rows
  sample_guided    Sampler.sample: the whole sampling of the guided step
  sample_plain     Sampler.sample of the same rows without grammars (the plain fast path)
  argmax           torch.argmax of the logits alone (in both samples; tensor work here,
                   asynchronous on the GPU)
  inputs.fill      StepInputs.fill of the 256 decode rows (block tables, placeholders)
  resolve_rows     what a step's resolve does per row (Scheduler.on_sampled, the matcher's
                   accept and the termination check), on fresh copies of the rows

Each figure is the best of --repeats means over --calls calls (ms per call). Compare two
revisions by running the script with each on the path, e.g.

    PYTHONPATH=/tmp/before python bench/guided_host_cpu.py
    PYTHONPATH=$PWD python bench/guided_host_cpu.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xgrammar as xgr

from bucketserve.buckets import BucketSpec
from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.runner import StepInputs
from bucketserve.engine.sampler import Sampler
from bucketserve.engine.scheduler import ScheduledBatch, Scheduler
from bucketserve.engine.sequence import GuidedDecoding, SamplingParams, Sequence, SequenceStatus
from bucketserve.engine.structured import GrammarCompiler, GrammarMasks

ROWS, GUIDED, VOCAB, BLOCK = 256, 128, 128, 16
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
DOCUMENT = '{"name":"Ada Lovelace of Byron","age":36,"tags":["a","b"]}'


class SmallVocab:
    """The tokenizer interface GrammarCompiler reads: id 0 is EOS, then one token per
    printable ASCII character and a few JSON pieces (a RAW vocabulary)."""

    PIECES = ('{"', '":', '",', '"}', '":"', 'name', 'age', 'tags', 'true', 'false', 'null')

    def __init__(self) -> None:
        self.tokens = ["</s>", *(chr(c) for c in range(32, 127)), *self.PIECES]
        self.vocab_size = len(self.tokens)
        self.eos_token_ids = {0}
        self.is_byte_level = False
        self.ids = {t: i for i, t in enumerate(self.tokens)}

    def id_to_token(self, i: int) -> str:
        return self.tokens[i]

    def encode_chars(self, text: str) -> list[int]:
        return [self.ids[c] for c in text]


def make_rows(compiler: GrammarCompiler | None, vocab: SmallVocab,
              seed: int = 0) -> list[Sequence]:
    """ROWS running decode sequences, one token pending each; with a compiler, every other
    row is guided, its matcher advanced over a prefix of DOCUMENT (its output so far)."""
    rng = random.Random(seed)
    guided = GuidedDecoding("json", json.dumps(SCHEMA))
    seqs: list[Sequence] = []
    next_block = 0
    for r in range(ROWS):
        prompt = [rng.randrange(1, vocab.vocab_size) for _ in range(rng.randrange(16, 1024))]
        with_grammar = compiler is not None and r % 2 == 1 and r // 2 < GUIDED
        seq = Sequence(prompt, SamplingParams(max_tokens=256, temperature=0.0,
                                              guided=guided if with_grammar else None))
        if with_grammar:
            out = vocab.encode_chars(DOCUMENT[:1 + r % (len(DOCUMENT) - 2)])
            seq.grammar = compiler.state(guided)
            seq.grammar.future.result()
            assert seq.grammar.ready() and seq.grammar.error is None
            for t in out:
                assert seq.grammar.accept(t)
        else:
            out = [rng.randrange(1, vocab.vocab_size) for _ in range(rng.randrange(1, 200))]
        seq.token_ids += out
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = len(seq.token_ids)  # its newest token is on the device
        seq.num_pending = 1
        nblocks = -(-(len(seq.token_ids) + 1) // BLOCK)
        seq.block_table = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        seqs.append(seq)
    return seqs


def timed(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """ms per call: the best of `repeats` means over `calls` calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    vocab = SmallVocab()
    compiler = GrammarCompiler(vocab, VOCAB, threads=1)
    seqs = make_rows(compiler, vocab)
    plain = make_rows(None, vocab)
    g_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    states = [seqs[i].grammar for i in g_rows]
    logits = torch.randn(ROWS, VOCAB)
    logits[:, 0] -= 100.0  # no row samples EOS: resolve_rows finishes none
    sampler = Sampler(vocab.eos_token_ids, seed=0)
    masks = GrammarMasks()
    masks.apply(logits.clone(), g_rows, states)  # its buffers and its batch matcher
    bitmask = torch.zeros(ROWS, (VOCAB + 31) // 32, dtype=torch.int32)
    matchers = [st.matcher for st in states]
    index = torch.tensor(g_rows, dtype=torch.int32)

    inputs = StepInputs(8192, ROWS, 128, BLOCK, torch.device("cpu"))
    batch = ScheduledBatch(seqs, [1] * ROWS, ROWS, "decode", ROWS, 0, ROWS)
    pending = {s: j for j, s in enumerate(seqs)}

    scheduler = Scheduler(BlockManager(100_000, BLOCK), BucketSpec([1, 256]), BucketSpec([1, 256]),
                          ROWS, 8192, 4096, vocab.eos_token_ids)
    next_ids = torch.argmax(sampler.process_logits(logits, seqs), dim=-1).tolist()

    def resolve_rows() -> None:
        # fresh rows each call (their matchers and token lists change), made outside the timing
        fresh = resolve_pool.pop()
        t0 = time.perf_counter()
        for seq, tok in zip(fresh, next_ids, strict=True):
            finished = scheduler.on_sampled(seq, tok)
            g = seq.grammar
            if g is not None and not finished:
                g.accept(tok)
                _ = g.terminated
        resolve_times.append(time.perf_counter() - t0)

    results = {
        "masks.apply": timed(lambda: masks.apply(logits, g_rows, states), args.calls, args.repeats),
        "mask_fill": timed(lambda: masks._batch.batch_fill_next_token_bitmask(
            matchers, bitmask, g_rows), args.calls, args.repeats),
        "mask_kernel": timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask,
                                                                     indices=index),
                             args.calls, args.repeats),
        "process_logits": timed(lambda: sampler.process_logits(logits, seqs), args.calls,
                                args.repeats),
        "sample_guided": timed(lambda: sampler.sample(logits, seqs), args.calls, args.repeats),
        "sample_plain": timed(lambda: sampler.sample(logits, plain), args.calls, args.repeats),
        "argmax": timed(lambda: torch.argmax(logits, dim=-1), args.calls, args.repeats),
        "inputs.fill": timed(lambda: inputs.fill(batch, pending), args.calls, args.repeats),
    }
    n_resolve = 60
    resolve_times: list[float] = []
    resolve_pool = [make_rows(compiler, vocab, seed=1) for _ in range(n_resolve)]
    for _ in range(n_resolve):
        resolve_rows()
    results["resolve_rows"] = min(resolve_times) * 1e3
    for name, ms in results.items():
        print(f"{name:16} {ms:8.3f} ms/call")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
