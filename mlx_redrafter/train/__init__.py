"""Training: self-distillation data (distill.py, shards.py), the drafter fit
(trainer.py), the run over several processes (world.py), and the
adaptive-depth controller's training (controller.py)."""
