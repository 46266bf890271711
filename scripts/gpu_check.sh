#!/usr/bin/env bash
# The checks for the day a GPU is lent: one command, one summary table (see scripts/gpu_check.py).
#   bash scripts/gpu_check.sh [--out DIR]
# Without a GPU every step is checked for reachability and skipped with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gpu_check.py "$@"
