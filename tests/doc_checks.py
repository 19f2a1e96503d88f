"""What test_docs.py checks a page of docs with: plain functions over its
text and the real project, none of which runs a command.

* the shell lines of fenced blocks: ``mlx-redrafter ...`` (also behind
  ``.venv/bin/``, ``python -m mlx_redrafter.cli`` and ``mlx.launch ... --``)
  through click's own parser, ``python bench/SCRIPT.py ...`` through the
  script's own argparse parser (caught before it parses, nothing run),
  ``make TARGET`` against the Makefile;
* the values written after an option: a click type's (``--max-tokens N``:
  ``N`` is a placeholder; ``--max-tokens many`` is not), and those the CLI
  checks after parsing against the project's own lists (``--tree``,
  ``--dtype``, ``--kind``, ``--preset``);
* a documented command line is complete: a required option left out is stale;
* flags named inline in prose (`` `--queue-size` ``, `` `serve --api-key` ``,
  `` `--tree auto|fixed` ``): the command the span names has them, else some command;
* client examples: every URL of the local server names a route the app
  serves, and every model name is one ``serve`` answers to;
* relative links and their anchors.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

try:  # newer typer parses with its own copy of click: its exceptions are that copy's
    from typer._click import exceptions as errors
    from typer._click.core import Context
except ImportError:  # older typer: click itself
    from click import Context
    from click import exceptions as errors

REPO = Path(__file__).resolve().parents[1]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
# An inline Markdown link or image: [text](target) / ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A value written as a placeholder: N, PATH, FILE.jsonl, <dir>, ..., $KEY, {model}.
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:\.\w+)?|<[^>]+>|\.\.\.|.*[$%{].*)$")
# Programs whose flags are not ours, when a prose span starts with them.
FOREIGN = {"pip", "hf", "git", "claude", "codex", "pytest", "docker", "apt-get", "sudo", "brew", "ollama", "curl"}
LOCAL_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost|host\.docker\.internal)(?::\d+)?(/[^\s'\"`)<>*]*)?")
# Where a client example names a model: JSON, Python keywords, TOML, env variables, ollama.Client calls.
MODEL_NAMES = re.compile(
    r"\"model\"\s*:\s*\"([^\"]+)\"|\bmodel\s*=\s*\"([^\"]+)\"|\b[A-Z_]*_MODEL=(\S+)|\.(?:chat|generate)\(\s*\"([^\"]+)\""
)


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


def prose(text: str) -> str:
    """A page without its fenced blocks."""
    return re.sub(r"^\s*(```+|~~~+).*?^\s*\1\s*$", "", text, flags=re.S | re.M)


def split_words(line: str) -> List[str]:
    """One command's words (leading ``VAR=value`` assignments and redirections dropped)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in a shell fragment: not a command line
        return []
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    redirect = next((i for i, w in enumerate(words) if re.match(r"^\d*[<>]", w)), len(words))
    return words[:redirect]  # `> replies.txt`, `2>&1`: the shell's, not the command's


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
            words = split_words(part)
            if words:
                out.append(words)
    return out


def command_of(words: List[str]) -> Optional[Tuple[str, List[str]]]:
    """``("cli", ["mlx-redrafter", ...])``, ``("bench", ["bench/x.py", ...])``,
    ``("make", words)`` or None (another program), seen through ``.venv/bin/``,
    ``python -m mlx_redrafter.cli`` and ``mlx.launch ... -- COMMAND``."""
    if not words:
        return None
    program = Path(words[0]).name
    if program == "mlx.launch":
        return command_of(words[words.index("--") + 1 :]) if "--" in words else None
    if program == "mlx-redrafter":
        return "cli", ["mlx-redrafter", *words[1:]]
    if program == "make":
        return "make", words
    if re.match(r"^python[\d.]*$", program) and len(words) > 1:
        if words[1] == "-m" and words[2:3] in (["mlx_redrafter.cli"], ["mlx_redrafter"]):
            return "cli", ["mlx-redrafter", *words[3:]]
        if words[1].endswith(".py") and Path(words[1]).parent.name == "bench":
            return "bench", words[1:]
    return None


# --------------------------------------------------------------------------- mlx-redrafter's options


def value_choices() -> Dict[str, set]:
    """The values of options the CLI takes as text and checks after parsing,
    read from the lists the project checks them against."""
    from mlx_redrafter.config import TREES
    from mlx_redrafter.draft.datastore.index import KINDS
    from mlx_redrafter.llm.load import DTYPES
    from mlx_redrafter.train.trainer import PRESETS

    return {"--tree": set(TREES), "--dtype": set(DTYPES), "--kind": {*KINDS, "all"}, "--preset": set(PRESETS)}


def value_after(args: List[str], opts) -> List[str]:
    """The values ``args`` give the option named ``opts`` (``--x v`` and ``--x=v``)."""
    out = []
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in opts:
            out += [value] if eq else args[i + 1 : i + 2]
    return out


def bad_values(args: List[str], checked: Dict[str, set]) -> List[str]:
    """Values of the project-checked options that are neither allowed nor placeholders (``a|b``: each)."""
    bad = []
    for flag, allowed in checked.items():
        for value in value_after(args, (flag,)):
            bad += [f"{flag} {v}" for v in value.split("|") if not PLACEHOLDER.match(v) and v not in allowed]
    return bad


def walk(words: List[str], root):
    """``(name, command, args)`` of ``mlx-redrafter SUB ...``, or ``(problem, None, None)``."""
    cmd, args, name = root, list(words[1:]), words[0]
    while hasattr(cmd, "get_command") and args and not args[0].startswith("-"):  # a group: walk down
        sub = cmd.get_command(Context(cmd), args[0])
        if sub is None:
            return f"no subcommand {args[0]!r} in `{name}`", None, None
        name, cmd, args = f"{name} {args[0]}", sub, args[1:]
    return name, cmd, args


def check_cli(words: List[str], root, complete: bool = True) -> Optional[str]:
    """Why ``words`` (``mlx-redrafter ...``) does not parse against the CLI,
    or None. ``complete``: the line is a whole command (a required option left
    out is stale); prose spans are fragments."""
    if any(re.search(r"[$%{]", w) or PLACEHOLDER.match(w) for w in words[1:2]):
        return None  # a subcommand held in a variable or written as COMMAND
    name, cmd, args = walk(words, root)
    if cmd is None:
        return name
    if "--help" in args or "-h" in args:
        return None
    bad = bad_values(args, value_choices())
    if bad:
        return f"`{name}`: {', '.join(bad)} is not a value it takes"
    try:
        cmd.make_context(name, list(args))
    except errors.NoSuchOption as e:
        return f"`{name}` has no option {e.option_name}"
    except errors.MissingParameter as e:
        missing = "/".join(e.param.opts) if e.param is not None else "a parameter"
        return f"`{name}` needs {missing}" if complete else None
    except errors.BadOptionUsage as e:
        if not complete and "requires an argument" in e.format_message():
            return None  # a fragment naming the option alone (`generate --seed`)
        return f"`{name} {' '.join(args)}`: {e.format_message()}"
    except errors.BadParameter as e:
        given = value_after(args, e.param.opts) if e.param is not None else []
        if given and all(PLACEHOLDER.match(v) for v in given):
            return None  # a value written as a placeholder (PATH, N): the flags exist
        return f"`{name} {' '.join(args)}`: {e.format_message()}"
    except errors.UsageError as e:
        return f"`{name} {' '.join(args)}`: {e.format_message()}"
    return None


def all_options(root) -> Dict[str, list]:
    """Every option string of every ``mlx-redrafter`` command -> the commands' names."""
    found: Dict[str, list] = {}

    def visit(cmd, name):
        for p in getattr(cmd, "params", []):
            for opt in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]:
                found.setdefault(opt, []).append(name)
        if hasattr(cmd, "list_commands"):
            ctx = Context(cmd)
            for sub in cmd.list_commands(ctx):
                visit(cmd.get_command(ctx, sub), f"{name} {sub}")

    visit(root, "mlx-redrafter")
    return found


# --------------------------------------------------------------------------- bench scripts' options


class _Caught(Exception):
    pass


@functools.lru_cache(maxsize=None)
def bench_parser(script: str) -> Optional[argparse.ArgumentParser]:
    """The argparse parser of ``bench/SCRIPT.py``: its module is imported and
    its ``parse_args`` (else ``main``) called with argparse's own
    ``parse_args`` replaced by a catch, so the parser is taken as it is
    about to parse and nothing runs. None: the script takes no flags."""
    path = REPO / script
    if "argparse" not in path.read_text():
        return None
    spec = importlib.util.spec_from_file_location(f"_doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    caught = []

    def catch(parser, *a, **k):
        caught.append(parser)
        raise _Caught

    original, argv = argparse.ArgumentParser.parse_args, sys.argv
    argparse.ArgumentParser.parse_args, sys.argv = catch, [str(path)]
    try:
        (getattr(module, "parse_args", None) or module.main)()
    except _Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args, sys.argv = original, argv
    assert caught, f"{script}: its parse_args/main did not parse arguments"
    return caught[0]


def check_bench(words: List[str], complete: bool = True) -> Optional[str]:
    """Why ``bench/SCRIPT.py ARGS`` does not parse with the script's parser, or None."""
    script, args = words[0], words[1:]
    if not (REPO / script).is_file():
        return f"no script {script}"
    parser = bench_parser(script)
    if parser is None:
        return f"`{script}` takes no options, given {' '.join(args)}" if args else None
    if "--help" in args or "-h" in args:
        return None

    def error(message):
        raise _Caught(message)

    parser.error = error  # argparse's own errors, raised instead of exiting
    try:
        argparse.ArgumentParser.parse_args(parser, args)
    except _Caught as e:
        message = str(e)
        if not complete and ("required" in message or "expected one argument" in message):
            return None  # a fragment: an option named alone, the command's other options left out
        if re.search(r"invalid \w+ value: '([^']*)'", message):
            value = re.search(r"invalid \w+ value: '([^']*)'", message).group(1)
            if PLACEHOLDER.match(value):
                return None
        return f"`{script} {' '.join(args)}`: {message}"
    return None


def bench_options(scripts) -> Dict[str, list]:
    """Every option string of the bench scripts -> the scripts."""
    found: Dict[str, list] = {}
    for script in scripts:
        parser = bench_parser(script)
        for action in parser._actions if parser else []:
            for opt in action.option_strings:
                found.setdefault(opt, []).append(script)
    return found


# --------------------------------------------------------------------------- flags named in prose


def prose_spans(text: str) -> List[str]:
    """The inline code spans of a page's prose, whitespace (line breaks) made single spaces."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose(text))]


def flag_alternatives(word: str) -> List[str]:
    """``--lookup/--no-lookup`` -> both; ``--beam-width/-W`` -> both; ``--flag`` -> itself."""
    return [w for w in word.split("/") if re.match(r"^--?[A-Za-z][\w-]*$", w)]


def check_span(span: str, root, options: Dict[str, list], checked: Dict[str, set]) -> Optional[str]:
    """Why a prose span's flags or values are stale, or None: a span that is
    a command (or names a subcommand first) is parsed as a fragment of one;
    bare flags must exist on some command, with their values where the
    project checks them."""
    words = split_words(span)
    if not words or Path(words[0]).name in FOREIGN or not any(w.startswith("-") for w in words):
        return None
    cmd = command_of(words)
    if cmd is None and words[0].endswith(".py") and Path(words[0]).parent.name == "bench":
        cmd = ("bench", words)
    if cmd is None and not words[0].startswith("-"):
        name, found, _ = walk(["mlx-redrafter", *words], root)
        cmd = ("cli", ["mlx-redrafter", *words]) if found is not None and name != "mlx-redrafter" else None
        if cmd is None:
            return None  # another program's flags (mlx.launch --python, ...)
    if cmd is not None:
        kind, args = cmd
        if kind == "cli":
            return check_cli(args, root, complete=False)
        return check_bench(args, complete=False) if kind == "bench" else None
    flags = [f for w in words if w.startswith("-") for f in flag_alternatives(w)]
    missing = [f for f in flags if f not in options]
    if missing:
        return f"no command has {', '.join(missing)}"
    bad = bad_values(words, checked)
    return f"{', '.join(bad)} is not a value it takes" if bad else None


def foreign_flags(spans: List[str]) -> set:
    """The flags of other programs' commands among ``spans`` (``pip install --no-deps ...``)."""
    words = [split_words(s) for s in spans]
    return {w for ws in words if ws and Path(ws[0]).name in FOREIGN for w in ws if w.startswith("-")}


def prose_problems(path: Path, root, options: Dict[str, list]) -> List[str]:
    """The stale flags, values and commands in a page's inline code; a bare
    flag that another program's command of the same paragraph has is that program's."""
    checked = value_choices()
    problems = []
    for paragraph in re.split(r"\n\s*\n", prose(path.read_text())):
        spans = prose_spans(paragraph)
        theirs = foreign_flags(spans)
        for span in spans:
            why = None if span in theirs else check_span(span, root, options, checked)
            if why:
                problems.append(f"{path.relative_to(REPO)}: `{span}`: {why}")
    return problems


# --------------------------------------------------------------------------- client examples


def app_routes() -> Dict[str, set]:
    """``path -> methods`` the server's app serves (built on a scripted engine: no model)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_server_scripted import ScriptedEngine

    from mlx_redrafter.serve.app import create_app
    from mlx_redrafter.serve.tools import GENERIC_FORMAT

    app = create_app(ScriptedEngine(GENERIC_FORMAT, []))
    routes: Dict[str, set] = {}
    for path, ops in app.openapi()["paths"].items():
        routes.setdefault(path, set()).update(m.upper() for m in ops)
    for r in app.routes:  # what the schema leaves out: the chat page, the schema itself
        if getattr(r, "path", None) is not None:
            routes.setdefault(r.path or "/", set()).update(getattr(r, "methods", None) or {"GET"})
    return routes


def route_problems(text: str, routes: Dict[str, set]) -> List[str]:
    """Local-server URLs (a base URL: a prefix of routes) and ``METHOD /path``
    spans whose route the app does not serve."""
    problems = []
    for path in LOCAL_URL.findall(text):
        path = path.rstrip(".,;:") or "/"
        if path not in routes and not any(r.startswith(path.rstrip("/") + "/") for r in routes):
            problems.append(f"no route {path}")
    for span in prose_spans(text):
        m = re.match(r"^(GET|POST|PUT|DELETE) (/\S*)$", span) or re.match(r"^()(/(?:v1|api)/[\w/]+)$", span)
        if m and (m.group(2) not in routes or (m.group(1) and m.group(1) not in routes[m.group(2)])):
            problems.append(f"no route `{span}`")
    return problems


def model_problems(text: str, root) -> List[str]:
    """Model names in client examples that the server documented does not
    answer to: ``serve``'s default model, or one a ``serve --model M`` of the page serves."""
    _, serve, _ = walk(["mlx-redrafter", "serve"], root)
    served = {next(p.default for p in serve.params if "--model" in p.opts)}
    for block in fenced_blocks(Path("page.md"), text):
        for words in shell_commands(block):
            cmd = command_of(words)
            if cmd and cmd[0] == "cli" and cmd[1][1:2] == ["serve"]:
                served.update(value_after(cmd[1], ("--model", "-m")))
    code = "\n".join(b.text for b in fenced_blocks(Path("page.md"), text))
    named = {next(g for g in m if g) for m in MODEL_NAMES.findall(code)}
    return [f"model {n!r} is not one the documented server serves" for n in named if n.split(":")[0] not in served]


# --------------------------------------------------------------------------- links and make


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
    bad = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):  # code is not prose: no links inside
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # a URL (https:, mailto:)
        file, _, anchor = target.partition("#")
        dest = path.parent / file if file else path
        if file and not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(text if dest == path else dest.read_text()):
            bad.append(target)
    return bad


# --------------------------------------------------------------------------- a page


SHELLS = {"bash", "sh", "shell", "console", "zsh", ""}


def check_command(words: List[str], root, targets: set) -> Optional[str]:
    """Why one shell line of a fenced block is stale, or None (another program's: not ours to check)."""
    cmd = command_of(words)
    if cmd is None:
        return None
    kind, args = cmd
    complete = "..." not in args  # `mlx-redrafter datastore build ... --minutes 6 ...`: the rest as above
    if kind == "cli":
        return check_cli(args, root, complete)
    return check_bench(args, complete) if kind == "bench" else check_make(args, targets)


def doc_problems(paths, root, targets: set, routes: Optional[Dict[str, set]] = None) -> List[str]:
    """Every stale command line, inline flag, route, model name and broken link in ``paths``."""
    options = {**all_options(root), **bench_options(sorted(f"bench/{p.name}" for p in (REPO / "bench").glob("*.py")))}
    problems = []
    for path in paths:
        where = path.relative_to(REPO)
        text = path.read_text()
        problems += [f"{where}: broken link {t}" for t in broken_links(path)]
        problems += prose_problems(path, root, options)
        problems += [f"{where}: {p}" for p in route_problems(text, routes or {}) if routes is not None]
        problems += [f"{where}: {p}" for p in model_problems(text, root)]
        for block in fenced_blocks(path):
            if block.lang not in SHELLS:
                continue
            for words in shell_commands(block):
                why = check_command(words, root, targets)
                if why:
                    problems.append(f"{block.where}: {why}")
    return problems
