#!/usr/bin/env bash
# Train a GAD block drafter (--arch block_drafter_small) for an AR fairseq model on the CPU (or a GPU: --device cuda):
#   1. distil: the AR model's own beam output on the training sources (decode_corpus: sharded,
#      resumable; NPROC workers through torchrun)
#   2. segment with the model's sentencepiece model and binarize with the AR model's dictionaries
#   3. fairseq-train --criterion block_drafting (glancing), every tensor of matching shape
#      initialised from the AR checkpoint; stops after MINUTES; keeps the checkpoint with the most
#      accepted draft tokens per block on the (distilled) validation set
# Defaults train a drafter for ../shared/models/deen-tiny on ../shared/data/train/de-en:
#   scripts/train_drafter.sh --out work/drafter-deen
# then decode:  fairseq-generate ... --decoding gad --drafter work/drafter-deen/ckpt/checkpoint_best.pt
# Options: --model-dir DIR (checkpoint, dictionaries, spm8k.model) --checkpoint NAME --dict-dir DIR
#   --bpe sentencepiece|none --train PREFIX --valid PREFIX -s L -t L --out DIR --block-size K
#   --decoder-layers N --minutes M --lines N (first N training lines; 0 = all)
#   --valid-lines N (first N validation lines, distilled and scored at each validation; 0 = all) --beam B
#   --device cpu|cuda (fairseq-train's device; default cpu. Distillation uses CUDA when torch sees it)
#   Anything after `--` goes to fairseq-train (e.g. -- --arch block_drafter --encoder-embed-dim 512).
# Environment: NPROC (distillation workers, default 2), THREADS (per worker, default 1), PYTHON, STREAMBEAM_SHARED (read instead of ../shared).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
shared="${STREAMBEAM_SHARED:-$here/../shared}"
model_dir="$shared/models/deen-tiny"; train="$shared/data/train/de-en/train"; valid="$shared/data/train/de-en/valid"
s=de; t=en; out=work/drafter; k=8; layers=2; minutes=25; lines=0; valid_lines=0; beam=5; checkpoint=checkpoint_best.pt
dict_dir=""; bpe=sentencepiece; device=cpu
python="${PYTHON:-python}"; nproc="${NPROC:-2}"; threads="${THREADS:-1}"
usage() { sed -n '2,/^# Environment/p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model-dir) model_dir="$2"; shift 2;;
    --checkpoint) checkpoint="$2"; shift 2;;
    --dict-dir) dict_dir="$2"; shift 2;;
    --bpe) bpe="$2"; shift 2;;
    --train) train="$2"; shift 2;;
    --valid) valid="$2"; shift 2;;
    -s) s="$2"; shift 2;;
    -t) t="$2"; shift 2;;
    --out) out="$2"; shift 2;;
    --block-size) k="$2"; shift 2;;
    --decoder-layers) layers="$2"; shift 2;;
    --minutes) minutes="$2"; shift 2;;
    --lines) lines="$2"; shift 2;;
    --valid-lines) valid_lines="$2"; shift 2;;
    --beam) beam="$2"; shift 2;;
    --device) device="$2"; shift 2;;
    -h|--help) usage 0;;
    --) shift; break;;
    *) echo "unknown option $1" >&2; usage 2;;
  esac
done
need() { echo "train_drafter.sh: $1" >&2; exit 2; }
count() { [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] || need "$1 must be a whole number of at least $3, not '$2'"; }
count --lines "$lines" 0; count --valid-lines "$valid_lines" 0; count --block-size "$k" 1; count --decoder-layers "$layers" 1; count --beam "$beam" 1
[[ "$minutes" =~ ^[0-9]*\.?[0-9]+$ ]] && awk "BEGIN{exit !($minutes > 0)}" || need "--minutes must be a number above 0, not '$minutes'"
case "$bpe" in sentencepiece|none) ;; *) need "--bpe must be sentencepiece or none, not '$bpe'";; esac
ar="$model_dir/$checkpoint"; dict_dir="${dict_dir:-$model_dir}"
case "$device" in cpu) device_args=(--cpu);; cuda) device_args=();; *) need "--device must be cpu or cuda";; esac
spm_args=(); seg_args=(--bpe none)
if [ "$bpe" = sentencepiece ]; then
  spm_args=(--bpe sentencepiece --sentencepiece-model "$model_dir/spm8k.model")
  seg_args=(--bpe sentencepiece --sentencepiece-model "$model_dir/spm8k.model")
fi
for f in "$ar" "$dict_dir/dict.$s.txt" "$dict_dir/dict.$t.txt" "$train.$s" "$valid.$s"; do
  [ -e "$f" ] || { echo "missing $f" >&2; exit 2; }
done
mkdir -p "$out"
export OMP_NUM_THREADS="$threads"
echo "threads: OMP_NUM_THREADS=$OMP_NUM_THREADS per process, $nproc distillation worker(s)" >&2

for split in train valid; do
  src="$train.$s"; [ "$split" = valid ] && src="$valid.$s"
  n="$lines"; [ "$split" = valid ] && n="$valid_lines"
  if [ "$n" -gt 0 ]; then head -n "$n" "$src" > "$out/$split.head.$s"; src="$out/$split.head.$s"; fi
  echo "== distilling $split ($(wc -l < "$src") lines, beam $beam)" >&2
  NPROC="$nproc" PYTHON="$python" "$here/scripts/decode_corpus.sh" --input "$src" --output-dir "$out/distill-$split" \
    --data "$dict_dir" --path "$ar" -s "$s" -t "$t" "${spm_args[@]}" \
    --decoding beam --beam "$beam" --batch-size 64 --shard-lines 10000 --threads "$threads" --quiet
  "$python" -m fairseq_streambeam.drafters.distill --src "$src" --hyp "$out/distill-$split/output.txt" \
    "${seg_args[@]}" --out-prefix "$out/pairs/$split" -s "$s" -t "$t"
done

echo "== binarizing with the AR model's dictionaries" >&2
rm -rf "$out/bin"
fairseq-preprocess --source-lang "$s" --target-lang "$t" --trainpref "$out/pairs/train" --validpref "$out/pairs/valid" \
  --srcdict "$dict_dir/dict.$s.txt" --tgtdict "$dict_dir/dict.$t.txt" --destdir "$out/bin" --workers "$nproc" >&2

echo "== training for at most $minutes minutes" >&2
share=()
if cmp -s "$dict_dir/dict.$s.txt" "$dict_dir/dict.$t.txt"; then share=(--share-all-embeddings); fi
fairseq-train "$out/bin" --user-dir "$here/fairseq_streambeam" -s "$s" -t "$t" \
  --arch block_drafter_small --decoder-layers "$layers" --draft-block-size "$k" "${share[@]}" --init-from "$ar" \
  --criterion block_drafting --glance-ratio 0.5 --blocks-per-sentence 2 --label-smoothing 0.1 \
  --dropout 0.1 --optimizer adam --adam-betas '(0.9,0.98)' --lr 5e-4 --lr-scheduler inverse_sqrt \
  --warmup-updates 200 --max-tokens 4096 --stop-time-hours "$(awk "BEGIN{print $minutes/60}")" --max-epoch 20 \
  --best-checkpoint-metric draft_accepted --maximize-best-checkpoint-metric --validate-interval-updates 250 \
  --save-interval-updates 250 --keep-interval-updates 1 --no-epoch-checkpoints \
  --save-dir "$out/ckpt" "${device_args[@]}" --seed 1 --log-format simple --log-interval 50 "$@"
echo "drafter: $out/ckpt/checkpoint_best.pt" >&2
