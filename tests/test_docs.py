"""Docs that cannot go stale: every fenced block of README.md and docs/ is
checked against the real project.

* every ``mlx-redrafter SUBCOMMAND ...`` line parses against the real CLI
  (the subcommand exists and every flag exists on it), through click's own
  parser, without running the command;
* every ``make TARGET`` names a target of the Makefile;
* every Python block that imports ``mlx_redrafter`` runs (on the default
  model), unless the line before its fence is ``<!-- not run: REASON -->``;
* every relative link points at a file that exists.

The checkers are plain functions; the last tests show that each one fails on
a renamed flag, a removed subcommand, a missing make target and a broken link.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest
import typer

try:  # newer typer parses with its own copy of click: its exceptions are that copy's
    from typer._click import exceptions as errors
    from typer._click.core import Context
except ImportError:  # older typer: click itself
    from click import Context
    from click import exceptions as errors

from mlx_redrafter.cli import app

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "RESULTS.md"]
SHELLS = {"bash", "sh", "shell", "console", "zsh", ""}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
# An inline Markdown link or image: [text](target) / ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass
class Block:
    """One fenced block: where it is, its language, its text, and why it is not run (if so)."""

    path: Path
    line: int
    lang: str
    text: str
    not_run: Optional[str] = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path, text: Optional[str] = None) -> List[Block]:
    """The fenced blocks of a Markdown file (``text``: its content, read when not given)."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        before = NOT_RUN.search(lines[i - 1]) if i else None
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start + 1, lang, "\n".join(body), before.group(1) if before else None))
        i += 1
    return blocks


def shell_commands(block: Block) -> List[List[str]]:
    """The command lines of a shell block as argument lists (comments, ``$ ``
    prompts, leading ``VAR=value`` assignments and ``\\`` continuations handled)."""
    out, pending = [], ""
    for raw in block.text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = line[2:] if line.startswith("$ ") else line
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote in a shell fragment: not a command line
                continue
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            redirect = next((i for i, w in enumerate(words) if re.match(r"^\d*[<>]", w)), len(words))
            words = words[:redirect]  # `> replies.txt`, `2>&1`: the shell's, not the command's
            if words:
                out.append(words)
    return out


def check_cli(words: List[str], root) -> Optional[str]:
    """Why ``words`` (``mlx-redrafter ...``) does not parse against the CLI, or None."""
    cmd, args, name = root, list(words[1:]), words[0]
    if any("$" in w for w in args[:1]):
        return None  # a subcommand held in a shell variable: what it expands to is not written here
    while hasattr(cmd, "get_command") and args and not args[0].startswith("-"):  # a group: walk down
        sub = cmd.get_command(Context(cmd), args[0])
        if sub is None:
            return f"no subcommand {args[0]!r} in `{name}`"
        name, cmd, args = f"{name} {args[0]}", sub, args[1:]
    if "--help" in args or "-h" in args:
        return None
    try:
        cmd.make_context(name, args)
    except errors.NoSuchOption as e:
        return f"`{name}` has no option {e.option_name}"
    except (errors.MissingParameter, errors.BadParameter):
        return None  # a value written as a placeholder (PATH, N): the flags exist
    except errors.UsageError as e:
        return f"`{name} {' '.join(args)}`: {e.format_message()}"
    return None


def make_targets(makefile: Path) -> set:
    """The targets a Makefile defines (``name:`` at the start of a line, not ``:=``)."""
    found = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.%/-]+(?:\s+[A-Za-z0-9_.%/-]+)*)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            found.update(m.group(1).split())
    return found


def check_make(words: List[str], targets: set) -> Optional[str]:
    """Why ``make ...`` names a target the Makefile lacks, or None."""
    wanted = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    missing = [t for t in wanted if t not in targets]
    return f"make target(s) {', '.join(missing)} not in the Makefile" if missing else None


def anchors(text: str) -> set:
    """The anchors GitHub gives a Markdown page's headings (lower case, punctuation
    dropped, spaces as hyphens; a repeated heading gets -1, -2, ...)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    seen, out = {}, set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path, text: Optional[str] = None) -> List[str]:
    """The relative links of a Markdown file whose target does not exist, or
    whose ``#anchor`` names no heading of the Markdown page it points at."""
    text = path.read_text() if text is None else text
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # code is not prose: no links inside
    bad = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # a URL (https:, mailto:)
        file, _, anchor = target.partition("#")
        dest = path.parent / file if file else path
        if file and not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(text if dest == path else dest.read_text()):
            bad.append(target)
    return bad


def doc_problems(paths, root, targets: set) -> List[str]:
    """Every stale command line and broken link in ``paths``."""
    problems = []
    for path in paths:
        problems += [f"{path.relative_to(REPO)}: broken link {t}" for t in broken_links(path)]
        for block in fenced_blocks(path):
            if block.lang not in SHELLS:
                continue
            for words in shell_commands(block):
                why = None
                if words[0] == "mlx-redrafter":
                    why = check_cli(words, root)
                elif words[0] == "make":
                    why = check_make(words, targets)
                if why:
                    problems.append(f"{block.where}: {why}")
    return problems


def python_blocks(paths) -> List[Block]:
    return [b for p in paths for b in fenced_blocks(p) if b.lang in ("python", "py") and "mlx_redrafter" in b.text]


@pytest.fixture(scope="module")
def cli_root():
    return typer.main.get_command(app)


# --------------------------------------------------------------------------- the docs as they are


def test_every_documented_command_flag_target_and_link_exists(cli_root):
    paths = [p for p in DOCS if p.is_file()]
    assert REPO / "README.md" in paths
    problems = doc_problems(paths, cli_root, make_targets(REPO / "Makefile"))
    assert not problems, "stale docs:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", python_blocks([p for p in DOCS if p.is_file()]), ids=lambda b: b.where)
def test_every_python_block_runs_or_says_why_not(block, _isolated_cache):
    if block.not_run:
        assert len(block.not_run) > 8, f"{block.where}: say why the block is not run"
        pytest.skip(f"{block.where} is marked not run: {block.not_run}")
    done = subprocess.run([sys.executable, "-c", block.text], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.where} failed:\n{done.stderr[-3000:]}"


# --------------------------------------------------------------------------- the checkers do fail


def test_a_renamed_flag_a_removed_subcommand_and_a_bad_value_are_found(cli_root):
    assert check_cli(["mlx-redrafter", "generate", "--max-tokens", "8", "--prompt", "hi"], cli_root) is None
    assert "--max-token" in check_cli(["mlx-redrafter", "generate", "--max-token", "8"], cli_root)
    assert "no subcommand 'generat'" in check_cli(["mlx-redrafter", "generat", "--prompt", "x"], cli_root)
    assert "no subcommand 'bogus'" in check_cli(["mlx-redrafter", "datastore", "bogus"], cli_root)
    assert check_cli(["mlx-redrafter", "datastore", "info", "--model", "M"], cli_root) is None
    assert check_cli(["mlx-redrafter", "chat", "--help"], cli_root) is None


def test_shell_lines_are_split_like_a_shell():
    block = Block(
        REPO / "README.md",
        1,
        "bash",
        "\n".join(
            [
                "# a comment",
                "$ LD_PRELOAD=/x.so mlx-redrafter generate --prompt 'a b' -n 4  # trailing comment",
                "make setup && make test TEST_WORKERS=4",
                "mlx-redrafter sweep \\",
                "    --widths 1,2",
            ]
        ),
    )
    assert shell_commands(block) == [
        ["mlx-redrafter", "generate", "--prompt", "a b", "-n", "4"],
        ["make", "setup"],
        ["make", "test", "TEST_WORKERS=4"],
        ["mlx-redrafter", "sweep", "--widths", "1,2"],
    ]


def test_a_missing_make_target_is_found():
    targets = make_targets(REPO / "Makefile")
    assert {"setup", "test", "chat"} <= targets
    assert check_make(["make", "test", "TEST_WORKERS=4"], targets) is None
    assert "no-such-target" in check_make(["make", "no-such-target"], targets)


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A title: with `code`\n## 21. Several clients (issue 38)\n")
    text = (
        "# Top\n[ok](there.md) [anchor](there.md#a-title-with-code) [web](https://x.org) [self](#top) "
        "[deep](there.md#21-several-clients-issue-38) [gone](missing.md) [stale](there.md#22-gone) [nope](#none)\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page, text) == ["missing.md", "there.md#22-gone", "#none"]


def test_a_block_marked_not_run_carries_its_reason(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- not run: downloads a model from the Hub -->\n```python\nimport mlx_redrafter\n```\n"
        "```python\nimport mlx_redrafter\n```\n"
    )
    first, second = fenced_blocks(page)
    assert first.not_run == "downloads a model from the Hub" and second.not_run is None
