"""bench/'s one entry point (`python -m bench`): its table of groups names every script of
bench/ once, each in its section of bench/README.md, and it lists and runs them by name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench.__main__ import GROUPS

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def run_bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_every_script_is_in_the_table_once_and_in_its_readme_section():
    on_disk = sorted(p.name for p in BENCH.iterdir()
                     if p.suffix in (".py", ".sh") and p.name not in ("__init__.py", "__main__.py"))
    listed = [name for _, scripts in GROUPS for name in scripts]
    assert sorted(listed) == on_disk
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", (BENCH / "README.md").read_text(),
                               flags=re.M | re.S))
    for group, scripts in GROUPS:
        assert group in sections, f"bench/README.md has no section '## {group}'"
        missing = [s for s in scripts if f"`{s}`" not in sections[group]]
        assert missing == [], f"not in bench/README.md's section {group!r}: {missing}"


def test_list_names_every_script_under_its_group():
    out = run_bench("LIST")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for group, scripts in GROUPS:
        start = lines.index(f"{group}:")
        names = []
        for line in lines[start + 1:]:
            if not line.startswith("  "):
                break
            names.append(line.split()[0])
        assert names == [s.rsplit(".", 1)[0] for s in scripts]


def test_runs_a_script_by_name_with_its_arguments():
    out = run_bench("loc", "--help")  # argv reaches the script's own parser
    assert out.returncode == 0, out.stderr
    assert "usage: loc.py" in out.stdout and "--rev" in out.stdout
    out = run_bench("loc.py")  # run as __main__: it prints a line per subpackage
    assert out.returncode == 0, out.stderr
    assert re.search(r"^\s*engine\b.*\d", out.stdout, flags=re.M), out.stdout


def test_an_unknown_name_is_a_clear_error():
    out = run_bench("no_such_bench")
    assert out.returncode == 2
    assert out.stderr.strip() == ("python -m bench: error: no script 'no_such_bench' "
                                  "(python -m bench LIST names them)")
