"""Docs that cannot go stale: every page of README.md, docs/ and
bench/RESULTS.md is checked against the real project (doc_checks.py has the
checkers: commands behind ``.venv/bin/``, ``mlx.launch ... --`` and
``python bench/...`` included, choice values, required options, flags
named inline in prose, client examples' routes and model names, links).
Every Python block that imports ``mlx_redrafter`` runs (on the default
model), unless the line before its fence is ``<!-- not run: REASON -->``.

The last tests show that each checker fails on what it is there to find: a
renamed flag, a removed subcommand, a bad choice value, a missing required
option, a flag named in prose that no command has, a route the server does
not serve, a model it does not answer to, a missing make target, a broken link.
"""

from __future__ import annotations

import subprocess
import sys
from typing import List

import pytest
import typer
from doc_checks import (
    REPO,
    Block,
    all_options,
    app_routes,
    bench_options,
    broken_links,
    check_bench,
    check_cli,
    check_command,
    check_make,
    check_span,
    doc_problems,
    fenced_blocks,
    make_targets,
    model_problems,
    route_problems,
    shell_commands,
    value_choices,
)

from mlx_redrafter.cli import app

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "RESULTS.md"]


def python_blocks(paths) -> List[Block]:
    return [b for p in paths for b in fenced_blocks(p) if b.lang in ("python", "py") and "mlx_redrafter" in b.text]


@pytest.fixture(scope="module")
def cli_root():
    return typer.main.get_command(app)


# --------------------------------------------------------------------------- the docs as they are


def test_every_documented_command_flag_target_and_link_exists(cli_root):
    paths = [p for p in DOCS if p.is_file()]
    assert REPO / "README.md" in paths
    problems = doc_problems(paths, cli_root, make_targets(REPO / "Makefile"), app_routes())
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


def test_a_bad_value_and_a_missing_required_option_are_found(cli_root):
    gen = ["mlx-redrafter", "generate", "--prompt", "hi"]
    assert check_cli(gen + ["--max-tokens", "N"], cli_root) is None  # a placeholder
    assert "--max-tokens" in check_cli(gen + ["--max-tokens", "many"], cli_root)
    assert check_cli(gen + ["--tree", "auto", "--dtype", "bfloat16"], cli_root) is None
    assert "--tree bogus" in check_cli(gen + ["--tree", "bogus"], cli_root)  # the CLI takes text, checked later
    assert "--kind some" in check_cli(["mlx-redrafter", "datastore", "clear", "--kind", "some"], cli_root)
    build = ["mlx-redrafter", "datastore", "build", "--model", "M"]
    assert "needs --prompts" in check_cli(build, cli_root)  # a whole command line
    assert check_cli(build, cli_root, complete=False) is None  # a fragment in prose
    assert value_choices()["--tree"] == {"auto", "fixed"}


def test_commands_behind_venv_launchers_and_bench_scripts_are_checked(cli_root):
    targets = make_targets(REPO / "Makefile")
    found = lambda line: check_command(shell_commands(Block(REPO / "x.md", 1, "bash", line))[0], cli_root, targets)  # noqa: E731
    assert found("LD_PRELOAD=... .venv/bin/mlx-redrafter sweep --widths 1,2") is None
    assert "--widht" in found(".venv/bin/mlx-redrafter sweep --widht 1")
    assert "--out" not in (found("mlx.launch -n 2 --backend ring -- mlx-redrafter distill --out d") or "")
    assert "--bogus" in found("mlx.launch -n 2 --backend ring -- mlx-redrafter distill --bogus 1")
    assert "--bogus" in found("python -m mlx_redrafter.cli generate --bogus")
    assert found("python bench/lookup.py --mt-bench 16 --per-task 8 --max-tokens N") is None
    assert "unrecognized arguments: --bogus" in found(".venv/bin/python bench/run.py --quick --bogus")
    assert "invalid int value: 'many'" in found("python bench/lookup.py --mt-bench many")
    assert "--drafters" in found("python bench/acceptance.py")  # a required option left out
    assert "no script" in found("python bench/gone.py --quick")
    assert "takes no options" in found("python bench/compile.py --fast")
    assert check_bench(["bench/acceptance.py", "--calibration"], complete=False) is None


def test_flags_named_in_prose_are_found(cli_root):
    options = {**all_options(cli_root), **bench_options(["bench/acceptance.py"])}
    span = lambda text: check_span(text, cli_root, options, value_choices())  # noqa: E731
    for fine in ("--queue-size", "--lookup/--no-lookup", "--beam-width/-W", "--tree auto|fixed", "serve --api-key KEY"):
        assert span(fine) is None, fine
    assert span("doctor --calibrate") is None and span("bench/acceptance.py --calibration") is None
    assert "no command has --queue-sized" in span("--queue-sized")
    assert "--tree bogus" in span("--tree auto|bogus")
    assert "has no option --calibrate" in span("serve --calibrate")  # the command it names lacks it
    assert span("pip install --no-deps x") is None and span("mlx.launch --python") is None  # not ours
    assert "--queue-size" in all_options(cli_root) and "serve" in " ".join(all_options(cli_root)["--queue-size"])


def test_routes_and_model_names_of_client_examples_are_found(cli_root):
    routes = app_routes()
    assert {"/v1/chat/completions", "/api/chat", "/v1/messages", "/health", "/"} <= set(routes)
    good = "curl http://127.0.0.1:8080/v1/chat/completions\nbase_url = http://127.0.0.1:8080/v1 `GET /v1/models`"
    assert route_problems(good, routes) == []
    bad = "curl http://127.0.0.1:8080/v1/chat/completion and `POST /v1/models` and `/api/pull`"
    assert route_problems(bad, routes) == [
        "no route /v1/chat/completion",
        "no route `POST /v1/models`",
        "no route `/api/pull`",
    ]
    page = '```python\nclient.chat.completions.create(model="default")\n```\n```json\n{"model": "gpt-4o"}\n```\n'
    assert model_problems(page, cli_root) == ["model 'gpt-4o' is not one the documented server serves"]
    served = '```bash\nmlx-redrafter serve --model org/m\n```\n```toml\nmodel = "org/m"\n```\n'
    assert model_problems(served, cli_root) == [] and model_problems(served.replace("org/m", "x", 1), cli_root)


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
