#!/usr/bin/env bash
# Every check that needs a GPU, in one command on a borrowed GPU host, each step under a deadline
# of its own so that one stalled step cannot spend the others' time. From the checkout's root:
#
#   tests/gpu.sh wheels                 here, where a package index is: the wheels the host lacks, in .whl/
#   bash benchmarks/gpu_host.sh [OUT]   on the GPU host, with .whl/ brought along; figures under OUT
#                                       (default $OUT, else gpu-host-out/)
#
# 1. nvidia-smi's view of the host (OUT/nvidia-smi.txt)
# 2. the tests marked gpu (tests/gpu.sh: real NVML, pinning by CUDA_VISIBLE_DEVICES, a run on GPU 0,
#    the producer models on CUDA, two torchrun ranks sharing one GPU): OUT/gpu-tests.log
# 3. the GPU benchmark (python -m stoker.benchmarks.gpu: the feed, the DataLoader and the replayed
#    batches, both model sizes, P = 2 and GPU_BENCH_PRODUCERS; GPU_BENCH_ARGS adds flags of its
#    own, e.g. "--quick --size small" for a try of this script elsewhere): OUT/gpu.json and OUT/gpu.txt
# 4. where py-spy is installed: the first feed child (the trainer process) sampled by thread from
#    its start to its end (OUT/feed-gil.txt, py-spy's raw format, one stack a line with its thread:
#    keep the samples under the training loop to leave its start-up out)
#
# The status of each step is the last line of OUT/steps.txt; the script's own status is the worst.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-host-out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TESTS_S=${GPU_TESTS_S:-300}
BENCH_S=${GPU_BENCH_S:-360}
PRODUCERS=${GPU_BENCH_PRODUCERS:-12}
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

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
step gpu-tests "$TESTS_S" bash tests/gpu.sh > "$OUT/gpu-tests.log" 2>&1

if [[ -d .whl ]]; then  # tests/gpu.sh installed the wheels there: the benchmark's children import them too
  export PYTHONPATH="${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}" PATH="${SITE:-/tmp/site}/bin:$PATH"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
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
profiler=
if command -v py-spy > /dev/null; then
  profile &
  profiler=$!
fi
step gpu-benchmark "$BENCH_S" "$PY" -m stoker.benchmarks.gpu --producers 2 --producers "$PRODUCERS" \
  ${GPU_BENCH_ARGS:-} --out "$OUT/gpu.json" > "$OUT/gpu.txt" 2> "$OUT/gpu.log"
[[ -n "$profiler" ]] && kill "$profiler" 2> /dev/null  # still looking for a feed child: there is none now
wait
exit "$worst"
