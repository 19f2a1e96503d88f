"""The order test files are handed to ``make test``'s workers: longest first.

``make test`` runs ``pytest -n 2 --dist loadfile``: each worker takes a
whole file when it is nearly done with the one before. pytest-xdist hands
them out by number of tests, most first, so files with a few long tests
(a fuzzer, a sampling check, launches of two processes) came last, and one
worker ran them alone while the other idled. Handed out longest first
(list scheduling's longest-processing-time rule), the last files are short
ones and the workers finish close together.

SECONDS: what each file takes alone (CPU seconds of pytest and the processes
it starts, one file at a time on a quiet 2-core Linux machine with BLIS).
Only the order matters, so rough numbers do; list a new file with its
time (``/usr/bin/time -f %U+%S pytest -q tests/test_x.py``).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Dict, List

# A file not listed yet (new, not measured) counts as a middling one: early
# enough not to be left for last if it is long, and the listed short files
# still end the run.
UNLISTED = 15

SECONDS: Dict[str, float] = {
    "test_sampling.py": 88,
    "test_exactness.py": 87,
    "test_models.py": 73,  # with the optional Gemma 3 extra (`make setup-gemma`); ~45 without
    "test_chat.py": 72,
    "test_hybrid.py": 67,
    "test_distributed.py": 60,  # launches of two processes: more time than CPU
    "test_lookup.py": 45,
    "test_agent_apis.py": 43,
    "test_auto_tree.py": 42,
    "test_server.py": 40,
    "test_ui.py": 38,
    "test_server_fuzz.py": 35,
    "test_docs.py": 32,
    "test_ollama_api.py": 30,
    "test_server_tools.py": 30,
    "test_grammar.py": 30,
    "test_structured.py": 28,
    "test_datastore_loops.py": 28,
    "test_tool_grammar.py": 27,
    "test_server_security.py": 23,
    "test_eagle3_train.py": 22,
    "test_eagle3_draft.py": 21,
    "test_datastore_cli.py": 20,
    "test_controller.py": 19,
    "test_server_limits.py": 18,
    "test_make_drafter.py": 17,
    "test_train.py": 17,
    "test_one_check.py": 15,
    "test_server_crash.py": 15,
    "test_dflash.py": 15,
    "test_sources.py": 14,
    "test_governor.py": 12,
    "test_datastore_sampling.py": 14,
    "test_sweep.py": 13,
    "test_front_door.py": 12,
    "test_first_use.py": 11,
    "test_batch_trees.py": 11,
    "test_agent_clients.py": 10,
    "test_drafter_store.py": 10,
    "test_sources_cli.py": 10,
    "test_tool_calls.py": 9,
    "test_agents_e2e.py": 7,  # skipped without `make setup-agents`
    "test_dflash_train.py": 6,
    "test_wheel.py": 6,
    "test_pipeline.py": 6,
    "test_batch_drafts.py": 5,
    "test_dflash_surfaces.py": 5,
    "test_server_scripted.py": 4,
    "test_datastore.py": 4,
    "test_batching.py": 4,
    "test_head_features.py": 4,
    "test_tree_select.py": 4,
    "test_prompt_cache.py": 4,
    "test_convert.py": 3,
    "test_tree.py": 3,
    "test_hub_drafters.py": 3,
    "test_mtp.py": 3,
    "test_layering.py": 3,
    "test_help.py": 3,
    "test_eagle3.py": 3,
    "test_drafter_beam.py": 3,
    "test_live_cost.py": 3,
    "test_dflash_parity.py": 3,
    "test_load_options.py": 3,
    "test_self_contained.py": 2,
}


def longest_first(items: List) -> None:
    """Sort pytest ``items`` in place: the files' tests by the files' SECONDS,
    largest first; each file's tests keep their order (a stable sort)."""
    items.sort(key=lambda item: SECONDS.get(_file(item), UNLISTED), reverse=True)


def _file(item) -> str:
    return PurePosixPath(item.nodeid.split("::", 1)[0]).name
