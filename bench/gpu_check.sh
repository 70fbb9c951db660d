#!/usr/bin/env bash
# The GPU check, in one call on a CUDA machine without network (an H200 in mind), within a budget:
#   bash bench/gpu_check.sh             on the GPU machine (OUT=... for where the results go)
#   bash bench/gpu_check.sh --dry-run   here or in CI, no GPU: every step but its CUDA work
#
# On the GPU machine: the wheels in .whl/ (bench/gpu_kit/wheelhouse.sh builds it; wheels.txt:
# diffusers, pydantic, av, ...) are installed with --target /tmp/site, first on PYTHONPATH (the
# image's torch, triton and numpy untouched); then bench/gpu_kit/steps.txt's steps in order:
#   env       versions, CUDA, the imports every step needs (no CUDA: the rest is skipped);
#   tests     correctness: tests/gpu and tests/unit/test_kernels.py on real Triton kernels
#             (lossless bit-identical under batching for every served class and the full
#             presets, the memory plan within 10% of the allocator's peak, tiled peaks within
#             their bound, the out-of-memory retry on a real CUDA OOM, folded buffers released,
#             deferred host copies, the fp32 fallback on a real fp16 overflow);
#   fastpath  speed: sd/flux/flux2 at 1024 and 2048 px per tier (lossless is diffusers' own
#             decode bit for bit; high), `high` images/s at 512 and 1024 px, batch 1/4/8;
#   video     Wan 81 frames at 480x832 and 720x1280, Qwen-Image 1024 px: diffusers vs lossless
#             (bit-identity checked) vs high, first streamed chunk, memory untiled vs tiled;
#   encode    png vs uint8 at 1024 px, batch 8, 16 in flight;
#   preemption  a session's chunk latency beside bulk Wan clips and 2048 px lossless tiled images, preemption on/off;
#   memory    each tier's estimate vs the allocated peak, a tiled peak vs its bound;
#   parallel  one request's tiles over every GPU here (no Ray) vs one GPU, bit-identity;
#   replay    lossless above the bound: the class's tiled decode direct vs recorded and replayed;
#   fastpath_wan  the Wan rows of the tier table, with what budget is left;
#   compile   diffusers' own decode eager vs torch.compile'd vs high (bench/gpu_kit/bench_compile.py).
# Each step runs under its own timeout; one that would start with less than its minimum left of
# GPU_CHECK_BUDGET_S (default 480 s, counted from the start, install included) is skipped and
# recorded so. Everything printed goes to $OUT/gpu_check.log (and stdout); $OUT/summary.json has
# each step's name, status (passed/failed/timeout/skipped), rc, seconds and output tail, with the
# versions (torch, triton, CUDA, driver, GPU), the date and the git commit where there is one.
# GPU_CHECK_ONLY=tests,fastpath runs only those steps. Exit status: 0 when no step failed or
# timed out (skipped ones are listed in the summary).
# Targets (issue notes): high <= 22 ms at 1024 px and <= 130 ms at 2048 px; lossless <= 80 ms;
# Wan lossless <= 1.3 s and high <= 0.8 s at 480p, high <= 2.0 s at 720p; png/uint8 <= 1.3.
#
# --dry-run (no GPU, well under a minute once .whl is built; network only without .whl): the
# wheelhouse checked (bench/gpu_kit/kit.py wheels: one wheel per pin, resolved for CPython 3.12
# manylinux x86-64 from .whl, or from PyPI's metadata without it; requirements met by the pins or
# the GPU image; the loadable wheels installed into a temp --target), then, under an interpreter
# that sees only what the GPU machine will (that target plus the packages the image has too), the
# env step's imports, the pytest steps collected, each bench step's exact flags parsed by the
# bench's own argparse (a renamed flag fails), and the summary written. GPU_CHECK_OFFLINE=1
# without .whl skips the resolution, with a note.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
RESERVE=${GPU_CHECK_RESERVE_S:-20}  # left for the summary
STEPS=${GPU_CHECK_STEPS:-bench/gpu_kit/steps.txt}
ONLY=${GPU_CHECK_ONLY:-}
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # real kernels (tests/conftest.py sets it only where CUDA is missing)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
RECORDS=$TMP/records.jsonl
SECONDS=0
SUMMARY_PY=${PYTHON:-python3}

say() { echo "$*" | tee -a "$LOG"; }
record() {  # name status rc seconds output note
  "$SUMMARY_PY" bench/gpu_kit/summary.py record --records "$RECORDS" --name "$1" --status "$2" \
    ${3:+--rc "$3"} --seconds "$4" ${5:+--output "$5"} ${6:+--note "$6"}
}
# run_step NAME MIN_S MAX_S COMMAND: under `timeout`, within what is left of the budget
run_step() {
  local name=$1 min=$2 max=$3 cmd=$4
  local left=$((BUDGET - RESERVE - SECONDS))
  if ((left < min)); then
    say "== $name: skipped ($left s of the budget left, needs $min s)"
    record "$name" skipped "" 0 "" "budget: ${left}s left, needs ${min}s"
    return 0
  fi
  local limit=$((max < left ? max : left)) start=$SECONDS rc status
  say "== $name (timeout ${limit}s, ${left}s of the budget left, $(date -u +%H:%M:%S)): $cmd"
  timeout -k 10 "$limit" bash -c "$cmd" </dev/null 2>&1 | tee -a "$LOG" "$TMP/$name.out"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=passed ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  say "== $name: $status (rc $rc, $((SECONDS - start)) s)"
  record "$name" "$status" "$rc" "$((SECONDS - start))" "$TMP/$name.out" ""
  return "$rc"
}

if ((DRY)); then
  export PY=${DRY_PYTHON:-.venv/bin/python}
  [[ -x $PY ]] || PY=python3
  say "== gpu_check --dry-run with $PY ($(date -u +%FT%TZ)), budget ${BUDGET}s"
  run_step wheels 10 180 "$PY bench/gpu_kit/kit.py wheels --work $TMP/kit"
  # the GPU machine's view: no site-packages, only the wheels and the packages the image has too
  SIM="$PY -S"
  export PYTHONPATH="$TMP/kit/site:$TMP/kit/farm:$ROOT:$ROOT/clients"
  left=$((BUDGET - RESERVE - SECONDS))
  say "== dry steps under '$SIM' with PYTHONPATH=$PYTHONPATH (timeout ${left}s)"
  timeout -k 10 "$left" $SIM bench/gpu_kit/kit.py dry --records "$RECORDS" --steps "$STEPS" --only "$ONLY" </dev/null 2>&1 |
    tee -a "$LOG" "$TMP/dry.out"
  rc=${PIPESTATUS[0]}
  if ((rc != 0 && rc != 1)); then  # 1: a step failed, and said so in its record
    record dry "$([[ $rc == 124 || $rc == 137 ]] && echo timeout || echo failed)" "$rc" "$SECONDS" "$TMP/dry.out" ""
  fi
  PY_FOR_SUMMARY=$SIM
  MODE=dry
else
  export PY=${PYTHON:-python3}
  say "== gpu_check on ${HOSTNAME:-?} with $PY ($(date -u +%FT%TZ)), budget ${BUDGET}s"
  if compgen -G ".whl/*.whl" >/dev/null; then
    run_step install 5 240 "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --disable-pip-version-check --target $SITE .whl/*.whl"
    export PYTHONPATH="$SITE:$ROOT:$ROOT/clients${PYTHONPATH:+:$PYTHONPATH}"
  else
    say "== install: skipped (no .whl/: the image's own packages)"
    record install skipped "" 0 "" "no .whl"
    export PYTHONPATH="$ROOT:$ROOT/clients${PYTHONPATH:+:$PYTHONPATH}"
  fi
  no_cuda=0
  while read -r name min max cmd; do
    [[ -z $name || $name == \#* ]] && continue
    [[ -n $ONLY && ",$ONLY," != *",$name,"* ]] && continue
    if ((no_cuda)); then
      say "== $name: skipped (no CUDA device)"
      record "$name" skipped "" 0 "" "no CUDA device"
      continue
    fi
    run_step "$name" "$min" "$max" "$cmd"
    rc=$?
    [[ $name == env && $rc == 3 ]] && no_cuda=1
  done <"$STEPS"
  PY_FOR_SUMMARY=$PY
  MODE=gpu
fi

"$SUMMARY_PY" bench/gpu_kit/summary.py write --records "$RECORDS" --out "$OUT/summary.json" --mode "$MODE" \
  --python "$PY_FOR_SUMMARY" --budget "$BUDGET" --elapsed "$SECONDS" 2>&1 | tee -a "$LOG"
"$SUMMARY_PY" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/summary.json'))['ok'] else 1)"
