"""Lines of code per subpackage of bucketserve/, docstrings, comments and blank lines not counted.

    python bench/loc.py                 # the working tree
    python bench/loc.py --rev d005733   # a commit (read with git show), and the change to now

A line counts when it holds a token other than a comment, a docstring or the line break; a
docstring is a string expression that is the first statement of a module, class or function.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def code_lines(source: str) -> int:
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def subpackage(path: str) -> str:
    parts = path.split("/")
    return parts[1] if len(parts) > 2 else "(top level)"


def count(rev: str | None) -> Counter:
    totals: Counter = Counter()
    if rev is None:
        files = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "bucketserve").rglob("*.py")}
    else:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "bucketserve"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        files = {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout
                 for n in names if n.endswith(".py")}
    for path, source in files.items():
        totals[subpackage(path)] += code_lines(source)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default=None, help="a commit to compare the working tree with")
    a = ap.parse_args()
    now = count(None)
    if a.rev is None:
        for name in sorted(now):
            print(f"{name:14s} {now[name]:6d}")
        print(f"{'total':14s} {sum(now.values()):6d}")
        return
    before = count(a.rev)
    print(f"| subpackage | {a.rev} | now | change |\n|---|---|---|---|")
    for name in sorted(set(now) | set(before)):
        b, n = before[name], now[name]
        print(f"| {name} | {b:,} | {n:,} | {n - b:+,} |")
    b, n = sum(before.values()), sum(now.values())
    print(f"| total | {b:,} | {n:,} | {n - b:+,} |")


if __name__ == "__main__":
    main()
