"""``make-drafter``'s verdict: a new drafter against plain decoding and against
lookup drafts alone, measured in one run on held-out prompts (greedy), and
the rule that decides whether it is installed.

Plain decoding drifts with the machine, so it is measured first and last
and every other setting is compared with the mean of the two (as the sweep
brackets its cells). Each finished pass is handed to ``save`` at once, so an
interrupted verdict resumes at the next pass. ``measure(name, draft,
prompts, max_tokens)`` can be replaced (tests decide the rule with given
numbers); by default it is :func:`~mlx_redrafter.tuning.measure.run_pass`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from ..config import DraftConfig

PLAIN, PLAIN_AFTER, LOOKUP, DRAFTER, EXISTING = "plain", "plain again", "lookup", "drafter", "existing"
EAGLE3 = "eagle3"  # a new EAGLE-3 head (make-drafter --head eagle3|auto); DRAFTER is the new ReDrafter head
DFLASH = "dflash"  # a new DFlash drafter (make-drafter --head dflash|auto)
CANDIDATES = (DRAFTER, EAGLE3, DFLASH)
Measure = Callable[[str, Optional[DraftConfig], List[List[int]], int], dict]


def pass_record(p) -> dict:
    """What a verdict keeps of a :class:`~mlx_redrafter.tuning.measure.Pass`."""
    return {"tokens_per_s": p.tokens_per_s, "tokens_per_step": p.tokens_per_step, "tokens": [r.tokens for r in p.runs]}


def real_measure(model, eos_ids=(), tick: Optional[Callable[[], None]] = None) -> Measure:
    """Greedy passes on ``model`` (:func:`~mlx_redrafter.tuning.measure.run_pass`), after one warm-up each way."""
    from .measure import run_pass, warm_up

    warmed = set()

    def measure(name, draft, prompts, max_tokens):
        if draft is not None and name not in warmed:
            warm_up(model, prompts[0], draft)
            warmed.add(name)
        return pass_record(run_pass(model, prompts, draft, max_tokens=max_tokens, eos_ids=eos_ids, tick=tick))

    return measure


def run_verdict(
    settings: Dict[str, Optional[DraftConfig]],
    prompts: List[List[int]],
    max_tokens: int,
    measure: Measure,
    done: Optional[dict] = None,
    save: Optional[Callable[[dict], None]] = None,
    on_pass: Optional[Callable[[str, int, int], None]] = None,
) -> dict:
    """Measure plain decoding, each of ``settings`` (name -> draft) and plain
    decoding again, skipping the passes ``done`` already holds; returns every
    pass's record by name."""
    done = dict(done or {})
    order = [PLAIN, *settings, PLAIN_AFTER]
    for i, name in enumerate(order):
        if name in done:
            continue
        if on_pass:
            on_pass(name, i, len(order))
        done[name] = measure(name, settings.get(name), prompts, max_tokens)
        if save:
            save(done)
    return done


def summarize(passes: dict) -> dict:
    """Each setting's tokens/step, speed-up over the mean of the plain passes
    and whether its outputs equal plain greedy decoding's, prompt for prompt."""
    base = [passes[k]["tokens_per_s"] for k in (PLAIN, PLAIN_AFTER) if k in passes]
    plain_tps = sum(base) / len(base)
    reference = passes[PLAIN]["tokens"]
    out = {"plain": {"tokens_per_second": round(plain_tps, 3), "passes": [round(b, 3) for b in base]}}
    for name, rec in passes.items():
        if name in (PLAIN, PLAIN_AFTER):
            continue
        same = sum(a == b for a, b in zip(rec["tokens"], reference))
        out[name] = {
            "speedup": round(rec["tokens_per_s"] / plain_tps, 4) if plain_tps else 0.0,
            "tokens_per_step": round(rec["tokens_per_step"], 4),
            "tokens_per_second": round(rec["tokens_per_s"], 3),
            "identical_outputs": same,
        }
    out["prompts"] = len(reference)
    out["identical"] = all(
        v["identical_outputs"] == len(reference)
        for v in out.values()
        if isinstance(v, dict) and "identical_outputs" in v
    )
    return out


def chosen(summary: dict) -> str:
    """The new head the verdict weighs: the fastest of the new ones it measured (DRAFTER, EAGLE3, DFLASH)."""
    return max((k for k in CANDIDATES if k in summary), key=lambda k: summary[k]["speedup"])


def decide(summary: dict) -> tuple:
    """``(install, reason)``: install only a drafter (the faster new head,
    :func:`chosen`) that measured faster than the best setting without one
    (plain, or lookup alone) and than the drafter the model already uses (if
    any), with outputs identical to plain decoding."""
    new = summary[chosen(summary)]["speedup"]
    rivals = {"plain decoding": 1.0}
    if LOOKUP in summary:
        rivals["lookup alone"] = summary[LOOKUP]["speedup"]
    if EXISTING in summary:
        rivals["the drafter in use"] = summary[EXISTING]["speedup"]
    best = max(rivals, key=rivals.get)
    if not summary["identical"]:
        return False, "its outputs are not all identical to plain greedy decoding's"
    if new > rivals[best]:
        return True, f"{new:.2f}x against {best}'s {rivals[best]:.2f}x"
    return False, f"{new:.2f}x is not faster than {best} ({rivals[best]:.2f}x)"


def target_speedup(summary: dict) -> float:
    """The speed-up a drafter must beat (:func:`decide`'s best rival)."""
    return max([1.0] + [summary[k]["speedup"] for k in (LOOKUP, EXISTING) if k in summary])
