"""The commands' model and drafting flags reach the runtime by name, whole
(issue 46): one LoadOptions object from the edge to ``open_runtime``, built
by cli/options.py ``drafting`` (no ``locals()``, issue 54)."""

import inspect
from dataclasses import fields

import pytest

from mlx_redrafter.cli import run as commands
from mlx_redrafter.cli.options import DRAFT_FLAGS, draft_options
from mlx_redrafter.draft.stateful import SourceFlags
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.runtime import LoadOptions


def test_each_flag_reaches_the_option_of_its_own_name():
    """Every drafting flag, each a distinct value: each lands in its own field
    (a swapped or dropped one would not)."""
    flags = {name: f"value of {name}" for name, _, _ in DRAFT_FLAGS}
    got = draft_options(flags, history=True)
    assert got.history is True
    for f in fields(LoadOptions):
        if f.name not in ("sources", "history"):
            assert getattr(got, f.name) == flags[f.name], f.name
    for f in fields(SourceFlags):
        assert getattr(got.sources, f.name) == flags[f.name], f.name
    assert {n for n, _, _ in DRAFT_FLAGS} == ({f.name for f in fields(LoadOptions)} - {"sources", "history"}) | {
        f.name for f in fields(SourceFlags)
    }


@pytest.mark.parametrize("command", [commands.generate, commands.chat, commands.serve])
def test_every_drafting_command_has_a_flag_for_each_option(command):
    """A field of LoadOptions or SourceFlags a command lacks would silently keep its default."""
    params = set(inspect.signature(command).parameters)
    wanted = {f.name for f in fields(LoadOptions)} - {"sources", "history"} | {f.name for f in fields(SourceFlags)}
    assert wanted <= params, sorted(wanted - params)


def test_contradicting_flags_fail_before_the_load():
    with pytest.raises(RedrafterError, match="--no-draft and --drafter"):
        LoadOptions("no-such-model", "d", no_draft=True).check()
    with pytest.raises(RedrafterError, match="--beam-width must be at least 1"):
        LoadOptions("no-such-model", beam_width=0).check()
