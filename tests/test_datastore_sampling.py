"""The sampling distribution with datastore rows in the tree (issue 28): the
pattern of test_sampling.py, on its 5-token model."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
from helpers import accepted_in_steps
from test_sampling import chi2_passes, exact_first_tokens, small_model  # noqa: F401  (a fixture)

from mlx_redrafter.config import SamplingConfig
from mlx_redrafter.draft.datastore.index import Datastore
from mlx_redrafter.generate import DraftConfig, generate_tokens

N_RUNS = 1000


def test_sampling_with_datastore_rows_matches_the_model(small_model):  # noqa: F811
    """Datastore rows in the tree (where context lookup finds nothing): still the model's distribution."""
    cfg = SamplingConfig(temp=1.0)
    store = Datastore()
    mx.random.seed(9)
    for _ in range(8):  # every 2-token suffix of a 5-token vocabulary is in the store
        store.add(mx.random.randint(0, 5, (40,)).tolist())
    draft = DraftConfig(lookup=1, lookup_length=3, datastore=store)
    prompt = [1, 3, 0, 2]
    expected = exact_first_tokens(small_model, prompt, cfg)
    mx.random.seed(4)
    observed, taken = Counter(), 0
    for _ in range(N_RUNS):
        tokens, stats = generate_tokens(small_model, prompt, draft=draft, max_tokens=3, temp=cfg.temp)
        observed[tuple(tokens)] += 1
        taken += accepted_in_steps(stats, len(tokens), "datastore")
    assert store.proposed > N_RUNS // 4  # datastore rows were really in many trees
    assert taken >= 5  # ... and accepted (8 here)
    assert chi2_passes(observed, expected, N_RUNS)
