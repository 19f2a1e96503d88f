"""Layering by folder: a module's path says what it may import.

From the bottom up: the ground floor (errors.py, files.py); config.py and
profiles.py; llm/; draft/ and step/ (the engine); hub/ (drafter
distribution: the store, the Hub, load_drafter); the front door
(generate.py and its neighbours); the tools (tuning/, train/, converters);
the apps (chat/, serve/); the command line (cli/). Imports are read with ``ast``
(function-local ones included), so nothing is imported to check. Every
module named here must exist: a missing one fails, it is not skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mlx_redrafter"
P = "mlx_redrafter."

# Layer -> the modules it holds (a folder's name holds every module in it).
GROUND = ["errors", "files"]
CONFIG = ["config", "profiles"]
LLM = ["llm"]
ENGINE = ["draft", "step"]
DISTRIBUTION = ["hub"]
FRONT = ["generate", "keywords", "output", "runtime", "prompts", "doctor", "__init__"]
TOOLS = ["tuning", "train", "converters"]
APPS = ["chat", "serve"]
CLI = ["cli"]
UPPER = TOOLS[:2] + APPS + CLI  # what nothing below may import (the converters are a tool, yet llm/ reads GGUF)
# Modules the layout promises (more may join a folder).
NAMED = [
    "errors",
    "files",
    "config",
    "profiles",
    "generate",
    "output",
    "runtime",
    "prompts",
    "doctor",
    "cli/__init__",
    "cli/options",
    "cli/run",
    "cli/sweep",
    "cli/convert",
    "cli/training",
    "cli/make",
    "cli/drafters",
    "llm/load",
    "llm/parts",
    "llm/text",
    "llm/cache",
    "llm/identity",
    "draft/redrafter",
    "draft/beam",
    "draft/lookup",
    "draft/controller",
    "draft/datastore/index",
    "draft/datastore/file",
    "draft/datastore/use",
    "hub/store",
    "hub/locate",
    "hub/load",
    "hub/publish",
    "step/tree",
    "step/verify",
    "step/accept",
    "step/protocol",
    "step/source",
    "step/sources/__init__",
    "step/build",
    "step/loop",
    "step/plan",
    "step/dispatch",
    "tuning/measure",
    "tuning/cost",
    "tuning/sweep",
    "tuning/report",
    "tuning/verdict",
    "train/distill",
    "train/shards",
    "train/trainer",
    "train/world",
    "train/controller",
    "train/recipe",
    "train/recipe_state",
    "train/budget",
    "train/sources",
    "train/finish",
    "train/learning",
    "chat/terminal",
    "chat/conversation",
    "chat/commands",
    "chat/settings",
    "serve/engine",
    "serve/app",
    "serve/streaming",
    "serve/openai_api",
    "serve/ollama_api",
    "serve/anthropic_api",
    "serve/anthropic_reply",
    "serve/responses_api",
    "serve/responses_reply",
]
COMMANDS = (P + "cli", P + "chat", P + "tuning.sweep", P + "serve")


def module_name(path: Path) -> str:
    """The dotted name a file is imported as (converters/ ships as mlx_redrafter.converters)."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "converters":
        parts = ["mlx_redrafter"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set:
    """Every module ``path`` imports, relative imports resolved, ``from . import x`` as ``pkg.x``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def package_imports(path: Path) -> set:
    """The package modules ``path`` imports (names of ours only; ``mlx_redrafter`` itself dropped)."""
    return {m for m in imported_modules(path) if m.startswith(P)}


def in_group(module: str, group) -> bool:
    return any(module == P + g or module.startswith(P + g + ".") for g in group)


def package_files():
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    return files + list((REPO / "converters").rglob("*.py"))


def _top_name(module: str) -> str:
    """``mlx_redrafter.step.tree.PAD`` -> ``step``; ``mlx_redrafter.config.X`` -> ``config``."""
    return module[len(P) :].split(".")[0] if module.startswith(P) else module


def offenders(files, allowed) -> dict:
    """``{file: [imports outside allowed]}``; ``allowed``: top-level names of the package."""
    out = {}
    for path in files:
        bad = sorted(m for m in package_imports(path) if _top_name(m) not in allowed)
        if bad:
            out[str(path.relative_to(REPO))] = bad
    return out


def files_of(group):
    out = []
    for g in group:
        folder, single = PACKAGE / g, PACKAGE / f"{g}.py"
        if folder.is_dir():
            out += [p for p in folder.rglob("*.py") if "__pycache__" not in p.parts]
        elif g == "converters":
            out += list((REPO / "converters").rglob("*.py"))
        else:
            out.append(single)
    return out


@pytest.mark.parametrize("name", NAMED)
def test_every_module_the_layout_names_exists(name):
    assert (PACKAGE / f"{name}.py").is_file(), f"mlx_redrafter/{name}.py is missing: the layout names it"


def test_every_package_module_has_a_layer():
    every = GROUND + CONFIG + LLM + ENGINE + DISTRIBUTION + FRONT + TOOLS + APPS + CLI
    loose = [
        p.relative_to(REPO)
        for p in package_files()
        if _top_name(module_name(p)) not in every and module_name(p) != "mlx_redrafter"
    ]
    assert not loose, f"modules in no layer (add them to a folder, or to a layer here): {loose}"


def test_the_import_reader_sees_relative_and_local_imports():
    imports = imported_modules(PACKAGE / "cli" / "sweep.py") | imported_modules(PACKAGE / "cli" / "run.py")
    assert P + "tuning.sweep" in imports and P + "chat" in imports  # function-local, relative
    assert P + "config.LOOKUP_LENGTH" in imports and P + "cli.options.app" in imports
    assert _top_name(P + "step.tree.PAD") == "step" and in_group(P + "chat.settings", APPS)
    # The checks below do find a bad import when there is one.
    assert offenders(files_of(["cli"]), GROUND), "cli imports more than the ground floor"


def test_the_ground_floor_imports_nothing_of_ours():
    assert not offenders(files_of(GROUND), GROUND)


def test_config_imports_only_the_ground_floor():
    # profiles.py names the device through doctor.py's BLAS probe.
    assert not offenders(files_of(CONFIG), GROUND + CONFIG + ["doctor"])


def test_llm_imports_only_the_ground_floor():
    # GGUF files are converted on load (converters/gguf.py imports only the ground floor).
    assert not offenders(files_of(LLM), GROUND + LLM + ["converters"])
    assert not offenders([REPO / "converters" / "gguf.py"], GROUND)


def test_step_and_draft_import_only_llm_config_and_each_other():
    assert not offenders(files_of(ENGINE), GROUND + CONFIG + LLM + ENGINE)


def test_draft_sources_do_not_import_the_step_that_consumes_them():
    """Arrays flow one way: draft/ proposes rows, step/ verifies them; a shared
    constant (PAD) lives on the floor both stand on (config.py). Nor does a
    draft source reach drafter distribution (hub/): the store and the Hub
    hand a source its files, never the other way round."""
    assert not offenders(files_of(["draft"]), GROUND + CONFIG + LLM + ["draft"])


# A Hub drafter in the PyTorch layout is converted on first use, as llm/ converts a
# GGUF file on load: hub/locate.py alone may call the converters (the safe reader).
CONVERTS_ON_LOAD = [PACKAGE / "hub" / "locate.py"]


def test_drafter_distribution_imports_only_the_draft_sources_below_it():
    """hub/ (the drafter store, the Hub, publishing, load_drafter) stands on
    draft/ (the drafter's files) and llm/ (a model's identity); the front door
    and everything above import it."""
    hub = [p for p in files_of(DISTRIBUTION) if p not in CONVERTS_ON_LOAD]
    assert hub and not offenders(hub, GROUND + CONFIG + LLM + ["draft"] + DISTRIBUTION)
    assert not offenders(CONVERTS_ON_LOAD, GROUND + CONFIG + LLM + ["draft"] + DISTRIBUTION + ["converters"])


def test_nothing_below_imports_the_tools_the_apps_or_the_cli():
    below = files_of(GROUND + CONFIG + LLM + ENGINE + DISTRIBUTION + FRONT) + [REPO / "converters" / "gguf.py"]
    bad = {}
    for path in below:
        hits = sorted(m for m in package_imports(path) if in_group(m, UPPER))
        if hits:
            bad[str(path.relative_to(REPO))] = hits
    assert not bad, bad


def test_the_tools_import_no_app():
    assert not offenders(files_of(TOOLS), GROUND + CONFIG + LLM + ENGINE + DISTRIBUTION + FRONT + TOOLS)


def test_no_module_uses_a_command_module_as_a_library():
    """Only cli/ (and a command's own parts) may import chat/, serve/, the sweep or cli/."""
    files = package_files() + list((REPO / "bench").rglob("*.py"))
    found = {}
    for path in files:
        me = module_name(path)
        for m in imported_modules(path):
            for cmd in COMMANDS:
                own = me == cmd or me.startswith(cmd + ".")
                cli = me == P + "cli" or me.startswith(P + "cli.")
                if not own and not cli and (m == cmd or m.startswith(cmd + ".")):
                    found.setdefault(str(path.relative_to(REPO)), []).append(m)
    assert not found, found


def import_cycles(files) -> list:
    """The import cycles among ``files`` (each a sorted list of module names),
    function-local imports included: strongly connected components of the graph."""
    modules = {module_name(p): p for p in files}

    def target(name):  # `pkg.module.attr` -> `pkg.module`
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    return _components({m: {t for t in map(target, package_imports(p)) if t and t != m} for m, p in modules.items()})


def _components(graph) -> list:
    """The groups of more than one module that all reach each other."""
    seen, cycles = set(), []
    for start in graph:  # a module is in a cycle with the modules it reaches that reach it back
        if start in seen:
            continue
        ahead = _reach(graph, start)
        group = sorted(m for m in ahead if start in _reach(graph, m))
        seen.update(group)
        if len(group) > 1:
            cycles.append(group)
    return cycles


def _reach(graph, start) -> set:
    out, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - out:
            out.add(nxt)
            todo.append(nxt)
    return out


def test_the_import_graph_has_no_circle():
    """No module reaches itself through imports, function-local ones included:
    every API's routes stand on serve/streaming.py (openai_api and ollama_api
    once imported each other), the commands on cli/options.py (they once
    imported the cli package that imports them), make-drafter's stages on
    train/recipe_state.py (finish and recipe once imported each other)."""
    everything = files_of(GROUND + CONFIG + LLM + ENGINE + DISTRIBUTION + FRONT + TOOLS + APPS + CLI)
    assert not import_cycles(everything)
    a, b = PACKAGE / "serve" / "openai_api.py", PACKAGE / "serve" / "ollama_api.py"
    assert import_cycles([a, b]) == []
    # The finder finds a circle where there is one (cli/__init__ and a command importing it back, as before).
    fake = {P + "cli": {P + "cli.run", P + "errors"}, P + "cli.run": {P + "cli"}, P + "errors": set()}
    assert _components(fake) == [[P + "cli", P + "cli.run"]]


# --------------------------------------------------------------------------- sizes and one protocol

MAX_MODULE_LINES = 450
# From `def` to the last line, the docstring not counted: the limit keeps code
# short, and the public API's docstrings (help(stream_generate) documents every
# keyword) must not have to shrink for it.
MAX_FUNCTION_LINES = 70


def function_lines(node) -> int:
    n = node.end_lineno - node.lineno + 1
    doc = node.body[0] if node.body else None
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        n -= doc.end_lineno - doc.lineno + 1
    return n


def test_no_module_or_function_is_too_long():
    long = []
    for path in package_files():
        source = path.read_text()
        rel = path.relative_to(REPO)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{rel}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = function_lines(node)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}(): {n} lines")
    assert not long, "split these (modules <= 450 lines, functions <= 70):\n" + "\n".join(long)


def test_the_step_loop_speaks_the_one_host_protocol():
    """The read layout and the rebuild of a step's tokens and stats live in
    step/protocol.py alone; the loop's two schedules use them, and no loop or
    config names a source (a source is a module of step/sources/, asked
    through the protocol)."""
    source = (PACKAGE / "step" / "loop.py").read_text()
    for used in ("StepRead.parse(", "step_read(", "first_step(", ".tokens(step"):
        assert used in source, f"step/loop.py does not use protocol's {used}"
    for copy in ("StepStats(", "StepTokens(", "vals[3"):
        assert copy not in source, f"step/loop.py repeats the protocol: {copy!r}"
    names = ('"drafter"', '"lookup"', '"datastore"', '"mtp"', '"eagle3"', '"draft-model"', ".drafter", ".lookup")
    for name in ("loop", "build", "plan", "dispatch", "auto", "select"):
        text = (PACKAGE / "step" / f"{name}.py").read_text()
        named = [n for n in names if n in text]
        assert not named, f"step/{name}.py names a source: {named}"
