"""The LLM side: loading models (load.py), the parts ReDrafter calls and
layer taps (parts.py), prompts into ids (text.py), and every KV-cache
operation (cache.py). Imports nothing above the ground floor."""
