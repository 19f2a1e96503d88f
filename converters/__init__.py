"""Converters into MLX: GGUF models (``gguf``) and PyTorch-trained drafters (``drafter``)."""
