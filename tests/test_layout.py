"""The CPU's weight layout (llm/layout.py): a model loaded on the CPU stores
its float weights column-major, with every value and logit unchanged."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import assert_exact_under_drafting, bigram_drafter, bigram_model, save_tiny_folder
from mlx.utils import tree_flatten

from mlx_redrafter import load_model
from mlx_redrafter.llm.layout import lay_out_for_cpu


def _column_major(w: mx.array) -> bool:
    rows, cols = w.shape
    return memoryview(w).strides == (w.itemsize, w.itemsize * rows)


def _row_major(w: mx.array) -> bool:
    return memoryview(w).strides == (w.itemsize * w.shape[1], w.itemsize)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # an lm_head, a tied embedding
def test_a_cpu_load_stores_float_weights_column_major_with_their_values(tmp_path, kind):
    from mlx_lm.utils import load as mlx_load

    folder = save_tiny_folder(tmp_path / kind, kind=kind)
    model, _ = load_model(str(folder))
    plain, _ = mlx_load(str(folder))
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(plain.parameters()))
    assert ours.keys() == theirs.keys()
    for name, w in ours.items():
        assert w.shape == theirs[name].shape and mx.array_equal(w, theirs[name]), name
    linears = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(_column_major(w) for w in linears)
    embed = model.model.embed_tokens.weight
    assert _column_major(embed) if kind == "qwen3" else _row_major(embed)  # gathered only: left as is
    tokens = mx.array([[5, 17, 3, 42, 9, 11]])
    assert np.allclose(np.array(model(tokens)), np.array(plain(tokens)), atol=1e-4)


def test_quantized_layers_keep_their_own_layout():
    model = bigram_model()
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    mx.eval(model.parameters())
    lay_out_for_cpu(model)
    quantized = [m.weight for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and all(_row_major(w) for w in quantized)


def test_drafting_on_the_cpu_layout_is_plain_greedy_decoding(tmp_path):
    """Trees of 2-4 tokens verified by column-major matmuls give what one
    token at a time gives (mlx-lm's own loop on the same model object)."""
    model, tok = load_model(str(save_tiny_folder(tmp_path / "bigram", bigram=True)))
    assert _column_major(model.model.layers[0].mlp.down_proj.weight)
    drafter = bigram_drafter(bigram_model())
    assert_exact_under_drafting(
        model, tok, "w1 w2 w3 w1 w2 w3 w1", max_tokens=16, drafter=drafter, beam_width=2, min_accepted=4
    )
