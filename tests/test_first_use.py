"""What a new user meets first: the slow-BLAS warning at start, the shipped
drafter from Python, API errors that name no CLI flag, unknown routes, and a
chat whose Ctrl-C keeps the KV cache (issue 26)."""

from __future__ import annotations

import mlx.core as mx

from mlx_redrafter.doctor import BLIS_PATH, BlasInfo, slow_blas_warning


def test_slow_blas_warning_names_the_fix_on_the_cpu():
    bundled = BlasInfo("bundled reference BLAS (netlib)", "/x/mlx_cpu.libs/libblas.so", True)
    line = slow_blas_warning(bundled, device=mx.cpu, installed="")  # BLIS not on disk
    assert line and "\n" not in line
    assert "bundled reference BLAS" in line and "libblis4-pthread" in line and BLIS_PATH in line


def test_installed_blis_is_preloaded_not_installed_again(monkeypatch, capsys):
    """With BLIS on disk but not preloaded, the warning and `doctor` say to
    preload the library found, never to apt-get install it (they did).
    Caught: blis_fix() and the warning ignoring installed_blis()."""
    from helpers import cli

    import mlx_redrafter.doctor as doctor

    arm = "/usr/lib/aarch64-linux-gnu/blis-pthread/libblas.so.3"  # found, whatever the architecture
    bundled = BlasInfo("bundled reference BLAS (netlib)", "/x/mlx_cpu.libs/libblas.so", True)
    line = slow_blas_warning(bundled, device=mx.cpu, installed=arm)
    assert f"BLIS is installed: run with LD_PRELOAD={arm}" in line and "apt-get" not in line
    assert "apt-get install libblis4-pthread" in slow_blas_warning(bundled, device=mx.cpu, installed="")
    assert doctor.blis_fix(arm) == [f"export LD_PRELOAD={arm}"]
    assert doctor.blis_fix("") == ["sudo apt-get install libblis4-pthread", f"export LD_PRELOAD={BLIS_PATH}"]
    monkeypatch.setattr(doctor, "blas_info", lambda: bundled)
    monkeypatch.setattr(doctor, "installed_blis", lambda: arm)
    assert cli(["doctor"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"BLIS is installed here ({arm}): preload it: export LD_PRELOAD={arm}" in err and "apt-get" not in err


def test_no_blas_warning_with_blis_or_on_a_gpu():
    assert slow_blas_warning(BlasInfo("BLIS", BLIS_PATH, False), device=mx.cpu) is None
    bundled = BlasInfo("bundled reference BLAS (netlib)", "/x/libblas.so", True)
    assert slow_blas_warning(bundled, device=mx.gpu) is None


def test_load_drafter_default_loads_the_shipped_drafter():
    from mlx_redrafter import load_drafter
    from mlx_redrafter.draft.redrafter import shipped_drafter_path

    shipped = shipped_drafter_path("default")
    assert shipped is not None
    for name in ("default", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        drafter = load_drafter(name)
        assert drafter.source_path == shipped
        assert drafter.config == load_drafter(shipped).config


def flags_named(error) -> list:
    import re

    return re.findall(r"--[a-z][a-z-]*", str(error))


def test_api_errors_name_no_command_line_flags(tmp_path):
    import mlx.nn as nn
    import pytest

    from mlx_redrafter import RedrafterError, SamplingConfig, load_drafter, load_model
    from mlx_redrafter.llm.cache import check_cache
    from mlx_redrafter.step.verify import install_tree_hooks

    not_a_model = tmp_path / "folder"
    not_a_model.mkdir()
    calls = [
        lambda: load_drafter(str(tmp_path / "missing")),
        lambda: load_drafter("no-such-model/drafter"),
        lambda: load_model(str(tmp_path / "missing")),
        lambda: load_model(str(not_a_model)),
        lambda: install_tree_hooks(nn.Sequential(nn.Linear(4, 4))),
        lambda: check_cache([object()]),
        lambda: SamplingConfig(temp=-1.0),
        lambda: SamplingConfig(top_p=2.0),
    ]
    for call in calls:
        with pytest.raises(RedrafterError) as e:
            call()
        assert e.value.fix and not flags_named(e.value), str(e.value)


def test_generate_warns_at_start_on_the_bundled_blas(monkeypatch, capsys):
    import pytest

    from mlx_redrafter import doctor
    from mlx_redrafter.cli import main

    bundled = BlasInfo("bundled reference BLAS (netlib)", "/x/mlx_cpu.libs/libblas.so", True)
    monkeypatch.setattr(doctor, "blas_info", lambda: bundled)
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    with pytest.raises(SystemExit) as e:  # typer exits when the command is done
        main(["generate", "--no-draft", "-n", "2", "-p", "Hi"])
    assert e.value.code in (0, None)
    err = capsys.readouterr().err
    assert "Warning: MLX runs on the CPU with the bundled reference BLAS" in err


def test_help_documents_every_keyword():
    import inspect

    from mlx_redrafter import generate, stream_generate

    names = [p for p in inspect.signature(stream_generate).parameters if p not in ("model", "tokenizer", "prompt")]
    for name in names:
        if name == "profile":  # the deprecated alias, named beside timings
            continue
        assert f"{name}" in stream_generate.__doc__.replace("``", ""), name
        assert name in generate.__doc__, name
        assert name in inspect.signature(generate).parameters, name
    doc = " ".join(stream_generate.__doc__.split())
    assert "no chat template" in doc and "apply_chat_template" in doc
    assert all(f".{a}" in doc for a in ("text", "token", "stats"))


def test_the_docstring_example_runs(default_model):
    from mlx_redrafter import load_drafter, stream_generate

    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers."}], add_generation_prompt=True
    )
    out = list(stream_generate(model, tokenizer, prompt, drafter=load_drafter("default"), max_tokens=6))
    assert len(out) == 6 and all(r.text is not None and r.stats is not None for r in out)
