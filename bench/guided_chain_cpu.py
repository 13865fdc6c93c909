#!/usr/bin/env python3
"""The engine thread's host work between a guided step's tokens and its sampling, on the CPU.

The trace of a guided server on an H100 (docs/structured-output.md, "What the trace says")
put about 1.5 ms of Python between the wait for the previous step's tokens and the next
sampling: the held resolve and, with `schedule_ahead`, the next step's schedule and inputs.
While the engine thread does that, xgrammar fills the masks on its own threads; the longer of
the two sets when the sampling, and then the next forward, can be queued. This script times
those parts of the real engine (the default model on the CPU, overlapped scheduling,
--rows sequences decoding at once, every other one under a JSON-schema grammar, greedy, no
detokenization as in the server's core), per step, after every sequence has reached decode:

  resolve          LLMEngine._resolve (the held one and any other)
  accept           the guided rows' accepts inside it, on this thread (_accept_guided; with
                   BUCKETSERVE_OVERLAP_FILL=4, _thread_accepts: llguidance's rows, and
                   handing xgrammar's to the fill thread)
  accept_wait      (=4) the resolve waiting for the fill thread's accepts before it resolves
                   the guided rows (BatchAccepts.results; with the other modes, inside
                   accept: the batch's answer read on this thread)
  start_masks      handing the mask fill to its thread, inside it (LLMEngine._start_masks)
  schedule_ahead   LLMEngine._schedule_ahead: on_launched, the schedule and prepare_forward
  prepare_forward  ModelRunner.prepare_forward (StepInputs.fill and the path)
  schedule         Scheduler.schedule
  fill_wait        waiting for the started fill (GrammarMasks._take_pending, in the sampling)
  step             the whole engine step (the model's forward included: CPU-bound here)

Run it with each code on the path to compare a change of the host work:

    PYTHONPATH=$PWD python bench/guided_chain_cpu.py [--steps 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import tempfile
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 300}, "count": {"type": "integer"}},
    "required": ["name", "count"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15, help="timed steps")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps first (the prefills)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", default="xgrammar", help="[structured] backend")
    args = ap.parse_args()

    import bucketserve.engine.llm_engine as le
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.sequence import GuidedDecoding, SamplingParams
    from bucketserve.models import load_model

    loaded = load_model("smollm2-135m-instruct", device="cpu")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "buckets.toml")
        with open(path, "w") as f:
            f.write(f"[scheduler]\nmax_running = {args.rows}\nasync_scheduling = true\n"
                    "[kv_cache]\ncpu_memory_gib = 2\nprefix_caching = false\n"
                    f"[structured]\nbackend = \"{args.backend}\"\n")
        eng = le.LLMEngine(loaded, load_buckets(path, max_model_len=loaded.max_model_len), "cpu",
                           async_scheduling=True)
    guided = GuidedDecoding("json", json.dumps(SCHEMA))
    for i in range(args.rows):
        eng.add_request([1 + (i * 7 + j) % 1000 for j in range(16)], SamplingParams(
            max_tokens=args.warmup + args.steps + 8, temperature=0, ignore_eos=True,
            guided=guided if i % 2 else None, detokenize=False))

    spent: dict[str, float] = {}

    def timed(fn, key):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return wrapper

    eng._resolve = timed(eng._resolve, "resolve")
    eng._schedule_ahead = timed(eng._schedule_ahead, "schedule_ahead")
    eng._start_masks = timed(eng._start_masks, "start_masks")
    eng.runner.prepare_forward = timed(eng.runner.prepare_forward, "prepare_forward")
    eng.scheduler.schedule = timed(eng.scheduler.schedule, "schedule")
    le._accept_guided = timed(le._accept_guided, "accept")
    if hasattr(le, "_thread_accepts"):  # (since 2026-12-08; A/B runs may import older code)
        le._thread_accepts = timed(le._thread_accepts, "accept")
        from bucketserve.engine import structured

        batch = getattr(structured, "BatchAccepts", None) or structured.ThreadAccepts
        batch.results = timed(batch.results, "accept_wait")
    masks = eng.runner.sampler._grammar_masks()
    masks._take_pending = timed(masks._take_pending, "fill_wait")
    step = timed(eng.step_news, "step")
    for _ in range(args.warmup):
        step()
    spent.clear()
    for _ in range(args.steps):
        step()
    per = {k: round(v / args.steps * 1e3, 3) for k, v in sorted(spent.items(), key=lambda x: -x[1])}
    report = {"rows": args.rows, "guided": args.rows // 2, "steps": args.steps,
              "backend": args.backend,
              "schedule_ahead": eng.schedule_ahead,
              "accepts_on_thread": eng.accepts_on_thread, "running": eng.scheduler.num_running,
              "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or
              platform.machine(), "ms_per_step": per}
    for k, v in per.items():
        print(f"{k:16s} {v:8.3f} ms/step")
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
