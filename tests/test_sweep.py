"""`mlx-redrafter sweep`, tuned profiles and bench/run.py on tiny models.

Nothing here asserts a timing: only that every number is present, consistent
across the output files, and computed from what was measured. The model is
the bigram tiny model and the drafter the one that predicts it
(helpers.bigram_drafter): every "identical to plain decoding" is checked in
cells whose drafts were accepted.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    SPECIALS,
    OracleDrafter,
    bigram_drafter,
    bigram_model,
    cli,
    drafted_share,
    random_drafter,
    save_bigram_drafter,
    save_random_drafter,
    save_tiny_folder,
    squeeze,
    tiny_model,
)
from helpers import (
    prompts as random_prompts,
)

from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.runtime import resolve_drafter_path
from mlx_redrafter.tuning import report, summary
from mlx_redrafter.tuning import sweep as sw
from mlx_redrafter.tuning.measure import PHASES
from mlx_redrafter.tuning.results import cell_key

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "model", bigram=True)


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    return save_bigram_drafter(tmp_path_factory.mktemp("drafter") / "d")


@pytest.fixture(scope="module")
def model():
    return bigram_model()


@pytest.fixture(scope="module")
def drafter(model):
    return bigram_drafter(model)


@pytest.fixture
def prompt_file(tmp_path):
    rows = [
        {"question_id": 1, "category": "alpha", "turns": ["w1 w2 w3 w4", "w5 w6"]},
        {"question_id": 2, "category": "beta", "turns": ["w7 w8 w9"]},
        {"question_id": 3, "category": "alpha", "turns": ["w10 w11"]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def png_size(path: Path):
    """(width, height) from the IHDR chunk, after checking the signature."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def read_csv(path: Path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(s: str):
    return None if s == "" else float(s)


# --------------------------------------------------------------------------- grid and prompts


def test_parse_grid():
    assert sw.parse_grid("1,2,4") == [1, 2, 4]
    assert sw.parse_grid("4-6") == [4, 5, 6]
    assert sw.parse_grid(" 3, 1,1-2 ") == [1, 2, 3]


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "empty"),
        (" , ", "empty"),
        ("a,b", "'a' is not a whole number"),
        ("1,x", "'x'"),
        ("0,1", "at least 1"),
        ("3-1", "empty"),
        ("-2", "not a whole number"),
        ("1.5", "not a whole number"),
    ],
)
def test_parse_grid_rejects_garbage(text, words):
    with pytest.raises(RedrafterError) as e:
        sw.parse_grid(text, "--lengths")
    assert words in str(e.value) and "--lengths" in str(e.value)


def test_config_rejects_empty_grid_and_small_values():
    for widths, lengths in (([], [2]), ([1], []), ([0], [2]), ([1], [0])):
        with pytest.raises(RedrafterError):
            sw.SweepConfig(widths, lengths).check()
    with pytest.raises(RedrafterError):
        sw.SweepConfig([1], [2], max_tokens=0).check()


def test_select_conversations_round_robin():
    from mlx_redrafter.prompts import select_conversations

    convs = [{"id": str(i), "category": c, "turns": ["x"]} for i, c in enumerate("aaabbc")]
    picked = select_conversations(convs, 4)
    assert [c["category"] for c in picked] == ["a", "b", "c", "a"]
    assert select_conversations(convs, 99) == convs


def test_bad_prompt_sets(tmp_path):
    from mlx_redrafter.prompts import load_prompt_set

    with pytest.raises(RedrafterError, match="Unknown prompt set"):
        load_prompt_set("no_such_set")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(RedrafterError, match="No prompts"):
        load_prompt_set(str(empty))
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\xff\xfe{not json\n")
    with pytest.raises(RedrafterError, match="Cannot read"):
        load_prompt_set(str(garbage))
    for name in ("mt_bench", "spec_bench", "alpaca_eval"):  # the shipped sets load
        assert load_prompt_set(name)


def test_chat_prompt_ids_use_the_template(tiny_folder):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_redrafter.prompts import first_turn_ids

    tok = load_tokenizer(tiny_folder)
    ids = first_turn_ids(tok, [{"turns": ["w1 w2"]}])[0]
    user, assistant = SPECIALS.index("<user>"), SPECIALS.index("<assistant>")
    w1, w2 = len(SPECIALS) + 1, len(SPECIALS) + 2
    assert ids == [user, w1, w2, assistant]


@pytest.mark.parametrize("templated", [True, False])
def test_chat_sweep_bench_and_distill_feed_the_same_ids(tiny_folder, templated):
    """Training (distill), benchmarks (sweep, bench, train-controller) and
    inference (chat, generate) tokenize a conversation alike."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    from mlx_redrafter.chat import ChatSession
    from mlx_redrafter.cli.options import format_prompt
    from mlx_redrafter.llm.text import encode_prompt
    from mlx_redrafter.prompts import chat_prompt_ids, first_turn_ids
    from mlx_redrafter.train.distill import DistillConfig, Distiller

    hf = AutoTokenizer.from_pretrained(tiny_folder)
    if not templated:
        hf.chat_template = None
    tok = TokenizerWrapper(hf)
    assert tok.has_chat_template == templated
    model = tiny_model("llama")
    system, user = "w3 w4", "w1 w2"
    chat = ChatSession(model, tok, system=system)
    messages = chat.messages(user)
    ids = chat._fit_context(user)[0]  # what the chat feeds the model
    assert ids == Distiller(model, tok, DistillConfig(system=system)).encode(messages)
    assert ids == chat_prompt_ids(hf, messages)  # a bare Hugging Face tokenizer too
    alone = ChatSession(model, tok)._fit_context(user)[0]
    assert alone == first_turn_ids(tok, [{"turns": [user]}])[0]
    assert len(set(ids)) > 2 and ids != alone  # the system message is in there
    if templated:  # `generate` without --raw (a model without a template continues the text as given)
        assert alone == encode_prompt(tok, format_prompt(tok, user, None, False))


# --------------------------------------------------------------------------- the sweep


def expected_matrix(results: dict, key: str, widths, lengths) -> np.ndarray:
    m = np.full((len(widths), len(lengths)), np.nan)
    for c in results["cells"]:
        if c["status"] == "ok":
            m[widths.index(c["width"]), lengths.index(c["length"])] = c[key]
    return m


def test_sweep_2x2_outputs_are_complete_and_consistent(tmp_path, model, drafter):
    from PIL import Image

    cfg = sw.SweepConfig([1, 2], [2, 3], max_tokens=10, baseline_every=2, timings=True)
    ps = random_prompts(2)
    events = []
    results = sw.run_sweep(
        model, ps, drafter, cfg, tmp_path, {"model": "tiny"}, progress=lambda d, t, label: events.append((d, t, label))
    )
    for name in ("results.json", "results.csv", "results.md", "speedup.png", "tokens_per_s.png", "tokens_per_step.png"):
        assert (tmp_path / name).is_file(), name
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["cells"] == json.loads(json.dumps(results["cells"]))

    # The progress bar ends full: every prompt of every pass counted once.
    assert events[-1][0] == events[-1][1] == (4 + sw.baseline_count(4, 2)) * 2

    # Baselines: one before the grid, one after every 2 cells.
    assert len(data["baselines"]) == sw.baseline_count(4, 2) == 3
    assert all(b["tokens_per_s"] > 0 and b["tokens"] == 2 * 10 for b in data["baselines"])
    seqs = {b["seq"]: b for b in data["baselines"]}
    assert {"device", "blas", "default_dtype", "machine"} <= set(data["machine"])

    assert [cell_key(c) for c in data["cells"]] == cfg.cells()
    for c in data["cells"]:
        w, l = c["width"], c["length"]
        assert c["status"] == "ok" and c["tokens"] == 2 * 10
        assert c["identical_outputs"] == 2  # greedy ReDrafter == plain mlx-lm decoding
        # The speedup uses the baseline passes right before and after the cell.
        before, after = c["baseline_seqs"]
        assert before < c["seq"] < after and not any(before < s < after for s in seqs)
        base = np.mean([seqs[s]["tokens_per_s"] for s in c["baseline_seqs"]])
        assert math.isclose(c["baseline_tokens_per_s"], base)
        assert math.isclose(c["speedup"], c["tokens_per_s"] / base)
        assert len(c["acceptance_by_depth"]) == l
        assert all(0 <= a <= 1 for a in c["acceptance_by_depth"])
        assert c["tokens_per_step"] > 1.2  # drafts were accepted in every cell
        assert 1 < c["tree_size"] <= 1 + w * l
        assert math.isclose(c["compression"], (c["tree_size"] - 1) / (w * l))
        assert set(c["time_split_ms"]) == set(PHASES)
        assert all(v >= 0 for v in c["time_split_ms"].values()) and c["time_split_ms"]["verify"] > 0
        assert c["peak_memory_gb"] > 0 and "memory_overhead_gb" in c
    best = max(data["cells"], key=lambda c: c["speedup"])
    assert (data["best"]["width"], data["best"]["length"]) == (best["width"], best["length"])

    # CSV == JSON, baselines included.
    rows = read_csv(tmp_path / "results.csv")
    assert [r["kind"] for r in rows] == ["baseline"] * 3 + ["cell"] * 4
    for r, b in zip(rows[:3], sorted(data["baselines"], key=lambda b: b["seq"])):
        assert int(r["seq"]) == b["seq"] and num(r["tokens_per_s"]) == b["tokens_per_s"]
    for r, c in zip(rows[3:], data["cells"]):
        assert (int(r["width"]), int(r["length"]), r["status"]) == (c["width"], c["length"], "ok")
        for k in (
            "tokens_per_s",
            "speedup",
            "baseline_tokens_per_s",
            "tokens_per_step",
            "tree_size",
            "compression",
            "peak_memory_gb",
        ):
            assert num(r[k]) == c[k], k
        for p in PHASES:
            assert num(r[f"{p}_ms"]) == c["time_split_ms"][p]
        for d, a in enumerate(c["acceptance_by_depth"], 1):
            assert num(r[f"accept_ge_{d}"]) == a
        assert int(r["identical_outputs"]) == 2

    # The Markdown table: one row per cell, in (W, L) order, with the JSON's speedups.
    md = (tmp_path / "results.md").read_text().splitlines()
    cell_rows = [line.split(" | ") for line in md[2:] if line.startswith("| ")]
    assert [(int(r[0][2:]), int(r[1])) for r in cell_rows] == sorted((w, l) for w, l, *_ in cfg.cells())
    by_cell = {(c["width"], c["length"]): c for c in data["cells"]}
    for r in cell_rows:
        assert r[2] == f"{by_cell[(int(r[0][2:]), int(r[1]))]['speedup']:.2f}x"
    assert md[-1].startswith("Plain decoding baselines") and md[-1].split(": ")[1].count(",") == 2

    # The heatmaps: PNGs of the grid's size, drawing exactly the JSON values.
    size = report.heatmap_pixels(2, 2)
    for key, (name, _, _) in report.HEATMAPS.items():
        assert png_size(tmp_path / name) == size
        with Image.open(tmp_path / name) as im:
            assert im.size == size and im.format == "PNG"
    drawn = summary.write_outputs(data, tmp_path, cfg)
    for key in report.HEATMAPS:
        np.testing.assert_array_equal(drawn[key], expected_matrix(data, key, [1, 2], [2, 3]))
    assert report.heatmap_pixels(3, 4) != size  # the size follows the grid


def test_sweep_auto_column_beside_the_fixed_grid(tmp_path, model, drafter):
    """tree fixed with the auto column: the grid, then one auto cell per width
    (caps W x the longest L), exact, drawn as a last heatmap column."""
    cfg = sw.SweepConfig([1, 2], [1, 2], max_tokens=8, baseline_every=3, auto_column=True)
    assert cfg.has_auto() and not sw.SweepConfig([1], [1]).has_auto()
    results = sw.run_sweep(model, random_prompts(2), drafter, cfg, tmp_path, {"model": "tiny"})
    auto = [(1, 2, 0, "auto"), (2, 2, 0, "auto")]
    assert sorted(cell_key(c) for c in results["cells"]) == sorted(
        [(w, l, 0, "fixed") for w in (1, 2) for l in (1, 2)] + auto
    )
    for c in results["cells"]:
        assert c["status"] == "ok" and c["identical_outputs"] == 2
        assert 1 <= c["tree_size"] <= 1 + c["width"] * c["length"]
        assert c["tokens_per_step"] > 1 or c["tree"] == "auto"  # the fixed cells' drafts were accepted
    assert summary.heatmap_lengths(cfg) == [1, 2, "auto"]
    drawn = summary.write_outputs(results, tmp_path, cfg)
    by_key = {cell_key(c): c for c in results["cells"]}
    for key in report.HEATMAPS:
        want = [[by_key[(w, l, 0, "fixed")][key] for l in (1, 2)] + [by_key[(w, 2, 0, "auto")][key]] for w in (1, 2)]
        np.testing.assert_allclose(drawn[key], want)
    assert png_size(tmp_path / "speedup.png") == report.heatmap_pixels(2, 3)
    md = [r.split(" | ") for r in (tmp_path / "results.md").read_text().splitlines()[2:] if r.startswith("| ")]
    assert [r[-1].rstrip(" |") for r in md] == ["fixed"] * 4 + ["auto"] * 2
    rows = read_csv(tmp_path / "results.csv")
    assert [r["tree"] for r in rows if r["kind"] == "cell"] == ["fixed"] * 4 + ["auto"] * 2
    # tree="auto" sweeps every cell as caps: no separate column.
    assert [t for *_, t in sw.SweepConfig([1], [1, 2], tree="auto", auto_column=True).cells()] == ["auto", "auto"]
    with pytest.raises(RedrafterError, match="fixed or auto"):
        sw.SweepConfig([1], [1], tree="wide").check()


def test_heatmap_table_colours_and_blanks():
    from rich.console import Console

    m = np.array([[0.5, 1.5], [np.nan, 1.0]])
    console = Console(record=True, width=80, color_system="truecolor")
    console.print(report.heatmap_table(m, [1, 2], [2, 3], "speedup", "{:.2f}x", center=1.0))
    text = console.export_text()
    assert "0.50x" in text and "1.50x" in text and "-" in text
    assert "on #ff0040" in report._colour(0.5, 0.5, 1.5, 1.0)  # below 1: red
    assert "on #00ff40" in report._colour(1.5, 0.5, 1.5, 1.0)  # best: green


def test_sweep_metrics_with_accepting_drafter(tmp_path, model):
    """With a drafter that proposes the model's own continuation, the step
    metrics are not trivial and must agree with each other."""
    prompt = random_prompts(1)[0]
    oracle = OracleDrafter(model, prompt, max_tokens=16, length=3)
    # Profiled: the synchronous loop, which packs the beams' shared prefixes.
    cfg = sw.SweepConfig([1, 2], [3], max_tokens=16, baseline_every=4, timings=True)
    results = sw.run_sweep(model, [prompt], oracle, cfg, tmp_path)
    for c in results["cells"]:
        acc = c["acceptance_by_depth"]
        assert c["identical_outputs"] == 1
        assert acc[0] > 0 and all(a >= b for a, b in zip(acc, acc[1:]))  # deeper is rarer
        # Tokens per step = 1 + E[accepted] (less the cut last step).
        assert 1 < c["tokens_per_step"] <= 1 + sum(acc) + 1e-9
    wide = results["cells"][1]
    assert wide["compression"] < 1  # the oracle's beams share prefixes: dedup packs them
    # Unprofiled, the pipelined loop verifies every beam's own nodes.
    cfg = sw.SweepConfig([2], [3], max_tokens=16, baseline_every=4)
    wide = sw.run_sweep(model, [prompt], oracle, cfg, tmp_path / "pipelined")["cells"][0]
    assert wide["compression"] == 1 and wide["identical_outputs"] == 1


def test_sweep_resumes_without_redoing_cells(tmp_path, model, drafter, monkeypatch):
    cfg = sw.SweepConfig([1, 2], [2, 3], max_tokens=6, baseline_every=2)
    ps = random_prompts(2)
    real_save = sw.save_results

    def interrupt_after_first_cell(out_dir, results):
        real_save(out_dir, results)
        if len(results["cells"]) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(sw, "save_results", interrupt_after_first_cell)
    with pytest.raises(KeyboardInterrupt):
        sw.run_sweep(model, ps, drafter, cfg, tmp_path)
    monkeypatch.setattr(sw, "save_results", real_save)
    first = json.loads((tmp_path / "results.json").read_text())
    assert [(c["width"], c["length"]) for c in first["cells"]] == [(1, 2)]

    passes = []
    real_pass = sw.run_pass

    def counting_pass(model, prompts, draft, **k):
        passes.append(None if draft is None else (draft.beam_width, draft.beam_length))
        return real_pass(model, prompts, draft, **k)

    monkeypatch.setattr(sw, "run_pass", counting_pass)
    results = sw.run_sweep(model, ps, drafter, cfg, tmp_path)
    assert [p for p in passes if p] == [(1, 3), (2, 2), (2, 3)]  # only the missing cells
    assert passes[0] is None and passes[-1] is None  # bracketed by baseline passes
    assert results["cells"][0] == first["cells"][0] | {
        k: results["cells"][0][k] for k in ("baseline_seqs", "baseline_tokens_per_s", "speedup", "memory_overhead_gb")
    }
    assert results["cells"][0]["finished_at"] == first["cells"][0]["finished_at"]
    assert len(results["cells"]) == 4 and len(results["baselines"]) == 1 + 3
    seqs = [b["seq"] for b in results["baselines"]] + [c["seq"] for c in results["cells"]]
    assert len(set(seqs)) == len(seqs)  # one timeline across both runs

    passes.clear()  # a finished sweep measures nothing again
    sw.run_sweep(model, ps, drafter, cfg, tmp_path)
    assert passes == []


def test_sweep_refuses_other_settings_unless_fresh(tmp_path, model, drafter):
    ps = random_prompts(1)
    sw.run_sweep(model, ps, drafter, sw.SweepConfig([1], [2], max_tokens=4), tmp_path, {"model": "a"})
    with pytest.raises(RedrafterError, match="max_tokens"):
        sw.run_sweep(model, ps, drafter, sw.SweepConfig([1], [2], max_tokens=5), tmp_path, {"model": "a"})
    with pytest.raises(RedrafterError, match="model"):
        sw.run_sweep(model, ps, drafter, sw.SweepConfig([1], [2], max_tokens=4), tmp_path, {"model": "b"})
    with pytest.raises(RedrafterError, match="prompts_digest"):
        sw.run_sweep(
            model, random_prompts(1, seed=9), drafter, sw.SweepConfig([1], [2], max_tokens=4), tmp_path, {"model": "a"}
        )
    r = sw.run_sweep(model, ps, drafter, sw.SweepConfig([1], [2], max_tokens=5), tmp_path, {"model": "a"}, fresh=True)
    assert r["config"]["max_tokens"] == 5 and len(r["cells"]) == 1
    (tmp_path / "results.json").write_text("{truncated")
    with pytest.raises(RedrafterError, match="Cannot read"):
        sw.run_sweep(model, ps, drafter, sw.SweepConfig([1], [2], max_tokens=5), tmp_path, {"model": "a"})


def test_cells_over_the_memory_budget_are_skipped(tmp_path, model, drafter):
    ps = random_prompts(2)
    small = sw.estimate_cell_bytes(model, drafter, 1, 2, max(map(len, ps)), 6)
    big = sw.estimate_cell_bytes(model, drafter, 4, 5, max(map(len, ps)), 6)
    assert small < big  # the estimate grows with the tree
    limit = (small + big) / 2 / 1e9
    cfg = sw.SweepConfig([1, 4], [2, 5], max_tokens=6, memory_limit_gb=limit)
    results = sw.run_sweep(model, ps, drafter, cfg, tmp_path)
    status = {(c["width"], c["length"]): c for c in results["cells"]}
    assert status[(1, 2)]["status"] == "ok"
    assert status[(4, 5)]["status"] == "skipped" and "GB" in status[(4, 5)]["note"]
    assert status[(4, 5)]["estimated_memory_gb"] > limit
    rows = {(r["width"], r["length"]): r for r in read_csv(tmp_path / "results.csv") if r["kind"] == "cell"}
    assert rows[("4", "5")]["status"] == "skipped" and rows[("4", "5")]["note"]
    drawn = summary.write_outputs(results, tmp_path, cfg)
    assert np.isnan(drawn["speedup"][1, 1]) and np.isfinite(drawn["speedup"][0, 0])


def test_oversized_cell_estimate_counts_kv_tree_and_beams(model, drafter):
    base = sw.estimate_cell_bytes(model, drafter, 1, 1, 10, 10)
    longer = sw.estimate_cell_bytes(model, drafter, 1, 1, 10, 1010)
    assert longer - base == 1000 * sw.kv_bytes_per_token(model)
    # 2 layers x (K + V) x 2 KV heads x 16 dims x 4 bytes
    assert sw.kv_bytes_per_token(model) == 2 * 2 * 2 * 16 * 4


# --------------------------------------------------------------------------- the CLI and tuned profiles


def test_cli_sweep_bad_input_is_one_clear_error(tmp_path, tiny_folder, drafter_folder, capsys):
    base = ["sweep", "--model", str(tiny_folder), "--drafter", str(drafter_folder), "--out", str(tmp_path / "o")]
    cases = [
        (["--widths", "a,b"], "not a whole number"),
        (["--widths", ","], "empty"),
        (["--lengths", "0"], "at least 1"),
        (["--prompts", "no_such_set"], "Unknown prompt set"),
        (["--num-prompts", "0"], "at least 1"),
        (["--max-tokens", "0"], "at least 1"),
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases.append((["--prompts", str(empty)], "No prompts"))
    for extra, words in cases:
        assert cli(base + extra) == 1, extra
        out = capsys.readouterr().err
        assert words in out and "Traceback" not in out, (extra, out)
    # No --drafter and none ships for this model.
    assert cli(["sweep", "--model", str(tiny_folder), "--out", str(tmp_path / "o")]) == 1
    assert "No drafter given" in capsys.readouterr().err


def test_default_model_without_shipped_drafter_is_a_clear_error(monkeypatch, tmp_path):
    import mlx_redrafter.hub.store as store

    monkeypatch.setattr(store, "shipped_root", lambda: tmp_path)  # the package ships none, the store holds none
    with pytest.raises(RedrafterError, match="No drafter given") as e:
        resolve_drafter_path("default", None)
    assert "--drafter" in e.value.fix and "make-drafter --model default" in e.value.fix


def test_cli_sweep_saves_a_profile_that_generate_uses(tmp_path, tiny_folder, prompt_file, capsys, monkeypatch):
    from mlx_redrafter.profiles import lookup_profile

    dfolder = save_bigram_drafter(tmp_path / "drafter")
    out = tmp_path / "sweep"
    args = [
        "sweep",
        "--model",
        str(tiny_folder),
        "--drafter",
        str(dfolder),
        "--widths",
        "1,2",
        "--lengths",
        "2",
        "--prompts",
        str(prompt_file),
        "--num-prompts",
        "2",
        "--max-tokens",
        "6",
        "--out",
        str(out),
        "--save-profile",
    ]
    assert cli(args) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["num_prompts"] == 2 and results["config"]["model"] == str(tiny_folder)
    # Every (W, L) with lookup off and on (the default lookup dimension), and
    # the auto column beside them (caps W x the longest L), each exact.
    grid = [(w, 2, k, t) for t in ("auto", "fixed") for w in (1, 2) for k in (0, 1)]
    assert sorted(cell_key(c) for c in results["cells"]) == sorted(grid)
    assert all(c["identical_outputs"] == 2 for c in results["cells"]) and results["baselines"]
    assert all(c["tokens_per_step"] > 1 for c in results["cells"] if c["tree"] == "fixed")  # drafts accepted
    best = results["best"]
    assert "saved profile" in captured.err and "Speedupoverplain" in squeeze(captured.out)  # tables on stdout
    assert squeeze("auto: the cost-aware selection (--tree auto)") in squeeze(captured.out)

    # Same --out, other settings: refused before the model is loaded.
    import mlx_redrafter.runtime as session

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(session, "load_runtime", no_load)
    assert cli(args[:-4] + ["7", "--out", str(out)]) == 1
    assert "max_tokens" in capsys.readouterr().err
    monkeypatch.undo()

    profile = lookup_profile(str(tiny_folder), dfolder)
    assert (profile["beam_width"], profile["beam_length"], profile["lookup"], profile["tree"]) == cell_key(best)

    gen = ["generate", "--model", str(tiny_folder), "--drafter", str(dfolder), "--prompt", "w1 w2", "-n", "4"]
    assert cli(gen) == 0
    err = squeeze(capsys.readouterr().err)  # rich wraps long lines when not on a terminal
    assert squeeze(f"W={best['width']} L={best['length']} (tuned profile {profile['file']}") in err
    # A profile slower than plain decoding is pointed out (the drafter is still used).
    assert (squeeze("--no-draft is faster here") in err) == (best["speedup"] < 1)
    assert ("+1copyfromthecontext" in err) == (best["lookup"] == 1)
    assert ("copyfromthecontext" not in err) == (best["lookup"] == 0)
    assert cli(gen + ["--no-lookup"]) == 0
    assert "copyfromthecontext" not in squeeze(capsys.readouterr().err)
    assert cli(gen + ["-W", "3", "-L", "1"]) == 0
    assert "W=3L=1(flags)" in squeeze(capsys.readouterr().err)


def test_load_runtime_picks_up_a_saved_profile(tmp_path, tiny_folder, monkeypatch):
    from rich.console import Console

    from mlx_redrafter.config import DEFAULT_LENGTH, DEFAULT_WIDTH
    from mlx_redrafter.profiles import save_profile
    from mlx_redrafter.runtime import load_runtime

    dfolder = save_random_drafter(tmp_path / "d", seed=7)
    s = load_runtime(str(tiny_folder), str(dfolder))
    assert (s.beam_width, s.beam_length, s.shape_origin) == (DEFAULT_WIDTH, DEFAULT_LENGTH, "built-in default")

    # Saved under a relative spelling of the same folder: still found.
    monkeypatch.chdir(tiny_folder.parent)
    path = save_profile(tiny_folder.name, dfolder, 3, 5)
    s = load_runtime(str(tiny_folder), str(dfolder))
    assert (s.beam_width, s.beam_length) == (3, 5)
    assert s.shape_origin == f"tuned profile {path}"
    console = Console(record=True, width=400)
    s.announce(console)
    assert f"W=3 L=5 (tuned profile {path})" in console.export_text()

    s = load_runtime(str(tiny_folder), str(dfolder), beam_width=1)
    assert (s.beam_width, s.beam_length) == (1, 5) and s.shape_origin.startswith("flags + tuned profile")
    s = load_runtime(str(tiny_folder), str(dfolder), beam_width=2, beam_length=2)
    assert (s.beam_width, s.beam_length, s.shape_origin) == (2, 2, "flags")


def test_the_library_uses_a_saved_profile_when_no_shape_is_given(tmp_path, tiny_folder):
    from mlx_redrafter.config import DEFAULT_LENGTH, DEFAULT_WIDTH, library_draft
    from mlx_redrafter.generate import stream_generate
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.profiles import save_profile

    model, tok = load_model(str(tiny_folder))
    dfolder = save_random_drafter(tmp_path / "d", seed=9)
    drafter = load_drafter(dfolder)
    shape = lambda w=None, l=None: (lambda d: (d.beam_width, d.beam_length))(library_draft(model, drafter, w, l))
    assert shape() == (DEFAULT_WIDTH, DEFAULT_LENGTH)
    save_profile(str(tiny_folder), dfolder, 3, 5)
    assert shape() == (3, 5)
    assert shape(w=1) == (1, 5) and shape(2, 2) == (2, 2)  # a given value wins, the other comes from the profile
    depths = {r.stats.depth for r in stream_generate(model, tok, "w5 w6 w7", drafter=drafter, max_tokens=12)}
    assert depths - {0} == {5}  # step 0 (the prompt's token) drafts nothing
    # A drafter built in code has no folder, hence no profile: the built-in shape.
    assert library_draft(model, random_drafter(), None, None).beam_length == DEFAULT_LENGTH


def test_a_profile_from_an_auto_cell_sets_the_tree(tmp_path, tiny_folder):
    """A sweep's best cell may be an auto one: its profile says so, and the
    tree is then the profile's unless one is given."""
    from mlx_redrafter.config import library_draft
    from mlx_redrafter.hub.load import load_drafter
    from mlx_redrafter.keywords import tree_kw
    from mlx_redrafter.llm.load import load_model
    from mlx_redrafter.profiles import save_profile
    from mlx_redrafter.runtime import load_runtime

    model, _ = load_model(str(tiny_folder))
    dfolder = save_random_drafter(tmp_path / "d", seed=11)
    drafter = load_drafter(dfolder)
    tree = lambda given=None: library_draft(model, drafter, None, None, **tree_kw(given, model)).tree
    assert tree() == "fixed"  # a float model's default
    save_profile(str(tiny_folder), dfolder, 2, 3, tree="auto")
    assert tree() == "auto" and tree("fixed") == "fixed"
    assert load_runtime(str(tiny_folder), str(dfolder)).draft.tree == "auto"
    assert load_runtime(str(tiny_folder), str(dfolder), tree="fixed").draft.tree == "fixed"


def test_a_profile_slower_than_plain_decoding_is_announced(tmp_path, tiny_folder):
    from rich.console import Console

    from mlx_redrafter.profiles import save_profile
    from mlx_redrafter.runtime import load_runtime

    dfolder = save_random_drafter(tmp_path / "d", seed=8)
    save_profile(str(tiny_folder), dfolder, 2, 3, speedup=0.8)
    s = load_runtime(str(tiny_folder), str(dfolder))
    # The drafter is still used (only --no-draft turns it off), and the user is told.
    assert s.drafter is not None and (s.beam_width, s.beam_length) == (2, 3)
    console = Console(record=True, width=400)
    s.announce(console)
    assert (
        "tuned profile measured ReDrafter at 0.80x of plain decoding; --no-draft is faster here"
        in console.export_text()
    )
    save_profile(str(tiny_folder), dfolder, 2, 3, speedup=1.2)
    assert load_runtime(str(tiny_folder), str(dfolder)).note is None
    assert load_runtime(str(tiny_folder), no_draft=True).drafter is None


# --------------------------------------------------------------------------- bench/run.py


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("drafting", ["drafter", "merged", "lookup_only"])
def test_bench_quick_run_writes_report_and_spec_bench_answers(
    tmp_path, tiny_folder, drafter_folder, prompt_file, capsys, drafting
):
    bench = load_bench()
    out = tmp_path / "bench"
    how = {
        "drafter": ["--drafter", str(drafter_folder), "--no-lookup"],
        "merged": ["--drafter", str(drafter_folder), "--lookup"],
        "lookup_only": ["--drafter", "none", "--lookup"],
    }[drafting]
    rc = bench.main(
        [
            "--quick",
            "--model",
            str(tiny_folder),
            *how,
            "-W",
            "2",
            "-L",
            "2",
            "--sets",
            str(prompt_file),
            "--max-tokens",
            "5",
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["lookup"] == (drafting != "drafter")
    s = results["sets"]["prompts"]
    assert list(s["by_category"]) == ["alpha", "beta"]  # --quick: one conversation per category
    assert s["by_category"]["alpha"]["redrafter"]["turns"] == 2  # both turns of question 1
    for v in list(s["by_category"].values()) + [s["overall"]]:
        for mode in ("baseline", "redrafter"):
            m = v[mode]
            assert m["tokens_per_s"] > 0 and m["latency_p50_s"] <= m["latency_p95_s"] <= m["latency_p99_s"]
            assert m["ttft_p50_s"] > 0 and m["peak_memory_gb"] > 0
        assert v["speedup"] > 0 and v["redrafter"]["tokens_per_step"] >= 1
        assert v["redrafter"]["tokens_per_step"] > 1 or drafting == "lookup_only"  # the bigram drafter: accepted
        assert v["baseline"]["tokens_per_step"] == 1

    answers = {}
    for mode in ("baseline", "redrafter"):
        lines = (out / "answers" / "prompts" / f"{mode}.jsonl").read_text().splitlines()
        answers[mode] = [json.loads(line) for line in lines]
        assert [a["question_id"] for a in answers[mode]] == [1, 2]
        for a in answers[mode]:
            ch = a["choices"][0]
            assert {"turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"} <= set(ch)
            assert len(ch["turns"]) == len(ch["new_tokens"]) == len(ch["wall_time"]) == len(ch["decoding_steps"])
            # Each turn's first token comes from the prefill; the steps emit the rest.
            assert sum(ch["accept_lengths"]) == sum(ch["new_tokens"]) - len(ch["turns"])
    for b, r in zip(answers["baseline"], answers["redrafter"]):
        assert b["choices"][0]["turns"] == r["choices"][0]["turns"]  # greedy: the same text

    report = (out / "report.md").read_text()
    assert "| alpha |" in report and "| beta |" in report and "**overall**" in report
    assert "python bench/run.py --quick" in report and "p99" in report


def test_bench_rejects_bad_input(tmp_path, capsys):
    bench = load_bench()
    assert bench.main(["--sets", "no_such_set", "--out", str(tmp_path)]) == 1
    assert "Unknown prompt set" in capsys.readouterr().err
    assert bench.main(["--drafter", "none", "--out", str(tmp_path)]) == 1
    assert "--lookup" in capsys.readouterr().err
    assert bench.main(["--max-tokens", "0", "--out", str(tmp_path)]) == 1


def test_cli_lookup_flags(tiny_folder, capsys):
    """--drafter none --lookup drafts by lookup alone (same text as plain
    decoding); --no-draft --lookup contradict each other."""
    gen = ["generate", "--model", str(tiny_folder), "--prompt", "w1 w2 w3 w1 w2 w3 w1", "-n", "12", "--raw"]
    assert cli(gen + ["--no-draft"]) == 0
    plain = capsys.readouterr()
    assert "plaindecoding(--no-draft)" in squeeze(plain.err)
    assert cli(gen + ["--drafter", "none", "--lookup"]) == 0
    looked = capsys.readouterr()
    assert (
        "drafting:1copyfromthecontext" in squeeze(looked.err)
        and "(nodrafter)" in squeeze(looked.err)
        and looked.out == plain.out
        and drafted_share(looked.err) > 0  # the same text, with copies accepted
    )
    assert cli(gen + ["--drafter", "none"]) == 0
    assert "plaindecoding(--drafternone)" in squeeze(capsys.readouterr().err)
    assert cli(gen + ["--no-draft", "--lookup"]) == 1
    assert "--drafter none --lookup" in capsys.readouterr().err


def test_lookup_bench_runs_every_mode_exactly(tmp_path, tiny_folder, drafter_folder, capsys):
    spec = importlib.util.spec_from_file_location("bench_lookup", REPO / "bench" / "lookup.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "lookup"
    rc = bench.main(
        [
            "--model",
            str(tiny_folder),
            "--drafter",
            str(drafter_folder),
            "--mt-bench",
            "1",
            "--per-task",
            "1",
            "--copy",
            "1",
            "--max-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    # The tiny model's 512-token context leaves out the long Spec-Bench prompts.
    assert list(results["groups"])[0] == "mt_bench" and list(results["groups"])[-2:] == ["copy", "all"]
    assert len(results["groups"]) - 1 + results["dropped_prompts"] == 2 + len(bench.SPEC_TASKS)
    for group in results["groups"].values():
        assert set(group) == set(bench.MODES)
        assert all(row["mismatches"] == 0 and row["tokens_per_step"] >= 1 for row in group.values())
    drafted = [row for mode, row in results["groups"]["all"].items() if mode not in ("plain", "lookup")]
    assert all(row["tokens_per_step"] > 1 for row in drafted)  # the bigram drafter's drafts: accepted
    assert "| copy | 1 |" in (out / "report.md").read_text()
