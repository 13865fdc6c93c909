#!/usr/bin/env python3
"""xgrammar's batch mask fill against llguidance's on the same states (docs/structured-output.md).

The guided step's host time holds must-show 3 of issue 30 back, and the mask fill is the
grammar's own share of it. This times one fill of --rows matchers of one JSON schema (compact,
as served) over the SmolLM2 vocabulary (--tok: a directory with its tokenizer.json), with both
libraries, in two sets of states:
- in_string: every row part-way through the same string value (most tokens allowed);
- varied: row i has accepted the first i/rows of a valid document (keys, numbers, arrays,
  a nested object, a pattern-bound string).
ms per fill is the best of 5 rounds of --calls fills; `equal_rows` counts the rows whose two
masks are identical. Then what a request with a new schema costs before its first mask
(`compile`: bench/structured_gpu.py's schemas, a different one each time): xgrammar's
compilation as the engine runs it (`GrammarCompiler._compile`) against llguidance's matcher
from a new schema, ms each; and what a thread compiling new schemas with xgrammar without
pause does to the main thread (`main_thread_beside_xgrammar_compiles`: the share of 2 s it could
not run, its longest stall, stalls over 1 ms a second; `main_thread_alone`: the same without
the compile thread). The engine compiles in its core process, whose loop needs the GIL for
every step. `xgrammar_fill_on_a_thread`: the same for the batch fill (in_string states), at
Python's default switch interval and at 0.1 ms, with the fill's ms per call on its thread. llguidance is a dependency of the project since
it became the second backend ([structured] backend = "llguidance").

    PYTHONPATH=$PWD python bench/grammar_fill_cpu.py --tok DIR [--threads 1] [--calls 100]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import threading
import time
from functools import partial

import numpy as np
import xgrammar as xgr
from transformers import AutoTokenizer

from bucketserve.engine.structured import tokenizer_info
from bucketserve.models.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    "addr": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "addr"]}
DOC = ('{"name":"Ada Lovelace the first","age":36,"tags":["a","b","a"],'
       '"addr":{"city":"London town","zip":"12345"}}')
IN_STRING = '{"name":"Ada'


def best_ms(fill, calls: int) -> float:
    fill()
    fill()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fill()
        rounds.append((time.perf_counter() - t) / calls * 1e3)
    return round(min(rounds), 4)


def stalls(duration_s: float) -> dict:
    """The main thread spins for duration_s and records every gap between its iterations
    longer than 100 us: time it could not run (the GIL held elsewhere, or no core)."""
    gaps, last = [], time.perf_counter()
    end = last + duration_s
    while last < end:
        now = time.perf_counter()
        if now - last > 1e-4:
            gaps.append(now - last)
        last = now
    return {"lost_pct": round(100 * sum(gaps) / duration_s, 1),
            "max_stall_ms": round(max(gaps, default=0.0) * 1e3, 2),
            "stalls_over_1ms_per_s": round(sum(g > 1e-3 for g in gaps) / duration_s, 1)}


def fill_until(batch, matchers, bitmask, stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        count[0] += 1


def fills_beside(batch, matchers, bitmask) -> dict:
    """xgrammar's batch fill without pause on a thread while the main thread spins, at Python's
    default switch interval (5 ms) and at 0.1 ms: the main thread's stalls, and the fill's ms
    per call (alone, it is the `in_string` figure)."""
    out = {}
    default = sys.getswitchinterval()
    for interval in (default, 1e-4):
        sys.setswitchinterval(interval)
        stop = threading.Event()
        count = [0]
        th = threading.Thread(target=fill_until, args=(batch, matchers, bitmask, stop, count))
        th.start()
        main = stalls(2.0)
        stop.set()
        th.join()
        out[f"switch_{interval * 1e3:g}ms"] = {"main_thread": main,
                                               "fill_ms": round(2000 / max(count[0], 1), 3)}
    sys.setswitchinterval(default)
    return out


def compile_costs(args, lltok) -> dict:
    import llguidance

    from bench.structured_gpu import schema
    from bucketserve.engine.sequence import GuidedDecoding
    from bucketserve.engine.structured import GrammarCompiler

    n = args.compiles
    compiler = GrammarCompiler(Tokenizer.from_hf_dir(args.tok), 0, threads=1)

    def xgrammar_range(first: int, count: int = n) -> None:
        for i in range(first, first + count):
            compiler._compile(GuidedDecoding("json", json.dumps(schema(i))))

    def llguidance_range(first: int) -> None:
        for i in range(first, first + n):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema(i)), defaults={"whitespace_flexible": False})
            assert not llguidance.LLMatcher(lltok, grammar).is_error()

    xgrammar_range(10**6)  # warm
    llguidance_range(10**6)
    t = time.perf_counter()
    xgrammar_range(0)
    xs = time.perf_counter() - t
    t = time.perf_counter()
    llguidance_range(0)
    ls = time.perf_counter() - t
    # the engine loop's view: a thread compiling new schemas without pause, as the core's
    # compile pool does under a burst of them, beside the main thread
    alone = stalls(1.0)
    stop = threading.Event()

    def compile_until_stopped() -> None:
        i = 2 * 10**6
        while not stop.is_set():
            xgrammar_range(i, 1)
            i += 1

    th = threading.Thread(target=compile_until_stopped)
    th.start()
    beside = stalls(2.0)
    stop.set()
    th.join()
    return {"xgrammar_ms": round(xs / n * 1e3, 3), "llguidance_ms": round(ls / n * 1e3, 3),
            "main_thread_alone": alone, "main_thread_beside_xgrammar_compiles": beside}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tok", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--compiles", type=int, default=40)
    args = ap.parse_args()
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    tok = AutoTokenizer.from_pretrained(args.tok)
    vocab = len(tok)
    rows = args.rows
    doc = tok.encode(DOC, add_special_tokens=False)
    states = {"in_string": [tok.encode(IN_STRING, add_special_tokens=False)] * rows,
              "varied": [doc[:(i * len(doc)) // rows] for i in range(rows)]}
    schema = json.dumps(SCHEMA)
    info = tokenizer_info(Tokenizer.from_hf_dir(args.tok), vocab)  # as the engine builds it
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        schema, any_whitespace=False, separators=(",", ":"))
    xbatch = xgr.BatchGrammarMatcher(max_threads=args.threads)
    lltok = llguidance.hf.from_tokenizer(tok)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    executor = llguidance.LLExecutor(args.threads)
    out = {"rows": rows, "threads": args.threads, "vocab": vocab,
           "xgrammar": importlib.metadata.version("xgrammar"),
           "llguidance": getattr(llguidance, "__version__", "?")}
    for name, prefixes in states.items():
        xms = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        lms = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
        for xm, lm, p in zip(xms, lms, prefixes, strict=True):
            assert all(xm.accept_token(t) for t in p)
            assert lm.consume_tokens(p), lm.get_error()
        xmask = xgr.allocate_token_bitmask(rows, vocab)
        lmask = lnp.allocate_token_bitmask(rows, vocab)
        pairs = [(m, i) for i, m in enumerate(lms)]
        out[name] = {
            "xgrammar_ms": best_ms(partial(xbatch.batch_fill_next_token_bitmask, xms, xmask),
                                   args.calls),
            "llguidance_ms": best_ms(partial(lnp.fill_next_token_bitmask_par, executor, pairs,
                                             lmask), args.calls),
            "equal_rows": sum(int(np.array_equal(lmask[i], xmask[i].numpy()))
                              for i in range(rows))}
        if name == "in_string":
            out["xgrammar_fill_on_a_thread"] = fills_beside(xbatch, xms, xmask)
    out["compile"] = compile_costs(args, lltok)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
