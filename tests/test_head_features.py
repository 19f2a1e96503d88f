"""Layer heads that use what the loop hands them (issue 53): an MTP head and
an EAGLE-3 head right by construction only through the target's features,
and, for EAGLE-3, only with its three taps in order (tests/feature_heads.py:
a target whose next token follows the one before the current one). With
them the output is plain decoding's with drafts accepted; the same heads fed
zeros, or the taps in another order, lose their acceptance; their caches end
as a clean teacher-forced pass, keys and values (which depend on the tokens
and the features); and the depth gate (RADAR) decides a head's calls from
that head's real confidences.

Mutations seen caught here (bench/mutations.py): H2 (zeros handed to the
heads after each step), H3 (the taps fused in reverse), H5 (the gate fed
zeros), C2 (a source's cache not trimmed), C3 (d2t without its offsets)."""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx
import numpy as np
import pytest
from feature_heads import (
    HIDDEN,
    Rewired,
    following,
    mtp_head,
    previous_token_target,
    save_eagle3_head,
    taps_reversed,
    zeros,
)
from helpers import assert_tokens_exact
from mlx_lm.models.cache import make_prompt_cache

from mlx_redrafter.config import DraftConfig
from mlx_redrafter.generate import generate_tokens
from mlx_redrafter.llm.parts import model_parts

PROMPT = [5, 9, 11, 3, 20]
N = 30
DRAFT_VOCAB = 72


@pytest.fixture(scope="module")
def target():
    model = previous_token_target()
    plain, _ = generate_tokens(model, PROMPT, max_tokens=N + 20)
    reply = PROMPT[-1:] + plain
    assert all(reply[n + 1] == following(model, reply[n - 1]) for n in range(1, len(reply) - 1))  # as built
    return model, plain


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    from mlx_redrafter.hub.load import load_drafter

    model, _ = target
    folder = save_eagle3_head(tmp_path_factory.mktemp("eagle3-features"), model, DRAFT_VOCAB)
    return {"mtp": mtp_head(model), "eagle3": load_drafter(folder, dtype="float32")}


def drafted(model, plain, head, width: int, length: int, **kw):
    """``(tokens, stats)`` of a draft by ``head`` alone, checked equal to plain decoding."""
    draft = DraftConfig(head=head, head_width=width, head_length=length, **kw)
    tokens, stats = generate_tokens(model, PROMPT, draft=draft, max_tokens=N)
    assert tokens == plain[:N], "drafting changed the greedy output"
    return tokens, stats


@pytest.mark.parametrize("width, length", [(1, 1), (1, 3), (2, 2)])
def test_an_mtp_head_that_reads_the_targets_state_drafts_every_depth(target, heads, width, length):
    """Its first draft needs the target's state at the last accepted token,
    its chained ones its own state: every depth right.

    Seen to catch: zeros handed to the head after each step (step/loop.py
    features, H2); its two input norms swapped (draft/mtp.py)."""
    model, plain = target
    _, stats = drafted(model, plain, heads["mtp"], width, length)
    assert all(s.accepted == length for s in stats[1:-1]), [s.accepted for s in stats]
    assert {s.source for s in stats if s.accepted} == {"mtp"}


@pytest.mark.parametrize("width, length", [(1, 1), (1, 2), (2, 2)])
def test_an_eagle3_head_that_fuses_the_targets_taps_drafts(target, heads, width, length):
    """Its first draft needs the first of its three taps, in order (its chained
    ones are wrong: accepted whole at length 1, in part past it).

    Seen to catch: the taps fused in reverse order (step/drafts.py
    ``columns``, H3); zeros handed to the head after each step (H2); d2t
    without its offsets."""
    model, plain = target
    _, stats = drafted(model, plain, heads["eagle3"], width, length)
    assert all(s.accepted == 1 for s in stats[1:-1]), [s.accepted for s in stats]
    assert {s.source for s in stats if s.accepted} == {"eagle3"}


@pytest.mark.parametrize(
    "kind, change",
    [("mtp", zeros), ("eagle3", zeros), ("eagle3", taps_reversed)],
    ids=["mtp-zeros", "eagle3-zeros", "eagle3-reversed"],
)
def test_the_same_head_fed_zeros_or_the_taps_in_another_order_loses_its_acceptance(target, heads, kind, change):
    """The heads above are right only through what they are handed: fed zeros
    (or the EAGLE-3 taps reversed) on every call with the target's features,
    they are almost never accepted (the output stays exact: the target verifies)."""
    model, plain = target
    _, right = drafted(model, plain, heads[kind], 1, 2)
    _, wrong = drafted(model, plain, Rewired(heads[kind], change), 1, 2)
    accepted = sum(s.accepted for s in wrong)
    assert accepted <= sum(s.accepted for s in right) // 4, accepted  # a coincidence or two


def clean_pass(model, head, text):
    """The head's cache after one teacher-forced pass over ``text``: every pair
    ``(t[i+1], features[i])`` with the target's own features at ``i`` (its
    taps, in the head's order, or its final state)."""
    ids = mx.array(text, mx.int32)[None]
    layers = list(dict.fromkeys(head.taps or ()))
    wide = model_parts(model, layers or None)[1](ids)  # [each layer's output..., the final state]
    taps = [wide[..., layers.index(t) * HIDDEN : (layers.index(t) + 1) * HIDDEN] for t in head.taps or ()]
    feats = mx.concatenate(taps, axis=-1) if taps else wide
    cache = head.make_cache()
    logits, _ = head(ids[:, 1:], feats[:, :-1], cache, first=True)
    return cache, logits


@pytest.mark.parametrize("kind, length", [("mtp", 3), ("eagle3", 2)])
def test_the_heads_cache_is_a_clean_pass_keys_and_values(target, heads, kind, length):
    """The head's cache ends holding what a teacher-forced pass over the
    accepted text gives, one entry behind the model's: keys and values, which
    depend on the tokens and the features (the EAGLE-3 head's second depth is
    rejected every step: its chained call never stays in the cache).

    Seen to catch: zeros handed to the head after each step (H2); the
    chain's cache not trimmed after drafting in it."""
    model, plain = target
    head, cache = heads[kind], make_prompt_cache(model)
    tokens, stats = generate_tokens(
        model, PROMPT, draft=DraftConfig(head=head, head_length=length), max_tokens=N, prompt_cache=cache
    )
    assert tokens == plain[:N] and sum(s.accepted for s in stats) >= N // 3
    mine, held = cache[-1], cache[0].offset
    assert len(cache) == len(model.model.layers) + 1 and mine.offset == held - 1
    clean, _ = clean_pass(model, head, (PROMPT + plain)[:held])
    for got, want in ((mine.keys, clean[0].keys), (mine.values, clean[0].values)):
        a, b = got[..., : held - 1, :], want[..., : clean[0].offset, :]
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- the depth gate (RADAR) on real confidences


def reading_controller(threshold: float, length: int, before_call: bool):
    """A depth controller that reads its input: it goes deeper while the last
    depth's top-1 confidence is above ``threshold``. Its LSTM forgets
    (forget gate shut) and writes ``tanh(50 (c1 - threshold))`` (``c1``: the
    first of the top-k confidences); its continue logit is the mean of the
    state's positive part, less 0.05."""
    from mlx_redrafter.draft.controller import Controller, ControllerConfig

    c = Controller(ControllerConfig(beam_width=1, beam_length=length, before_call=before_call, threshold=0.5))
    h, k = c.config.hidden, c.config.top_k
    wx = np.zeros((4 * h, k), np.float32)
    wx[2 * h : 3 * h, 0] = 50.0  # the g gate reads c1
    bias = np.concatenate([np.full(h, 10.0), np.full(h, -10.0), np.full(h, -50.0 * threshold), np.full(h, 10.0)])
    c.lstm.Wx, c.lstm.Wh, c.lstm.bias = mx.array(wx), mx.zeros_like(c.lstm.Wh), mx.array(bias.astype(np.float32))
    c.mlp[0].weight, c.mlp[0].bias = mx.eye(h), mx.zeros((h,))
    c.mlp[1].weight, c.mlp[1].bias = mx.full((1, h), 1.0 / h), mx.array([-0.05])
    mx.eval(c.parameters())
    return c


def test_before_each_call_the_gate_reads_the_confidence_of_the_depth_drafted(target, heads):
    """Before each call past the first (RADAR's order over EAGLE-3), a
    controller that reads the confidence of the depth drafted decides: the
    depth verified each step is 2 exactly where the head's own first-depth
    top-1 probability there (from a teacher-forced pass over the text) is
    above the threshold, which is set between those probabilities.

    Seen to catch: the gate fed zeros for a head's confidences (draft/head.py, H5)."""
    model, plain = target
    head = heads["eagle3"]
    _, logits = clean_pass(model, head, PROMPT + plain)
    top1 = np.array(mx.softmax(logits[0], axis=-1).max(axis=-1))  # entry i: the draft after text[i + 1]
    ordered = np.sort(top1[len(PROMPT) - 1 : len(PROMPT) + N])
    gap = int(np.argmax(np.diff(ordered[2:-2]))) + 2  # the widest gap with a few on each side
    threshold = float(ordered[gap : gap + 2].mean())
    draft = dict(controller=reading_controller(threshold, 2, before_call=True))
    tokens, stats = drafted(model, plain, head, 1, 2, **draft)
    ends = list(accumulate(1 + s.accepted for s in stats))  # tokens emitted after each step
    steps = [(s, ends[i - 1]) for i, s in enumerate(stats) if i and ends[i - 1] < N]
    want = [2 if top1[len(PROMPT) - 2 + before] > threshold else 1 for _, before in steps]
    assert [s.depth for s, _ in steps] == want
    assert set(want) == {1, 2}, "the threshold splits no steps: the test says little"


class Flattened(Rewired):
    """A layer head whose logits are divided by 100: the same drafts, unsure of each."""

    def __call__(self, tokens, features, cache, first: bool = True, last: bool = False):
        logits, hidden = self.inner(tokens, features, cache, first, last=last)
        return logits / 100.0, hidden


@pytest.mark.parametrize("before_call", [False, True])
def test_a_sure_head_is_drafted_deep_and_an_unsure_one_shallow(target, heads, before_call):
    """The same controller on the same head: sure of each draft (top-1 above
    0.5 at every depth here), every depth is verified; its logits flattened
    (the same drafts), only the first. After each call the gate reads each
    depth's own confidence, before each the one before it.

    Seen to catch: the gate fed zeros for a head's confidences (H5)."""
    model, plain = target
    for head, depth in ((heads["eagle3"], 3), (Flattened(heads["eagle3"], None), 1)):
        draft = dict(controller=reading_controller(0.5, 3, before_call))
        _, stats = drafted(model, plain, head, 1, 3, **draft)
        assert {s.depth for s in stats[1:]} == {depth}
        assert sum(s.accepted for s in stats) >= N // 3


def test_exact_with_lookup_beside(target, heads):
    """Beside lookup's rows, in one tree: still plain decoding's tokens, the head's drafts accepted."""
    model, plain = target
    assert_tokens_exact(
        model, PROMPT, DraftConfig(head=heads["eagle3"], head_length=2, lookup=1), min_accepted=N // 3,
        source="eagle3", max_tokens=N, plain=plain[:N],
    )  # fmt: skip
