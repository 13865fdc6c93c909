"""The docs cannot drift from the code: every TOML key and every CLI flag is on
docs/configuration.md, and every figure of the README's headline table links to a result file
that exists and is listed in bench/results/MANIFEST.toml."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from bucketserve.buckets import __main__ as buckets_main
from bucketserve.buckets import config as buckets_config
from bucketserve.server import cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
README = (ROOT / "README.md").read_text()
MANIFEST = tomllib.loads((ROOT / "bench" / "results" / "MANIFEST.toml").read_text())

# BucketsConfig fields that are not TOML keys (where the file came from, which keys it set,
# the [embedding] table as one object)
NOT_KEYS = {"source", "user_keys", "embedding"}


def toml_keys() -> set[tuple[str, str]]:
    """(table, key) of the shipped file and of the validator's schema."""
    shipped = tomllib.loads(buckets_config.default_buckets_path().read_text())
    keys = {(table, key) for table, values in shipped.items() for key in values}
    keys |= {(table, key) for table, values in buckets_config._SCHEMA.items() for key in values}
    return keys


def test_every_toml_key_is_documented():
    missing = [f"[{table}] {key}" for table, key in sorted(toml_keys())
               if f"`[{table}] {key}`" not in CONFIGURATION]
    assert not missing, f"docs/configuration.md does not document {missing}"


def test_every_config_field_has_a_toml_key():
    # a field the validator cannot set would be configuration the docs never name
    targets = {path for values in buckets_config._SCHEMA.values() for _, path in values.values()}
    fields = {f.name for f in dataclasses.fields(buckets_config.BucketsConfig)} - NOT_KEYS
    fields |= {f"embedding.{f.name}" for f in dataclasses.fields(buckets_config.EmbeddingConfig)}
    assert fields <= targets, f"config fields without a TOML key: {sorted(fields - targets)}"


def subcommands(parser: argparse.ArgumentParser, prefix: str):
    """(command line, its parser) for the parser and every subcommand, depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((f"{prefix} {name}", sub))
                found += subcommands(sub, f"{prefix} {name}")
    return found


def section(doc: str, command: str) -> str:
    """The `## ...` section of docs/configuration.md whose heading names `command`."""
    parts = re.split(r"^## ", doc, flags=re.M)
    matches = [p for p in parts if p.split("\n", 1)[0].startswith(f"`{command}")]
    assert len(matches) == 1, f"docs/configuration.md needs one section '## `{command} ...`'"
    return matches[0]


def arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The flags (long form) and positionals (as METAVAR / upper-case dest) of a parser."""
    names = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        if action.option_strings:
            names.append(longs[0] if longs else action.option_strings[0])
        else:
            names.append(action.metavar or action.dest.upper())
    return names


COMMANDS = (subcommands(cli.build_parser(), "bucketserve")
            + subcommands(buckets_main.build_parser(), "python -m bucketserve.buckets"))


def test_the_walk_finds_every_subcommand():
    names = [name for name, _ in COMMANDS]
    for expected in ("bucketserve serve", "bucketserve bench", "bucketserve tune-buckets",
                     "python -m bucketserve.buckets check"):
        assert expected in names


@pytest.mark.parametrize("command,parser", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_cli_flag_is_documented(command, parser):
    text = section(CONFIGURATION, command)
    missing = [a for a in arguments(parser)
               if not re.search(r"`" + re.escape(a) + r"(?![\w-])", text)]
    assert not missing, f"docs/configuration.md, section `{command}`, does not document {missing}"


def headline_rows() -> list[str]:
    part = README.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in part.splitlines() if line.startswith("| ")]
    return rows[1:]  # the header row; the |---| row does not start with "| "


def listed(path: str) -> bool:
    return any(path == e["path"] or path.startswith(e["path"].rstrip("/") + "/")
               for e in MANIFEST["result"])


def test_the_headline_table_has_figures():
    assert len(headline_rows()) >= 5


@pytest.mark.parametrize("row", headline_rows())
def test_every_headline_figure_links_to_a_listed_result_file(row):
    links = re.findall(r"\]\((bench/results/[^)]+)\)", row)
    assert links, f"a headline figure without a result file: {row}"
    for link in links:
        assert (ROOT / link).is_file(), f"{link} does not exist"
        assert listed(link), f"{link} is not in bench/results/MANIFEST.toml"
    scripts = re.findall(r"bench/[\w./-]+\.(?:py|sh)", row)
    assert scripts, f"a headline figure without its command: {row}"
    for script in scripts:
        assert (ROOT / script).is_file(), f"{script} does not exist"


def test_every_manifest_entry_exists_and_says_how_it_was_made():
    for entry in MANIFEST["result"]:
        assert (ROOT / entry["path"]).exists(), entry["path"]
        for key in ("command", "machine", "date", "doc"):
            assert entry[key].strip(), f"{entry['path']}: no {key}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"]), entry


def test_every_environment_variable_is_documented():
    # every BUCKETSERVE_* name the package, the tests or the benchmarks use
    used = set()
    for folder in ("bucketserve", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"BUCKETSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert used, "the scan found no variable"
    assert sorted(v for v in used if f"`{v}" not in operations) == []


# pages other branches add (linked from the README already); checked like any other once there
PENDING = {"docs/quantization.md", "docs/quantization-checkpoints.md", "docs/frontend.md",
           "docs/structured-output.md", "docs/ray.md"}


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def test_relative_links_and_anchors_resolve():
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if link.startswith(("http://", "https://")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                if str(target.relative_to(ROOT)) not in PENDING:
                    broken.append(f"{page.name}: {link}")
                continue
            if anchor and target.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", prose(target), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name}: {link}")
    assert broken == []
