"""Lines of code per subpackage of bucketserve/, docstrings, comments and blank lines not counted.

    python bench/loc.py                 # the working tree
    python bench/loc.py --rev d005733   # a commit (read with git show), and the change to now
    python bench/loc.py --groups [--rev REV]   # per file of the embeddings stack and the LLM core

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


# Named groups of files (--groups). The embeddings stack: every file that serves /v1/embeddings
# (rerank and score share it), from the route to the encoder's kernels. The LLM core: the engine
# scheduler, block manager, LLM engine, model runner, engine core process, sampler and sequence
# state (the files issue 31 counted: 2,337 lines with docstrings and comments at d005733).
GROUPS = {
    "embeddings": ("server/embeddings.py", "server/rerank.py", "engine/embedding_batcher.py",
                   "engine/embedding_queue.py", "engine/embedding_cost.py",
                   "engine/embedding_runner.py", "models/embedding_tokenizer.py",
                   "models/bert.py", "models/bert_loader.py", "kernels/bert_ops.py",
                   "kernels/triton_bert.py"),
    "LLM core": ("engine/scheduler.py", "engine/block_manager.py", "engine/llm_engine.py",
                 "engine/runner.py", "engine/core.py", "engine/sampler.py", "engine/sequence.py"),
}


def subpackage(path: str) -> str:
    parts = path.split("/")
    return parts[1] if len(parts) > 2 else "(top level)"


def sources(rev: str | None) -> dict[str, str]:
    """{path under the repository: source} of every .py file of bucketserve/ at rev (None: now)."""
    if rev is None:
        files = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "bucketserve").rglob("*.py")}
    else:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "bucketserve"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        files = {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout
                 for n in names if n.endswith(".py")}
    return files


def count(rev: str | None) -> Counter:
    totals: Counter = Counter()
    for path, source in sources(rev).items():
        totals[subpackage(path)] += code_lines(source)
    return totals


def print_groups(rev: str | None) -> None:
    """Per file of each group, code lines now (and at rev), then the group's total."""
    now = sources(None)
    before = sources(rev) if rev else {}
    for group, files in GROUPS.items():
        print(f"| {group} | {rev + ' | ' if rev else ''}now |\n|---|{'---|' if rev else ''}---|")
        tb = tn = 0
        for f in files:
            n = code_lines(now.get("bucketserve/" + f, ""))
            # a file moved since rev is found by its name (models/embedding_tokenizer.py was in
            # engine/ at d005733)
            old = [src for path, src in before.items() if path.endswith("/" + f.split("/")[-1])]
            b = code_lines(before.get("bucketserve/" + f, old[0] if len(old) == 1 else ""))
            tb, tn = tb + b, tn + n
            print(f"| {f} | {f'{b:,} | ' if rev else ''}{n:,} |")
        print(f"| **{group} total** | {f'{tb:,} | ' if rev else ''}**{tn:,}** |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default=None, help="a commit to compare the working tree with")
    ap.add_argument("--groups", action="store_true",
                    help="per file of the embeddings stack and the LLM core (GROUPS)")
    a = ap.parse_args()
    if a.groups:
        print_groups(a.rev)
        return
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
