"""``make-drafter``: the whole recipe for one model, in one resumable command.

Stages, each the existing function of its command: distillation
(:func:`~mlx_redrafter.train.distill.distill`), training
(:func:`~mlx_redrafter.train.trainer.train`), the depth controller
(:func:`~mlx_redrafter.train.controller.fit_and_save`), this device's
verify-cost curve (:func:`~mlx_redrafter.tuning.calibrate.measure_curve`),
the verdict (:mod:`~mlx_redrafter.tuning.verdict`) and the install into the
drafter store (:func:`~mlx_redrafter.hub.store.install`), which happens
only when the verdict measured the drafter faster than decoding without
one (:mod:`.finish`).

The budget is a total over every run into the work folder (``OUT``:
``data/`` the distilled shards, ``drafter/`` the drafter, its checkpoint and
controller, ``make-drafter.json`` the state, :mod:`.recipe_state`); it is
split by the rates this run measures (:mod:`.budget`). Ctrl-C keeps what is
done; the same command continues; a larger budget distils more and trains
on from the checkpoint, and the stages after it measure the new drafter.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .budget import LiveRate, Rates, Sizes, fit_sizes, measure_step_s, measure_train_rate, more_distill_s
from .heads import DFLASH, EAGLE3, FOLDERS, LAYER_HEADS, REDRAFTER, draft_vocab_size, heads_of, train_head
from .recipe_state import State, Status, default_out, positions
from .sources import HISTORY, held_out_conversations, open_source, source_label

TRAIN_FLOOR = 0.1  # the least share of the budget that training gets


@dataclass
class RecipeConfig:
    """What ``make-drafter`` is asked to do (the command's flags)."""

    model: str = "default"
    minutes: float = 90.0  # total over every run into ``out``
    out: Optional[Path] = None  # None: a folder under cache_root() keyed by the model and prompts
    prompts: Optional[str] = None  # None: the shipped ShareGPT prompts; "history"; or a prompt file
    max_conversations: Optional[int] = None  # distil at most this many conversations (over all runs)
    command: str = ""  # the command line, recorded in the drafter's metadata
    sizes: Optional[Sizes] = None  # the controller's, calibration's and verdict's sizes (None: fit to the budget)
    distill: dict = field(default_factory=dict)  # DistillConfig fields over the recipe's
    train: dict = field(default_factory=dict)  # TrainConfig fields over the recipe's
    seed: int = 0
    head: str = REDRAFTER  # which draft head: redrafter, eagle3, dflash, or auto (all; the fastest is installed)
    eagle3: dict = field(default_factory=dict)  # Eagle3TrainConfig fields over the recipe's
    dflash: dict = field(default_factory=dict)  # DFlashTrainConfig fields over the recipe's


@dataclass
class Report:
    out: Path
    drafter: Path  # the drafter in the work folder (the head the verdict chose)
    installed: Optional[Path]  # where the store keeps it (None: the verdict refused it)
    verdict: dict
    meta: dict
    already_done: bool  # the folder had finished every stage for this budget before this run
    verdict_measured: bool = True  # False: the verdict is an earlier run's
    kept: Tuple[str, ...] = ()  # heads this run trained on but did not improve: kept as they were


def head_settings(hidden: int, vocab: int) -> dict:
    """The drafter's head from the model's own sizes: the default preset's
    shape (one ResBlock as wide as the LLM, so the head starts from the LLM's
    own output rows) and a reduced draft vocabulary, 4096 tokens, or 8192 for
    a vocabulary over 65536 (Gemma 3's 262144 spreads the same text over more
    ids; a doubling costs 1.7x the draft time, section 12's vocabulary table)."""
    return dict(exit_dim=hidden, num_draft_layers=1, draft_vocab_size=draft_vocab_size(vocab), skip_repeats=5)


def make_drafter(cfg: RecipeConfig, progress: Optional[Callable[[Status], None]] = None, measure=None) -> Report:
    """Run (or continue) the recipe for ``cfg.model`` and return what it made.

    ``progress(status)`` follows every stage. ``measure`` replaces the
    verdict's timed passes (:mod:`~mlx_redrafter.tuning.verdict`). A
    ``KeyboardInterrupt`` leaves the folder as a rerun continues it.
    """
    from ..errors import RedrafterError

    if not cfg.minutes or cfg.minutes <= 0:
        raise RedrafterError(
            f"The budget must be more than 0 minutes (got {cfg.minutes}).", "Use e.g. --minutes 90 or --hours 1.5."
        )
    label = source_label(cfg.prompts)
    out = Path(cfg.out).expanduser() if cfg.out else default_out(cfg.model, label)
    state = State.open(out, cfg.model, label)
    run = RecipeRun(cfg, state, out, progress or (lambda status: None), measure)
    with state.timed("setup"):
        run.load()
    finished_before = run.all_finished()
    for stage in run.stages():
        stage()
    return run.report(finished_before)


class RecipeRun:
    """One run of the recipe into a work folder: the loaded model and what the
    stages share. Every attribute is declared here; :meth:`load` sets the
    model's (None before it), the stages the ones they measure."""

    # Given: the recipe, the folder's state, the folder, the progress callback, the verdict's passes.
    cfg: RecipeConfig
    state: State
    out: Path
    tell: Callable[[Status], None]
    measure: Optional[Callable]
    budget: float  # seconds, over every run into the folder
    heads: Tuple[str, ...]  # the kinds of head trained: redrafter, eagle3 or both
    data: Path  # the distilled data
    head_dirs: Dict[str, Path]  # each head's folder
    # Set by load(): the model, where its prompts come from, the settings fixed by the folder's first run.
    model: object = None
    tokenizer: object = None
    identity: object = None  # the model's identity (llm/identity.py), keys the store
    source: object = None  # the prompts (sources.py), with the held-out share
    raw: bool = False  # no chat template: prompts are raw text
    held: Optional[List[dict]] = None  # the held-out conversations
    distill_cfg: object = None
    train_cfg: object = None
    eagle3_cfg: object = None  # None unless an EAGLE-3 head is trained
    dflash_cfg: object = None  # None unless a DFlash drafter is trained
    rates: Optional[Rates] = None  # measured rates the budget plans with
    sizes: object = None  # the fixed stages' prompt counts and lengths (budget.fit_sizes)
    # Set by the stages.
    held_acc: Optional[float] = None  # the last held-out first-draft accuracy training logged
    verdict_measured: bool = False  # this run measured the verdict (else an earlier run's stands)
    kept: Tuple[str, ...] = ()  # the heads this run trained on whose held-out score it did not beat (kept as they were)
    held_ids: Optional[List[Tuple[str, List[int]]]] = None  # the held-out prompts that fit (finish.held_prompts)
    existing: object = None  # the store's drafter for the model the verdict measures against, if any

    def __init__(self, cfg: RecipeConfig, state: State, out: Path, tell, measure=None):
        self.cfg, self.state, self.out, self.tell, self.measure = cfg, state, out, tell, measure
        self.budget = 60.0 * cfg.minutes
        self.heads = heads_of(cfg.head)
        self.data, self.head_dirs = out / "data", {kind: out / FOLDERS[kind] for kind in self.heads}

    def stages(self) -> Tuple[Callable[[], None], ...]:
        """The stages in their order (recipe_state.STAGES names them in the state file)."""
        return (self.distill, self.train, self.controller, self.calibrate, self.verdict, self.install)

    @property
    def drafter_dir(self) -> Path:
        """The folder of the head the stages after training report on: the one
        the verdict chose, else the first this run trains."""
        from .heads import kind_of_key

        key = (self.state["verdict"] or {}).get("chosen")
        return self.head_dirs[kind_of_key(key) if key else self.heads[0]]

    # -- set-up --------------------------------------------------------------

    def load(self) -> None:
        from ..llm.identity import model_identity
        from ..llm.load import load_model
        from ..prompts import has_chat_template

        self.tell(Status("loading", info=f"model {self.cfg.model}"))
        self.state.pin("head", {"head": self.cfg.head}, {"head": self.cfg.head})
        self.model, self.tokenizer = load_model(self.cfg.model)
        self.identity = model_identity(self.model, self.cfg.model)
        self.source = open_source(self.cfg.prompts, self.cfg.model, self.tokenizer, self.out, self.state["held_out"])
        self.state["held_out"] = self.source.held_out
        self.raw = not has_chat_template(self.tokenizer)
        self.state["runs"].append(
            {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "minutes": self.cfg.minutes, "command": self.cfg.command}
        )
        self.distill_cfg, self.train_cfg = self._settings()
        self.held = held_out_conversations(self.source, self.cfg.seed)
        self.rates = Rates.from_dict(self.state["rates"])
        self._measure_rates()

    def _settings(self):
        """The distillation and training settings: the recipe's, with the
        config's overrides, fixed by the folder's first run (the budget
        fields excepted: a rerun may change them)."""
        from .distill import DistillConfig
        from .eagle3_trainer import distill_layers
        from .heads import dflash_settings, eagle3_settings
        from .trainer import BUDGET_FIELDS, TrainConfig

        distill = asdict(
            DistillConfig(
                batch_size=80,
                raw=self.raw,
                seed=self.cfg.seed,
                max_prompt_tokens=1024 if self.source.label == HISTORY else 384,
                # An EAGLE-3 head (and a DFlash drafter) reads three of the model's layers: the data keeps them.
                feature_layers=distill_layers(self.identity.num_layers) if set(LAYER_HEADS) & set(self.heads) else [],
            )
        )
        distill = {k: v for k, v in distill.items() if k not in ("minutes", "max_conversations")}
        distill = self.state.pin("distill", {**distill, **self.cfg.distill}, self.cfg.distill)
        train = asdict(
            TrainConfig(
                **head_settings(self.identity.hidden_size, self.identity.vocab_size),
                eval_fraction=self.source.held_out,
                seed=self.cfg.seed,
            )
        )
        train = {k: v for k, v in train.items() if k not in BUDGET_FIELDS}
        fixed = {k: v for k, v in self.cfg.train.items() if k not in BUDGET_FIELDS}
        budget = {"epochs": 1000.0, **{k: v for k, v in self.cfg.train.items() if k in BUDGET_FIELDS}}
        train = self.state.pin("train", {**train, **fixed}, fixed)
        self.eagle3_cfg = eagle3_settings(self) if EAGLE3 in self.heads else None
        self.dflash_cfg = dflash_settings(self) if DFLASH in self.heads else None
        return (
            DistillConfig(**{**distill, "max_conversations": self.cfg.max_conversations}),
            TrainConfig(**{**train, **budget}),
        )

    def _measure_rates(self) -> None:
        from ..prompts import conversation_ids

        if not self.rates.step_s:
            self.tell(Status("loading", info="timing a decode step"))
            conv = (self.held or [{"id": "x", "turns": ["Hello"]}])[0]
            self.rates.step_s = measure_step_s(self.model, conversation_ids(self.tokenizer, conv, self.raw)[:256])
        if REDRAFTER in self.heads and not self.rates.train_steps_per_s:
            self.tell(Status("loading", info="timing a training step"))
            self.rates.train_steps_per_s = measure_train_rate(self.model, self.train_cfg, top_k=self.distill_cfg.top_k)
        if EAGLE3 in self.heads and not self.rates.eagle3_positions_per_s:
            from .eagle3_trainer import measure_rate

            self.tell(Status("loading", info="timing an EAGLE-3 training step"))
            self.rates.eagle3_positions_per_s = measure_rate(self.model, self.eagle3_cfg, top_k=self.distill_cfg.top_k)
        if DFLASH in self.heads and not self.rates.dflash_positions_per_s:
            from .dflash_trainer import measure_rate as dflash_rate

            self.tell(Status("loading", info="timing a DFlash training step"))
            self.rates.dflash_positions_per_s = dflash_rate(self.model, self.dflash_cfg)
        self.state["rates"] = asdict(self.rates)
        self.sizes = self.cfg.sizes or fit_sizes(self.budget, self.rates.step_s)
        self.state.save()

    # -- what is left ----------------------------------------------------------

    def stamp(self) -> Optional[str]:
        """The heads in the folder, as the stages after training key what they measured (None: one is missing)."""
        from ..profiles import drafter_id

        if not all((d / "model.safetensors").is_file() for d in self.head_dirs.values()):
            return None
        return " + ".join(drafter_id(d) for d in self.head_dirs.values())

    def data_final(self) -> bool:
        return self.state.finished("distill", self.budget) and self.state.finished("train", self.budget)

    def expected_s(self) -> dict:
        """Seconds each fixed stage (controller, calibration, verdict) takes, in
        order: the last run's where it ran, else estimated from the decode step."""
        from .budget import estimate_fixed_s

        est = estimate_fixed_s(self.sizes, self.rates.step_s)
        return {k: self.state["last"].get(k, v) for k, v in est.items()}

    def fixed_todo_s(self) -> float:
        """Seconds the fixed stages still need."""
        stamp = self.stamp() if self.data_final() else None
        keys = {"controller": stamp, "calibrate": True, "verdict": stamp}
        return sum(s for k, s in self.expected_s().items() if not self.state.finished(k, keys[k]))

    def left_s(self) -> float:
        """Seconds of the budget left for distilling and training."""
        return self.budget - self.state.spent() - self.fixed_todo_s()

    def all_finished(self) -> bool:
        stamp = self.stamp()
        return (
            self.data_final()
            and stamp is not None
            and all(self.state.finished(s, stamp) for s in ("controller", "verdict"))
            and self.state.finished("calibrate", True)
        )

    # -- distillation ------------------------------------------------------------

    def distill(self) -> None:
        from .distill import distill
        from .shards import Manifest

        if self.state.finished("distill", self.budget):
            return
        before = Manifest.load(self.data)
        start = positions(before)
        left, train_spent = self.left_s(), self.state["seconds"].get("train", 0.0)
        live = LiveRate(self.rates.positions_per_s)

        def planned() -> float:
            rates = replace(self.rates, positions_per_s=live.rate or self.rates.positions_per_s)
            batch, held = self.train_cfg.batch_size, self.source.held_out
            return more_distill_s(left, start, train_spent, rates, batch, held, self.heads)

        def progress(m, running):
            live.update(positions(m) + running)
            plan = planned()
            self.tell(
                Status(
                    "distill",
                    min(live.elapsed / max(plan, 1e-9), 1.0),
                    plan - live.elapsed,
                    left - live.elapsed + self.fixed_todo_s(),
                    f"{live.now:.0f} positions/s, {positions(m) + running:,} positions, "
                    f"{len(m.done)} conversations saved",
                )
            )

        def past(replies: int, slack: float) -> bool:
            # At least one finished reply, whatever the budget: training needs data.
            late = live.elapsed >= planned() + slack * self.distill_cfg.max_new_tokens * live.step_s
            return late and (replies > 0 or start > 0)

        with self.state.timed("distill"):  # no new prompt once the last replies take the rest of the plan
            m = distill(
                self.cfg.model,
                self.source.path,
                self.data,
                self.distill_cfg,
                self.model,
                self.tokenizer,
                progress=progress,
                drain=lambda n: past(n, -1.0),
                stop=lambda n: past(n, 1.0),
            )
        if live.elapsed > 0 and positions(m) > start:
            self.rates.positions_per_s = (positions(m) - start) / live.elapsed
            self.state["rates"] = asdict(self.rates)
        line = (
            f"distilled {positions(m) - start:,} positions in {live.elapsed / 60:.1f} min "
            f"({len(m.done)} conversations, {positions(m):,} positions in all)"
        )
        self.tell(Status("distill", 1.0, line=line + self.used_up(m)))
        self.state.finish("distill", self.budget)

    def used_up(self, m) -> str:
        """Why distillation added nothing, and what adds data, when the
        prompts are what ran out ("" otherwise: the budget's share ended it)."""
        from ..prompts import read_conversations

        cap, total = self.cfg.max_conversations, len(read_conversations(self.source.path))
        if cap is not None and len(m.done) >= cap < total:
            return (
                f": the --max-conversations {cap} cap is reached; the rest of the budget trains on the same "
                "data. A larger --max-conversations adds data."
            )
        if len(m.done) < total:
            return ""
        prompts = "the shipped ShareGPT prompts" if self.source.label == "sharegpt" else f"--prompts {self.cfg.prompts}"
        return (
            f": every one of the {total:,} conversations of {prompts} is distilled, so the rest of the budget "
            "trains on the same data. More data needs more prompts: --prompts FILE.jsonl (a work folder of its own)."
        )

    # -- training ------------------------------------------------------------

    def train(self) -> None:
        from .trainer import checkpoint_state

        if self.state.finished("train", self.budget):
            return
        for i, kind in enumerate(self.heads):
            # Each head gets an equal share of what is left. Training gets at
            # least TRAIN_FLOOR of the budget in all, also when distillation
            # ran past its share (its first replies take what they take).
            done = checkpoint_state(self.head_dirs[kind]).get("seconds", 0.0)
            floor = TRAIN_FLOOR * self.budget / len(self.heads)
            left = max(self.left_s() / (len(self.heads) - i), floor - done, 0.0)
            train_head(self, kind, left)
            self.state["rates"] = asdict(self.rates)
        self.state.finish("train", self.budget)

    # -- the stages after training (finish.py) ----------------------------------

    def controller(self) -> None:
        from .finish import controller_stage

        controller_stage(self)

    def calibrate(self) -> None:
        from .finish import calibrate_stage

        calibrate_stage(self)

    def verdict(self) -> None:
        from .finish import verdict_stage

        before = self.state["verdict"]
        verdict_stage(self)
        self.verdict_measured = self.state["verdict"] is not before  # else the earlier run's stands

    def install(self) -> None:
        from .finish import install_stage

        install_stage(self)

    def report(self, already_done: bool) -> Report:
        return Report(
            self.out,
            self.drafter_dir,
            self.state["installed"] and Path(self.state["installed"]),
            self.state["verdict"] or {},
            self.state["meta"] or {},
            already_done,
            self.verdict_measured,
            self.kept,
        )
