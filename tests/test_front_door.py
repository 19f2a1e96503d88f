"""The public front door after the layout change: resolved configs in place
of loose keywords, ``timings=`` with ``profile=`` as its deprecated alias,
and the server's sampling defaults reaching each request."""

from __future__ import annotations

import warnings

import pytest
from helpers import OracleDrafter, assert_exact_under_drafting, prompts, random_drafter, tiny_model

import mlx_redrafter
from mlx_redrafter import DraftConfig, RedrafterError, SamplingConfig, trim_cache
from mlx_redrafter.generate import generate_tokens, stream_generate


def test_the_public_api_names():
    for name in (
        "DraftConfig",
        "SamplingConfig",
        "trim_cache",
        "generate",
        "stream_generate",
        "load_model",
        "load_drafter",
        "save_drafter",
        "Drafter",
        "DrafterConfig",
        "RedrafterError",
    ):
        assert name in mlx_redrafter.__all__ and hasattr(mlx_redrafter, name)
    from mlx_redrafter.chat import ChatSession, ChatSettings  # the README's import path

    assert ChatSession.__module__ == "mlx_redrafter.chat.conversation" and ChatSettings().max_tokens > 0
    assert callable(trim_cache)


def test_profile_is_a_deprecated_alias_of_timings():
    model = tiny_model("llama")
    p = prompts(1)[0]
    draft = DraftConfig(random_drafter(), 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # timings= itself warns nothing
        tokens, stats = generate_tokens(model, p, draft=draft, max_tokens=8, timings=True)
    assert any(s.verify_time > 0 for s in stats[1:])
    with pytest.warns(DeprecationWarning, match="timings"):
        old, old_stats = generate_tokens(model, p, draft=draft, max_tokens=8, profile=True)
    assert old == tokens and any(s.verify_time > 0 for s in old_stats[1:])
    plain_stats = generate_tokens(model, p, draft=draft, max_tokens=8)[1]
    assert all(s.verify_time == 0 for s in plain_stats)


def test_resolved_configs_replace_the_loose_keywords(default_model):
    model, tok = default_model
    p = tok.encode("The capital of France is")
    oracle = OracleDrafter(model, p, 12, 3)

    def tokens(**kw):
        return [r.token for r in stream_generate(model, tok, p, max_tokens=12, **kw)]

    rs = assert_exact_under_drafting(
        model, tok, p, drafter=oracle, beam_width=2, beam_length=3, lookup=1, max_tokens=12, min_accepted=4
    )
    resolved = tokens(draft=DraftConfig(oracle, 2, 3, lookup=1), sampling=SamplingConfig())
    assert resolved == [r.token for r in rs]
    with pytest.raises(RedrafterError, match="draft= and beam_width="):
        tokens(draft=DraftConfig(oracle, 2, 3), beam_width=2)
    with pytest.raises(RedrafterError, match="sampling= and temp="):
        tokens(sampling=SamplingConfig(), temp=0.5)


def test_a_request_inherits_the_servers_sampling_defaults():
    from types import SimpleNamespace  # the server extra (fastapi) is installed by `make test`: no skip

    from mlx_redrafter.serve.openai_api import CompletionRequest, _params

    engine = SimpleNamespace(sampling=SamplingConfig(temp=0.7, top_p=0.9, min_p=0.05, top_k=40), max_tokens=32)
    p = _params(engine, CompletionRequest(prompt="x"), None)
    assert (p.max_tokens, p.sampling) == (32, engine.sampling)
    p = _params(engine, CompletionRequest(prompt="x", temperature=0, top_k=5, min_p=0.2), 4)
    assert (p.max_tokens, p.sampling) == (4, SamplingConfig(temp=0, top_p=0.9, min_p=0.2, top_k=5))
