#!/usr/bin/env bash
# Prepares what the GPU acceptance run carries to the lent H200 (benchmarks/gpu_acceptance.py's header), here,
# once, from the repo root:   bash benchmarks/gpu_carry.sh [PYTHON]
#
# That machine reaches no registry and has no diffusers. diffusers and its two pure-Python needs the image lacks
# (importlib_metadata, lazy_importer) are pure Python: they are taken from PYTHON's site-packages (default: the
# project's .venv, diffusers 0.42.1) into .carry/site.tgz (~5 MiB), which .gitignore ignores; the device call
# names `.carry` in its carry list and gpu_acceptance.sh unpacks it into /tmp/site. cpdoctor itself travels as
# the working tree. Refuses when the tracked and untracked-not-ignored files plus .carry exceed 48 MiB (the
# device's limit is 64 MiB for all of it; the margin is for what accumulates in benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
SITE="$("$PYTHON" -c 'import diffusers, os; print(os.path.dirname(os.path.dirname(diffusers.__file__)))')"
mkdir -p .carry
names=()
for pkg in diffusers importlib_metadata lazy_importer; do
  names+=("$pkg")
  while IFS= read -r info; do names+=("$(basename "$info")"); done < <(ls -d "$SITE/$pkg"-*.dist-info 2>/dev/null || true)
done
tar czf .carry/site.tgz --exclude=__pycache__ -C "$SITE" "${names[@]}"
carry=$(du -sb .carry | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
total=$((carry + tree))
echo "carry: .carry = $((carry / 1024)) KiB ($(tar tzf .carry/site.tgz | grep -c dist-info/METADATA) packages: ${names[*]})"
echo "working tree (tracked + untracked, not ignored) = $((tree / 1024)) KiB; together $((total / 1048576)) MiB of the 64 MiB limit"
if [ "$total" -gt $((48 * 1048576)) ]; then
  echo "too large to travel with margin: keep the working tree small or carry less" >&2
  exit 1
fi
echo 'device call: run(command="bash benchmarks/gpu_acceptance.sh", carry=[".carry"], timeout_s=600)'
