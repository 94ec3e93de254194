#!/usr/bin/env bash
# Thin wrapper: run the benchmark with an explicit thread count (default 1; set THREADS=N).
# Oversubscribed threads made fairseq 60x slower on a shared machine, so never leave it implicit.
set -euo pipefail
export OMP_NUM_THREADS="${THREADS:-1}" MKL_NUM_THREADS="${THREADS:-1}"
exec "${PYTHON:-python}" -m fairseq_streambeam.bench --threads "${THREADS:-1}" "$@"
