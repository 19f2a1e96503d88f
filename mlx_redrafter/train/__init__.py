"""Drafter training by self-distillation: ``distill`` (data) and ``trainer`` (fit)."""
