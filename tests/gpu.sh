#!/usr/bin/env bash
# The tests marked gpu (real NVML, CUDA children pinned by CUDA_VISIBLE_DEVICES, a run on GPU 0),
# on a host with an NVIDIA GPU and python3 with PyTorch or CuPy, numpy, scipy, msgpack, psutil,
# pyyaml, fsspec and nvidia-ml-py; TensorFlow is not needed. From the checkout's root:
#
#   tests/gpu.sh wheels [DIR]   on a machine with a package index: the wheels a bare GPU host
#                               lacks (stoker's other dependencies, the test runner, pytest and
#                               pytest-timeout, and py-spy for benchmarks/gpu_host.sh's profile)
#                               into DIR (default .whl), for python 3.12 x86-64
#   tests/gpu.sh [DIR]          on the GPU host: installs DIR/*.whl, if any, into $SITE (default
#                               /tmp/site) without dependencies (the test runner's only where the
#                               host has none), puts it on PYTHONPATH, then runs every test file
#                               that uses the gpu marker
#
# Other test files are not collected there: many import TensorFlow or test-only packages the GPU
# host lacks. pytest-xdist is not needed: the run is one process (addopts overridden).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == wheels ]]; then
  DIR=${2:-.whl}
  mkdir -p "$DIR"
  if [[ "$DIR" != /* ]]; then  # inside the checkout: kept out of commits (a worktree's too)
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$DIR/" "$exclude" 2>/dev/null || echo "/$DIR/" >> "$exclude"
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$DIR" \
    pyzmq soundfile cffi pycparser soxr orjson xxhash num2words pyloudnorm \
    pytest pytest-timeout pluggy iniconfig packaging pygments py-spy
  ls "$DIR"
  exit 0
fi

DIR=${1:-.whl}
SITE=${SITE:-/tmp/site}
shopt -s nullglob
wheels=()
for wheel in "$DIR"/*.whl; do
  case "${wheel##*/}" in  # a host with its own pytest keeps it: its plugins were installed for that one
    pytest-*|pytest_timeout-*|pluggy-*|iniconfig-*|packaging-*|pygments-*)
      "$PY" -c "import pytest, pytest_timeout" 2>/dev/null && continue ;;
  esac
  wheels+=("$wheel")
done
if ((${#wheels[@]})); then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
  echo "tests/gpu.sh: pytest and pytest-timeout are not installed here: run 'tests/gpu.sh wheels' on a" \
       "machine with a package index and bring $DIR/ along" >&2
  exit 2
fi
absent=$("$PY" -c "from tests.conftest import nvidia_gpu_absent; print(nvidia_gpu_absent())")
if [[ -n "$absent" ]]; then
  echo "tests/gpu.sh: $absent" >&2
  exit 2
fi
mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu\b' tests | sort)
exec "$PY" -m pytest -o addopts=-ra -p no:cacheprovider -m gpu "${files[@]}"
