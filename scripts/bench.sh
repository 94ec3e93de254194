#!/usr/bin/env bash
# Thin wrapper: run the benchmark with an explicit thread count (default 1; set THREADS=N).
# Oversubscribed threads can make fairseq many times slower, so the thread count is never implicit.
set -euo pipefail
export OMP_NUM_THREADS="${THREADS:-1}" MKL_NUM_THREADS="${THREADS:-1}"
exec "${PYTHON:-python}" -m fairseq_streambeam.bench --threads "${THREADS:-1}" "$@"
