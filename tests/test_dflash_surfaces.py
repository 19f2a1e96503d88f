"""Every surface names a DFlash drafter's drafts ``dflash`` (issue 56): the
step stats, ``/metrics``, the chat's colours, the chat page's legend; the
command line drafts with one through ``--drafter``; ``sweep`` covers its
block size (the length of its one row)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dflash_drafters import save_zlab
from helpers import cli, save_tiny_folder
from test_dflash import PROMPT, _oracle, _target

from mlx_redrafter.step.sources import LABELS as SOURCES

UI = Path(__file__).resolve().parents[1] / "mlx_redrafter" / "serve" / "ui"


def test_every_draft_source_has_a_name_on_every_surface():
    """The sources the step loop can report (step/sources/'s LABELS, dflash
    among them) each have a /metrics counter, a chat colour, a chat page
    colour and a swatch in its legend."""
    from mlx_redrafter.chat.terminal import STYLES
    from mlx_redrafter.serve.metrics import DRAFT_SOURCES

    assert "dflash" in SOURCES
    css, html = (UI / "style.css").read_text(), (UI / "index.html").read_text()
    for source in SOURCES:
        assert source in DRAFT_SOURCES, source
        assert source == "drafter" or source in STYLES, source
        assert f".src-{source}," in css and f"--{source}:" in css, source
        assert f'class="swatch src-{source}"' in html, source


def test_metrics_count_dflash_tokens():
    """``/metrics`` has a dflash counter from the start, and counts a generation's dflash tokens."""
    from types import SimpleNamespace

    from helpers import engine_metrics

    from mlx_redrafter.output import Tally

    m, engine = engine_metrics()
    line = 'redrafter_draft_tokens_accepted_total{source="dflash"}'
    assert f"{line} 0.0" in m.text().decode()
    done = SimpleNamespace(
        prompt_tokens=4,
        completion_tokens=9,
        step_tokens=[4, 5],
        drafted_by_source={"dflash": 7},
        reused_tokens=0,
        tally=Tally(),
    )
    engine.listeners[0](done)
    assert f"{line} 7.0" in m.text().decode()


def test_generate_drafts_with_a_dflash_folder(tmp_path, capsys):
    """``generate --drafter FOLDER`` with a z-lab drafter: announced as DFlash
    guesses of its block, the output plain decoding's."""
    folder = save_tiny_folder(tmp_path / "model", bigram=True, num_hidden_layers=4)
    drafter = save_zlab(tmp_path / "dflash", _bigram(folder), [1, 3], block=4, mask=0)
    base = ["generate", "--temp", "0", "--raw", "-n", "20", "--model", str(folder), "-p", "w5 w9 w11"]
    assert cli(base + ["--no-draft"]) == 0
    plain = capsys.readouterr().out
    assert cli(base + ["--drafter", str(drafter), "--no-lookup"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "1 DFlash guess of 3 tokens per step" in " ".join(out.err.split()), out.err


def _bigram(folder):
    from mlx_redrafter.llm.load import load_model

    return load_model(str(folder))[0]


def test_sweep_covers_the_block_size(tmp_path):
    """A sweep over lengths is a sweep over the block it drafts: every cell
    exact, the oracle's longer blocks taking more tokens per step."""
    from mlx_redrafter.tuning import sweep as sw

    model = _target("qwen3", vocab=31)
    folder = save_zlab(tmp_path / "d", model, [1, 3], block=8, mask=0)
    oracle = _oracle(model, folder, rank=0, max_tokens=24)
    cfg = sw.SweepConfig([1], [2, 7], max_tokens=24, baseline_every=4)
    results = sw.run_sweep(model, [PROMPT], oracle, cfg, tmp_path / "sweep")
    cells = {c["length"]: c for c in results["cells"] if c["tree"] == "fixed"}
    assert sorted(cells) == [2, 7] and all(c["identical_outputs"] == 1 for c in cells.values())
    assert cells[7]["tokens_per_step"] > cells[2]["tokens_per_step"] > 1


@pytest.mark.parametrize("layout", ["z-lab", "speculators"])
def test_a_hub_id_fetches_a_drafter_into_the_store_as_it_is(tmp_path, monkeypatch, layout):
    """``load_drafter("org/name")`` and ``--drafter org/name``: a DFlash repo
    (from an offline Hugging Face cache, as `hf download` leaves it) is kept
    in the store as it is, found there afterwards, and drafts exactly."""
    import shutil

    from helpers import assert_tokens_exact
    from huggingface_hub import constants
    from test_dflash import _save

    from mlx_redrafter.config import library_draft
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.hub.locate import locate

    model = _target("qwen3")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))
    repo, commit = "someone/Tiny-DFlash-b5", "0123456789abcdef0123456789abcdef01234567"
    root = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(_save(layout, tmp_path / "d", model, [0, 2], block=5, mask=0), root / "snapshots" / commit)
    found = locate(repo, say=lambda m: None)
    assert found.source == f"hub:{repo}" and (found.path / "model.safetensors").is_file()
    drafter = load_drafter(repo, dtype="float32")
    assert drafter.source_path == found.path and drafter.taps == (0, 2)
    assert_tokens_exact(model, PROMPT, library_draft(model, drafter, 1, None, 0), min_accepted=3, max_tokens=40)
