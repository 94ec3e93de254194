#!/usr/bin/env bash
# Tune LMBR on a dev split of a data-bin, from evidence n-best lists made here or given:
#   1. evidence: fairseq-generate --nbest N (beam N) on the dev split, once per evidence system
#      (--evidence a.pt,b.pt: one n-best list each = system combination; default: the model itself);
#      skipped for systems whose list exists, or when --nbest files are given
#   2. streambeam-calibrate (python -m fairseq_streambeam.calibrate) over the LMBR grids
# Writes OUT/evidence/*.nbest and the tuner's OUT/calibrate.md, best.json (bench --config), best.args
# (fairseq-generate options, e.g. `fairseq-generate ... --lmbr-posteriors P $(cat OUT/best.args)`).
#   scripts/tune_lmbr.sh --data DATA-BIN --path model.pt -s de -t en --out work/tune
# Options: --data DIR --path CKPT -s L -t L --dev SPLIT (default valid) --limit N (tuning subset;
#   evidence covers the whole split) --evidence CKPT[,CKPT...] --nbest-size N (default 10)
#   --nbest FILE[,FILE...] (existing evidence; then nothing is generated) --decoding D --beam K
#   --post-process P (default sentencepiece) --out DIR
#   Anything after `--` goes to the tuner (e.g. -- --lambdas 0.25 0.5 1 2 --alphas 0.5 1 --lmbr-search grid).
# Environment: THREADS (default 1), PYTHON.
set -euo pipefail
data=""; path=""; s=""; t=""; dev=valid; limit=0; evidence=""; nbest_size=10; nbest=""; decoding=beam; beam=5
post=sentencepiece; out=work/tune-lmbr
python="${PYTHON:-python}"; threads="${THREADS:-1}"
usage() { sed -n '2,/^# Environment/p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data="$2"; shift 2;;
    --path) path="$2"; shift 2;;
    -s) s="$2"; shift 2;;
    -t) t="$2"; shift 2;;
    --dev) dev="$2"; shift 2;;
    --limit) limit="$2"; shift 2;;
    --evidence) evidence="$2"; shift 2;;
    --nbest-size) nbest_size="$2"; shift 2;;
    --nbest) nbest="$2"; shift 2;;
    --decoding) decoding="$2"; shift 2;;
    --beam) beam="$2"; shift 2;;
    --post-process) post="$2"; shift 2;;
    --out) out="$2"; shift 2;;
    -h|--help) usage 0;;
    --) shift; break;;
    *) echo "unknown option $1" >&2; usage 2;;
  esac
done
[ -n "$data" ] && [ -n "$path" ] && [ -n "$s" ] && [ -n "$t" ] || { echo "--data, --path, -s and -t are required" >&2; exit 2; }
export OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
plugin="$(cd "$(dirname "$0")/.." && pwd)/fairseq_streambeam"
files=()
if [ -n "$nbest" ]; then
  IFS=, read -r -a files <<< "$nbest"
else
  mkdir -p "$out/evidence"
  IFS=, read -r -a systems <<< "${evidence:-$path}"
  for ckpt in "${systems[@]}"; do
    # named by the checkpoint(s) and a hash of their full paths and the data: two systems whose files
    # share a name (a/checkpoint_best.pt, b/checkpoint_best.pt), an ensemble a.pt:b.pt against b.pt
    # alone, or another --data in the same --out get files of their own
    tag=$(printf '%s|%s' "$(realpath -m "$data")" "$(for c in ${ckpt//:/ }; do realpath -m "$c"; done)" | sha1sum | cut -c1-8)
    f="$out/evidence/$(basename "${ckpt//:/+}" .pt)-$tag.$dev.nbest$nbest_size"
    if [ ! -s "$f" ]; then
      echo "evidence: $ckpt, $nbest_size-best of $data:$dev -> $f" >&2
      fairseq-generate "$data" --user-dir "$plugin" --task streambeam_translation --path "$ckpt" -s "$s" -t "$t" \
        --gen-subset "$dev" --beam "$nbest_size" --nbest "$nbest_size" --batch-size 32 > "$f.tmp"
      mv "$f.tmp" "$f"
    fi
    files+=("$f")
  done
fi
exec "$python" -m fairseq_streambeam.calibrate --data "$data" --path "$path" -s "$s" -t "$t" --gen-subset "$dev" \
  --limit "$limit" --post-process "$post" --nbest "${files[@]}" --decoding "$decoding" --beam "$beam" \
  --threads "$threads" --out "$out" "$@"
