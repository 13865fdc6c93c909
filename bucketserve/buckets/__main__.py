"""`python -m bucketserve.buckets check [FILE] [--max-model-len N] [--embedding-max-len N]`:
print the effective config as TOML, or the one-line error on stderr with exit status 2."""

from __future__ import annotations

import argparse
import sys

from bucketserve.buckets.config import ConfigError, load_buckets


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bucketserve.buckets",
                                     description="Validate a bucketserve buckets TOML file.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate FILE (the defaults when omitted) and print "
                                         "the effective config")
    check.add_argument("file", nargs="?", help="buckets TOML file")
    check.add_argument("--max-model-len", type=_positive, help="the LLM's context length")
    check.add_argument("--embedding-max-len", type=_positive,
                       help="the embedding model's maximum input length")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_buckets(args.file, max_model_len=args.max_model_len)
        config = config.check_model(embedding_max_len=args.embedding_max_len)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# effective buckets config (source: {config.source})")
    print(config.to_toml(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
