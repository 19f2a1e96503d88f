"""Adaptive drafting: the controller changes how deep we verify, never the output."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import OracleDrafter, assert_tokens_exact, prompts, tiny_model

from mlx_redrafter import RedrafterError
from mlx_redrafter.draft.controller import Controller, ControllerConfig, load_controller, save_controller
from mlx_redrafter.generate import DraftConfig, generate_tokens
from mlx_redrafter.train.controller import (
    Episodes,
    expected_speedup,
    measure_latency,
    record_episodes,
    train_controller,
)

W, L = 2, 4


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    ps = prompts(4)
    refs = [generate_tokens(model, p, max_tokens=48)[0] for p in ps]
    return model, ps, refs


def synthetic_episodes(n=4000, length=L, seed=0):
    """Acceptance follows the top-1 confidence: confident depths get accepted."""
    rng = np.random.default_rng(seed)
    top1 = np.where(rng.uniform(size=(n, length)) < 0.6, 0.9, 0.1) + rng.uniform(-0.05, 0.05, size=(n, length))
    conf = np.concatenate([top1[..., None], np.repeat(((1 - top1) / 9)[..., None], 9, axis=-1)], axis=-1)
    right = rng.uniform(size=(n, length)) < top1
    accepted = np.cumprod(right, axis=1).sum(1)
    sizes = np.tile(np.arange(2, 2 * length + 1, 2)[None, :], (n, 1))
    return Episodes(conf.astype(np.float32), accepted, sizes)


LATENCY = {
    "verify_1": 60.0,
    "verify_3": 70.0,
    "verify_5": 80.0,
    "verify_9": 100.0,
    "draft": 4.0,
    "controller": 0.5,
    "plain": 60.0,
}


@pytest.fixture(scope="module")
def trained():
    """A controller trained on the synthetic episodes (seconds of training:
    shared by the tests that need one), and those episodes."""
    episodes = synthetic_episodes()
    ctrl = train_controller(
        episodes, ControllerConfig(beam_width=W, beam_length=L, latency=LATENCY), epochs=30, batch_size=256
    )
    return ctrl, episodes


def test_decisions_follow_the_confidences(trained):
    ctrl, episodes = trained
    sure = mx.array(np.tile([[0.95] + [0.005] * 9], (L, 1)), dtype=mx.float32)
    unsure = mx.array(np.tile([[0.08] + [0.1] * 9], (L, 1)), dtype=mx.float32)
    assert int(ctrl.depth(sure)) > int(ctrl.depth(unsure))
    # It learned something useful: better than always drafting the full depth.
    assert expected_speedup(ctrl, episodes, LATENCY) > expected_speedup(L, episodes, LATENCY)


def test_untrained_thresholds_cover_every_depth():
    ctrl = Controller(ControllerConfig(beam_length=L))
    mx.eval(ctrl.parameters())
    conf = mx.random.uniform(shape=(L, 10))
    for t, want in ((1e-6, L), (1 - 1e-6, 1)):
        ctrl.config.threshold = t
        assert int(ctrl.depth(conf)) == want


def test_adaptive_generation_is_exact(llama, trained):
    model, ps, refs = llama
    ctrl, _ = trained
    depths = []
    for p, ref in zip(ps, refs):
        oracle = OracleDrafter(model, p, 48, L)
        out, stats = assert_tokens_exact(
            model, p, DraftConfig(oracle, W, L, controller=ctrl), plain=ref, max_tokens=48, min_accepted=8
        )
        depths += [s.depth for s in stats[1:]]
        assert all(s.accepted <= s.depth for s in stats[1:])
    assert len(set(depths)) > 1  # it really varied the depth


def test_train_controller_end_to_end_on_a_tiny_model(llama, tmp_path):
    model, ps, refs = llama
    drafter = OracleDrafter(model, ps[0], 48, L)
    episodes = record_episodes(model, drafter, [ps[0]], W, L, max_tokens=48)
    assert episodes.confidences.shape[1:] == (L, 10)
    assert (episodes.tree_sizes[:, -1] >= episodes.tree_sizes[:, 0]).all()
    assert episodes.accepted.max() <= L
    latency = measure_latency(model, drafter, W, L, repeats=2)
    assert {"plain", "draft", "controller", f"verify_{W * L + 1}"} <= set(latency)
    ctrl = train_controller(episodes, ControllerConfig(beam_width=W, beam_length=L, latency=latency), epochs=3)
    (tmp_path / "d").mkdir()
    save_controller(ctrl, tmp_path / "d")
    again = load_controller(tmp_path / "d")
    conf = mx.array(episodes.confidences[:3])
    assert np.array_equal(np.array(ctrl.depth(conf)), np.array(again.depth(conf)))
    draft = DraftConfig(drafter, W, L, controller=again)
    assert_tokens_exact(model, ps[0], draft, plain=refs[0], max_tokens=48, min_accepted=8)


def test_episodes_are_recorded_where_the_live_choice_would_decode_plainly(llama, monkeypatch, tmp_path):
    """make-drafter's controller stage records one episode per drafted step.
    Outside the suite (no ``MLX_REDRAFTER_ALWAYS_DRAFT``) the live choice
    is on; on a device where drafting never pays it would run plain steps,
    which the recorder never sees (make-drafter then failed with an
    IndexError). Mutation: the recording without ``always_draft``."""
    from mlx_redrafter.step import keep, loop

    monkeypatch.setenv("MLX_REDRAFTER_ALWAYS_DRAFT", "0")
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    monkeypatch.setattr(keep, "_KEPT", {})
    real = loop.Generation.timed

    def steep(self, out, size, arm=None, probing=False):  # every verified token costs a plain step
        out.stats.step_time = 0.01 * (size + 0.5 * len(arm or ()))
        return real(self, out, size, arm, probing)

    monkeypatch.setattr(loop.Generation, "timed", steep)
    model, ps, _ = llama
    drafter = OracleDrafter(model, ps[0], 48, L)
    episodes = record_episodes(model, drafter, [ps[0]], W, L, max_tokens=48)
    assert len(episodes.accepted) >= 48 // (L + 1) and episodes.accepted.max() >= 1


def test_fit_and_save_trains_saves_and_compares_every_depth(llama, tmp_path):
    from mlx_redrafter.train.controller import fit_and_save

    model, ps, _ = llama
    drafter = OracleDrafter(model, ps[0], 24, L)
    (tmp_path / "d").mkdir()
    stages = []
    fit = fit_and_save(
        model,
        drafter,
        tmp_path / "d",
        [ps[0]],
        W,
        L,
        24,
        epochs=2,
        progress=lambda stage, done, total: stages.append(stage),
    )
    assert list(dict.fromkeys(stages)) == ["recording", "measuring latency", "training"]
    assert set(fit.fixed) == set(range(1, L + 1)) and fit.steps > 0
    assert fit.beats_fixed == (fit.learned > max(fit.fixed.values()))
    saved = load_controller(tmp_path / "d")
    assert fit.path.is_file() and (saved.config.beam_width, saved.config.beam_length) == (W, L)
    assert set(saved.config.latency) >= {"plain", "draft", "controller"}


def test_missing_controller_is_a_clear_error(tmp_path):
    with pytest.raises(RedrafterError, match="train-controller"):
        load_controller(tmp_path)
