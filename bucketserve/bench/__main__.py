"""`python -m bucketserve.bench {bench,tune-buckets} ...`: the same subcommands as the
`bucketserve` CLI, without importing the server (and torch) first: a quicker start."""

from __future__ import annotations

import argparse
import sys

from bucketserve.bench.cli import add_bench_parser, add_tune_parser, run_bench, run_tune


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bucketserve.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_tune_parser(sub)
    args = parser.parse_args(argv)
    return run_bench(args) if args.command == "bench" else run_tune(args)


if __name__ == "__main__":
    sys.exit(main())
