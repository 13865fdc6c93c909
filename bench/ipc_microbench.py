"""The per-step IPC cost between the engine core and the front end (engine/messages.py).

One StepOutputs message per step: N sequences with one new token each (plus, in the
"logprobs" variant, a logprob with 5 alternatives for every sequence), and the step's
StepStats. For each encoding: bytes per message, and microseconds to encode + decode it
(the work the two processes add per step); then the ZeroMQ transfer (PUSH -> PULL over an
ipc:// socket, send + receive in one thread, so the cost without the other process's
scheduling) with msgspec msgpack, the encoding the server uses.

    python bench/ipc_microbench.py [--out bench/results/ipc_microbench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time

import msgspec
import zmq

from bucketserve.engine.messages import SeqOutput, StepOutputs, output_codec
from bucketserve.engine.sequence import TokenLogprob
from bucketserve.engine.stats import StepStats


def message(n: int, logprobs: bool) -> StepOutputs:
    outs = []
    for i in range(n):
        lp = ([TokenLogprob(1000 + i, -0.25, [(1000 + i + k, -0.25 - k) for k in range(5)])]
              if logprobs else None)
        outs.append(SeqOutput(f"cmpl-{i:032x}-0", [1000 + i], None, lp))
    stats = StepStats("decode", n, n, 0, n, n, n, 4 * n, 4096, 0, 0, n, 0.012)
    return StepOutputs(outs, stats, 0, n, 4 * n, n)


def message_columns(n: int) -> StepOutputs:
    """The same step as `message(n, False)` as the core now sends it: the plain one-token
    news in the two columns (token_request_ids, tokens) instead of a SeqOutput each."""
    stats = StepStats("decode", n, n, 0, n, n, n, 4 * n, 4096, 0, 0, n, 0.012)
    return StepOutputs([], stats, 0, n, 4 * n, n,
                       token_request_ids=[f"cmpl-{i:032x}-0" for i in range(n)],
                       tokens=[1000 + i for i in range(n)])


def per_call_us(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def codecs() -> dict:
    enc, dec = output_codec()
    json_enc, json_dec = msgspec.json.Encoder(), msgspec.json.Decoder(StepOutputs)
    return {
        "msgspec_msgpack": (enc.encode, dec.decode),
        "msgspec_json": (json_enc.encode, json_dec.decode),
        "pickle": (lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
        "stdlib_json_untyped": (lambda m: json.dumps(msgspec.to_builtins(m)).encode(), json.loads),
    }


def zmq_transfer_us(data: bytes, reps: int) -> float:
    ctx = zmq.Context()
    path = os.path.join(tempfile.mkdtemp(), "s")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{path}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{path}")

    def once() -> None:
        push.send(data, copy=False)
        pull.recv(copy=False)

    us = per_call_us(once, reps)
    push.close(0)
    pull.close(0)
    ctx.term()
    return us


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    rows = []
    for n in (16, 256):
        for logprobs in (False, True):
            msg = message(n, logprobs)
            row = {"seqs": n, "logprobs": logprobs}
            for name, (encode, decode) in codecs().items():
                data = encode(msg)
                row[name] = {"bytes": len(data),
                             "encode_decode_us": round(per_call_us(lambda e=encode, d=decode, m=msg:
                                                                   d(e(m)), args.reps), 1)}
            enc, _ = output_codec()
            row["zmq_ipc_transfer_us"] = round(zmq_transfer_us(enc.encode(msg), args.reps), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    # records vs columns for the plain news, msgspec msgpack; building the message included
    # (the core builds one per step): what StepOutputs' columns save
    enc, dec = output_codec()
    for n in (16, 256):
        row = {"seqs": n, "build_encode_decode_us": {
            "records": round(per_call_us(lambda n=n: dec.decode(enc.encode(message(n, False))),
                                         args.reps), 1),
            "columns": round(per_call_us(lambda n=n: dec.decode(enc.encode(message_columns(n))),
                                         args.reps), 1)},
            "bytes": {"records": len(enc.encode(message(n, False))),
                      "columns": len(enc.encode(message_columns(n)))}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"cpu": _cpu(), "loadavg_1m": os.getloadavg()[0], "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
