"""Parity of the DFlash drafter's block logits with a reference
implementation of the same checkpoint (mlx-vlm's, computed once and kept as
a fixture: tests/fixtures/dflash/GENERATED_BY.md)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from helpers import tiny_model

from mlx_redrafter.hub.load import load_drafter

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "dflash"


@pytest.fixture(scope="module")
def reference():
    if not (FIXTURE / "reference.safetensors").is_file():
        pytest.fail(f"the DFlash parity fixture is missing at {FIXTURE}: it ships with the repository")
    return mx.load(str(FIXTURE / "reference.safetensors"))


def _target(ref):
    """A tiny model whose embedding and LM head are the fixture's (what the drafter borrows)."""
    vocab, hidden = ref["embed"].shape
    model = tiny_model(
        "qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model.model.embed_tokens.weight = ref["embed"]
    model.lm_head.weight = ref["lm_head"]
    return model


def test_block_logits_match_the_reference_across_two_steps(reference):
    """A block after 7 context positions, then one after 3 more (the cache
    carried over): each draft position's logits as mlx-vlm's drafter gives them.
    The drafter's ``target_layer_ids`` are out of order: its fc reads them so."""
    drafter = load_drafter(FIXTURE / "drafter", dtype="float32").bind(_target(reference))
    assert drafter.taps == (1, 4, 2)
    cache = drafter.make_cache()
    for ctx, block, want in (("ctx1", "block1", "logits1"), ("ctx2", "block2", "logits2")):
        drafter.context(reference[ctx], cache)
        got = drafter.block_logits(reference[block], cache)
        assert got.shape == reference[want].shape
        assert mx.allclose(got, reference[want], atol=1e-4, rtol=1e-4), float(mx.abs(got - reference[want]).max())
    assert cache[0].offset == 10  # the context alone is cached, never a block


def test_the_block_chain_drafts_the_references_argmax(reference):
    """Through the step loop's source (draft/dflash_chain.py): the context
    handed over in pieces, the block drafted after it, its one row the
    reference's argmax at each position."""
    from mlx_redrafter.draft.dflash_chain import BlockChain

    drafter = load_drafter(FIXTURE / "drafter", dtype="float32").bind(_target(reference))
    chain = BlockChain(drafter, 1, 7)
    chain.cache = chain.make_cache()
    ctx = reference["ctx1"][0]
    chain.extend([0] * 4, ctx[:4])
    chain.extend([0] * 3, ctx[4:])
    beams = chain.draft(int(reference["block1"][0, 0]))
    assert beams.tokens.tolist() == [mx.argmax(reference["logits1"][0], axis=-1).tolist()]
