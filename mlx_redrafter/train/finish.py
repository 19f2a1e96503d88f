"""``make-drafter``'s stages after training: the depth controller, this
device's verify-cost curve, the verdict, the install, and the drafter's
metadata (META, hub/store.py: what its model card says).

Each stage is keyed by the drafter it measured (its file's size and time,
:func:`~mlx_redrafter.profiles.drafter_id`): a rerun that trained on
measures the new drafter again, one that did not skips them. The controller
and the verdict run on held-out prompts only (:mod:`.sources`): the verdict
on the first ones, the controller on the next (the same ones when there are
too few: the verdict measures fixed shapes, which the controller does not
touch). Every function here takes the run
(:class:`~mlx_redrafter.train.recipe.RecipeRun`, whose attributes are all
declared there; not imported: recipe.py imports this module).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import List, Tuple

from ..errors import RedrafterError
from ..files import write_json_atomic
from .recipe_state import Status, positions

CONTROLLER_DEPTH = 4  # `make train-default`'s train-controller -L
MAX_PROMPT_TOKENS = 512  # as train-controller: longer held-out prompts are left out


def held_prompts(run) -> List[Tuple[str, List[int]]]:
    """``(conversation id, prompt ids)`` of the held-out prompts that fit."""
    from ..llm.parts import context_limit
    from ..prompts import conversation_ids

    if run.held_ids is None:
        limit = context_limit(run.model) or 1 << 30
        room = max(run.sizes.verdict_tokens, run.sizes.controller_tokens) + 16
        want = run.sizes.verdict_prompts + run.sizes.controller_prompts
        run.held_ids = []
        for conv in run.held:
            ids = conversation_ids(run.tokenizer, conv, run.raw)
            if len(ids) <= min(MAX_PROMPT_TOKENS, limit - room):
                run.held_ids.append((conv["id"], ids))
            if len(run.held_ids) >= want:
                break
    if not run.held_ids:
        raise RedrafterError(
            f"None of the prompts in {run.source.path} is held out (or short enough) to measure the drafter on.",
            "Give more prompts (the verdict holds out a share of them by id).",
        )
    return run.held_ids


def verdict_prompts(run):
    return held_prompts(run)[: run.sizes.verdict_prompts]


def controller_prompts(run):
    held, n = held_prompts(run), run.sizes.verdict_prompts
    return held[n : n + run.sizes.controller_prompts] or held[: run.sizes.controller_prompts]


def _status(run, stage: str, tic: float, fraction: float, info: str, after: float = 0.0) -> Status:
    """A fixed stage's status: its ETA from how far it got (else its expected time)."""
    spent = time.perf_counter() - tic
    eta = spent / fraction - spent if fraction > 0 else run.expected_s()[stage] - spent
    return Status(stage, fraction, max(eta, 0.0), max(eta, 0.0) + after, info)


def _after(run, stage: str) -> float:
    """Expected seconds of the fixed stages after ``stage``."""
    expected = run.expected_s()
    order = list(expected)
    return sum(expected[s] for s in order[order.index(stage) + 1 :])


# --------------------------------------------------------------------------- controller and curve


def load_head(run, folder):
    """The head in ``folder``, fitted to (and, a layer head, bound to) the run's model."""
    from ..draft.redrafter import check_fits
    from ..hub.load import load_drafter

    head = load_drafter(folder)
    check_fits(head, run.model)
    return head.bind(run.model) if hasattr(head, "bind") else head


def controller_stage(run) -> None:
    """Train the depth controller next to each new head (``train-controller``'s fit)."""
    stamp = run.stamp()
    if run.state.finished("controller", stamp):
        return
    run.state["controllers"] = {}
    for kind, folder in run.head_dirs.items():
        if kind != "dflash":  # a DFlash drafter drafts its block in one call: no depth to decide
            _controller(run, kind, folder)
    run.state.finish("controller", stamp)


def _controller(run, kind: str, folder) -> None:
    from ..config import DEFAULT_WIDTH
    from ..step.curve import load_curve
    from .controller import fit_and_save
    from .head_controller import fit_head_controller

    ids = [p for _, p in controller_prompts(run)]
    tic, after = time.perf_counter(), _after(run, "controller")

    def progress(stage, done, total):
        fraction = {"recording": 0.9 * done / max(total or 1, 1), "measuring latency": 0.9}.get(stage, 0.95)
        run.tell(_status(run, "controller", tic, fraction, f"{stage} {done}/{total or '?'}", after))

    eos, curve, head = run.tokenizer.eos_token_ids, load_curve(run.model, run.cfg.model), load_head(run, folder)
    with run.state.timed("controller"):
        if kind == "eagle3":  # a layer head: one beam, each depth a draft call of its own
            fit = fit_head_controller(
                run.model,
                head,
                folder,
                ids,
                CONTROLLER_DEPTH,
                run.sizes.controller_tokens,
                eos,
                curve=curve,
                seed=run.cfg.seed,
                progress=progress,
            )
        else:
            fit = fit_and_save(
                run.model,
                head,
                folder,
                ids,
                DEFAULT_WIDTH,
                CONTROLLER_DEPTH,
                run.sizes.controller_tokens,
                eos_ids=eos,
                seed=run.cfg.seed,
                curve=curve,
                progress=progress,
            )
    run.state["controllers"][kind] = {
        "prompts": len(ids),
        "steps": fit.steps,
        "best_depth": fit.best_depth,
        "fixed": {str(d): round(v, 4) for d, v in fit.fixed.items()},
        "learned": round(fit.learned, 4),
        "beats_fixed": fit.beats_fixed,
    }
    line = ", ".join(f"L={d}: {v:.2f}" for d, v in fit.fixed.items())
    what = "depth controller" if len(run.head_dirs) == 1 else f"depth controller ({kind})"
    run.tell(
        Status(
            "controller",
            1.0,
            line=f"{what}: {fit.steps} steps recorded; offline tokens per "
            f"plain-step time {line}, adaptive {fit.learned:.2f}",
        )
    )


def calibrate_stage(run) -> None:
    """Measure and store this device's verify-cost curve (``doctor --calibrate``)."""
    from ..step.curve import save_curve
    from ..tuning.calibrate import measure_curve

    if run.state.finished("calibrate", True):
        return
    run.tell(_status(run, "calibrate", time.perf_counter(), 0.0, "timing verify calls", _after(run, "calibrate")))
    with run.state.timed("calibrate"):
        curve = measure_curve(run.model, run.cfg.model, budget_s=run.sizes.calibrate_s)
    if not curve.rounds:  # c(N) = N, as if drafting never paid: never stored (a larger budget measures it)
        run.tell(
            Status(
                "calibrate",
                1.0,
                line=f"verify-cost curve: {run.sizes.calibrate_s:.0f} s timed no full "
                "round on this device, so none is stored (`mlx-redrafter doctor --calibrate` measures it)",
            )
        )
        run.state.finish("calibrate", True)
        return
    path = save_curve(curve, run.model, run.cfg.model)
    run.tell(
        Status(
            "calibrate",
            1.0,
            line=f"verify-cost curve: c(2) {curve(2):.2f}, c(4) {curve(4):.2f} ({curve.rounds} rounds), saved {path}",
        )
    )
    run.state.finish("calibrate", True)


# --------------------------------------------------------------------------- verdict


def verdict_settings(run) -> dict:
    """What the verdict measures besides plain decoding: lookup alone, the new
    drafter and the drafter the model already uses (if any), in the shape the
    tools give a drafter by default."""
    from ..config import DEFAULT_LOOKUP, DraftConfig, resolve
    from ..hub.store import find
    from ..keywords import with_curve
    from ..step.curve import curve_for, default_tree
    from ..tuning.verdict import EXISTING, LOOKUP
    from .heads import VERDICT_KEYS

    tree = default_tree(run.model)
    curve = curve_for(run.model, run.cfg.model) if tree == "auto" else None

    def shape(drafter):  # the built-in shape and tree of its kind (a layer head drafts as the draft's head)
        draft = resolve(drafter, lookup=DEFAULT_LOOKUP, tree_default=tree, curve=curve).draft
        return with_curve(run.model, draft, run.cfg.model)  # a DFlash drafter's own default: tree auto

    settings = {LOOKUP: DraftConfig(None, lookup=DEFAULT_LOOKUP, tree=tree, curve=curve)}
    for kind, folder in run.head_dirs.items():
        settings[VERDICT_KEYS[kind]] = shape(load_head(run, folder))
    run.existing = find(run.identity)
    if run.existing is not None:
        settings[EXISTING] = shape(load_head(run, run.existing.path))
    return settings


def verdict_stage(run) -> None:
    """The new drafter against plain decoding, lookup alone and the drafter in use; the install rule."""
    from ..tuning.verdict import CANDIDATES, EXISTING, chosen, decide, real_measure, run_verdict, summarize

    stamp = run.stamp()
    if run.state.finished("verdict", stamp):
        return
    held = verdict_prompts(run)
    cids, prompts = [c for c, _ in held], [p for _, p in held]
    settings = verdict_settings(run)
    partial = run.state["verdict_passes"] or {}
    done = partial.get("passes") if (partial.get("stamp"), partial.get("prompts")) == (stamp, cids) else None
    tic, where = time.perf_counter(), {"pass": 0, "of": 1, "prompt": 0}

    def on_pass(name, i, n):
        where.update({"pass": i, "of": n, "prompt": 0, "name": name})
        tick()

    def tick():
        fraction = (where["pass"] + where["prompt"] / len(prompts)) / where["of"]
        where["prompt"] += 1
        run.tell(
            _status(
                run,
                "verdict",
                tic,
                fraction,
                f"{where.get('name', '')}: prompt {min(where['prompt'], len(prompts))}/{len(prompts)}",
            )
        )

    def save(passes):
        run.state["verdict_passes"] = {"stamp": stamp, "prompts": cids, "passes": passes}
        run.state.save()

    measure = run.measure or real_measure(run.model, run.tokenizer.eos_token_ids, tick)
    with run.state.timed("verdict"):
        passes = run_verdict(settings, prompts, run.sizes.verdict_tokens, measure, done, save, on_pass)
    summary = summarize(passes)
    install, reason = decide(summary)
    verdict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": device_line(),
        "commit": commit(),
        "max_tokens": run.sizes.verdict_tokens,
        "prompt_ids": cids,
        **summary,
        "installed": install,
        "reason": reason,
        "chosen": chosen(summary),
    }
    for key in CANDIDATES:
        if key in settings:
            s = settings[key]
            (w, length), more = s.drafter_shape, dict(lookup=s.lookup, tree=s.tree)
            verdict[key].update(beam_width=w, beam_length=length, **more)
    if EXISTING in verdict:
        verdict[EXISTING]["path"] = str(run.existing.path)
    if not install:
        verdict["needs"] = learning_need(run, summary).to_dict()
    run.state["verdict"] = verdict
    run.state.finish("verdict", stamp)


def learning_need(run, summary):
    """What the drafter's learning curve says it lacks (:mod:`.learning`)."""
    from ..tuning.verdict import chosen, target_speedup
    from .budget import train_seconds_per_position
    from .heads import DFLASH, EAGLE3, kind_of_key
    from .learning import data_needed, learning_points
    from .shards import Manifest
    from .trainer import LOG

    key = chosen(summary)
    kind = kind_of_key(key)
    cfg = {EAGLE3: run.eagle3_cfg, DFLASH: run.dflash_cfg}.get(kind, run.train_cfg)
    batch = cfg.positions_per_step if kind in (EAGLE3, DFLASH) else run.train_cfg.batch_size
    points = learning_points(run.drafter_dir / LOG, batch)
    record = training_record(run.drafter_dir)
    accuracy = (record.get("eval_acc") or [points[-1][1] if points else 0.0])[0]
    per_position = 1 / max(run.rates.positions_per_s, 1e-9) + train_seconds_per_position(
        run.rates, run.train_cfg.batch_size, run.source.held_out, (kind,)
    )
    d = summary[key]
    warmup = cfg.warmup_steps * batch
    return data_needed(
        points,
        accuracy,
        d["tokens_per_step"],
        d["speedup"],
        target_speedup(summary),
        positions(Manifest.load(run.data)),
        per_position,
        warmup,
    )


def training_record(drafter_dir: Path) -> dict:
    """The training record saved with the drafter (its step and held-out metrics)."""
    try:
        return dict(json.loads((Path(drafter_dir) / "config.json").read_text()).get("training") or {})
    except (OSError, ValueError):
        return {}


def device_line() -> str:
    """The device a verdict was measured on, in words."""
    import mlx.core as mx

    from ..doctor import report

    info, kind = report(), mx.default_device().type
    return f"{getattr(kind, 'name', kind)}, {info['machine']}, {info['cpu_count']} cores, {info['blas']}"


def commit() -> str:
    """The package's git commit when it runs from a checkout, else its version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = "mlx-redrafter " + version("mlx-redrafter")
    except PackageNotFoundError:
        release = "unknown"
    package = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(package), "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return release
    # Only this project's checkout: an installed package may sit inside some other repository.
    return out[1] if len(out) == 2 and Path(out[0]) / package.name == package else release


# --------------------------------------------------------------------------- install and META


def install_stage(run) -> None:
    """Write the drafter's META; install it into the store when the verdict says it pays."""
    from ..hub.store import META, install

    meta = build_meta(run)
    write_json_atomic(run.drafter_dir / META, meta)
    run.state["meta"] = meta
    if not meta["verdict"].get("installed"):
        run.state["installed"] = None
        run.state.save()
        return
    with run.state.timed("install"):
        path = install(run.drafter_dir, run.identity, meta)
    run.state["installed"] = str(path)
    run.state.finish("install", run.stamp())


def build_meta(run) -> dict:
    """What the drafter's model card says: the base model, the data, the
    recipe (the command and each stage's minutes), held-out acceptance and
    the verdict with the device it was measured on."""
    from .heads import FOLDERS, train_recipe
    from .shards import Manifest
    from .trainer import checkpoint_state

    m, record, seconds = Manifest.load(run.data), training_record(run.drafter_dir), run.state["seconds"]
    stages = {s: {"minutes": round(v / 60, 2)} for s, v in seconds.items()}
    stages.setdefault("train", {})["steps"] = checkpoint_state(run.drafter_dir).get("step", 0)
    distill = run.distill_cfg
    kind = next(k for k, f in FOLDERS.items() if run.drafter_dir.name == f)
    accepted = record.get("eval_accepted_w1")
    return {
        "source": "make-drafter",
        "head": kind,
        "base_model": run.identity.to_dict(),
        "data": {
            "prompts": run.source.label,
            "private": run.source.private,
            "conversations": len(m.done),
            "positions": positions(m),
            "tokens": m.tokens,
            "prompt_positions": m.prompt_tokens,
            "held_out": run.source.held_out,
        },
        "recipe": {
            "command": run.cfg.command,
            "minutes": run.cfg.minutes,
            "runs": len(run.state["runs"]),
            "stages": stages,
            "rates": run.state["rates"],
            "distill": {
                k: getattr(distill, k)
                for k in ("batch_size", "max_new_tokens", "max_prompt_tokens", "top_k", "prompt_positions", "raw")
            },
            "train": train_recipe(run, kind),
            "controller": (run.state["controllers"] or {}).get(kind),
        },
        "acceptance": {
            "held_out": {
                "positions": record.get("eval_examples"),
                "step": record.get("step"),
                "by_depth": record.get("eval_acc"),
                "accepted_w1": accepted,
                "tokens_per_step": None if accepted is None else round(1 + accepted, 4),
            }
        },
        "verdict": run.state["verdict"],
    }
