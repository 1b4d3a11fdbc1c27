#!/usr/bin/env bash
# One device call: the bounded GPU measurement, then the GPU tests, everything returned through $OUT.
#
#   bash benchmarks/gpu_session.sh            (from the repository root; OUT defaults to a temp folder)
#
# Environment: ATTNZOO_PHASES (gpu_speed.py's phases, default "warm speed correctness"),
# ATTNZOO_SPEED_SECONDS (its budget, default 300), ATTNZOO_TESTS_SECONDS (pytest -m gpu, default 150;
# 0 skips the tests), ATTNZOO_TESTS (what pytest collects, default "tests"), ATTNZOO_SPEED_ARGS (more
# gpu_speed.py arguments), ATTNZOO_RESULTS (results folder, default benchmarks/results/gpu/<device>),
# ATTNZOO_SPEED_SLACK (seconds past its budget before the measurement is stopped, default 90).
# Files in $OUT (the device tool returns at most eight): env.txt, log.txt and models.jsonl (written as
# the measurement goes: a call stopped half-way still returns them), speed.md, models.md, tests.log,
# results.tar.gz (the whole results folder: `tar xzf results.tar.gz` in the repository root puts it in
# place).
set -u
OUT="${OUT:-$(mktemp -d -t attnzoo_gpu.XXXXXX)}"
PY="${ATTNZOO_PYTHON:-python3}"
SPEED_SECONDS="${ATTNZOO_SPEED_SECONDS:-300}"
TESTS_SECONDS="${ATTNZOO_TESTS_SECONDS:-150}"
PHASES="${ATTNZOO_PHASES:-warm speed correctness}"
TESTS="${ATTNZOO_TESTS:-tests}"
export PYTHONUNBUFFERED=1

{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi; "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/env.txt" 2>&1

name=$("$PY" -c "import torch; from attnzoo.ops.measured import slug; print(slug(torch.cuda.get_device_name()))")
results="${ATTNZOO_RESULTS:-benchmarks/results/gpu/$name}"
mkdir -p "$results"
# the measurement keeps its own deadlines (each phase, each model case); the outer limit only catches a hang
# shellcheck disable=SC2086  # PHASES is a word list on purpose
timeout -s INT -k 20 $((SPEED_SECONDS + ${ATTNZOO_SPEED_SLACK:-90})) "$PY" benchmarks/gpu_speed.py --budget-seconds "$SPEED_SECONDS" \
  --out "$results" --mirror "$OUT" --phases $PHASES ${ATTNZOO_SPEED_ARGS:-} 2>&1 | tail -n 400 > "$results/stdout.txt"
cp "$results/speed.md" "$results/models.md" "$OUT/" 2>/dev/null

if [ "$TESTS_SECONDS" -gt 0 ]; then
  workers=""
  "$PY" -c "import xdist" 2>/dev/null && workers="-n 8"
  # shellcheck disable=SC2086  # TESTS and workers are word lists on purpose
  timeout -s INT -k 20 "$TESTS_SECONDS" "$PY" -m pytest -q -rfE -p no:cacheprovider -m gpu --timeout 120 $workers $TESTS \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit code $?" >> "$OUT/tests.log"
  tail -n 25 "$OUT/tests.log"
fi

tar czf "$OUT/results.tar.gz" "$results" 2>/dev/null
grep -A 20 "^## Summary" "$results/speed.md" 2>/dev/null | head -30
grep -A 14 "^## Throughput" "$results/models.md" 2>/dev/null
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
