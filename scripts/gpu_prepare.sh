#!/usr/bin/env bash
# Prepare, on a machine with network access (no GPU needed), what a run on a GPU machine carries:
# that machine has Python 3.12, torch and no network, and takes at most 64 MiB of working tree.
#   .whl/      cp312 wheels it lacks: ve-fairseq (slimmed: no examples/, no NAT/BASE-layer/alignment
#              extensions), hydra-core, omegaconf, antlr4 runtime, bitarray, cffi, pycparser, sacrebleu
#   gpu-data/  a slim copy of ../shared in its layout (so STREAMBEAM_SHARED=gpu-data works for the
#              tests): deen-tiny (best + ep5) and gec-tiny checkpoints with fp16 weights and no
#              optimizer state, dictionaries, spm model, data-bin test splits, the first lines of
#              newstest2017 de-en and CoNLL-14, and a gzipped slice of the de-en training text
# Both folders are git-ignored; carry them: run(..., carry=[".whl", "gpu-data"]). Prints the sizes
# and the total that travels (tracked + untracked files + both folders); fails above 64 MiB.
# Options: --shared DIR (default ../shared) --train-lines N (0 = all) --test-lines N (500)
#   --dtype fp16|fp32 (checkpoint weights) --with-ct2 (also CTranslate2's wheel: 43 MB, built
#   against CUDA 12's cuBLAS; does not fit beside gpu-data) --skip-wheels --skip-data
# Environment: PYTHON (default python; needs torch and sentencepiece), PIP (default python3 -m pip).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
shared="${STREAMBEAM_SHARED:-$here/../shared}"
train_lines=0; test_lines=500; dtype=fp16; with_ct2=0; wheels=1; data=1
python="${PYTHON:-python}"; pip="${PIP:-python3 -m pip}"
usage() { sed -n '2,/^# Environment/p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --shared) shared="$2"; shift 2;;
    --train-lines) train_lines="$2"; shift 2;;
    --test-lines) test_lines="$2"; shift 2;;
    --dtype) dtype="$2"; shift 2;;
    --with-ct2) with_ct2=1; shift;;
    --skip-wheels) wheels=0; shift;;
    --skip-data) data=0; shift;;
    -h|--help) usage 0;;
    *) echo "gpu_prepare.sh: unknown option $1" >&2; usage 2;;
  esac
done
cd "$here"
helper=("$python" "$here/scripts/gpu_check.py")
limit_mib=64

# ---- wheels -----------------------------------------------------------------------------------
# sacrebleu: listed for the image by some notes, not by its package list: carried to be sure (130 kB)
WHEELS=(ve-fairseq==0.12.3 hydra-core==1.3.8 omegaconf==2.3.1 bitarray==3.12.3 cffi==2.1.1 pycparser==3.12
        sacrebleu==2.6.0)
SLIM=(fairseq/examples/ fairseq/libnat. fairseq/libbase. alignment_train_cpu_binding.)
if [ "$wheels" = 1 ]; then
  mkdir -p .whl
  rm -f .whl/*.whl
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  specs=("${WHEELS[@]}")
  [ "$with_ct2" = 1 ] && specs+=(ctranslate2==4.8.5)
  for spec in "${specs[@]}"; do
    $pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
      -d .whl "$spec" 2>&1 | grep -v "^WARNING: Location" || true
    ls .whl/"$(echo "${spec%%==*}" | tr - _)"-*.whl >/dev/null 2>&1 || ls .whl/"${spec%%==*}"-*.whl >/dev/null 2>&1 \
      || { echo "gpu_prepare.sh: no cp312 wheel downloaded for $spec" >&2; exit 1; }
  done
  # omegaconf needs antlr4-python3-runtime==4.9.*, which PyPI has as source only: build its pure-Python wheel
  $pip wheel -q --no-deps --no-binary=:all: -w .whl antlr4-python3-runtime==4.9.3 2>&1 | grep -v "^WARNING: Location" || true
  ls .whl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null || { echo "gpu_prepare.sh: antlr4 wheel not built" >&2; exit 1; }
  "${helper[@]}" slim-wheel .whl/ve_fairseq-0.12.3-*.whl "${SLIM[@]}"
  "${helper[@]}" check-wheels .whl
fi

# ---- data -------------------------------------------------------------------------------------
if [ "$data" = 1 ]; then
  for f in models/deen-tiny/checkpoint_best.pt models/gec-tiny/checkpoint_best.pt data/wmt/de-en/newstest2017.de \
           data/gec/conll14/INPUT.txt data/train/de-en/train.de; do
    [ -e "$shared/$f" ] || { echo "gpu_prepare.sh: missing $shared/$f (set --shared)" >&2; exit 2; }
  done
  rm -rf gpu-data
  d=gpu-data/models/deen-tiny; g=gpu-data/models/gec-tiny
  mkdir -p "$d/data-bin" "$g/data-bin" gpu-data/data/wmt/de-en gpu-data/data/gec/conll14 gpu-data/data/train/de-en
  for ckpt in checkpoint_best.pt checkpoint_ep5.pt; do
    "${helper[@]}" slim-checkpoint "$shared/models/deen-tiny/$ckpt" "$d/$ckpt" --dtype "$dtype"
  done
  "${helper[@]}" slim-checkpoint "$shared/models/gec-tiny/checkpoint_best.pt" "$g/checkpoint_best.pt" --dtype "$dtype"
  cp "$shared"/models/deen-tiny/{dict.de.txt,dict.en.txt,spm8k.model} "$d/"
  cp "$shared"/models/deen-tiny/data-bin/{dict.*,test.*} "$d/data-bin/"
  cp "$shared"/models/gec-tiny/{dict.src.txt,dict.trg.txt,spm8k.model} "$g/"
  cp "$shared"/models/gec-tiny/data-bin/{dict.*,test.*} "$g/data-bin/"
  for l in de en; do
    head -n "$test_lines" "$shared/data/wmt/de-en/newstest2017.$l" > "gpu-data/data/wmt/de-en/newstest2017.$l"
    if [ "$train_lines" -gt 0 ]; then head -n "$train_lines" "$shared/data/train/de-en/train.$l"
    else cat "$shared/data/train/de-en/train.$l"; fi | gzip -9 > "gpu-data/data/train/de-en/train.$l.gz"
    head -n "$test_lines" "$shared/data/train/de-en/valid.$l" > "gpu-data/data/train/de-en/valid.$l"
  done
  head -n "$test_lines" "$shared/data/gec/conll14/INPUT.txt" > gpu-data/data/gec/conll14/INPUT.txt
fi

# ---- sizes ------------------------------------------------------------------------------------
for f in .whl gpu-data; do [ -e "$f" ] && du -sh "$f"; done
[ -d .whl ] && ls -l .whl | awk 'NR > 1 {printf "  %8.1f MiB  %s\n", $5 / 1048576, $9}'
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
carry_bytes=$(find .whl gpu-data -type f -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((tree_bytes + carry_bytes))
awk -v t="$tree_bytes" -v c="$carry_bytes" -v s="$total" -v l="$limit_mib" 'BEGIN {
  printf "travels: working tree %.1f MiB + .whl and gpu-data %.1f MiB = %.1f MiB of %d MiB\n",
         t / 1048576, c / 1048576, s / 1048576, l }'
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_prepare.sh: over the ${limit_mib} MiB a GPU run carries: use fewer --train-lines or drop --with-ct2" >&2
  exit 1
fi
