"""Where drafts come from, one family of draft sources: the ReDrafter
recurrent head and its beam search (redrafter.py, beam.py), n-gram lookup
(lookup.py), the datastore of past outputs (datastore/), and the
adaptive-depth controller at run time (controller.py; its training is in
train/controller.py). Each proposes rows of draft tokens; step/ packs and
verifies them. Getting a drafter by name, the drafter store and the Hub are
drafter distribution, in hub/. Sources with state of their own: layer heads
(head.py; native MTP heads, mtp.py and mtp_load.py) and small draft models
(draft_model.py), kept in step with the model by chain.py (stateful.py loads
them for the commands)."""
