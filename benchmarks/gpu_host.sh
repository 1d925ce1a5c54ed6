#!/usr/bin/env bash
# Every check that needs a GPU, on a borrowed GPU host, each step under a deadline of its own so
# that one stalled step cannot spend the others' time. From the checkout's root:
#
#   tests/gpu.sh wheels                         here, where a package index is: the wheels the
#                                               host lacks (py-spy among them), into .whl/
#   bash benchmarks/gpu_host.sh OUT [STEP ...]  on the GPU host, with .whl/ brought along: the
#                                               steps named (default all), figures under OUT
#
# The steps, with their deadlines (seconds; 13 minutes in all, so that a host lent for 15 runs
# them in two calls, e.g. `tests models` then `bench`):
#   tests   (GPU_TESTS_S, 300) the tests marked gpu (tests/gpu.sh: real NVML, pinning by
#           CUDA_VISIBLE_DEVICES, a run on GPU 0, the producer models on CUDA, two torchrun ranks
#           sharing one GPU): OUT/gpu-tests.log
#   models  (GPU_MODELS_S, 180) the producer-models benchmark's PyTorch encoder, quick: in the
#           step, in the producers on the same GPU, from the cache: OUT/producer_models.json, .txt
#   bench   (GPU_BENCH_S, 300) the GPU benchmark (python -m stoker.benchmarks.gpu: the feed, the
#           DataLoader and the replayed batches, both model sizes, each first calibrated on the GPU
#           to its step of ~15 or ~50 ms, P = 2 and GPU_BENCH_PRODUCERS, 12; GPU_BENCH_ARGS adds
#           flags, e.g. "--quick --size small" for a try elsewhere): OUT/gpu.json (rewritten after
#           each way, "complete": false until the end, so that the deadline leaves what was
#           measured) and OUT/gpu.txt; where py-spy is installed, its first feed child (the
#           trainer process) sampled by thread from start to end (OUT/feed-gil.txt, raw: one stack
#           a line with its thread; keep those under the training loop to leave its start-up out)
#
# OUT/nvidia-smi.txt is the host; OUT/steps.txt has each step's status and seconds; the script's
# own status is the worst of its steps'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-host-out}}
shift $(($# > 0 ? 1 : 0))
STEPS=${*:-tests models bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
worst=0

step() {  # step NAME DEADLINE_S COMMAND...: runs it, notes its status and seconds
  local name=$1 deadline=$2 started=$SECONDS status
  shift 2
  timeout --kill-after 10 "$deadline" "$@"
  status=$?
  echo "$name: status $status in $((SECONDS - started)) s" | tee -a "$OUT/steps.txt"
  ((status > worst)) && worst=$status
  return 0
}

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

profile() {  # the first feed child's threads, sampled from its start to its end (-d: a ceiling)
  local pid
  for _ in $(seq 600); do
    pid=$(pgrep -f "stoker.benchmarks.gpu child .*\"kind\": \"feed\"" | head -1)
    [[ -n "$pid" ]] && break
    sleep 0.5
  done
  [[ -z "$pid" ]] && return 0
  py-spy record --gil --threads --nonblocking --format raw -r 200 -d 300 --pid "$pid" -o "$OUT/feed-gil.txt" \
    > "$OUT/py-spy.log" 2>&1
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if wanted tests; then
  step tests "${GPU_TESTS_S:-300}" bash tests/gpu.sh > "$OUT/gpu-tests.log" 2>&1
fi

if [[ -d .whl ]]; then  # where tests/gpu.sh installs the wheels: the benchmarks' processes import them too
  SITE=${SITE:-/tmp/site}
  wheels=()
  for wheel in .whl/*.whl; do  # all but the test runner's (tests/gpu.sh installs those where the host has none)
    case "${wheel##*/}" in pytest-*|pytest_timeout-*|pluggy-*|iniconfig-*|packaging-*|pygments-*) ;; *) wheels+=("$wheel") ;; esac
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

if wanted models; then
  step models "${GPU_MODELS_S:-180}" "$PY" -m stoker.benchmarks.producer_models --quick --framework torch \
    --out "$OUT/producer_models.json" > "$OUT/producer_models.txt" 2> "$OUT/producer_models.log"
fi

if wanted bench; then
  profiler=
  if command -v py-spy > /dev/null; then
    profile &
    profiler=$!
  fi
  step bench "${GPU_BENCH_S:-300}" "$PY" -m stoker.benchmarks.gpu --producers 2 \
    --producers "${GPU_BENCH_PRODUCERS:-12}" ${GPU_BENCH_ARGS:-} --out "$OUT/gpu.json" > "$OUT/gpu.txt" 2> "$OUT/gpu.log"
  [[ -n "$profiler" ]] && kill "$profiler" 2> /dev/null  # still looking for a feed child: there is none now
  wait
fi
exit "$worst"
