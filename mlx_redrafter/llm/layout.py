"""The CPU's weight layout: float weights stored column-major.

mlx-lm's ``Linear`` computes ``x @ W.T`` with ``W`` stored row-major as
``(out, in)``, so on the CPU the BLAS multiplies by a transposed operand.
Stored column-major instead (the same values, the same logical shape: a
transposed view of a contiguous ``(in, out)`` array), ``W.T`` is a plain
row-major operand. Measured on the default model (2-core x86 CPU, float32,
200 tokens of context, both layouts in one run; bench/RESULTS.md section 37):

* with BLIS, one token's forward costs 0.97-0.98 of what it did, and a tree
  of 2 / 3 / 4 tokens 1.19 / 1.25 / 1.33 of one token's against 1.26 /
  1.34 / 1.49: plain decoding runs 1.04x as fast, drafting 1.05-1.07x;
* with MLX's bundled BLAS, every forward costs 0.71-0.75 of what it did.

Every reader of a weight sees the same array (only the strides differ), so
nothing else changes: fingerprints, saving, training, quantizing. A GPU's
kernels are written for the row-major layout: there it is left alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def column_major(w: mx.array) -> mx.array:
    """``w`` (2-D) with the same values and shape, stored column-major."""
    return mx.contiguous(w.T).T


def _output_embedding(model: nn.Module) -> bool:
    """Whether the token embedding is also the output layer (tied), so that
    a matmul reads it; otherwise it is only gathered, row by row."""
    return not isinstance(getattr(model, "lm_head", None), nn.Module)


def lay_out_for_cpu(model: nn.Module) -> nn.Module:
    """Store ``model``'s float ``Linear`` weights (and a tied embedding)
    column-major, in place. Quantized layers, which have their own kernels,
    are left as they are."""
    tied = _output_embedding(model)
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear) or (tied and isinstance(module, nn.Embedding)):
            w = module.weight
            if w.ndim == 2 and mx.issubdtype(w.dtype, mx.floating):
                module.weight = column_major(w)
                mx.eval(module.weight)  # one at a time: the old layout is freed as it goes
    return model
