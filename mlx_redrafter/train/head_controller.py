"""The adaptive-depth controller (RADAR) for a layer head: an EAGLE-3 head's draft calls.

RADAR was built on EAGLE-3 trees: after each draft call an LSTM reads the
top-k confidences and decides whether one more call pays. For a layer head
every depth is a call of its own (the first from the call that feeds the
accepted positions, each later one a chained call on the head's own state),
so the price of depth ``D`` grows with ``D``, and the controller decides
before each call from the depths drafted so far (``before_call``: a depth
it does not draft costs nothing): the latency model here times
both calls and prices depth ``D`` at ``commit + (D - 1) x chained``
(``draft_D`` in the controller's latency table; train/controller.py's
``step_cost`` reads it).

Episodes are recorded by replaying greedy decoding with one beam, offline:
the target's greedy reply is decoded once, its taps computed in one forward,
and the head then runs exactly as the step loop runs it (its cache fed the
accepted positions, chained to depth ``L`` on its own drafts, the chain
trimmed), so each step's confidences, accepted count (the drafts that match
the target's own tokens) and tree sizes are what a one-beam greedy step
would see. The controller itself (its LSTM, REINFORCE, the saved files) is
the recurrent drafter's (train/controller.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..draft.controller import Controller, ControllerConfig, before_call_inputs
from ..draft.head import top_confidences
from .controller import Episodes, FitReport, train_and_save


def _greedy(model, prompt: List[int], max_tokens: int, eos_ids) -> List[int]:
    from ..generate import generate_tokens

    tokens, _ = generate_tokens(model, prompt, max_tokens=max_tokens, eos_ids=eos_ids)
    return tokens


def _chain(head, cache, logits: mx.array, hidden: mx.array, length: int, top_k: int):
    """Drafts and per-depth top-k probabilities of one greedy beam chained to ``length`` (lazy)."""
    drafts, confs = [], []
    for d in range(length):
        if d:
            out, hid = head(drafts[-1].reshape(1, 1), hidden, cache, first=False)
            logits, hidden = out[0, -1], hid[:, -1:]
        logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
        confs.append(top_confidences(logp, top_k))
        idx = mx.argmax(logp)
        drafts.append(idx if head.draft_to_target is None else head.draft_to_target[idx])
    return mx.stack(drafts), mx.stack(confs)


def replay(model, head, prompt: List[int], length: int, max_tokens: int, eos_ids=(), top_k: int = 10):
    """One prompt's episodes: ``(confidences [n, L, k], accepted [n])`` of its one-beam greedy steps."""
    from ..llm.parts import model_parts

    full = list(prompt) + _greedy(model, prompt, max_tokens + length + 1, eos_ids)
    _, backbone, _ = model_parts(model, list(head.taps))
    feats = backbone(mx.array(full, mx.int32)[None])  # [1, T, (taps + 1) h]: the head reads the taps
    cache, fed, p = head.make_cache(), 0, len(prompt) - 1
    confs, accepted = [], []
    while p + 1 + length < len(full) and p - len(prompt) + 1 < max_tokens:
        # Pairs (features at j, the token after j) up to p, whose token is the target's next one (g0).
        tokens = mx.array(full[fed + 1 : p + 2], mx.int32)[None]
        logits, hidden = head(tokens, feats[:, fed : p + 1], cache, first=True)
        fed = p + 1
        drafts, conf = _chain(head, cache, logits[0, -1], hidden[:, -1:], length, top_k)
        for c in cache:  # the chained entries never stay: the next step feeds what was accepted
            c.trim(length - 1)
        mx.eval(drafts, conf)
        right = np.array(drafts) == np.array(full[p + 2 : p + 2 + length])
        a = int(np.cumprod(right).sum())
        confs.append(np.array(conf))
        accepted.append(a)
        p += a + 1
    return confs, accepted


def record_head_episodes(model, head, prompts, length: int, max_tokens: int, eos_ids=(), top_k=10, progress=None):
    """Episodes of one-beam greedy steps over ``prompts`` (see the module doc); a
    step's tree at depth ``d`` verifies ``d + 1`` tokens."""
    confs, accepted = [], []
    for i, prompt in enumerate(prompts):
        c, a = replay(model, head, prompt, length, max_tokens, eos_ids, top_k)
        confs += c
        accepted += a
        if progress:
            progress(i + 1)
    sizes = np.tile(np.arange(2, length + 2), (len(accepted), 1))
    return Episodes(np.stack(confs), np.array(accepted), sizes)


def head_latency(model, head, length: int, repeats: int = 5, context: int = 64) -> Dict[str, float]:
    """Milliseconds of a plain decode step, each verify size up to ``length + 1``,
    and the head's draft to each depth (``draft_D``: the commit call over two
    accepted positions, then ``D - 1`` chained calls), after ``context`` positions."""
    from ..llm.cache import warm_cache
    from ..llm.parts import model_parts
    from ..tuning.cost import median_ms

    _, backbone, lm_head = model_parts(model)
    cache, rewind = warm_cache(model, backbone, context)

    def forward(n):
        return lambda: mx.eval(mx.argmax(lm_head(backbone(mx.arange(n)[None] % 100, cache=cache)), axis=-1))

    out = {f"verify_{n}": median_ms(forward(n), repeats, after=rewind) for n in range(1, length + 2)}
    h, width = head.config.hidden_size, len(head.taps) * head.config.target_hidden_size
    own = head.make_cache()
    mx.eval(head(mx.zeros((1, context), mx.int32), mx.zeros((1, context, width)), own, first=True))

    def back():
        for c in own:
            c.trim(c.offset - context)

    commit = median_ms(lambda: mx.eval(head(mx.zeros((1, 2), mx.int32), mx.zeros((1, 2, width)), own)), repeats, back)
    state = mx.zeros((1, 1, h))
    chained = median_ms(lambda: mx.eval(head(mx.zeros((1, 1), mx.int32), state, own, first=False)), repeats, back)
    for d in range(1, length + 1):
        out[f"draft_{d}"] = commit + (d - 1) * chained
    out["draft"] = out["draft_1"]
    probe = Controller(ControllerConfig())
    mx.eval(probe.parameters())
    conf = mx.random.uniform(shape=(length, probe.top_k))
    out["controller"] = median_ms(lambda: mx.eval(probe.depth(conf)), repeats)
    out["plain"] = out["verify_1"]
    return out


def fit_head_controller(
    model,
    head,
    folder,
    prompts: List[List[int]],
    length: int,
    max_tokens: int,
    eos_ids=(),
    epochs: int = 100,
    alpha: float = 0.05,
    seed: int = 0,
    progress: Optional[Callable[[str, int, Optional[int]], None]] = None,
    curve=None,
) -> FitReport:
    """:func:`~mlx_redrafter.train.controller.fit_and_save` for a layer head
    (one beam): record, measure this device's latencies, train, save next to the head."""
    tell = progress or (lambda stage, done, total: None)
    config = ControllerConfig(beam_width=1, beam_length=length, alpha=alpha, before_call=True)
    tell("recording", 0, len(prompts))
    episodes = record_head_episodes(
        model, head, prompts, length, max_tokens, eos_ids, config.top_k, lambda i: tell("recording", i, len(prompts))
    )
    # It decides before each call, from the depths drafted so far (draft/controller.py DepthGate).
    episodes = dataclasses.replace(episodes, confidences=before_call_inputs(episodes.confidences))
    tell("measuring latency", 0, None)
    return train_and_save(episodes, config, head_latency(model, head, length), curve, folder, epochs, seed, tell)
