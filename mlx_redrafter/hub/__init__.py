"""Drafter distribution: where a drafter comes from and goes to, apart from
the draft sources themselves (draft/). store.py: the drafter store under the
cache folder (install, find the one that fits a model, list, remove);
locate.py: a drafter by name (a folder, the store, the package, a Hugging
Face Hub repo, fetched and kept); load.py: ``load_drafter``; publish.py: the
model card and the upload."""
