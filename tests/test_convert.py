"""`convert` and `inspect`: PyTorch-trained drafters into MLX, checked against
the official fixtures; the safe unpickler; the conversion checks; step costs."""

import json
import os
import pickle
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_redrafter.converters.drafter import convert_drafter, inspect_drafter
from torch_format import BF16, write_legacy, write_zip

from mlx_redrafter import RedrafterError
from mlx_redrafter.draft.beam import beam_search, warp_logits
from mlx_redrafter.draft.redrafter import Drafter, DrafterConfig
from mlx_redrafter.hub.load import load_drafter
from mlx_redrafter.tuning.cost import decode_step_cost, draft_step_cost

FIXTURES = ["drafter_rnn", "drafter_norn", "drafter_rnn_bin", "drafter_rnn_bf16", "drafter_rnn_distilled"]
# The official file each fixture's conversion must reproduce (key names, shapes).
OFFICIAL_FILE = {name: name for name in FIXTURES} | {"drafter_rnn_bin": "drafter_rnn"}
# The float32 reference logits (reference.npz tf_*) each fixture must match.
REF_KIND = {"drafter_rnn": "rnn", "drafter_norn": "norn", "drafter_rnn_bin": "rnn", "drafter_rnn_bf16": "rnn"}
SOURCE_DTYPE = {name: "float32" for name in FIXTURES} | {"drafter_rnn_bf16": "bfloat16"}
DTYPES = ["float32", "float16", "bfloat16"]
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def logit_tolerance(dtypes, max_logit):
    """Absolute tolerance on logits for weights rounded to each of ``dtypes`` in turn.

    Rounding a weight to p significant bits moves it by at most u|w| (unit
    roundoff u = 2^-11 for float16, 2^-8 for bfloat16). A logit z is reached
    through about four weight matrices (rnn_w and rnn_u in the recurrence, the
    ResBlocks, the head); each adds a first-order error of at most
    u (|W| |x|)_i, which for these layers (little cancellation) is of order
    u max|z|. We allow 4 u max|z| per rounding (max|z| is about 23 here:
    0.045 for float16, 0.36 for bfloat16); observed: 0.013 (float16) and
    0.071 (bfloat16), about 1 u max|z|. A wrong bit layout (bfloat16 read as
    float16, a byte-order mix-up) or swapped tensors give errors of order
    max|z| and fail. Computation stays float32 (load_drafter's CPU dtype), so
    float32 summation order (~1e-6) is negligible next to these.
    """
    return 4 * sum(UNIT_ROUNDOFF[d] for d in dtypes if d != "float32") * max_logit


def safetensors_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def official_arrays(fixtures_dir, name):
    """The fixture's tensors as float32 numpy (bfloat16 widened exactly)."""
    return {
        k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(fixtures_dir / name / "model.safetensors")).items()
    }


def beam_logprob(drafter, embed, context, g0, tokens):
    """A beam's score under the official warped log-softmax (teacher-forced), and
    the largest |logit| on the way."""
    tokens = [int(t) for t in tokens]
    logits = drafter(mx.array(context), embed(mx.array([int(g0), *tokens[:-1]])))  # [L, V]
    warped = warp_logits(logits)
    lp = warped - mx.logsumexp(warped, axis=-1, keepdims=True)
    score = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1).sum()
    return score.item(), mx.abs(logits).max().item()


def config_only(fixtures_dir, tmp_path):
    """A source folder holding drafter_rnn's config.json, for weights written by a test."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(fixtures_dir / "drafter_rnn" / "config.json", src / "config.json")
    return src


def copy_fixture(fixtures_dir, tmp_path, name="drafter_rnn", config=None, edit=None):
    """A damaged copy of a fixture: ``config`` updates config.json, ``edit(arrays)``
    returns the tensors to save (float32 numpy)."""
    dst = tmp_path / f"src_{name}"
    shutil.copytree(fixtures_dir / name, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit:
        arrays = edit(official_arrays(fixtures_dir, name))
        mx.save_safetensors(
            str(dst / "model.safetensors"), {k: mx.array(v) for k, v in arrays.items()}, {"format": "pt"}
        )
    return dst


# --------------------------------------------------------------------------- the official fixtures


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FIXTURES)
def test_converted_fixture_matches_official_logits_and_beams(fixtures_dir, tmp_path, ref, embed, name, dtype):
    out = tmp_path / "out"
    report = convert_drafter(fixtures_dir / name, out, dtype=dtype)
    assert {v["dtype"] for k, v in safetensors_header(out / "model.safetensors").items() if k != "__metadata__"} == {
        {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    }
    assert report.dtype == dtype and report.source_dtypes == [SOURCE_DTYPE[name]]
    d = load_drafter(out)  # float32 on the CPU: only the weights are rounded

    kind = REF_KIND.get(name)
    if kind is not None:
        logits = np.array(d(mx.array(ref["ctx_c"]), embed(mx.array(ref["tf_tokens"]))))
        want = ref[f"tf_{kind}_logits_raw"]
        # drafter_rnn_bf16 holds drafter_rnn rounded to bfloat16: it matches the float32
        # reference within the bfloat16 tolerance only, whatever the output dtype.
        roundings = [SOURCE_DTYPE[name], dtype]
        if roundings == ["float32", "float32"]:
            np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        else:
            np.testing.assert_allclose(logits, want, rtol=0, atol=logit_tolerance(roundings, np.abs(want).max()))
        # Official beam search: beam_length=4 counts g0, so our length is 3.
        for width in (1, 2, 4):
            for row in range(3):
                b = beam_search(
                    d, embed, mx.array(ref["ctx_c"][row]), mx.array(ref["bs_init"][row]), width, 3, warp=True
                )
                np.testing.assert_array_equal(np.array(b.tokens), ref[f"bs_{kind}_w{width}_beams"][row][:, 1:])
    else:  # the distilled drafter: the beams its official generation drafted at every step
        d32 = load_drafter(fixtures_dir / name)  # the official float32 weights, as they are
        for p in (0, 1):
            ctx = ref[f"gen_distilled_w2_l4_p{p}_step_context"]
            g0 = ref[f"gen_distilled_w2_l4_p{p}_step_init_token"]
            beams = ref[f"gen_distilled_w2_l4_p{p}_step_beams"]
            for s in range(len(g0)):
                b = beam_search(d, embed, mx.array(ctx[s]), mx.array(g0[s]), 2, 3, warp=True)
                ours, official = np.array(b.tokens), beams[s][:, 1:]
                if dtype != "bfloat16":
                    np.testing.assert_array_equal(ours, official)
                    continue
                # At one step (p0, step 12) the official float32 drafter's second beam beats
                # the next candidate by only 0.045 in score, less than bfloat16 rounding
                # moves scores, and the bfloat16 conversion swaps them. So a differing beam
                # must be a near-tie of the official float32 drafter: its score and the
                # official beam's differ by less than the bfloat16 bound on a score
                # (3 steps x 2 logits x the logit tolerance). Every other beam is exact.
                for w in np.flatnonzero((ours != official).any(-1)):
                    s_off, z = beam_logprob(d32, embed, ctx[s], g0[s], official[w])
                    s_ours, _ = beam_logprob(d32, embed, ctx[s], g0[s], ours[w])
                    assert abs(s_off - s_ours) <= 6 * logit_tolerance(["bfloat16"], z), (p, s, w)


@pytest.mark.parametrize("name", FIXTURES)
def test_converted_drafter_keeps_the_official_layout(fixtures_dir, tmp_path, name):
    """Export direction: the official PyTorch code could load what we write."""
    out = tmp_path / "out"
    convert_drafter(fixtures_dir / name, out, dtype="float32")
    ours, official = (
        safetensors_header(out / "model.safetensors"),
        safetensors_header(fixtures_dir / OFFICIAL_FILE[name] / "model.safetensors"),
    )
    assert ours.pop("__metadata__") == {"format": "pt"}  # what transformers' from_pretrained expects
    official.pop("__metadata__", None)
    assert {k: v["shape"] for k, v in ours.items()} == {k: v["shape"] for k, v in official.items()}
    # float32 output is bit-exact (bfloat16 sources widen exactly).
    saved = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}
    for k, v in official_arrays(fixtures_dir, OFFICIAL_FILE[name]).items():
        np.testing.assert_array_equal(saved[k], v)
    cfg_ours = json.loads((out / "config.json").read_text())
    cfg_official = json.loads((fixtures_dir / name / "config.json").read_text())
    for k in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "exit_dim",
        "num_draft_layers",
        "rnn",
        "num_lookback_tokens",
        "architectures",
    ):
        assert cfg_ours[k] == cfg_official[k], k
    assert cfg_ours["torch_dtype"] == "float32"


def test_rounding_is_to_nearest_and_reported(fixtures_dir, tmp_path):
    src = official_arrays(fixtures_dir, "drafter_rnn")
    # bfloat16: MLX's cast equals torch's (the official bfloat16 file), bit for bit.
    r = convert_drafter(fixtures_dir / "drafter_rnn", tmp_path / "bf16", dtype="bfloat16")
    ours = mx.load(str(tmp_path / "bf16" / "model.safetensors"))
    theirs = mx.load(str(fixtures_dir / "drafter_rnn_bf16" / "model.safetensors"))
    for k in theirs:
        assert ours[k].dtype == mx.bfloat16
        np.testing.assert_array_equal(np.array(ours[k].view(mx.uint16)), np.array(theirs[k].view(mx.uint16)))
    assert 0 < r.max_rel_error <= UNIT_ROUNDOFF["bfloat16"]  # bfloat16 has float32's range: no subnormal loss
    # float16: equals numpy's round-to-nearest-even; the report is the true maximum change.
    r = convert_drafter(fixtures_dir / "drafter_rnn", tmp_path / "f16", dtype="float16")
    ours = mx.load(str(tmp_path / "f16" / "model.safetensors"))
    errs = []
    for k, x in src.items():
        want = x.astype(np.float16)
        np.testing.assert_array_equal(np.array(ours[k]), want)
        errs.append(np.abs(want.astype(np.float64) - x).max())
    assert r.max_abs_error == pytest.approx(max(errs), rel=1e-12)
    r32 = convert_drafter(fixtures_dir / "drafter_rnn", tmp_path / "f32", dtype="float32")
    assert r32.max_abs_error == 0 and r32.max_rel_error == 0


# --------------------------------------------------------------------------- PyTorch files


def _bf16_bits(fixtures_dir):
    return {
        k: np.array(v.view(mx.uint16))
        for k, v in mx.load(str(fixtures_dir / "drafter_rnn_bf16" / "model.safetensors")).items()
    }


def _write_shards(folder, arrays, kind):
    keys = sorted(arrays)
    parts = {f"model-0000{i + 1}-of-00002.{kind}": keys[i::2] for i in range(2)}
    for fname, ks in parts.items():
        if kind == "safetensors":
            mx.save_safetensors(str(folder / fname), {k: mx.array(arrays[k]) for k in ks}, {"format": "pt"})
        else:
            write_zip(folder / fname, {k: arrays[k] for k in ks})
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    weight_map = {k: fname for fname, ks in parts.items() for k in ks}
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "layout", ["zip-float16", "zip-bfloat16", "legacy-float32", "shards-safetensors", "shards-bin"]
)
def test_pytorch_layouts_convert_exactly(fixtures_dir, tmp_path, layout):
    src = config_only(fixtures_dir, tmp_path)
    f32 = official_arrays(fixtures_dir, "drafter_rnn")
    if layout == "zip-float16":
        write_zip(src / "pytorch_model.bin", {k: v.astype(np.float16) for k, v in f32.items()})
        want, source_dtype = {k: v.astype(np.float16).astype(np.float32) for k, v in f32.items()}, "float16"
    elif layout == "zip-bfloat16":  # the official bfloat16 weights, in a BFloat16Storage
        write_zip(src / "pytorch_model.bin", {k: BF16(v) for k, v in _bf16_bits(fixtures_dir).items()})
        want, source_dtype = official_arrays(fixtures_dir, "drafter_rnn_bf16"), "bfloat16"
    elif layout == "legacy-float32":
        write_legacy(src / "pytorch_model.bin", f32)
        want, source_dtype = f32, "float32"
    else:
        _write_shards(src, f32, layout.split("-")[1])
        want, source_dtype = f32, "float32"
    report = convert_drafter(src, tmp_path / "out", dtype="float32")
    assert report.source_dtypes == [source_dtype]
    assert report.format.endswith("2 shards") == layout.startswith("shards")
    saved = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(np.array(saved[k]), v)
    load_drafter(tmp_path / "out")


class RunsCommand:
    """Unpickling this object runs a shell command (it is what a hostile checkpoint holds)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Evaluates:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "nested"])
def test_hostile_pickle_is_refused_and_nothing_runs(fixtures_dir, tmp_path, container, payload):
    def hostile(marker):
        """A pickle that creates ``marker`` when unpickled, and the global it calls."""
        system = f"{os.system.__module__}.system"  # posix.system on Linux and macOS
        if payload == "os.system":
            return pickle.dumps(RunsCommand(f"touch {marker}"), protocol=2), system
        if payload == "builtins.eval":
            return pickle.dumps(Evaluates(f"open({str(marker)!r}, 'w')"), protocol=2), "builtins.eval"
        # a plausible state dict with one extra entry
        obj = {"lm_head.0.linear.bias": [0.0] * 4, "hook": RunsCommand(f"touch {marker}")}
        return pickle.dumps(obj, protocol=2), system

    # The payload is live: an ordinary unpickler runs it.
    control = tmp_path / "control"
    pickle.loads(hostile(control)[0])
    assert control.exists()

    marker = tmp_path / "pwned"
    data, name = hostile(marker)
    src = config_only(fixtures_dir, tmp_path)
    (write_zip if container == "zip" else write_legacy)(src / "pytorch_model.bin", {}, data_pkl=data)
    with pytest.raises(RedrafterError) as e:
        convert_drafter(src, tmp_path / "out")
    assert f"`{name}`" in e.value.problem and "nothing in it was run" in e.value.problem
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_pickle_that_is_not_a_state_dict(fixtures_dir, tmp_path):
    src = config_only(fixtures_dir, tmp_path)
    write_zip(src / "pytorch_model.bin", {}, data_pkl=pickle.dumps({"state_dict": {"a": 1}}, protocol=2))
    with pytest.raises(RedrafterError, match="does not hold a state dict of tensors.*state_dict"):
        convert_drafter(src, tmp_path / "out")


@pytest.mark.parametrize("name, file", [("drafter_rnn_bin", "pytorch_model.bin"), ("drafter_rnn", "model.safetensors")])
def test_truncated_weights_are_refused(fixtures_dir, tmp_path, name, file):
    src = copy_fixture(fixtures_dir, tmp_path, name)
    data = (src / file).read_bytes()
    (src / file).write_bytes(data[: len(data) // 2])
    with pytest.raises(RedrafterError, match="truncated or corrupt"):
        convert_drafter(src, tmp_path / "out")


def test_tensor_larger_than_its_storage_is_refused(fixtures_dir, tmp_path):
    """A crafted size must not make the reader look past the storage's bytes."""
    src = config_only(fixtures_dir, tmp_path)
    f32 = official_arrays(fixtures_dir, "drafter_rnn")
    write_zip(src / "pytorch_model.bin", f32, shapes={"rnn_u.bias": (64, 64)})
    with pytest.raises(RedrafterError, match="tensor rnn_u.bias does not fit in its storage"):
        convert_drafter(src, tmp_path / "out")


# --------------------------------------------------------------------------- checks on damaged copies


def test_missing_and_unknown_keys_are_listed(fixtures_dir, tmp_path):
    def edit(a):
        a["rnn_v.weight"] = a.pop("rnn_w.weight")
        del a["lm_head.1.linear.bias"]
        return a

    src = copy_fixture(fixtures_dir, tmp_path, edit=edit)
    with pytest.raises(RedrafterError) as e:
        convert_drafter(src, tmp_path / "out")
    assert "missing keys: lm_head.1.linear.bias, rnn_w.weight" in e.value.problem
    assert "unknown keys: rnn_v.weight" in e.value.problem and e.value.fix
    assert not (tmp_path / "out").exists()


def test_config_that_contradicts_the_shapes(fixtures_dir, tmp_path):
    src = copy_fixture(fixtures_dir, tmp_path, config={"vocab_size": 300})
    with pytest.raises(
        RedrafterError, match=r"lm_head\.2\.weight has shape \(257, 128\) but config\.json implies \(300, 128\)"
    ):
        convert_drafter(src, tmp_path / "out")
    # A flag that adds or removes layers shows up as keys.
    src = copy_fixture(fixtures_dir, tmp_path / "b", config={"rnn": False})
    with pytest.raises(RedrafterError, match="unknown keys: rnn_u.bias, rnn_u.weight, rnn_w.weight"):
        convert_drafter(src, tmp_path / "out")


@pytest.mark.parametrize("bad, label", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_non_finite_weight_is_named(fixtures_dir, tmp_path, bad, label):
    def edit(a):
        a["lm_head.1.linear.bias"][7] = bad
        return a

    src = copy_fixture(fixtures_dir, tmp_path, edit=edit)
    with pytest.raises(RedrafterError, match=f"lm_head.1.linear.bias .* contains {label}"):
        convert_drafter(src, tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()


def test_overflow_in_the_target_dtype_is_named(fixtures_dir, tmp_path):
    def edit(a):
        a["rnn_w.weight"][0, 0] = 1e5  # above float16's 65504
        return a

    src = copy_fixture(fixtures_dir, tmp_path, edit=edit)
    with pytest.raises(RedrafterError, match="rnn_w.weight overflows float16") as e:
        convert_drafter(src, tmp_path / "out", dtype="float16")
    assert "--dtype float32" in e.value.fix
    convert_drafter(src, tmp_path / "out", dtype="bfloat16")


def _shrunk(fixtures_dir, config_update):
    """An edit that slices every tensor to the shapes of the updated config."""
    base = json.loads((fixtures_dir / "drafter_rnn" / "config.json").read_text())
    expected = dict(tree_flatten(Drafter(DrafterConfig.from_dict({**base, **config_update})).parameters()))

    def edit(a):
        return {k: v[tuple(slice(0, n) for n in expected[k].shape)] for k, v in a.items()}

    return edit


@pytest.mark.parametrize(
    "update, message",
    [
        ({"vocab_size": 256}, "vocab_size is 256 but the model's embedding has 257 rows"),
        ({"hidden_size": 32, "exit_dim": 64}, "hidden_size is 32 but the model's is 64"),
    ],
)
def test_drafter_that_does_not_fit_the_model(fixtures_dir, tmp_path, update, message):
    src = copy_fixture(fixtures_dir, tmp_path, config=update, edit=_shrunk(fixtures_dir, update))
    with pytest.raises(RedrafterError, match=message):
        convert_drafter(src, tmp_path / "out", model=str(fixtures_dir / "llm"))
    assert not (tmp_path / "out").exists()
    convert_drafter(src, tmp_path / "out")  # a valid drafter, just for another LLM


def test_drafter_that_fits_the_model(fixtures_dir, tmp_path):
    convert_drafter(fixtures_dir / "drafter_rnn_bin", tmp_path / "out", model=str(fixtures_dir / "llm"))
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_source_and_destination_errors(fixtures_dir, tmp_path):
    with pytest.raises(RedrafterError, match="does not exist"):
        convert_drafter(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RedrafterError, match="No config.json"):
        convert_drafter(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(RedrafterError, match="not a ReDrafter drafter"):
        convert_drafter(fixtures_dir / "llm", tmp_path / "out")
    src = copy_fixture(fixtures_dir, tmp_path)
    (src / "model.safetensors").unlink()
    with pytest.raises(RedrafterError, match="No drafter weights"):
        convert_drafter(src, tmp_path / "out")
    with pytest.raises(RedrafterError, match="Unknown dtype"):
        convert_drafter(fixtures_dir / "drafter_rnn", tmp_path / "out", dtype="int8")
    # The output folder: never the source, never a folder with other files; a previous drafter is replaced.
    src = copy_fixture(fixtures_dir, tmp_path / "b")
    with pytest.raises(RedrafterError, match="is the source folder"):
        convert_drafter(src, src)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(RedrafterError, match="holds other files"):
        convert_drafter(src, busy)
    assert (busy / "notes.txt").read_text() == "keep me"
    convert_drafter(src, tmp_path / "out", dtype="float32")
    convert_drafter(src, tmp_path / "out", dtype="bfloat16")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []  # no temporary left


def test_weights_file_as_source(fixtures_dir, tmp_path):
    r = convert_drafter(fixtures_dir / "drafter_rnn_bin" / "pytorch_model.bin", tmp_path / "out")
    assert r.format == "pytorch pickle" and r.dtype == "float16"


def test_hub_repo_offline(fixtures_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(RedrafterError, match="Drafter 'someone/redrafter-tiny' is not in the Hugging Face cache"):
        convert_drafter("someone/redrafter-tiny", tmp_path / "out")
    # The same repo, cached (as `hf download` leaves it): converts without the network.
    repo = cache / "models--someone--redrafter-tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(fixtures_dir / "drafter_rnn_bin", repo / "snapshots" / commit)
    r = convert_drafter("someone/redrafter-tiny", tmp_path / "out", dtype="float32")
    assert r.format == "pytorch pickle"
    np.testing.assert_array_equal(
        np.array(mx.load(str(tmp_path / "out" / "model.safetensors"))["rnn_w.weight"]),
        official_arrays(fixtures_dir, "drafter_rnn")["rnn_w.weight"],
    )


# --------------------------------------------------------------------------- cost and inspect


@pytest.mark.parametrize(
    "cfg",
    [
        dict(vocab_size=257, hidden_size=64),  # the fixtures' shape
        dict(vocab_size=257, hidden_size=64, exit_dim=128, num_draft_layers=1, rnn=False),
        dict(vocab_size=300, hidden_size=48, exit_dim=40, num_draft_layers=3),  # with input_proj
        dict(vocab_size=300, hidden_size=48, exit_dim=40, draft_vocab_size=64),  # reduced head
    ],
)
def test_draft_step_cost(cfg):
    config = DrafterConfig(**cfg)
    h, e, n, v = config.hidden_size, config.exit_dim, config.num_draft_layers, config.head_size
    c = draft_step_cost(config, itemsize=2)
    assert c.macs == (2 * h * h if config.rnn else 0) + (2 * h * e if e != 2 * h else 0) + n * e * e + e * v
    assert c.flops == 2 * c.macs
    # Every parameter of the drafter is read once per step (and nothing else).
    assert c.bytes == 2 * Drafter(config).num_params()


def test_draft_step_cost_of_the_default_head():
    """SmolLM2-135M's default head (h=576, V=49152, E=1152, n=2) has 59.9M
    parameters (docs/tuning.md, 'Measured facts the code is built on')."""
    c = draft_step_cost(DrafterConfig(vocab_size=49152, hidden_size=576), itemsize=4)
    assert c.bytes // 4 == 59_943_744
    assert c.macs == 2 * 576**2 + 2 * 1152**2 + 1152 * 49152


def test_decode_step_cost():
    from helpers import tiny_model
    from mlx_lm.utils import get_total_parameters

    untied = tiny_model("llama")  # h=64, V=97, 2 layers, 4 heads of 16, 2 kv heads, mlp 128
    h, v = 64, 97
    per_layer = h * h + 2 * (32 * h) + h * h + 3 * 128 * h + 2 * h
    c = decode_step_cost(untied)
    assert c.macs == 2 * per_layer + h + v * h == get_total_parameters(untied) - v * h
    assert c.bytes == 4 * c.macs  # float32
    tied = tiny_model("qwen3")
    assert "lm_head" not in tied and decode_step_cost(tied).macs == get_total_parameters(tied)
    # Quantized: the same logical MACs, fewer bytes.
    nn.quantize(untied, group_size=32, bits=4)
    q = decode_step_cost(untied)
    assert q.macs == c.macs and q.bytes < c.bytes / 4


@pytest.mark.parametrize("name", ["drafter_rnn", "drafter_rnn_bin", "drafter_rnn_bf16", "drafter_norn"])
def test_inspect_drafter(fixtures_dir, name):
    info = inspect_drafter(fixtures_dir / name)
    h, e, v = 64, 128, 257
    n_params = 2 * (e * e + e) + e * v + 2 * h * h + h if "norn" not in name else (e * e + e) + e * v
    assert info.num_params == n_params
    weights = fixtures_dir / name / ("pytorch_model.bin" if name.endswith("bin") else "model.safetensors")
    assert info.size_bytes == weights.stat().st_size
    assert info.dtypes == [SOURCE_DTYPE[name]]
    text = "\n".join(info.lines())
    assert f"{n_params:,}" in text and SOURCE_DTYPE[name] in text and info.draft is None


def test_inspect_with_model(fixtures_dir):
    info = inspect_drafter(fixtures_dir / "drafter_rnn", model=str(fixtures_dir / "llm"))
    # Shapes from reference.md: drafter h=64, E=128, n=2, V=257, rnn; LLM 2 layers of
    # q,o 64x64, k,v 32x64, mlp 3x128x64, 2 norms of 64, a final norm, lm_head 257x64.
    draft_macs = 2 * 64 * 64 + 2 * 128 * 128 + 128 * 257
    llm_macs = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64 + 2 * 64) + 64 + 257 * 64
    assert info.draft.macs == draft_macs and info.decode.macs == llm_macs
    assert info.model_dtype == "float32" and info.decode.bytes == 4 * llm_macs
    assert info.draft.bytes == 4 * info.num_params
    text = "\n".join(info.lines())
    assert f"{draft_macs / llm_macs:.3f}x FLOPs" in text


def test_inspect_with_a_model_it_does_not_fit(fixtures_dir, tmp_path):
    update = {"vocab_size": 256}
    src = copy_fixture(fixtures_dir, tmp_path, config=update, edit=_shrunk(fixtures_dir, update))
    assert inspect_drafter(src).num_params < inspect_drafter(fixtures_dir / "drafter_rnn").num_params
    with pytest.raises(RedrafterError, match="vocab_size is 256 but the model's embedding has 257 rows"):
        inspect_drafter(src, model=str(fixtures_dir / "llm"))


# --------------------------------------------------------------------------- CLI


def run_cli(*args) -> int:
    """``mlx-redrafter ARGS`` in this process; the exit status."""
    from helpers import cli

    return cli(list(args))


def test_cli_convert_and_inspect(fixtures_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        run_cli(
            "convert",
            str(fixtures_dir / "drafter_rnn_bin"),
            str(out),
            "--dtype",
            "bfloat16",
            "--model",
            str(fixtures_dir / "llm"),
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "max abs" in printed and "max relative" in printed and "bfloat16" in printed
    assert load_drafter(out).config.vocab_size == 257
    assert run_cli("inspect", str(out), "--model", str(fixtures_dir / "llm")) == 0
    printed = capsys.readouterr().out
    for word in ("vocab_size=257", "parameters:", "size on disk:", "dtype:        bfloat16", "MFLOPs", "ratio:"):
        assert word in printed

    hostile = config_only(fixtures_dir, tmp_path)
    write_zip(
        hostile / "pytorch_model.bin", {}, data_pkl=pickle.dumps(RunsCommand(f"touch {tmp_path / 'pwned'}"), protocol=2)
    )
    assert run_cli("convert", str(hostile), str(tmp_path / "out2")) == 1
    captured = capsys.readouterr()
    assert "Error:" in captured.err and "system" in captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "pwned").exists()
