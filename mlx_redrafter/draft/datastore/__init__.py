"""The datastore: drafts copied from the model's own earlier words (past
replies, a built corpus, the user's documents). index.py: the suffix index
and its proposals; file.py: its file on disk; use.py: which stores a
generation drafts from, the history it appends to, the session's counts."""
