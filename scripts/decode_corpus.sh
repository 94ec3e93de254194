#!/usr/bin/env bash
# Sharded, resumable corpus decoding. NPROC workers on this machine through torchrun (worker i on
# GPU i, wrapped round the GPUs); NPROC=1 runs a single process. Re-run the same command to resume.
#   NPROC=4 scripts/decode_corpus.sh --input big.de --output-dir out --data DICT_DIR --path model.pt \
#       -s de -t en --bpe sentencepiece --sentencepiece-model spm.model --shard-lines 100000
# On Slurm, use scripts/decode_corpus.sbatch (an array job; each task takes every N-th shard).
set -euo pipefail
NPROC="${NPROC:-1}"
if [ "$NPROC" -gt 1 ]; then
  exec "${TORCHRUN:-torchrun}" --standalone --nproc-per-node "$NPROC" -m fairseq_streambeam.decode_corpus "$@"
fi
exec "${PYTHON:-python}" -m fairseq_streambeam.decode_corpus "$@"
