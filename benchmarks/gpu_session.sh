#!/usr/bin/env bash
# One device call for a GPU session: the GPU test suites, then the d64 benchmark sweep, in ~540 s.
#
#   bash benchmarks/gpu_session.sh [tests|sweep|all]        (default: all; run from the repository root)
#
# Made for a lent machine reached through one shell command: python3 with torch/triton/timm already
# there, no pip, no venv, output returned only from $OUT (a handful of files) and the tail of stdout.
# Every phase has a hard time limit, the sweep saves each finished row at once (JSONL) and is rebuilt
# from it if it had to be killed, so a session always brings back something.
#
# Files in $OUT (default: a fresh temporary folder, printed at the end):
#   env.txt          GPU, driver, versions, which optional Python modules are importable
#   tests.log        full pytest output of phase 1
#   sweep.log        full output of phase 2 (one line per finished row)
#   sweep_summary.md the Markdown tables of every configuration (readable without unpacking)
#   sweep.tar.gz     the sweep folder (JSON, JSONL, Markdown, PNG), relative to the repository root:
#                    `tar xzf sweep.tar.gz` there puts it under benchmarks/results/gpu/<device>/
#   session.log      this script's own progress lines
#
# Budgets (seconds, environment variables):
#   ATTNZOO_TESTS_SECONDS   whole test phase (default 200 in "all", 480 alone)
#   ATTNZOO_TEST_TIMEOUT    one test (pytest-timeout, when installed; default 120)
#   ATTNZOO_SWEEP_SECONDS   whole sweep phase, startup and writing included (default 280 in "all", 480 alone)
#   ATTNZOO_CONFIG_SECONDS  one sweep configuration (default: 40% of the sweep phase)
#   ATTNZOO_CALL_TIMEOUT    any single benchmarked call, its compile included (default 45)
#   ATTNZOO_MAX_CALL        skip rows whose steady call is slower than this (default 5)
# Other knobs: ATTNZOO_PYTHON (python3), ATTNZOO_SEQ_LENS ("1024 4096"), ATTNZOO_SKIP_BACKENDS (none),
# ATTNZOO_SWEEP_OUT (benchmarks/results/gpu/<device>), ATTNZOO_SWEEP_ARGS (appended to sweep_gpu.py's
# arguments, e.g. "--device cpu --head-dims 8 --hidden 16" to check this script on a CPU).
set -u

PHASE="${1:-all}"
case "$PHASE" in
  tests|sweep|all) ;;
  *) echo "usage: bash benchmarks/gpu_session.sh [tests|sweep|all]" >&2; exit 2 ;;
esac

PY="${ATTNZOO_PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d -t attnzoo_gpu_session.XXXXXX)}"
mkdir -p "$OUT"
if [ "$PHASE" = all ]; then default_tests=200; default_sweep=280; else default_tests=480; default_sweep=480; fi
TESTS_SECONDS="${ATTNZOO_TESTS_SECONDS:-$default_tests}"
TEST_TIMEOUT="${ATTNZOO_TEST_TIMEOUT:-120}"
SWEEP_SECONDS="${ATTNZOO_SWEEP_SECONDS:-$default_sweep}"
CONFIG_SECONDS="${ATTNZOO_CONFIG_SECONDS:-$((SWEEP_SECONDS * 2 / 5))}"
CALL_TIMEOUT="${ATTNZOO_CALL_TIMEOUT:-45}"
MAX_CALL="${ATTNZOO_MAX_CALL:-5}"
SEQ_LENS="${ATTNZOO_SEQ_LENS:-1024 4096}"
SESSION_START=$(date +%s)

say() {  # a progress line on stdout (the device tool returns its tail) and in session.log
  echo "[gpu_session +$(( $(date +%s) - SESSION_START ))s] $*" | tee -a "$OUT/session.log"
}

slug() {  # as attnzoo.bench.environment.slug: lower case, runs of other characters -> one '-'
  echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//'
}

environment() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    # versions from package metadata, without importing anything (importing torch costs seconds)
    "$PY" - <<'EOF' 2>&1
import importlib.metadata as md, importlib.util, sys
print("python", sys.version.split()[0])
for module, dist in (("torch", "torch"), ("triton", "triton"), ("timm", "timm"), ("pytest", "pytest"),
                     ("pytest_timeout", "pytest-timeout"), ("hypothesis", "hypothesis"), ("rich", "rich"),
                     ("matplotlib", "matplotlib"), ("yaml", "PyYAML"), ("safetensors", "safetensors"),
                     ("einops", "einops"), ("flash_attn", "flash-attn"), ("fla", "flash-linear-attention")):
    if importlib.util.find_spec(module) is None:
        print(f"{module}: missing")
        continue
    try:
        print(f"{module}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{module}: installed (version unknown)")
EOF
  } > "$OUT/env.txt"
  say "environment written to env.txt"
}

run_tests() {
  local files=() f
  for f in tests/test_triton_gpu.py tests/test_fused_sinkhorn.py tests/test_fused_linear.py \
           tests/test_fused_ot.py tests/test_triton_dropout.py; do
    [ -f "$f" ] && files+=("$f")
  done
  if [ ${#files[@]} -eq 0 ]; then
    say "tests: none of the GPU test files exists"; return 0
  fi
  local per_test=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    per_test=(--timeout "$TEST_TIMEOUT")
  else
    say "tests: pytest-timeout is not installed: no per-test limit, only the phase limit"
  fi
  say "tests: ${files[*]} (phase limit ${TESTS_SECONDS}s, per test ${TEST_TIMEOUT}s)"
  # SIGINT first: pytest stops and still prints its summary of what ran; SIGKILL 20 s later if stuck
  timeout -s INT -k 20 "$TESTS_SECONDS" "$PY" -m pytest -q -rfE -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} "${files[@]}" \
    > "$OUT/tests.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/tests.log"
  say "tests: exit code $rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ' (phase time limit reached)')"
}

run_sweep() {
  local sweep_out="${ATTNZOO_SWEEP_OUT:-}"
  if [ -z "$sweep_out" ]; then
    local name
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    sweep_out="benchmarks/results/gpu/$(slug "${name:-device}")"
  fi
  # the sweep's own total budget leaves room for Python's start-up and the last configuration's files
  local total=$((SWEEP_SECONDS - 45))
  [ "$total" -lt 10 ] && total=10
  local skip=()
  [ -n "${ATTNZOO_SKIP_BACKENDS:-}" ] && skip=(--skip-backends "$ATTNZOO_SKIP_BACKENDS")
  say "sweep: d64, N = $SEQ_LENS, budget ${total}s in all, ${CONFIG_SECONDS}s per configuration -> $sweep_out"
  local started
  started=$(mktemp -t attnzoo_sweep_start.XXXXXX)  # files newer than this one are this session's
  # shellcheck disable=SC2086  # SEQ_LENS and ATTNZOO_SWEEP_ARGS are word lists on purpose
  timeout -s TERM -k 15 "$SWEEP_SECONDS" "$PY" benchmarks/sweep_gpu.py --head-dims 64 --seq-lens $SEQ_LENS \
    --causal no yes --max-call-seconds "$MAX_CALL" --call-timeout-seconds "$CALL_TIMEOUT" --target-seconds 0.5 \
    --budget-seconds "$CONFIG_SECONDS" --total-budget-seconds "$total" --out "$sweep_out" ${skip[@]+"${skip[@]}"} \
    ${ATTNZOO_SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/sweep.log"
  say "sweep: exit code $rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ' (killed at the phase limit)')"
  # a configuration cut off before its final write: rebuild its JSON (and Markdown, plots) from the row log
  local log md
  for log in "$sweep_out"/*.jsonl; do
    [ -e "$log" ] && [ "$log" -nt "$started" ] || continue
    if [ ! -e "${log%.jsonl}.json" ] || [ "${log%.jsonl}.json" -ot "$log" ]; then
      say "sweep: rebuilding ${log%.jsonl}.json from its row log"
      timeout 60 "$PY" -m attnzoo bench --from-jsonl "$log" --quiet >> "$OUT/sweep.log" 2>&1 \
        || say "sweep: rebuild of $log failed (the row log itself is in the archive)"
    fi
  done
  if [ -d "$sweep_out" ]; then
    : > "$OUT/sweep_summary.md"
    for md in "$sweep_out"/*.md; do
      [ -e "$md" ] && [ "$md" -nt "$started" ] && cat "$md" >> "$OUT/sweep_summary.md"
    done
    tar czf "$OUT/sweep.tar.gz" "$sweep_out"
    say "sweep: archived $sweep_out -> sweep.tar.gz ($(du -k "$OUT/sweep.tar.gz" | cut -f1) KiB)"
  else
    say "sweep: no output folder $sweep_out"
  fi
  rm -f "$started"
}

say "phase $PHASE, output in $OUT"
environment
case "$PHASE" in
  tests) run_tests ;;
  sweep) run_sweep ;;
  all) run_tests; run_sweep ;;
esac
say "done; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
