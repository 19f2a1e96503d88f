"""Where drafts come from: the drafter and its beam search (drafter.py,
beam.py), n-gram lookup (lookup.py), the adaptive-depth controller at run
time (controller.py; its training is in train/controller.py), and the
sources with state of their own: layer heads (head.py; native MTP heads,
mtp.py) and small draft models (draft_model.py), kept in step with the model
by chain.py."""
