#!/usr/bin/env python3
"""Does xgrammar's batch mask fill release the GIL? (docs/structured-output.md)

Builds 128 matchers of one JSON-schema grammar over the SmolLM2 vocabulary (--tok: a directory
with its tokenizer.json), each part-way through a document, and times: the batch fill alone
(`BatchGrammarMatcher.batch_fill_next_token_bitmask`, --threads threads, --calls calls), a
stretch of pure Python of the same length alone, and both at once (the fills on a thread, the
Python on the main thread). Read with care: "both at once" also counts the fill thread
waiting for the GIL before each call (up to Python's 5 ms switch interval while the main
thread runs Python), so a sum does not mean the fill holds the GIL; it releases it
(bench/grammar_fill_cpu.py measures the main thread's stalls, docs/structured-output.md).

    python bench/xgrammar_gil_cpu.py --tok DIR [--threads 1] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import xgrammar as xgr
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
    "required": ["name", "age", "tags"]}


def busy(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tok", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tok)
    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))  # compact, as served
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(args.rows)]
    for m in matchers:
        for t in tok.encode('{"name":"Ada', add_special_tokens=False):
            assert m.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(args.rows, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads=args.threads)

    def fills() -> None:
        for _ in range(args.calls):
            batch.batch_fill_next_token_bitmask(matchers, bitmask)

    fills()  # warm
    t = time.perf_counter()
    fills()
    fill_s = time.perf_counter() - t
    t = time.perf_counter()
    busy(100_000)
    per_iter = (time.perf_counter() - t) / 100_000
    n = int(fill_s / per_iter)  # Python of the same length as the fills
    t = time.perf_counter()
    busy(n)
    python_s = time.perf_counter() - t
    t = time.perf_counter()
    worker = threading.Thread(target=fills)
    worker.start()
    busy(n)
    worker.join()
    both_s = time.perf_counter() - t
    print(json.dumps({"rows": args.rows, "vocab": vocab, "threads": args.threads,
                      "fill_ms_per_call": round(fill_s / args.calls * 1e3, 4),
                      "fills_ms": round(fill_s * 1e3, 1), "python_ms": round(python_s * 1e3, 1),
                      "both_at_once_ms": round(both_s * 1e3, 1),
                      "one_after_the_other_ms": round((fill_s + python_s) * 1e3, 1)}))


if __name__ == "__main__":
    main()
