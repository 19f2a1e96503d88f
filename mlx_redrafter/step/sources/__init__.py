"""The draft sources, one module each (the protocol: step/source.py).

:data:`REGISTRY` lists, in order, the function of each source that reads a
request (a :class:`~mlx_redrafter.config.DraftConfig`) and returns the
sources it asks for. The plan (step/plan.py) asks them in this order, which
is the order of a step's rows, and of the caches the stateful sources keep
after the model's. A new source is a new module and one line here.
"""

from __future__ import annotations

from . import chain, datastore, host, lookup, redrafter

REGISTRY = (
    redrafter.from_request,  # the ReDrafter drafter's beams
    chain.from_request,  # a layer head (MTP, EAGLE-3), a draft model
    lookup.from_request,  # copies from the context
    datastore.from_request,  # a copy from past outputs where the context has none
    host.from_request,  # the caller's own sources (``sources=``)
)


# Every label the built-in sources' rows carry (a user's source names its own), and
# those a batch drafts with (step/batched.py: no source with a cache of its own).
LABELS = redrafter.LABELS + chain.LABELS + lookup.LABELS + datastore.LABELS
BATCH_LABELS = redrafter.LABELS + lookup.LABELS + datastore.LABELS


def request_sources(draft) -> list:
    """Every source a request asks for, in :data:`REGISTRY`'s order."""
    return [s for builder in REGISTRY for s in builder(draft)]
