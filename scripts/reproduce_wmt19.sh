#!/usr/bin/env bash
# Reproduce Table 1 of Yang et al. (EMNLP 2020): GREEDY / FIXED / VAR-BATCH / VAR-STREAM on the
# WMT'19 De-En or Ru-En ensembles (newstest2018), 5 repeats each, mean and std, in one process.
#
# Online (GPU instance):   scripts/reproduce_wmt19.sh --pair de-en [--config configs/paper_k5.json]
#   fetches the ensemble through fairseq's own hub table and newstest2018 with sacrebleu; needs
#   `pip install sacremoses` and fastBPE (README: optional extra).
# Offline:  scripts/reproduce_wmt19.sh --pair de-en --model-dir DIR --src FILE --ref FILE
#   DIR holds the dictionaries, checkpoints (--checkpoints, ':'-separated, relative to DIR or
#   absolute) and bpecodes; --tokenizer/--bpe none for pre-tokenized text (CI does this on a tiny model).
# Anything after `--` goes to `python -m fairseq_streambeam.bench` (e.g. -- --limit 500 --threads 4).
# The paper configs use the authors' settings: delta 1.5, M 5, eps 1/6 and sticky finalization that ends
# a source at z = k finished hypotheses (their find_top_z = k); `-- --finish-count 1` compares z = 1.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
pair=de-en; model_dir=""; src=""; ref=""; config="$here/configs/paper_k50.json"; out="results/wmt19"
repeats=5; checkpoints="model1.pt:model2.pt:model3.pt:model4.pt"; tokenizer=moses; bpe=fastbpe
python="${PYTHON:-python}"
usage() { sed -n '2,14p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --pair) pair="$2"; shift 2;;
    --model-dir) model_dir="$2"; shift 2;;
    --checkpoints) checkpoints="$2"; shift 2;;
    --src) src="$2"; shift 2;;
    --ref) ref="$2"; shift 2;;
    --config) config="$2"; shift 2;;
    --repeats) repeats="$2"; shift 2;;
    --out) out="$2"; shift 2;;
    --tokenizer) tokenizer="$2"; shift 2;;
    --bpe) bpe="$2"; shift 2;;
    -h|--help) usage 0;;
    --) shift; break;;
    *) echo "unknown option $1" >&2; usage 2;;
  esac
done
s="${pair%-*}"; t="${pair#*-}"
mkdir -p "$out"

if [ -z "$model_dir" ]; then
  echo "fetching transformer.wmt19.$pair through fairseq's hub table (fairseq caches it)" >&2
  model_dir="$("$python" - "$pair" <<'PY'
import sys
from fairseq import file_utils
from fairseq.models.transformer import TransformerModel
print(file_utils.load_archive_file(TransformerModel.hub_models()[f"transformer.wmt19.{sys.argv[1]}"]["path"]))
PY
)"
fi
if [ -z "$src" ]; then
  src="$out/newstest2018.$pair.$s"; ref="$out/newstest2018.$pair.$t"
  sacrebleu -t wmt18 -l "$pair" --echo src > "$src"
  sacrebleu -t wmt18 -l "$pair" --echo ref > "$ref"
fi
[ -n "$ref" ] || { echo "--src needs --ref" >&2; exit 2; }

paths=""
IFS=':' read -ra cks <<< "$checkpoints"
for c in "${cks[@]}"; do
  case "$c" in /*) p="$c";; *) p="$model_dir/$c";; esac
  paths="${paths:+$paths:}$p"
done
bpe_args=()
[ "$bpe" = fastbpe ] && bpe_args=(--bpe-codes "$model_dir/bpecodes")

exec "$python" -m fairseq_streambeam.bench --data "$model_dir" --path "$paths" -s "$s" -t "$t" \
  --src "$src" --ref "$ref" --tokenizer "$tokenizer" --bpe "$bpe" "${bpe_args[@]}" \
  --config "$config" --repeats "$repeats" --out "$out" "$@"
