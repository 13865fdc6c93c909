"""`bucketserve bench` and `bucketserve tune-buckets`: argument parsing and the run itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.parse

from bucketserve.bench.workload import WorkloadError


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench", help="load generator for any OpenAI-compatible server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Streams completions / chat / embeddings at a server and reports throughput, "
                    "TTFT, TPOT, ITL, E2E percentiles and goodput (table and --out JSON).")
    b.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load")
    b.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    b.add_argument("--embedding-model", default=None,
                   help="model name sent with embedding requests (default: none sent)")
    b.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    src = b.add_argument_group("requests (one of --workload, --trace, or generated)")
    src.add_argument("--workload", metavar="FILE", help="JSONL of requests (no arrival times used)")
    src.add_argument("--trace", metavar="FILE",
                     help="JSONL with arrival times (a --request-log file, or any JSONL with "
                          "arrival offsets and lengths), replayed at its pace / --speed")
    src.add_argument("--speed", type=float, default=1.0, help="trace replay speed-up")
    src.add_argument("--num-requests", type=int, default=256, help="generated requests")
    src.add_argument("--prompt-len", default="loguniform:16:1024",
                     help="generated prompt lengths (N, uniform:A:B, loguniform:A:B, "
                          "normal:MEAN:SD[:MIN:MAX], mix:W*DIST+W*DIST)")
    src.add_argument("--output-len", default="uniform:16:256", help="generated max_tokens")
    src.add_argument("--embedding-fraction", type=float, default=0.0,
                     help="share of generated requests that go to /v1/embeddings")
    src.add_argument("--embedding-len", default="uniform:8:128", help="generated input lengths")
    src.add_argument("--embedding-inputs", default="1", help="generated inputs per request")
    src.add_argument("--prompt-kind", choices=("ids", "text"), default="ids",
                     help="synthetic prompts: token ids (exact lengths) or words (~1 token each)")
    src.add_argument("--endpoint", choices=("completion", "chat"), default="completion",
                     help="endpoint of generated / replayed generation requests")
    src.add_argument("--seed", type=int, default=0)
    src.add_argument("--limit", type=int, default=None, help="only the first N requests")
    src.add_argument("--save-trace", metavar="FILE", help="write the requests as a trace JSONL")
    src.add_argument("--dry-run", action="store_true",
                     help="build (and --save-trace) the requests, send nothing")
    mode = b.add_argument_group("load")
    mode.add_argument("--concurrency", type=int, default=None,
                      help="closed loop with C requests in flight (cap of an open loop)")
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests/s")
    mode.add_argument("--workers", type=int, default=1, help="client processes sharing the load")
    mode.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    mode.add_argument("--no-stream", action="store_true", help="non-streaming generation")
    mode.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    mode.add_argument("--extra", default=None, help="JSON merged into every request body")
    mode.add_argument("--request-timeout", type=float, default=600.0)
    rep = b.add_argument_group("report")
    rep.add_argument("--slo-ttft-ms", type=float, default=None)
    rep.add_argument("--slo-tpot-ms", type=float, default=None)
    rep.add_argument("--slo-e2e-ms", type=float, default=None)
    rep.add_argument("--out", metavar="FILE", help="summary JSON")
    rep.add_argument("--per-request-out", metavar="FILE", help="per-request JSONL")
    rep.add_argument("--label", default="")
    rep.add_argument("--plot", metavar="DIR", help="write PNG figures (matplotlib) to DIR")
    rep.add_argument("--buckets", metavar="FILE", default=None,
                     help="the server's buckets TOML, for the nominal padding-per-bucket figure "
                          "(default: the shipped one)")
    rep.add_argument("--scrape-interval", type=float, default=0.5,
                     help="seconds between /metrics scrapes (bucketserve targets)")
    b.add_argument("--stub-server", type=int, metavar="PORT", default=None,
                   help="run the instant-streaming stub server on PORT instead (until Ctrl-C)")


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "tune-buckets", help="propose bucket boundaries and batch sizes for a traffic trace",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("trace", help="request log / trace JSONL")
    t.add_argument("--max-graphs", type=int, default=16,
                   help="most shapes per table (prefill lengths, decode sizes, embedding lengths, "
                        "embedding batch sizes)")
    t.add_argument("--memory-gib", type=float, default=2.0,
                   help="budget for all captured shapes together (GiB)")
    t.add_argument("--graph-mib", type=float, default=32.0,
                   help="estimated memory of one captured shape (MiB)")
    t.add_argument("--waste-per-gib", type=float, default=0.1,
                   help="padding fraction one GiB of shapes is worth: a shape is added only "
                        "where it saves more padding than its memory costs")
    t.add_argument("--align", type=int, default=1,
                   help="length boundaries are multiples of this (1: any length)")
    t.add_argument("--max-model-len", type=int, default=2048,
                   help="the LLM's context: prefill boundaries stay <= it")
    t.add_argument("--embedding-max-len", type=int, default=256,
                   help="the encoder's maximum input length (256: all-MiniLM-L6-v2): the last "
                        "embedding boundary, so inputs longer than the trace's are still served")
    t.add_argument("--max-running", type=int, default=None,
                   help="[scheduler] max_running: the decode headroom's limit (default: the base "
                        "file's, on --device: \"auto\" is 256 on cpu, 1024 on cuda)")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="the device the file is for (its \"auto\" embedding batch settings)")
    t.add_argument("--no-headroom", dest="headroom", action="store_false",
                   help="fit the trace only: no doubling ladder of decode and embedding batch "
                        "sizes above the trace's largest (a heavier load than the trace's then "
                        "runs its larger batches eagerly)")
    t.add_argument("--base", metavar="FILE", default=None,
                   help="buckets TOML whose other keys the output keeps (default: shipped)")
    t.add_argument("--out", metavar="FILE", default=None, help="write the TOML here (default: stdout)")


def _target(base_url: str) -> tuple[str, int]:
    u = urllib.parse.urlparse(base_url)
    if u.scheme not in ("http", ""):
        raise SystemExit(f"bucketserve bench: only http:// targets, got {base_url!r}")
    return u.hostname or "127.0.0.1", u.port or 80


async def _model_name(host: str, port: int) -> str:
    from bucketserve.bench.http import get

    got = await get(host, port, "/v1/models", timeout_s=10.0)
    data = json.loads(got.text).get("data") or []
    if got.status != 200 or not data:
        raise SystemExit(f"bucketserve bench: GET /v1/models gave HTTP {got.status}; give --model")
    return data[0]["id"]


def load_requests(args: argparse.Namespace):
    from bucketserve.bench import workload as wl

    if args.workload and args.trace:
        raise SystemExit("bucketserve bench: give --workload or --trace, not both")
    if args.trace or args.workload:
        reqs = wl.load_jsonl(args.trace or args.workload, args.prompt_kind, args.seed,
                             args.endpoint)
        if args.workload:
            for r in reqs:
                r.arrival = None
    else:
        reqs = wl.generate(args.num_requests, args.prompt_len, args.output_len, args.seed,
                           args.endpoint, args.prompt_kind, args.embedding_fraction,
                           args.embedding_len, args.embedding_inputs, args.rate)
    if args.limit:
        reqs = reqs[:args.limit]
    return reqs


async def _bench(args: argparse.Namespace) -> int:
    from bucketserve.bench import runner, stats
    from bucketserve.bench.scrape import Scraper, engine_info
    from bucketserve.bench.workload import save_trace

    host, port = _target(args.base_url)
    reqs = load_requests(args)
    if args.save_trace:
        save_trace(reqs, args.save_trace)
    if args.dry_run:
        print(f"{len(reqs)} requests" + (f" written to {args.save_trace}" if args.save_trace
                                          else ""))
        return 0
    if args.rate is not None:
        import numpy as np

        rng = np.random.default_rng(args.seed)
        gaps = rng.exponential(1.0 / args.rate, size=len(reqs))
        for r, t in zip(reqs, np.concatenate([[0.0], np.cumsum(gaps[1:])]), strict=True):
            r.arrival = float(t)
    open_loop = all(r.arrival is not None for r in reqs)
    if not open_loop and not args.concurrency:
        raise SystemExit("bucketserve bench: give --concurrency C (closed loop), --rate R (open "
                         "loop) or a --trace with arrival times")
    model = args.model or await _model_name(host, port)
    first = await Scraper(host, port).scrape_once()  # what the server runs, for the header
    engine = engine_info(first) if first is not None else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    cfg = runner.RunConfig(host, port, model, stream=not args.no_stream,
                           ignore_eos=not args.no_ignore_eos,
                           extra=json.loads(args.extra) if args.extra else {}, headers=headers,
                           concurrency=args.concurrency, open_loop=open_loop, speed=args.speed,
                           request_timeout_s=args.request_timeout, workers=args.workers,
                           embedding_model=args.embedding_model)
    if args.warmup:
        warm = runner.RunConfig(**{**cfg.__dict__, "open_loop": False, "workers": 1,
                                   "concurrency": args.concurrency or 8})
        await runner.run(warm, reqs[:args.warmup])
    scraper = Scraper(host, port, args.scrape_interval) if args.plot or args.out else None
    stop = asyncio.Event()
    scrape_task = asyncio.create_task(scraper.run(stop)) if scraper else None
    wall0 = time.time()
    results, t0, duration, cpu_s = await runner.run(cfg, reqs)
    stop.set()
    if scrape_task:
        await scrape_task
    slo = stats.SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    summary = stats.summarize(results, duration, slo)
    mode = (f"open loop, Poisson {args.rate}/s" if args.rate is not None else
            f"open loop, trace replay x{args.speed}" if open_loop else
            f"closed loop, concurrency {args.concurrency}")
    if open_loop and args.concurrency:
        mode += f", at most {args.concurrency} in flight"
    report = {"label": args.label, "base_url": args.base_url, "model": model, "mode": mode,
              "source": args.trace or args.workload or "generated", "workers": args.workers,
              "engine": engine, "stream": cfg.stream, "ignore_eos": cfg.ignore_eos,
              "started_unix": wall0,
              "machine": stats.machine(), **summary, "client_cpu_s": cpu_s,
              "client_cpu_us_per_token_event": 1e6 * cpu_s / max(1, summary["token_events"])}
    if scraper is not None and scraper.samples:
        from bucketserve.bench.plots import server_summary

        report["server"] = server_summary(scraper.samples)
    elif scraper is not None:
        report["server"] = {"scraped": False, "reason": scraper.reason}
    print(stats.table(summary, f"bucketserve bench: {mode}, {len(reqs)} requests, {model}\n"
                               + stats.engine_line(engine)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if args.per_request_out:
        with open(args.per_request_out, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    if args.plot:
        from bucketserve.bench.plots import write_plots

        paths = write_plots(args.plot, results, t0, scraper.samples if scraper else [], reqs,
                            args.buckets, title=args.label or mode)
        print(f"figures: {', '.join(paths)}")
    return 0 if summary["errors"] == 0 else 1


def run_bench(args: argparse.Namespace) -> int:
    if args.stub_server is not None:
        from bucketserve.bench.stub_server import serve

        asyncio.run(serve("127.0.0.1", args.stub_server))
        return 0
    try:
        return asyncio.run(_bench(args))
    except WorkloadError as exc:
        print(f"bucketserve bench: error: {exc}", file=sys.stderr)
        return 2


def run_tune(args: argparse.Namespace) -> int:
    from bucketserve.bench.tuner import TuneLimits, tune_file

    limits = TuneLimits(max_graphs=args.max_graphs, memory_gib=args.memory_gib,
                        graph_mib=args.graph_mib, waste_per_gib=args.waste_per_gib,
                        align=args.align, max_model_len=args.max_model_len,
                        embedding_max_len=args.embedding_max_len, max_running=args.max_running,
                        device=args.device, headroom=args.headroom)
    try:
        text = tune_file(args.trace, limits, base=args.base)
    except WorkloadError as exc:
        print(f"bucketserve tune-buckets: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0
