"""The repository is self-contained: no package module, test, benchmark or
build file refers to a path outside it. A user's clone has nothing beside it
(no shared data folder), so such a reference works on the developers' machine only.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("mlx_redrafter", "converters", "tests", "bench", ".ci")
# README.md too: its commands are what a user runs in a clone.
SCANNED_FILES = ("Makefile", "pyproject.toml", "README.md")
CODE_SUFFIXES = {".py", ".sh", ".toml", ".cfg", ".ini", ".yml", ".yaml"}

# Each pattern is written so that its own source text does not match it: this
# file is scanned like every other.
OUTSIDE = [
    (re.compile(r"(?<!\.)\.\.[/\\]"), "a relative path up out of a folder"),
    (re.compile(r"""["']\.\.["']|\bpardir\b"""), "the parent folder as a path component"),
    (re.compile(r"""["'/\\]shared(?:["'/\\]|$)""", re.M), "a folder named shared"),
    (
        re.compile(r"\b(?:REPO|ROOT|PROJECT)\w*\.parents?\b|\bcwd\(\)\.parents?\b", re.I),
        "the parent of the repository or working folder",
    ),
    (re.compile(r"""["'\s=]/(?:work|home|Users|root|mnt)/"""), "an absolute path on one machine"),
]


def outside_references(text: str, depth: int) -> list:
    """``(line number, why)`` for each reference to a path outside the repository
    in ``text``, the source of a file ``depth`` folders below the repository root."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        hits += [(n, why) for pattern, why in OUTSIDE if pattern.search(line)]
        if "__file__" in line:
            # parents[k] and k+1 chained .parent / dirname() climb k folders above
            # the file's own; more than its depth leaves the repository.
            ups = [int(k) for k in re.findall(r"\.parents\[(\d+)\]", line)]
            ups.append(len(re.findall(r"\.parent\b|dirname\(", line)) - 1)
            if max(ups) > depth:
                hits.append((n, f"{max(ups) + 1} folders up from __file__"))
    return hits


def _is_script(path):
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


def scanned_files():
    files = [REPO / name for name in SCANNED_FILES]
    for folder in SCANNED_DIRS:
        for path in sorted((REPO / folder).rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix in CODE_SUFFIXES or path.name == "Makefile" or _is_script(path):
                files.append(path)
    return files


def test_no_module_test_or_build_file_refers_outside_the_repository():
    files = scanned_files()
    names = {p.relative_to(REPO).as_posix() for p in files}
    # The scan sees what it must (this file included), or it proves nothing.
    assert {
        "Makefile",
        "README.md",
        ".ci/run",
        "mlx_redrafter/prompts.py",
        "mlx_redrafter/train/distill.py",
        "converters/gguf.py",
        "tests/conftest.py",
        "tests/test_self_contained.py",
        "bench/run.py",
    } <= names
    found = [
        f"{p.relative_to(REPO)}:{n}: {why}"
        for p in files
        for n, why in outside_references(p.read_text(encoding="utf-8"), len(p.relative_to(REPO).parts) - 1)
    ]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


# Written with placeholders (WORDS) so that this file itself stays clean.
OUTSIDE_SNIPPETS = [
    'SHARED = REPO{p} / "{s}"',
    "root = ROOT_DIR{ps}[0]",
    'p = base{p} / "{s}" / "data" / "sharegpt" / "x.jsonl.gz"',
    'p = Path("{up}/{s}/data/mt_bench/question.jsonl")',
    'open("{up}\\\\data\\\\x.json")',
    'Path("{up}") / "data"',
    'os.path.join(os.{pd}, "data")',
    'DATA = Path(__file__).resolve(){ps}[2] / "data"',
    'DATA = Path(__file__){p}{p}{p} / "data"',
    "DATA = os.path.dirname(os.path.dirname(os.path.dirname({f})))",
    'base = Path.cwd(){p} / "data"',
    'FIXTURES = Path("/{w}/{s}/fixtures")',
    "\t$(BIN)/mlx-redrafter distill --prompts {up}/{s}/data/sharegpt/x.jsonl.gz",
    'cd "$(dirname "$0")/{up}/{up}"',
    "DATA = '/{h}/me/{s}'",
]
INSIDE_SNIPPETS = [
    "REPO = Path(__file__).resolve(){ps}[1]",
    'DATA = Path(__file__){p} / "data"',
    'FIXTURES = Path(__file__).resolve(){p} / "fixtures"',
    'cd "$(dirname "$0")/{up}"',
    '"tuned profile ~/.cache/.../1a2b.json"',
    "Dynamic tree attention: merge the beams' {s} prefixes.",
    "BLIS := $(wildcard /usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3)",
    'out = tmp_path / "{s}_cache"',
    "x = path{p}.name",
]


# The placeholders' values, spelled so that these lines do not match either.
WORDS = dict(
    up="." + ".",
    s="sh" + "ared",
    p="." + "parent",
    ps="." + "parents",
    w="wo" + "rk",
    h="ho" + "me",
    pd="par" + "dir",
    f="__" + "file__",
)


def _expand(snippet):
    return snippet.format(**WORDS)


@pytest.mark.parametrize("snippet", OUTSIDE_SNIPPETS)
def test_references_outside_are_caught(snippet):
    assert outside_references(_expand(snippet), depth=1), _expand(snippet)


@pytest.mark.parametrize("snippet", INSIDE_SNIPPETS)
def test_references_inside_are_not(snippet):
    assert not outside_references(_expand(snippet), depth=1), _expand(snippet)
