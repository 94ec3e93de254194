#!/usr/bin/env bash
# Checks and measurements on a GPU machine, one command per stage (--device cpu --tiny makes a
# quick dry run anywhere). Installs the wheels that scripts/gpu_prepare.sh put in .whl/
# when fairseq is missing, records the machine, then runs the stages named by --step:
#   tests    the CUDA tests (pytest -m cuda tests/test_cuda.py)
#   bench    deen-tiny at beam 5 and 50 (fairseq, beam, var-batch, var-stream, and continuous / ct2
#            when they exist), the same in fp16 (identical: to fairseq fp16), gec-tiny IAD at batch 1 and 32 against fairseq greedy, the step
#            cost of deen-tiny by rows (fairseq's step; the plugin's, eager and as a CUDA graph), the host work
#            per step (scripts/host_step.py, into bench.log), then deen-tiny with configs/engine_k5.json and
#            engine_k50.json (var-batch, var-stream, continuous, both under a candidate budget C,
#            and ct2 where it runs) on --limit sentences at k = 5 and 50
#   drafter  trains a GAD block drafter for deen-tiny (scripts/train_drafter.sh, greedy distillation
#            of --drafter-lines) for --drafter-minutes, then GAD at batch 32 and 1 (half of batch
#            1's share of --limit) against fairseq greedy (tokens per pass, speed)
#   compile  the host work per step with --compile (on CUDA: CUDA graphs; scripts/host_step.py),
#            then --compile against the same decodings without it, in one process each: deen-tiny beam
#            and var-stream at beam 5 and 50 (and ct2 where it runs), and gec-tiny IAD at batch 1 and 32
#            against fairseq greedy; at least 5 repeats, the first capturing or compiling
#   serve    streambeam-serve on deen-tiny, var-stream k=5: continuous batching against static and
#            single (bench/serve_bench.py) at 1, 8, 32 and 128 clients over --limit lines (single: a
#            quarter), every answer checked against offline decoding
#   big      a WMT'19-shaped transformer (6+6 layers, d 1024, ffn 8192, 16 heads) trained for
#            --big-minutes on the de-en training text (pre-norm, fp16), its step costs by rows, host
#            against device time per step at 320 rows (fp32, fp16; gpu_check.py profile; then with
#            --compile's graphs, rows padded to powers of two and to quarter octaves), beam 5 with
#            fairseq, beam, var-batch, var-stream and fixed-stream (fp32, then fp16), beam and
#            var-stream with and without --compile on a quarter of --limit, and beam 50 on a fifth
# Each stage logs to OUT/<stage>.log; OUT/results.json, OUT/results.md and OUT/gpu_check.png are
# rewritten after every command, so a run cut off midway still returns what it measured.
# Options: --step LIST (tests; several comma-separated) --out DIR ($OUT, else ./gpu-out)
#   --device cuda|cpu --data DIR (gpu-data, else ../shared) --limit N (test sentences; 500; a quarter
#   of them for batch 1, which decodes one sentence at a time)
#   --repeats N (2) --drafter-minutes M (3) --drafter-lines N (20000) --big-minutes M (3)
#   --big-vocab N (dictionary padded to N entries; 42000; 0 keeps the tiny models' 8008)
#   --deadline S (seconds for the whole run, 570: commands are cut so the summary is written in time)
#   --tests-k EXPR (pytest -k) --tiny (dry-run sizes: tiny models, 5 sentences, a few updates, beam 5
#   and batch 1 only)
# Environment: PYTHON (default python3), WORK (scratch folder; default a new one under /tmp).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
steps=tests; device=cuda; out="${OUT:-$here/gpu-out}"; data=""; limit=""; repeats=""; tests_k=""; tiny=0
drafter_minutes=3; drafter_lines=20000; big_minutes=3; big_vocab=42000; deadline=570; valid_lines=500
beams=(5 50); batches=(1 32)  # bench: deen-tiny beam sizes; gec-tiny IAD and deen-tiny GAD batch sizes
python="${PYTHON:-python3}"
die() { echo "gpu_check.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^# Environment/p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --step|--steps) steps="$2"; shift 2;;
    --out) out="$2"; shift 2;;
    --device) device="$2"; shift 2;;
    --data) data="$2"; shift 2;;
    --limit) limit="$2"; shift 2;;
    --repeats) repeats="$2"; shift 2;;
    --drafter-minutes) drafter_minutes="$2"; shift 2;;
    --drafter-lines) drafter_lines="$2"; shift 2;;
    --big-minutes) big_minutes="$2"; shift 2;;
    --big-vocab) big_vocab="$2"; shift 2;;
    --deadline) deadline="$2"; shift 2;;
    --tests-k) tests_k="$2"; shift 2;;
    --tiny) tiny=1; shift;;
    -h|--help) usage 0;;
    *) echo "gpu_check.sh: unknown option $1" >&2; usage 2;;
  esac
done
IFS=, read -r -a stage_list <<< "$steps"
for s in "${stage_list[@]}"; do
  case "$s" in tests|bench|compile|drafter|serve|big) ;;
    *) die "unknown step '$s' (tests, bench, compile, drafter, serve, big)";; esac
done
case "$device" in cuda|cpu) ;; *) die "--device must be cuda or cpu";; esac
for n in "$deadline" "$drafter_lines" "$big_vocab" ${limit:+"$limit"} ${repeats:+"$repeats"}; do
  [[ "$n" =~ ^[0-9]+$ ]] || die "expected a whole number, got '$n'"
done
for n in "$drafter_minutes" "$big_minutes"; do
  [[ "$n" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "expected a number of minutes, got '$n'"
done
if [ -z "$data" ]; then
  if [ -d gpu-data/models ]; then data="$here/gpu-data"; else data="${STREAMBEAM_SHARED:-$here/../shared}"; fi
fi
data="$(cd "$data" 2>/dev/null && pwd)" || die "no data folder (run scripts/gpu_prepare.sh and carry gpu-data, or --data ../shared)"
[ -f "$data/models/deen-tiny/checkpoint_best.pt" ] || die "no models/deen-tiny in $data (run scripts/gpu_prepare.sh)"
if [ "$tiny" = 1 ]; then
  limit="${limit:-5}"; repeats="${repeats:-1}"; tests_k="${tests_k:-ensemble_and_options or prefix_tokens}"
  drafter_lines=60; big_vocab=0; valid_lines=20; beams=(5); batches=(1)
else
  limit="${limit:-500}"; repeats="${repeats:-2}"
fi
mkdir -p "$out" || die "cannot create $out"
out="$(cd "$out" && pwd)"
work="${WORK:-$(mktemp -d /tmp/gpu-check.XXXXXX)}"
mkdir -p "$work"
: > "$work/stages.tsv"
export STREAMBEAM_SHARED="$data" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# ---- wheels (the GPU machine has no fairseq) and the machine's record ------------------------------
record_env() {  # WORK/env.json; fails when torch or fairseq does not import
  "$python" - "$work/env.json" "$device" <<'EOF' > "$work/env.err" 2>&1
import json, platform, subprocess, sys
import torch, fairseq
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "fairseq": fairseq.__version__, "device": sys.argv[2]}
if torch.cuda.is_available():
    env["gpu"] = torch.cuda.get_device_name(0)
    env["cuda_available"] = True
try:
    env["nvidia-smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError:
    pass
json.dump(env, open(sys.argv[1], "w"))
EOF
}
if ! record_env; then
  ls .whl/*.whl >/dev/null 2>&1 || die "fairseq is not importable and .whl/ has no wheels (run scripts/gpu_prepare.sh, carry .whl)"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || die "installing .whl/*.whl failed"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
  record_env || die "fairseq still not importable after installing .whl/: $(grep -v '^ ' "$work/env.err" | tail -n 1)"
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
cat "$work/env.json" && echo
if [ "$device" = cuda ] && ! grep -q '"cuda_available": true' "$work/env.json"; then
  die "--device cuda: torch sees no CUDA device"
fi

# ---- helpers ----------------------------------------------------------------------------------
helper=("$python" "$here/scripts/gpu_check.py")
left() { echo $((deadline - SECONDS)); }

summarize() { "${helper[@]}" summarize "$work" "$out" "$@" 2>>"$out/summary.err"; }

# run STAGE LABEL CMD...: CMD's output goes to OUT/STAGE.log, its exit status and seconds to
# WORK/stages.tsv; it gets the time left less a reserve for the summary (exit 124: cut off).
run() {
  local stage=$1 label=$2; shift 2
  local budget=$(($(left) - 20)) t0=$SECONDS rc
  if [ "$budget" -lt 10 ]; then
    printf '%s\t%s\t%s\t%s\n' "$stage" "$label (skipped: out of time)" 124 0 >> "$work/stages.tsv"
    echo "[$stage] $label: skipped, out of time"
    return 124
  fi
  echo "==== $label: $*" >> "$out/$stage.log"
  timeout --kill-after=10 "$budget" "$@" >> "$out/$stage.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$stage" "$label" "$rc" $((SECONDS - t0)) >> "$work/stages.tsv"
  echo "[$stage] $label: exit $rc in $((SECONDS - t0)) s"
  summarize > /dev/null
  return "$rc"
}

bench() {  # bench STAGE NAME ARGS...: one benchmark run into WORK/bench-NAME
  local stage=$1 name=$2; shift 2
  run "$stage" "$name" "$python" -m fairseq_streambeam.bench "$@" --device "$device" --repeats "$repeats" \
    --threads 1 --quiet --no-plots --out "$work/bench-$name"
}

limit_for() { if [ "$1" = 1 ] && [ "$limit" -gt 100 ]; then echo $((limit / 4)); else echo "$limit"; fi; }

has_method() { "${helper[@]}" has-method "$1" 2>/dev/null; }

has_ct2() {  # CTranslate2 importable and able to use the device (its wheel needs CUDA 12's cuBLAS)
  [ "$tiny" = 0 ] || return 1
  "$python" -c "import sys, ctranslate2; sys.exit(0 if '$device' == 'cpu' or ctranslate2.get_cuda_device_count() > 0 else 1)" \
    >/dev/null 2>&1
}

read_text() { if [ -f "$1" ]; then cat "$1"; elif [ -f "$1.gz" ]; then gzip -dc "$1.gz"; else return 1; fi; }

text_slice() {  # text_slice N NAME: WORK/text/NAME.{de,en} = the first N training lines (0: all); valid.* beside
  local n=$1 name=$2 l src="$data/data/train/de-en"
  mkdir -p "$work/text"
  for l in de en; do
    if [ "$n" -gt 0 ]; then read_text "$src/train.$l" | head -n "$n"; else read_text "$src/train.$l"; fi > "$work/text/$name.$l"
    read_text "$src/valid.$l" | head -n "$valid_lines" > "$work/text/valid.$l"
    [ -s "$work/text/valid.$l" ] || head -n 200 "$work/text/$name.$l" > "$work/text/valid.$l"
  done
  [ -s "$work/text/$name.de" ] || { echo "no training text under $src" >> "$out/$3.log"; return 1; }
}

deen="$data/models/deen-tiny"; gec="$data/models/gec-tiny"
tiny_ar=(--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32 --encoder-ffn-embed-dim 64
         --decoder-ffn-embed-dim 64 --encoder-attention-heads 2 --decoder-attention-heads 2 --max-update 3)

# ---- stages -----------------------------------------------------------------------------------
stage_tests() {
  local k=()
  [ -n "$tests_k" ] && k=(-k "$tests_k")
  run tests pytest env STREAMBEAM_TEST_DEVICE="$device" STREAMBEAM_TEST_THREADS=1 \
    "$python" -m pytest -m cuda tests/test_cuda.py -q -rA -p no:cacheprovider --junitxml="$work/tests.xml" "${k[@]}"
}

stage_bench() {
  local methods="fairseq,beam,var-batch,var-stream" m k b
  for m in continuous; do has_method "$m" && methods+=",$m"; done  # methods that may come later
  has_ct2 && methods+=",ct2"
  for k in "${beams[@]}"; do
    bench bench "deen-k$k" --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" -s de -t en --beam "$k" \
      --methods "$methods" --limit "$limit"
  done
  for k in "${beams[@]}"; do  # half precision: beam's top-1 against fairseq's generator in fp16
    bench bench "deen-k$k-fp16" --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" -s de -t en --beam "$k" \
      --methods fairseq,beam,var-batch,var-stream --exact-ref fairseq --fp16 --limit "$limit"
  done
  for b in "${batches[@]}"; do
    bench bench "gec-iad-b$b" --data "$gec/data-bin" --path "$gec/checkpoint_best.pt" -s src -t trg --beam 1 \
      --batch-size "$b" --methods fairseq-greedy,greedy,iad --baseline fairseq-greedy --exact-ref fairseq-greedy \
      --limit "$(limit_for "$b")"
  done
  local rows=1,2,4,8,16,32,64,128,256,512,1024,2048,4096
  [ "$tiny" = 1 ] && rows=1,2,4
  run bench step-cost-deen "${helper[@]}" step-cost --data "$deen/data-bin" \
    --path "$deen/checkpoint_best.pt" -s de -t en --device "$device" --rows "$rows" --out "$work/step_cost_deen.json"
  run bench lean-step-deen "${helper[@]}" lean-step-cost --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" \
    -s de -t en --device "$device" --rows "$([ "$tiny" = 1 ] && echo 1,4 || echo 1,8,64,320,1024,3200)" \
    --out "$work/lean_step_deen.json"
  run bench host-step "$python" scripts/host_step.py --device "$device" --rounds "$([ "$tiny" = 1 ] && echo 1 || echo 5)"
  # the candidate-budget configs, last: the runs above keep their time. k = 50 decodes all --limit
  # sentences too: on a fifth (100) the longest output takes 55 of var-batch's 86 steps, so no
  # order could take under 0.64x its steps; on 500, 201 of 426 (CPU, the same outputs). A run that
  # does not finish in time brings back nothing but its exit status (124).
  local drop=()
  has_ct2 || drop=(--drop ct2)  # the benchmark refuses a config whose ct2 cannot run
  for k in "${beams[@]}"; do
    "${helper[@]}" bench-config "configs/engine_k$k.json" "$work/engine_k$k.json" "${drop[@]}" >> "$out/bench.log" 2>&1 \
      || { echo "[bench] engine-k$k: no config (see bench.log)"; continue; }
    bench bench "engine-k$k" --config "$work/engine_k$k.json" --data "$deen/data-bin" \
      --path "$deen/checkpoint_best.pt" -s de -t en --limit "$limit"
  done
}

stage_compile() {
  local methods="beam,beam+compile,var-stream,var-stream+compile" k n b
  local repeats=$(( repeats < 5 ? 5 : repeats ))  # the first captures: medians of 5 are warm
  has_ct2 && methods+=",ct2"
  run compile host-step-compile "$python" scripts/host_step.py --device "$device" --compile \
    --rounds "$([ "$tiny" = 1 ] && echo 1 || echo 5)"
  for k in "${beams[@]}"; do  # k = 50 on a fifth of the sentences
    n=$limit
    [ "$k" -gt 5 ] && n=$(( limit / 5 > 0 ? limit / 5 : 1 ))
    bench compile "deen-compile-k$k" --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" -s de -t en \
      --beam "$k" --methods "$methods" --baseline beam --exact-ref beam --limit "$n"
  done
  if [ "$device" = cuda ]; then  # host against device time with the graphs, where rows are many
    for k in "${beams[@]}"; do
      run compile "profile-deen-k$k" "${helper[@]}" profile --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" \
        -s de -t en --device "$device" --beam "$k" --sources 64 --methods beam,beam+compile,var-stream+compile \
        --out "$work/profile_deen_k$k.json"
    done
  fi
  for b in "${batches[@]}"; do  # on CUDA the draft blocks replay CUDA graphs
    bench compile "gec-compile-b$b" --data "$gec/data-bin" --path "$gec/checkpoint_best.pt" -s src -t trg --beam 1 \
      --batch-size "$b" --methods fairseq-greedy,iad,iad+compile --baseline fairseq-greedy \
      --exact-ref fairseq-greedy --limit "$(limit_for "$b")"
  done
}

stage_drafter() {
  text_slice "$drafter_lines" drafter drafter || return 1
  # greedy distillation (GAD verifies against greedy output); --minutes, not the epoch cap, ends training
  local dout="$work/drafter" extra=(--beam 1 -- --max-epoch 10000) b
  [ "$tiny" = 1 ] && extra=(--beam 2 --block-size 3 -- --arch block_drafter "${tiny_ar[@]}" --no-progress-bar)
  run drafter train-drafter env NPROC=1 THREADS=1 PYTHON="$python" bash scripts/train_drafter.sh --device "$device" \
    --model-dir "$deen" --train "$work/text/drafter" --valid "$work/text/valid" --lines 0 \
    --minutes "$drafter_minutes" --out "$dout" "${extra[@]}"
  local ckpt="$dout/ckpt/checkpoint_best.pt"
  [ -f "$ckpt" ] || { echo "[drafter] no drafter checkpoint: see drafter.log"; return 1; }
  local methods=fairseq-greedy,greedy,no-draft,gad
  [ "$device" = cuda ] && methods+=",gad+compile"  # the draft blocks as CUDA graphs
  # the drafter lives in the run's scratch folder, so its benches share the training's invocation:
  # the largest batch first (it reports tokens per pass soonest), batch 1 on half of limit_for's
  local lim
  for b in $(printf '%s\n' "${batches[@]}" | sort -rn); do
    lim=$(limit_for "$b"); [ "$b" = 1 ] && lim=$(( lim / 2 > 0 ? lim / 2 : 1 ))
    bench drafter "deen-gad-b$b" --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" -s de -t en --beam 1 \
      --batch-size "$b" --methods "$methods" --drafter "$ckpt" --baseline fairseq-greedy \
      --exact-ref fairseq-greedy --limit "$lim"
  done
}

stage_serve() {
  local clients=1,8,32,128
  [ "$tiny" = 1 ] && clients=1,8
  run serve serve-deen "$python" -m fairseq_streambeam.bench.serve_bench \
    --input "$data/data/wmt/de-en/newstest2017.de" --limit "$limit" --single-limit "$(limit_for 1)" \
    --clients "$clients" --device "$device" --threads 1 --out "$work/serve" -- \
    --data "$deen/data-bin" --path "$deen/checkpoint_best.pt" -s de -t en --bpe sentencepiece \
    --sentencepiece-model "$deen/spm8k.model" --decoding var-stream --beam 5
}

stage_big() {
  local lines=0 bb="$work/big-bin" seg="$work/big-seg" l
  [ "$tiny" = 1 ] && lines=200
  text_slice "$lines" big big || return 1
  mkdir -p "$seg" "$bb"
  for l in de en; do
    run big "segment-$l" "${helper[@]}" spm-encode "$deen/spm8k.model" \
      "$work/text/big.$l" "$seg/train.$l" || return 1
    cp "$deen/dict.$l.txt" "$seg/dict.$l.txt"
    if [ "$big_vocab" -gt 0 ]; then  # a WMT-sized output layer: symbols that never occur, appended
      awk -v n="$big_vocab" 'END { for (i = NR + 4; i < n; i++) printf "madeupword%06d 0\n", i }' \
        "$seg/dict.$l.txt" >> "$seg/dict.$l.txt"
    fi
  done
  run big preprocess fairseq-preprocess --source-lang de --target-lang en --trainpref "$seg/train" \
    --srcdict "$seg/dict.de.txt" --tgtdict "$seg/dict.en.txt" --destdir "$bb" --workers 8 || return 1
  cp "$deen"/data-bin/test.de-en.* "$bb/"  # newstest2017 as binarized for deen-tiny: same first 8008 symbols
  # pre-norm, clipped, warmed up over 1000 updates: post-norm at lr 7e-4 with 8k-token batches diverged
  # in fp16 (loss scale at its minimum). Layer shapes, and so step costs, are the WMT'19 models'.
  local arch=(--arch transformer_wmt_en_de_big --encoder-ffn-embed-dim 8192 --decoder-ffn-embed-dim 8192
              --encoder-normalize-before --decoder-normalize-before --clip-norm 1.0
              --stop-time-hours "$(awk "BEGIN{print $big_minutes/60}")")
  [ "$tiny" = 1 ] && arch=(--arch transformer "${tiny_ar[@]}")
  local dev=(--fp16)
  [ "$device" = cpu ] && dev=(--cpu)
  run big train fairseq-train "$bb" -s de -t en "${arch[@]}" --share-all-embeddings --optimizer adam \
    --adam-betas '(0.9,0.98)' --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 1000 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout 0.2 --max-tokens 8192 \
    --save-dir "$work/big-ckpt" --no-epoch-checkpoints --disable-validation --no-save-optimizer-state --seed 1 \
    --log-format simple --log-interval 50 --num-workers 2 "${dev[@]}"
  local ckpt="$work/big-ckpt/checkpoint_last.pt"
  [ -f "$ckpt" ] || { echo "[big] no checkpoint: see big.log"; return 1; }
  local rows=1,2,4,8,16,32,64,128,256,512,1024,2048
  [ "$tiny" = 1 ] && rows=1,2,4
  run big step-cost-big "${helper[@]}" step-cost --data "$bb" --path "$ckpt" \
    -s de -t en --device "$device" --rows "$rows" --out "$work/step_cost_big.json"
  # the goals' runs first (beam against fairseq at k = 5 and 50, host against device time), the
  # diagnostics after them: what the deadline cuts comes last
  local k n p sources=64 half="" lean_rows=1,8,64,320,1024,3200
  [ "$tiny" = 1 ] && sources=4 && lean_rows=1,4
  [ "$device" = cuda ] && half=fp16
  bench big big-k5 --data "$bb" --path "$ckpt" -s de -t en --beam 5 \
    --methods fairseq,beam,var-batch,var-stream,fixed-stream --limit "$limit"
  # --compile where the step is big enough for the device's share to matter: a quarter of the
  # sentences, 3 repeats (the first compiles and captures)
  repeats=$(( repeats < 3 ? 3 : repeats )) bench big big-k5-compile --data "$bb" --path "$ckpt" -s de -t en \
    --beam 5 --methods beam,beam+compile,var-stream,var-stream+compile --baseline beam --exact-ref beam \
    --limit "$(( limit / 4 > 0 ? limit / 4 : 1 ))"
  for k in "${beams[@]}"; do
    [ "$k" -gt 5 ] || continue
    n=$(( limit / 5 > 0 ? limit / 5 : 1 ))
    bench big "big-k$k" --data "$bb" --path "$ckpt" -s de -t en --beam "$k" \
      --methods fairseq,beam,var-batch,var-stream --limit "$n"
  done
  local graphs=""  # on CUDA: the same with --compile's CUDA graphs (fp16: variable-width beams only,
  [ "$device" = cuda ] && graphs=",beam+compile"  # fixed beams keep fairseq's step in half)
  for p in $half fp32; do  # host against device time per step at 64 sources x beam 5 = 320 rows
    run big "profile-big-$p" "${helper[@]}" profile --data "$bb" --path "$ckpt" -s de -t en --device "$device" \
      --beam 5 --sources "$sources" $([ "$p" = fp16 ] && echo --fp16) --out "$work/profile_big_$p.json" \
      --methods "fairseq,beam,var-stream$([ "$p" = fp32 ] && echo "$graphs" || echo ",var-stream+compile")"
  done
  if [ "$device" = cuda ]; then
    # the graphs' rows padded to powers of two against quarter octaves, side by side at 320 rows
    run big profile-big-rows "${helper[@]}" profile --data "$bb" --path "$ckpt" -s de -t en --device "$device" \
      --beam 5 --sources "$sources" --out "$work/profile_big_rows.json" \
      --methods beam+compile,beam+compile-quarter,var-stream+compile,var-stream+compile-quarter
    bench big big-k5-fp16 --data "$bb" --path "$ckpt" -s de -t en --beam 5 --fp16 \
      --methods fairseq,beam,var-batch,var-stream --exact-ref fairseq --limit "$limit"
  fi
  for p in $half fp32; do  # the plugin's step eager against a CUDA graph's replay: what host work costs
    run big "lean-step-big-$p" "${helper[@]}" lean-step-cost --data "$bb" --path "$ckpt" -s de -t en \
      --device "$device" --rows "$lean_rows" $([ "$p" = fp16 ] && echo --fp16) --out "$work/lean_step_big_$p.json"
  done
}

# ---- the run ----------------------------------------------------------------------------------
echo "data: $data | work: $work | out: $out | steps: $steps | limit $limit, repeats $repeats"
for s in "${stage_list[@]}"; do
  "stage_$s"
done
summarize --print
[ -s "$out/summary.err" ] || rm -f "$out/summary.err"  # kept only when the summary itself failed
exit 0
