#!/usr/bin/env bash
# Reproduce Table 1 of Yang et al. (EMNLP 2020): GREEDY / FIXED / VAR-BATCH / VAR-STREAM on the
# WMT'19 De-En or Ru-En ensembles (newstest2018), 5 repeats each, medians, in one process.
#
# Online (GPU instance):   scripts/reproduce_wmt19.sh --pair de-en|ru-en [--config configs/paper_k5.json]
#   fetches transformer.wmt19.PAIR with fairseq's hub code (the URL of fairseq's hub table, or
#   --model-url URL: an http(s) mirror, a file:// URL or a local .tar.gz) into fairseq's cache
#   ($PYTORCH_FAIRSEQ_CACHE), and newstest2018 with sacrebleu unless --src FILE --ref FILE are given.
#   Needs `pip install -e '.[wmt19]'` (sacremoses, requests) and fastBPE (the README's line).
# Offline:  scripts/reproduce_wmt19.sh --pair de-en --model-dir DIR --src FILE --ref FILE
#   DIR holds the dictionaries, checkpoints (--checkpoints, ':'-separated, relative to DIR or
#   absolute) and bpecodes; --tokenizer/--bpe none for pre-tokenized text, --bpe sentencepiece with
#   `-- --sentencepiece-model FILE` for sentencepiece models.
# Anything after `--` goes to `python -m fairseq_streambeam.bench` (e.g. -- --limit 500 --threads 4).
# The paper configs use the authors' settings: delta 1.5, M 5, eps 1/6 and sticky finalization that ends
# a source at z = k finished hypotheses (their find_top_z = k); `-- --finish-count 1` compares z = 1.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
pair=de-en; model_dir=""; model_url=""; src=""; ref=""; config="$here/configs/paper_k50.json"; out="results/wmt19"
repeats=5; checkpoints="model1.pt:model2.pt:model3.pt:model4.pt"; tokenizer=moses; bpe=fastbpe
python="${PYTHON:-python}"
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit "${1:-0}"; }
die() { echo "reproduce_wmt19.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --pair) pair="$2"; shift 2;;
    --model-dir) model_dir="$2"; shift 2;;
    --model-url) model_url="$2"; shift 2;;
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
    *) echo "reproduce_wmt19.sh: unknown option $1" >&2; usage 2;;
  esac
done
case "$pair" in *-*) ;; *) die "--pair takes SRC-TGT (de-en, ru-en), not '$pair'";; esac
s="${pair%-*}"; t="${pair#*-}"
[ -z "$model_dir" ] || [ -z "$model_url" ] || die "give --model-dir or --model-url, not both"
if { [ -n "$src" ] && [ -z "$ref" ]; } || { [ -z "$src" ] && [ -n "$ref" ]; }; then die "--src and --ref go together"; fi
for f in "$src" "$ref" "$config"; do [ -z "$f" ] || [ -f "$f" ] || die "no such file: $f"; done
need() { "$python" -c "import $1" 2>/dev/null || die "$1 is not installed: $2"; }
[ "$bpe" != fastbpe ] || need fastBPE "pip install cython setuptools wheel && pip install --no-build-isolation fastBPE==0.1.0"
[ "$tokenizer" != moses ] || need sacremoses "pip install -e '.[wmt19]'"
mkdir -p "$out"

if [ -z "$model_dir" ]; then
  echo "fetching transformer.wmt19.$pair with fairseq's hub code, cached in" \
    "${PYTORCH_FAIRSEQ_CACHE:-\$TORCH_HOME/pytorch_fairseq (default ~/.cache/torch/pytorch_fairseq)}" >&2
  model_dir="$("$python" - "$pair" "$model_url" "$out" <<'PY'
import logging
import os
import shutil
import sys
from urllib.parse import unquote, urlparse

logging.basicConfig(level=logging.WARNING)  # fairseq's import would log at DEBUG
pair, url, out = sys.argv[1:4]
name = f"transformer.wmt19.{pair}"
local = None  # a local archive (a path or a file:// URL)
if url and urlparse(url).scheme in ("", "file"):
    local = unquote(urlparse(url).path) if url.startswith("file:") else url
    if not os.path.isfile(local):
        sys.exit(f"reproduce_wmt19.sh: no archive at {url}")
try:
    from fairseq import file_utils
    from fairseq.models.transformer import TransformerModel

    if not url:
        table = TransformerModel.hub_models()
        if name not in table:
            sys.exit(f"reproduce_wmt19.sh: fairseq's hub table has no {name}; give --model-url or --model-dir")
        url = table[name]["path"]
    archive = url
    if local is not None:
        # fairseq's load_archive_file replaces a local archive by its extracted directory: give it a copy
        archive = os.path.join(out, "archive", os.path.basename(local))
        shutil.rmtree(archive, ignore_errors=True)
        os.makedirs(os.path.dirname(archive), exist_ok=True)
        shutil.copyfile(local, archive)
    model_dir = file_utils.load_archive_file(archive)
except ModuleNotFoundError as e:
    sys.exit(f"reproduce_wmt19.sh: {e.name} is not installed (pip install -e '.[wmt19]')")
except Exception as e:  # a download or an archive fairseq cannot read: one line, not a traceback
    sys.exit(f"reproduce_wmt19.sh: cannot fetch {url}: {type(e).__name__}: {e}")
if model_dir is None or not os.path.isdir(model_dir):
    sys.exit(f"reproduce_wmt19.sh: cannot fetch {url} (not found, or no connection)")
print(model_dir)
PY
)" || exit 1
  echo "model directory: $model_dir" >&2
fi
[ -d "$model_dir" ] || die "no such model directory: $model_dir"
for f in "dict.$s.txt" "dict.$t.txt"; do [ -f "$model_dir/$f" ] || die "$model_dir has no $f (--pair $pair)"; done
if [ -z "$src" ]; then
  src="$out/newstest2018.$pair.$s"; ref="$out/newstest2018.$pair.$t"
  sacrebleu -t wmt18 -l "$pair" --echo src > "$src"
  sacrebleu -t wmt18 -l "$pair" --echo ref > "$ref"
fi

paths=""
IFS=':' read -ra cks <<< "$checkpoints"
for c in "${cks[@]}"; do
  case "$c" in /*) p="$c";; *) p="$model_dir/$c";; esac
  [ -f "$p" ] || die "no checkpoint $p (--checkpoints)"
  paths="${paths:+$paths:}$p"
done
bpe_args=()
if [ "$bpe" = fastbpe ]; then
  [ -f "$model_dir/bpecodes" ] || die "$model_dir has no bpecodes (--bpe fastbpe)"
  bpe_args=(--bpe-codes "$model_dir/bpecodes")
fi

exec "$python" -m fairseq_streambeam.bench --data "$model_dir" --path "$paths" -s "$s" -t "$t" \
  --src "$src" --ref "$ref" --tokenizer "$tokenizer" --bpe "$bpe" "${bpe_args[@]}" \
  --config "$config" --repeats "$repeats" --out "$out" "$@"
