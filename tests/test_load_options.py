"""The commands' model and drafting flags reach the runtime by name, whole
(issue 46): one LoadOptions object from the edge to ``open_runtime``."""

import inspect
from dataclasses import fields

import pytest

from mlx_redrafter.cli import run as commands
from mlx_redrafter.cli.options import load_options
from mlx_redrafter.draft.stateful import SourceFlags
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.runtime import LoadOptions


def test_flags_are_taken_by_name_and_the_rest_keep_their_defaults():
    flags = {"model": "m", "drafter": "d", "tree": "auto", "mtp": "none", "num_draft_tokens": 3, "sampling": 0.5}
    got = load_options(flags, history=True)
    want = LoadOptions("m", "d", tree="auto", history=True, sources=SourceFlags(mtp="none", num_draft_tokens=3))
    assert got == want


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
