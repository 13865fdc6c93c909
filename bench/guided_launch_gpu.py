#!/usr/bin/env python3
"""Host time of a decode step's launches on a GPU, before and after the cuts of 2026-12-07.

A guided decode step is host-bound (docs/structured-output.md): what the engine thread
spends queueing the forward and the sampling is time the device waits. This script times,
on the 1B shape (random bf16 weights, 256 rows decoding at context ~512, half of them under
a JSON-schema grammar of SmolLM2's vocabulary), the host side of each launch with the device
idle before it (synchronized), as medians over --iters calls:

  forward before    the 6 host-to-device copies of StepInputs.to_device, then
                    DecodeGraphs.run (5 device-to-device copies into the static inputs, the
                    graph's replay)
  forward now       DecodeGraphs.load (5 copies from the pinned buffers into the static
                    inputs) and replay
  replay            the graph's replay alone (cudaGraphLaunch)
  plain sampling    the logits and their argmax (the 256 rows plain)
  guided before     the logits widened to float32, then Sampler.sample (a clone, the masks,
                    the argmax), the masks filled in the call
  guided now        the logits in bf16, Sampler.sample(inplace=True) (masked in place)
  fill              the 128 rows' xgrammar batch fill alone (inside both guided figures)

    python3 bench/guided_launch_gpu.py --tok DIR [--iters 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import Future

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 300}, "count": {"type": "integer"}},
    "required": ["name", "count"]}


def host_us(fn, iters: int, warmup: int = 20) -> float:
    """Median host time of fn() in us, the device idle before each call."""
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tok", required=True, help="SmolLM2's tokenizer directory")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from bucketserve.engine.sampler import Sampler
    from bucketserve.engine.sequence import SamplingParams, Sequence
    from bucketserve.engine.structured import GrammarState
    from bucketserve.kernels.attention import AttentionMetadata
    from bucketserve.kernels.cuda_graphs import DecodeGraphs
    from bucketserve.models.config import ModelConfig
    from bucketserve.models.loader import build_dummy_model

    n, page, ctx, width = args.rows, 16, 512, 64
    cfg = ModelConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                      num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      max_position_embeddings=2048)
    model = build_dummy_model(cfg, "cuda", torch.bfloat16)
    blocks = n * width + 1
    model.bind_kv_cache(torch.zeros(cfg.num_layers, 2, blocks, page, cfg.num_kv_heads,
                                    cfg.head_dim, device="cuda", dtype=torch.bfloat16))
    graphs = DecodeGraphs(model, [n], max_blocks_per_seq=width, max_seq_len=1024, device="cuda")
    graphs.capture()

    def pinned(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory()

    rows = torch.arange(n)
    tables = 1 + rows.unsqueeze(1) * width + torch.arange(width)
    h_ids = pinned(torch.randint(0, cfg.vocab_size, (n,)))
    h_pos = pinned(torch.full((n,), ctx - 1))
    h_slots = pinned(tables[:, (ctx - 1) // page] * page + (ctx - 1) % page)
    h_lens = pinned(torch.full((n,), ctx, dtype=torch.int32))
    h_qsl = pinned(torch.arange(n + 1, dtype=torch.int32))
    h_tables = pinned(tables.to(torch.int32))

    def forward_before() -> torch.Tensor:
        def put(h: torch.Tensor) -> torch.Tensor:
            return h.to("cuda", non_blocking=True)

        ids, pos = put(h_ids), put(h_pos)
        meta = AttentionMetadata(
            slot_mapping=put(h_slots), query_start_loc=put(h_qsl), seq_lens=put(h_lens),
            block_tables=put(h_tables), num_decodes=n, max_query_len=1, max_seq_len=ctx,
            query_lens_cpu=[1] * n, seq_lens_cpu=[ctx] * n)
        return graphs.run(ids, pos, meta)

    def forward_now() -> torch.Tensor:
        graphs.load(n, h_ids, h_pos, h_slots, h_lens, h_tables)
        return graphs.replay(n)

    tok = AutoTokenizer.from_pretrained(args.tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=cfg.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    prefix = tok.encode('{"name":"Ada', add_special_tokens=False)
    text_mask = torch.full(((cfg.vocab_size + 31) // 32,), -1, dtype=torch.int32)
    seqs = []
    for i in range(n):
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
        if i % 2:
            fut: Future = Future()
            fut.set_result(compiled)
            st = GrammarState(fut, text_mask)
            assert st.ready() and st.error is None
            for t in prefix:
                assert st.accept(t)
            seq.grammar = st
        seqs.append(seq)
    matchers = [s.grammar.matcher for s in seqs if s.grammar is not None]
    g_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    plain_seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
                  for _ in range(n)]
    sampler = Sampler(seed=0)
    hidden = forward_now().clone()
    bitmask = xgr.allocate_token_bitmask(n, cfg.vocab_size)
    batch = xgr.BatchGrammarMatcher(8)

    def plain() -> None:
        sampler.sample(model.compute_logits(hidden, widen=False), plain_seqs, inplace=True)

    def guided_before() -> None:
        sampler.sample(model.compute_logits(hidden), seqs)

    def guided_now() -> None:
        sampler.sample(model.compute_logits(hidden, widen=False), seqs, inplace=True)

    def fill() -> None:
        batch.batch_fill_next_token_bitmask(matchers, bitmask, g_rows)

    with torch.inference_mode():
        a, b = guided_before(), guided_now()  # (warm: Triton compiles the mask kernel)
        want = sampler.sample(model.compute_logits(hidden), seqs)[0]
        got = sampler.sample(model.compute_logits(hidden, widen=False), seqs, inplace=True)[0]
        assert torch.equal(want, got), "the two guided paths chose different tokens"
        report = {"rows": n, "guided": len(g_rows), "device": torch.cuda.get_device_name(),
                  "host_us": {}}
        parts = [("forward before", forward_before), ("forward now", forward_now),
                 ("replay", lambda: graphs.replay(n)), ("plain sampling", plain),
                 ("guided before", guided_before), ("guided now", guided_now), ("fill", fill)]
        for _ in range(2):  # two rounds, interleaved: the second shows the spread
            for name, fn in parts:
                us = host_us(fn, args.iters)
                report["host_us"].setdefault(name, []).append(us)
        del a, b
    for name, us in report["host_us"].items():
        print(f"{name:16s} {' '.join(f'{x:8.1f}' for x in us)} us")
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
