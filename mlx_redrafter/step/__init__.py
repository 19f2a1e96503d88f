"""One ReDrafter step and the loops that run it.

tree.py packs drafts into a tree, verify.py runs it through the LLM,
accept.py picks what the LLM keeps; protocol.py is the host protocol both
loops share (prefill, drafter call, the one read per step);
synchronous.py and pipelined.py are the loops, and dispatch.py picks one.
"""
