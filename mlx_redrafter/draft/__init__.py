"""Where drafts come from: the drafter and its beam search (drafter.py,
beam.py), n-gram lookup (lookup.py), and the adaptive-depth controller at
run time (controller.py; its training is in train/controller.py)."""
