"""Drafter and beam search against the official PyTorch reference outputs."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_redrafter import RedrafterError
from mlx_redrafter.draft.beam import beam_search, warp_logits
from mlx_redrafter.draft.redrafter import Drafter, DrafterConfig, save_drafter
from mlx_redrafter.hub.load import load_drafter


@pytest.mark.parametrize("kind", ["rnn", "norn"])
def test_official_folder_loads_unchanged(fixtures_dir, kind):
    d = load_drafter(fixtures_dir / f"drafter_{kind}")
    cfg = json.loads((fixtures_dir / f"drafter_{kind}" / "config.json").read_text())
    assert d.config.exit_dim == cfg["exit_dim"] and d.config.rnn == cfg["rnn"]
    assert ("rnn_u" in d) == cfg["rnn"] and "input_proj" not in d


@pytest.mark.parametrize("kind", ["rnn", "norn"])
def test_teacher_forced_unroll_matches_official(ref, embed, fixtures_dir, kind):
    d = load_drafter(fixtures_dir / f"drafter_{kind}")
    c, toks = mx.array(ref["ctx_c"]), mx.array(ref["tf_tokens"])
    logits = d(c, embed(toks))
    want = ref[f"tf_{kind}_logits_raw"]
    np.testing.assert_allclose(np.array(logits), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    warped = warp_logits(logits)
    keep = ref[f"tf_{kind}_logits_warped"] > -1e4
    assert np.array_equal(np.array(warped) > -1e4, keep)
    lp = np.array(warped - mx.logsumexp(warped, axis=-1, keepdims=True))
    np.testing.assert_allclose(lp[keep], ref[f"tf_{kind}_logprobs"][keep], atol=1e-4)


@pytest.mark.parametrize("kind", ["rnn", "norn"])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_reproduces_official_beams(ref, embed, fixtures_dir, kind, width):
    """Official beam_length=4 counts g0, so it drafts 3 tokens: our length=3."""
    d = load_drafter(fixtures_dir / f"drafter_{kind}")
    for row in range(3):
        b = beam_search(
            d,
            embed,
            mx.array(ref["ctx_c"][row]),
            mx.array(ref["bs_init"][row]),
            width,
            3,
            warp=True,
            return_logprobs=True,
        )
        official = ref[f"bs_{kind}_w{width}_beams"][row]
        assert (official[:, 0] == ref["bs_init"][row]).all()
        np.testing.assert_array_equal(np.array(b.tokens), official[:, 1:])
        np.testing.assert_allclose(np.array(b.scores), ref[f"bs_{kind}_w{width}_scores"][row], atol=1e-4)
        want = ref[f"bs_{kind}_w{width}_logprobs"][row]
        keep = want > -1e4
        assert b.logprobs.shape == want.shape
        np.testing.assert_allclose(np.array(b.logprobs)[keep], want[keep], atol=1e-4)


def test_beam_search_shapes_and_order():
    mx.random.seed(0)
    d = Drafter(DrafterConfig(vocab_size=50, hidden_size=16, exit_dim=24, num_draft_layers=1))
    e = nn.Embedding(50, 16)
    b = beam_search(d, e, mx.random.normal((16,)), mx.array(3), 4, 5, return_logprobs=True)
    assert b.tokens.shape == (4, 5) and b.scores.shape == (4,) and b.logprobs.shape == (4, 5, 50)
    s = np.array(b.scores)
    assert (np.diff(s) <= 0).all()
    # Scores are the sums of each beam's own token log-probabilities.
    lp = np.take_along_axis(np.array(b.logprobs), np.array(b.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(lp.sum(-1), s, atol=1e-4)
    # Beams are distinct sequences.
    assert len({tuple(r) for r in np.array(b.tokens).tolist()}) == 4


def test_reduced_vocab_and_input_proj_round_trip(tmp_path):
    mx.random.seed(0)
    cfg = DrafterConfig(vocab_size=50, hidden_size=16, exit_dim=24, num_draft_layers=2, draft_vocab_size=10)
    d = Drafter(cfg)
    d.draft_vocab = mx.array([3, 5, 7, 11, 13, 17, 19, 23, 29, 31], dtype=mx.int32)
    assert "input_proj" in d and d.lm_head[-1].weight.shape == (10, 24)
    assert "draft_vocab" not in dict(__import__("mlx.utils", fromlist=["x"]).tree_flatten(d.trainable_parameters()))
    save_drafter(d, tmp_path / "d", dtype="float32")
    e = load_drafter(tmp_path / "d")
    assert e.config == d.config
    np.testing.assert_array_equal(np.array(e.draft_vocab), np.array(d.draft_vocab))
    emb = nn.Embedding(50, 16)
    b = beam_search(e, emb, mx.random.normal((16,)), mx.array(3), 3, 4)
    assert set(np.array(b.tokens).reshape(-1).tolist()) <= set(np.array(d.draft_vocab).tolist())
    official = json.loads((tmp_path / "d" / "config.json").read_text())
    assert official["model_type"] == "recurrent_drafting_drafter" and official["draft_vocab_size"] == 10


def test_full_vocab_drafter_saves_official_keys_only(tmp_path, fixtures_dir):
    d = load_drafter(fixtures_dir / "drafter_rnn")
    save_drafter(d, tmp_path / "d", dtype="float32")
    saved = mx.load(str(tmp_path / "d" / "model.safetensors"))
    official = mx.load(str(fixtures_dir / "drafter_rnn" / "model.safetensors"))
    assert set(saved) == set(official)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "draft_vocab_size" not in cfg


def test_load_drafter_errors(tmp_path, fixtures_dir):
    with pytest.raises(RedrafterError, match="does not exist"):
        load_drafter(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RedrafterError, match="No config.json"):
        load_drafter(tmp_path / "empty")
    with pytest.raises(RedrafterError, match="PyTorch-format drafter"):
        load_drafter(fixtures_dir / "drafter_rnn_bin")
