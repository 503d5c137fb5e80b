#!/usr/bin/env bash
# Builds jaxvt with Bazel and runs its CPU tests under Bazel (docs/BAZEL.md).
#
#   tools/bazel_check.sh            # bazel build //... ; bazel test //:cpu_tests (every CPU test file)
#   tools/bazel_check.sh --quick    # ... ; bazel test //:quick_tests (the files tagged "quick")
#   tools/bazel_check.sh --clean    # start from an empty Bazel cache (bazel clean --expunge) first
#
# Environment: JAXVT_BAZEL_JOBS (default 2) bounds --jobs, --local_cpu_resources and
# --local_test_jobs; PYTHON (default python3) is the interpreter whose site-packages (jax, numpy,
# gguf, pytest, hypothesis, nanobind ...) the build and the tests use; pip installs the missing
# ones.
#
# Installs Debian's bazel-bootstrap (Bazel 4.2.3) with apt-get when `bazel` is missing. Exits 0 with
# a SKIPPED line when Bazel is missing and cannot be installed (no apt-get, or not root and no
# password-less sudo); exits non-zero when the build or a test fails, or when Bazel tried to
# download anything (the build is meant to be offline).
set -euo pipefail

cd "$(dirname "$0")/.."
JOBS="${JAXVT_BAZEL_JOBS:-2}"
SUITE="//:cpu_tests"
CLEAN=0
for arg in "$@"; do
  case "$arg" in
    --quick) SUITE="//:quick_tests" ;;
    --all) SUITE="//:cpu_tests" ;;
    --clean) CLEAN=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "bazel_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "bazel_check: $*"; }
skip() { say "SKIPPED: $*"; exit 0; }

if ! command -v bazel >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
      skip "bazel is not installed and apt-get cannot be run here (not root, no password-less sudo)"
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || skip "bazel is not installed and there is no apt-get to install it"
  say "installing Bazel: apt-get install bazel-bootstrap"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         $SUDO apt-get install -y -qq --no-install-recommends bazel-bootstrap; } >/tmp/bazel_check_apt.log 2>&1; then
    tail -5 /tmp/bazel_check_apt.log >&2 || true
    skip "bazel is not installed and apt-get could not install bazel-bootstrap (log: /tmp/bazel_check_apt.log)"
  fi
  command -v bazel >/dev/null 2>&1 || skip "apt-get installed bazel-bootstrap but there is no bazel on PATH"
fi
say "bazel: $(command -v bazel) ($(bazel --version 2>/dev/null | head -1); Debian's 4.2.3 says 'no_version')"

PY="$(command -v "${PYTHON:-python3}" || true)"
[ -n "$PY" ] || { say "FAILED: no ${PYTHON:-python3} on PATH"; exit 1; }
PY="$("$PY" -c 'import sys; print(sys.executable)')"
# What the build and the tests import from that Python. nanobind is only a build requirement of
# the pip install (it lives in pip's isolated build environment, not in site-packages), so a
# fresh machine that ran the README's commands lacks it: install what is missing with pip.
need=()
for spec in "jax:jax>=0.10" "nanobind:nanobind>=2.4" "numpy:numpy>=1.26" "gguf:gguf>=0.19,<0.20" \
            "pytest:pytest>=8" "hypothesis:hypothesis>=6"; do
  "$PY" -c "import ${spec%%:*}" 2>/dev/null || need+=("${spec#*:}")
done
if [ "${#need[@]}" != 0 ]; then
  say "installing into $PY: ${need[*]}"
  "$PY" -m pip install -q "${need[@]}" || { say "FAILED: pip could not install ${need[*]}"; exit 1; }
fi
"$PY" -c 'import jax, nanobind, numpy, gguf, pytest, hypothesis' \
  || { say "FAILED: $PY lacks jax/nanobind/numpy/gguf/pytest/hypothesis"; exit 1; }
say "python: $PY"

LOG="$(mktemp -t bazel_check.XXXXXX.log)"
FLAGS=(--jobs="$JOBS" --local_cpu_resources="$JOBS" --repo_env=JAXVT_PYTHON="$PY")
run() {  # run <what> bazel args...: tees to $LOG, returns Bazel's status
  local what="$1"; shift
  local t0=$SECONDS status=0
  say "$what: bazel $*"
  bazel "$@" 2>&1 | tee -a "$LOG" || status=$?
  say "$what: exit $status after $((SECONDS - t0))s"
  return "$status"
}

T0=$SECONDS
if [ "$CLEAN" = 1 ]; then run clean clean --expunge; fi
status=0
run build build "${FLAGS[@]}" //... || status=$?
if [ "$status" = 0 ]; then
  run test test "${FLAGS[@]}" --local_test_jobs="$JOBS" "$SUITE" || status=$?
fi
if grep -E "Download from|Downloading https?://" "$LOG" >/dev/null; then
  grep -E "Download from|Downloading https?://" "$LOG" | head -5 >&2
  say "FAILED: Bazel tried to download something; the build must be offline"
  [ "$status" != 0 ] || status=1
fi
say "total $((SECONDS - T0))s; log: $LOG"
if [ "$status" != 0 ]; then say "FAILED (exit $status)"; exit "$status"; fi
say "OK: bazel build //... and bazel test $SUITE passed"
