#!/usr/bin/env bash
# Check zbench on your GPU box: one GPU, torch already installed, no network needed.
#
#   tools/gpu-check.sh --out DIR [--budget SECONDS] [--steps a,b] [--rerun DIR/summary.json] [--dry-run]
#
# Runs tools/gpu_check.py's steps in priority order (`tools/gpu_check.py --help` lists them), each time-boxed and
# each writing one status line with its figures, and leaves at most 8 files in DIR: summary.txt, summary.json,
# logs.tar.gz, results.tar.gz (the runs, reports and profiler trace). `--rerun DIR/summary.json` runs only the steps
# that did not pass there. `--dry-run` runs what a machine without a GPU can (the environment, the tests' clean
# skips, the suites' case lists, the trace) and says what it left out.
#
# What the machine's Python lacks travels as wheels in .wheels/ (git-ignored), filled once on a machine with a
# package index (any OS; the wheels are for CPython 3.12 on x86-64 Linux, which PYTHON_VERSION changes):
#
#   tools/gpu-check.sh --fetch-wheels
#
# which downloads pydantic and its parts, plotly and hjson, and builds DeepSpeed as a pure wheel (DS_BUILD_OPS=0:
# no kernels; zbench trains it with its client optimizer, so none are JIT-built). The check installs them with
# `pip install --no-index --no-deps --target` into a folder of its own, never into the machine's Python, and runs
# zbench from this checkout (PYTHONPATH) on the machine's own torch.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${ZBENCH_WHEELS:-$ROOT/.wheels}
PY=${PYTHON:-python3}

# name==version of every wheel the GPU image lacks; versions are those CI tests with (pyproject's lower bounds hold).
REQUIREMENTS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  plotly==7.1.0 narwhals==2.29.0 hjson==3.1.0
)
DEEPSPEED=deepspeed==0.19.8

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "${REQUIREMENTS[@]}"
  # DeepSpeed ships as a source archive whose setup imports torch: built here, without kernels, as py3-none-any.
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$DEEPSPEED"
  ls -l "$WHEELS"
  exit 0
fi

SITE=$(mktemp -d /tmp/zbench-gpu-check-site.XXXXXX)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
else
  echo "gpu-check: no wheels in $WHEELS (tools/gpu-check.sh --fetch-wheels fills it): using the installed packages" >&2
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" "$ROOT/tools/gpu_check.py" "$@"
