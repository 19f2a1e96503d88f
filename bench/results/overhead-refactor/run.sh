#!/usr/bin/env bash
# bench/overhead.py before and after the layout refactor (issue 25), interleaved: old new new old.
# Run from the repository root, after
#   git worktree add /tmp/old e61f0dd            # before
#   git worktree add --detach /tmp/new 1fdfec4   # after (the refactor)
set -u
PY=${PY:-$PWD/.venv/bin/python}
OUT=${OUT:-/tmp/ovh}
mkdir -p "$OUT"
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3
for run in old:1 new:1 new:2 old:2; do
  side=${run%%:*}; n=${run##*:}
  echo "== $side $n start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd /tmp/$side && PYTHONPATH=/tmp/$side "$PY" bench/overhead.py --tokens 64 --out "$OUT/$side$n.json" > "$OUT/$side$n.txt" 2>&1; echo "rc=$?")
done
echo "== done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
