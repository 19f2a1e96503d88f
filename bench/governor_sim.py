"""The live choice (step/governor.py) on a simulated machine: how close it
comes to the best fixed arm, per scenario, over several generations that
carry their state as chat turns do.

    python bench/governor_sim.py [--seeds 100] [scenario ...]

No model runs: each step's time is its arm's cost in plain steps (5% noise)
and a drafting step emits 1 + a geometric number of accepted tokens with
the arm's mean (the swing that makes a few steps near a tie prove nothing).
Scenarios (the arms' costs and yields are rough copies of this project's
measurements, bench/RESULTS.md §36): ``tie`` (drafting at 1.06x),
``lose5`` (0.95x), ``win15`` (1.15x), ``dm`` (a draft model at 0.50x beside
the drafter and lookup: five arms), ``mtp`` (an MTP head at 0.40x, lookup alone at 1.7x),
``mtp-dead`` (an MTP head whose drafts are all rejected, its steps at
2.8 plain ones, lookup finding nothing), ``chat`` (the default model's
drafting on chat, about 1.09x, its yield in stretches of hard and easy text of
about 10 steps, as a real trace showed), ``stretch``
(copy stretches: yields switch every ~30 steps). An arm of host sources
alone (lookup) is also told what it would have emitted at the steps it sits
out, as step/shadow.py tells the real governor (``--no-shadow``: not).
``--generations`` and ``--tokens`` shape a run. Reports governed tokens
per unit of time against every arm pinned (the fixed settings). The tool
that tuned the governor's constants; the real runs are bench/never_slower.py.
"""

from __future__ import annotations

import argparse

import numpy as np

from mlx_redrafter.step.governor import PLAIN, Governor, arm_name

F = frozenset


def _yield(mean: float):
    def draw(rng) -> int:
        return 1 + min(int(rng.geometric(1 / mean)) - 1, 7) if mean > 1 else 1

    return draw


def scenario(name: str):
    """``(names, costly, {arm: (cost, draw or (prose draw, copy draw))}, stretch length or None)``."""
    full, lookup = F(["drafter", "lookup"]), F(["lookup"])
    default = ["drafter", "lookup"], ["drafter"]
    if name == "tie":
        return (*default, {PLAIN: (1.0, _yield(1)), full: (1.65, _yield(1.75)), lookup: (1.05, _yield(1.05))}, None)
    if name == "lose5":
        return (*default, {PLAIN: (1.0, _yield(1)), full: (1.65, _yield(1.57)), lookup: (1.05, _yield(1.04))}, None)
    if name == "lose10":
        return (*default, {PLAIN: (1.0, _yield(1)), full: (1.65, _yield(1.49)), lookup: (1.05, _yield(1.04))}, None)
    if name == "win15":
        return (*default, {PLAIN: (1.0, _yield(1)), full: (1.65, _yield(1.9)), lookup: (1.05, _yield(1.05))}, None)
    if name == "dm":  # the defaults with a draft model: five arms, two of them far behind
        arms = {
            F(["dm", "drafter", "lookup"]): (3.3, _yield(1.65)),
            PLAIN: (1.0, _yield(1)),
            F(["drafter", "lookup"]): (1.65, _yield(1.63)),
            F(["dm", "lookup"]): (3.0, _yield(1.2)),
            lookup: (1.05, _yield(1.01)),
        }
        return ["dm", "drafter", "lookup"], ["dm", "drafter"], arms, None
    if name == "mtp":
        arms = {PLAIN: (1.0, _yield(1)), F(["mtp", "lookup"]): (4.0, _yield(1.6)), lookup: (1.3, _yield(2.2))}
        return ["mtp", "lookup"], ["mtp"], arms, None
    if name == "mtp-dead":  # the Qwen3.5 shape's random MTP head: every draft rejected, a step at 2.8 plain ones
        arms = {PLAIN: (1.0, _yield(1)), F(["mtp", "lookup"]): (2.8, _yield(1)), lookup: (1.02, _yield(1.0))}
        return ["mtp", "lookup"], ["mtp"], arms, None
    if name == "chat":  # the default model on chat (bench/never_slower.py): drafting's yield in hard and easy stretches
        arms = {PLAIN: (1.0, _yield(1)), full: (1.47, (_yield(1.15), _yield(2.1))), lookup: (1.03, _yield(1.03))}
        return (*default, arms, 10)
    if name == "stretch":
        arms = {
            PLAIN: (1.0, _yield(1)),
            full: (1.65, (_yield(1.3), _yield(4.0))),
            lookup: (1.05, (_yield(1.02), _yield(3.8))),
        }
        return (*default, arms, 30)
    raise SystemExit(f"unknown scenario {name!r}")


def _draw(spec, copying: bool):
    """An arm's yield draw: ``spec``, or its prose or copy draw (a stretch scenario)."""
    return spec[copying] if isinstance(spec, tuple) else spec


def run(name: str, seed: int, pinned=None, generations: int = 6, tokens: int = 128, shadow: bool = True) -> float:
    """Tokens per unit of time over ``generations`` of ``tokens`` each (governed, or ``pinned`` to one arm)."""
    names, costly, arms, stretch = scenario(name)
    shadowed = [a for a in arms if a and not a & set(costly)] if shadow else []  # host sources alone
    rng = np.random.default_rng(seed)
    state, total, spent = None, 0, 0.0
    for _ in range(generations):
        gov = Governor(names, costly=costly)
        if state:
            gov.restore(state)
        n, copying = 0, False
        while n < tokens:
            if stretch and rng.random() < 1 / stretch:
                copying = not copying
            arm, probing = gov.choose() if pinned is None else (pinned, False)
            cost, draw = arms[arm]
            k, seconds = _draw(draw, copying)(rng), cost * (1 + 0.05 * rng.standard_normal())
            if pinned is None:
                gov.ran(arm, k, seconds, probing)
                for other in shadowed:  # lookup's rows checked where it sat out (step/shadow.py)
                    if other != arm:
                        gov.saw(other, _draw(arms[other][1], copying)(rng))
            n, total, spent = n + k, total + k, spent + seconds
        state = gov.to_dict()
    return total / spent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "scenarios", nargs="*", default=["tie", "lose5", "win15", "chat", "dm", "mtp", "mtp-dead", "stretch"]
    )
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--generations", type=int, default=6, help="generations per run (their state carries)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per generation")
    ap.add_argument("--no-shadow", action="store_true", help="lookup alone measured on its own steps only")
    args = ap.parse_args(argv)
    shape = dict(generations=args.generations, tokens=args.tokens, shadow=not args.no_shadow)
    for name in args.scenarios:
        governed = np.mean([run(name, s, **shape) for s in range(args.seeds)])
        fixed = {a: np.mean([run(name, s, pinned=a, **shape) for s in range(args.seeds)]) for a in scenario(name)[2]}
        best = max(fixed.values())
        arms = " ".join(f"{arm_name(a)} {v:.2f}" for a, v in fixed.items())
        print(f"{name:8s} governed {governed:.3f} | pinned: {arms} | governed / best fixed {governed / best:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
