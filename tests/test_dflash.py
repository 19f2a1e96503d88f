"""DFlash block drafters draft (issue 56): a drafter in either published
layout loads by ``load_drafter`` and becomes the draft's source
(``DraftConfig.head``, drafted through draft/dflash_chain.py in the sourced
loop), on an attention target and on a hybrid one. Greedy output is plain
decoding's; sampling keeps the model's distribution; the drafter's context
is kept in step with the accepted text; an oracle's blocks are accepted
whole, in part and from any row of the tree."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from dflash_drafters import OracleDFlash, save_speculators, save_zlab
from helpers import accepted_in_steps, assert_tokens_exact, tiny_model
from hybrids import tiny_hybrid
from mlx_lm.models.cache import make_prompt_cache
from test_sampling import chi2_passes, exact_first_tokens

from mlx_redrafter.config import DraftConfig, SamplingConfig, library_draft
from mlx_redrafter.draft.dflash_io import config_from_dict, read_dflash
from mlx_redrafter.draft.eagle3_io import read_config_dict
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.hub.load import load_drafter

SMALL_VOCAB = 7  # random drafts are often right by chance: equality with accepted drafts shows something
PROMPT = [1, 4, 2, 6, 3]


def _target(kind: str, vocab: int = SMALL_VOCAB):
    if kind == "qwen3":
        return tiny_model("qwen3", vocab_size=vocab, num_hidden_layers=4, tie_word_embeddings=False)
    return tiny_hybrid("qwen3_5", vocab_size=vocab)


@pytest.fixture(scope="module")
def targets():
    return {kind: _target(kind) for kind in ("qwen3", "qwen3_5")}


LAYOUTS = ["z-lab", "z-lab-newer", "speculators"]


def _save(layout: str, folder, model, ids, seed: int = 2, **kw):
    if layout == "z-lab-sliding":  # layer_types with a sliding layer (causal within its window of 3)
        return save_zlab(folder, model, ids, seed=seed, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=3, **kw)  # fmt: skip
    if layout == "speculators":
        return save_speculators(
            folder, model, ids, draft_vocab=model.model.embed_tokens.weight.shape[0] - 2, seed=seed, **kw
        )
    return save_zlab(folder, model, ids, newer=layout == "z-lab-newer", seed=seed, **kw)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("layout, width", [("z-lab", 1), ("z-lab-newer", 3), ("speculators", 3), ("z-lab-sliding", 2)])
def test_a_random_drafter_in_each_layout_loads_and_drafts_exactly(targets, tmp_path, kind, layout, width):
    model = targets[kind]
    drafter = load_drafter(_save(layout, tmp_path / "d", model, [0, 2], block=5, mask=0), dtype="float32")
    assert drafter.taps == (0, 2)  # speculators' aux ids are hidden_states indexes: one more than these
    assert drafter.config.block_size == 5 and drafter.reduced == (layout == "speculators")
    draft = library_draft(model, drafter, width, None, 0, tree="fixed")
    assert (draft.head_width, draft.head_length) == (width, 4)  # the trained block: 4 drafts after the token
    _, stats = assert_tokens_exact(model, PROMPT, draft, min_accepted=3, source="dflash", max_tokens=40)
    assert max(s.tree_size for s in stats) == 1 + width * 4


def test_target_layer_ids_are_layer_outputs_in_their_order(targets, tmp_path):
    """The context the drafter caches is ``hidden_norm(fc(...))`` of the outputs
    of ``layers[lid]`` (0-based, z-lab's hook), concatenated in the config's
    order, computed here by running the target's layers by hand."""
    model = targets["qwen3"]
    drafter = load_drafter(save_zlab(tmp_path / "d", model, [2, 0], block=4, mask=0), dtype="float32")
    cache = make_prompt_cache(model)
    tokens, _ = generate_tokens(model, PROMPT, draft=library_draft(model, drafter, 1, None, 0), prompt_cache=cache)
    own = cache[len(model.model.layers) :]
    n = own[0].offset
    assert n == cache[0].offset  # one context entry per token the model cached
    text = mx.array((PROMPT + tokens)[:n], mx.int32)[None]
    outputs, h = [], model.model.embed_tokens(text)
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, None)
    for layer in model.model.layers:
        h = layer(h, mask, None)
        outputs.append(h)
    clean = drafter.make_cache()
    drafter.context(mx.concatenate([outputs[2], outputs[0]], axis=-1), clean)
    for got, want in zip(own, clean):
        assert mx.allclose(got.keys[..., :n, :], want.keys[..., :n, :], atol=1e-4, rtol=1e-4)
        assert mx.allclose(got.values[..., :n, :], want.values[..., :n, :], atol=1e-4, rtol=1e-4)


def _oracle(model, folder, rank: int, max_tokens: int):
    text = PROMPT + generate_tokens(model, PROMPT, max_tokens=max_tokens + 20)[0]
    config = config_from_dict(read_config_dict(folder))
    oracle = OracleDFlash(config, text, rank=rank)
    from mlx.utils import tree_flatten

    oracle.load_weights(tree_flatten(read_dflash(folder, dtype="float32").parameters()))
    mx.eval(oracle.parameters())
    return oracle


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("width, tree", [(1, "fixed"), (3, "fixed"), (3, "auto")])
def test_an_oracle_block_is_accepted_whole_in_part_and_at_any_row(targets, tmp_path, kind, width, tree):
    """The oracle's blocks are the model's own continuation, cut irregularly,
    and in a tree the right path is another row each step: greedy output is
    plain decoding's, blocks are taken whole and in part, from rows past
    the first. It is right only where its context is the target's, token
    for token (cache in step, taps at the right positions)."""
    model = _target(kind, vocab=31)
    folder = save_zlab(tmp_path / "d", model, [1, 3], block=5, mask=0)
    oracle = _oracle(model, folder, rank=2 if width > 1 else 0, max_tokens=40)
    draft = library_draft(model, oracle, width, None, 0, tree=tree)
    want = 20 if tree == "fixed" else 8  # auto verifies what the tiny model's cost curve says pays
    _, stats = assert_tokens_exact(model, PROMPT, draft, min_accepted=want, source="dflash", max_tokens=40)
    accepted = [s.accepted for s in stats[1:]]
    if tree == "fixed":
        assert 4 in accepted and any(0 < a < 4 for a in accepted)  # whole blocks, and cut ones
    if width > 1 and tree == "fixed":
        assert any(s.beam > 0 and s.accepted for s in stats)  # the right path on another row


def test_its_rows_join_lookup_in_one_tree(targets, tmp_path):
    model = _target("qwen3", vocab=31)
    folder = save_zlab(tmp_path / "d", model, [1, 3], block=5, mask=0)
    oracle = _oracle(model, folder, rank=0, max_tokens=40)
    draft = library_draft(model, oracle, 1, 3, 2, tree="fixed")
    _, stats = assert_tokens_exact(model, PROMPT, draft, min_accepted=10, source="dflash", max_tokens=40)
    assert max(s.tree_size for s in stats) > 1 + 3  # g0, the block's row, then lookup's rows


def test_a_block_longer_than_trained_and_the_controller_are_refused(targets, tmp_path):
    model = targets["qwen3"]
    drafter = load_drafter(save_zlab(tmp_path / "d", model, [0], block=4, mask=0), dtype="float32")
    with pytest.raises(RedrafterError, match="blocks of 4"):
        generate_tokens(model, PROMPT, draft=library_draft(model, drafter, 1, 4, 0), max_tokens=4)
    draft = library_draft(model, drafter, 1, 2, 0)
    draft.controller = object()
    with pytest.raises(RedrafterError, match="one call"):
        generate_tokens(model, PROMPT, draft=draft, max_tokens=4)


def test_a_drafter_for_another_model_is_refused(targets, tmp_path):
    from mlx_redrafter.draft.redrafter import check_fits

    drafter = load_drafter(save_zlab(tmp_path / "d", targets["qwen3"], [0, 5], mask=0), dtype="float32")
    with pytest.raises(RedrafterError, match="layers 0-3"):
        check_fits(drafter, targets["qwen3"])


N_RUNS = 400


@pytest.mark.parametrize("layout, width, length", [("z-lab", 4, 2), ("speculators", 3, 1)])
def test_sampling_with_a_dflash_drafter_follows_the_model(tmp_path, layout, width, length):
    """Temperature 1: the first three tokens follow the model's own distribution
    (chi-square), with the block's rows (and a reduced vocabulary) in the tree."""
    target = tiny_model(
        "qwen3", vocab_size=5, num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1
    )
    drafter = load_drafter(_save(layout, tmp_path / "d", target, [0, 1], block=3, mask=0), dtype="float32")
    draft = DraftConfig(head=drafter, head_width=width, head_length=length)
    prompt = [1, 3, 0, 2]
    expected = exact_first_tokens(target, prompt, SamplingConfig(temp=1.0))
    mx.random.seed(7)
    observed, drafted = Counter(), 0
    for _ in range(N_RUNS):
        tokens, stats = generate_tokens(target, prompt, draft=draft, max_tokens=3, temp=1.0)
        observed[tuple(tokens)] += 1
        drafted += accepted_in_steps(stats, 3, "dflash")
    assert drafted > N_RUNS // 10  # drafts were accepted in many runs
    assert chi2_passes(observed, expected, N_RUNS)


def test_a_sliding_layer_is_causal_within_its_window(targets, tmp_path):
    """``layer_types`` and ``sliding_window`` as configured: a sliding layer's
    block attends causally, to the context within its window alone; a full
    layer's block attends to all of the context and, non-causally, to itself."""
    model = targets["qwen3"]
    window = 4

    def drafter(layer_type):
        folder = save_zlab(tmp_path / layer_type, model, [0, 2], layers=1, mask=0,
                           layer_types=[layer_type], sliding_window=window)  # fmt: skip
        return load_drafter(folder, dtype="float32").bind(model)

    mx.random.seed(1)
    taps = mx.random.normal((1, 9, 2 * 64))
    tokens = mx.array([[3, 0, 0, 5]], mx.int32)
    later = mx.array([[3, 0, 0, 6]], mx.int32)  # the block's last token changed
    old = mx.concatenate([taps[:, :1] + 5.0, taps[:, 1:]], axis=1)  # the oldest context position changed
    recent = mx.concatenate([taps[:, :-1], taps[:, -1:] + 5.0], axis=1)

    def hidden(d, t, ctx):
        cache = d.make_cache()
        d.context(ctx, cache)
        return d.hidden(t, cache)[0]

    sliding, full = drafter("sliding_attention"), drafter("full_attention")
    base = hidden(sliding, tokens, taps)
    assert mx.allclose(hidden(sliding, later, taps)[:-1], base[:-1]) and not mx.allclose(
        hidden(sliding, later, taps)[-1], base[-1]
    )
    assert mx.allclose(hidden(sliding, tokens, old), base)  # position 0 is out of every query's window
    assert not mx.allclose(hidden(sliding, tokens, recent)[0], base[0])
    edge = mx.concatenate([taps[:, :6], taps[:, 6:7] + 5.0, taps[:, 7:]], axis=1)  # position 6: 3 before the block
    moved = hidden(sliding, tokens, edge)
    assert not mx.allclose(moved[0], base[0]) and mx.allclose(moved[1:], base[1:])  # in query 0's window alone
    base = hidden(full, tokens, taps)
    assert not mx.allclose(hidden(full, later, taps)[0], base[0])  # the block sees itself both ways
    assert not mx.allclose(hidden(full, tokens, old)[0], base[0])


def test_an_mtp_head_beside_a_dflash_drafter_is_refused(targets, tmp_path):
    from test_sources import pass_through_head, repeating_target

    from mlx_redrafter.generate import generate
    from mlx_redrafter.keywords import with_sources

    model = targets["qwen3"]
    drafter = load_drafter(save_zlab(tmp_path / "d", model, [0, 2], mask=0), dtype="float32")
    draft = library_draft(model, drafter, 1, None, 0)
    with pytest.raises(RedrafterError, match="a DFlash drafter and an MTP head"):
        with_sources(model, draft, pass_through_head(repeating_target()))
    with pytest.raises(RedrafterError, match="the drafter is a DFlash drafter"):
        generate(model, None, PROMPT, drafter=drafter, mtp_depth=3, max_tokens=4)
