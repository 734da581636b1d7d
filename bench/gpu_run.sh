#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA and no network:
#   1. the Triton kernels' tests on CUDA (the same tests run under the interpreter on a CPU);
#   2. token-exactness against HF transformers on CUDA, tiny models, Triton attention, and
#      migration between two workers sharing the GPU (cuda:0,0: KV through CUDA IPC handles),
#      with the pause of each kind against the request's size (bench skew's sweep), and static
#      placement against LB and Mell on a skewed trace (bench skew);
#   3. python -m bench kernels: paged decode GB/s against the device's copy bandwidth, the
#      hidden-cache decode kernel at Llama-3-8B's and OPT-13B's shapes (time, max abs error), and
#      one request's swap-out into page-locked memory (the host's wait, and a decode beside it);
#      with STEPS=sweep, the decode kernel under every launch setting (tile, warps, parts);
#   4. python -m bench gpu-offline: our engine against HF generate at batch 64 (SmolLM2's and
#      Llama-3-8B's shapes, random weights);
#   5. paper scale, OPT-13B's shape, ShareGPT's lengths, 1 s TTFT / 1 s P99 TBT: Apt-Serve vs FCFS
#      vs FCFS prefill-first vs the default policy (bench online), then BROS vs FCFS vs the default
#      with batch jobs always pending (bench mixed). Rates: APT_RATES and BROS_RATES; seconds of
#      arrivals: DURATION, of drain: DRAIN; the KV pool: KV_GIB (8 GiB, ~10,000 tokens of OPT-13B,
#      was not filled at 4 req/s on an H100: a smaller pool or higher rates make memory bind).
# The machine needs torch with CUDA, Triton, transformers, accelerate, aiohttp, prometheus-client,
# numpy and pytest; the few packages it lacks travel as wheels in ./.whl (make gpu-wheels
# GPU_PYTHON=<its python's major.minor>, on a machine with network access), installed into
# /tmp/site, nothing else is touched. PYTHON names its interpreter (default: python3).
#   STEPS="tests migration" runs some of them (tests migration placement kernels offline apt bros
#   by default; sweep and bound on request).
#   All of them take longer than a 10-minute call: run "placement", "apt" and "bros" in calls of
#   their own (or shorten them: SKEW_DURATION and SKEW_DRAIN for placement, DURATION and DRAIN
#   for apt and bros).
# Results: bench/results/ (JSON, copied to $OUT where that is set) and the log on standard output.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    || echo "!! the wheels in .whl did not install (made for another Python? make gpu-wheels GPU_PYTHON=...)"
fi
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
$PY - <<'PY' || { echo "!! no CUDA device or no Triton for $PY: nothing to check here"; exit 2; }
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
PY
status=0
# STEPS picks steps by name (default: all, in this order); each step has its own time limit (s)
STEPS=${STEPS:-"tests migration placement kernels offline apt bros"}
step() {
  local limit=$1; shift; echo "== $*"; SECONDS=0
  timeout -k 10 "$limit" "$@" || { echo "!! exit $? from: $*"; status=1; }
  echo "== ${SECONDS}s"
  # the device tool brings back what is under $OUT
  if [[ -n "${OUT:-}" ]]; then cp bench/results/gpu_*.json bench/results/kernels*.json "$OUT"/ 2>/dev/null; fi
}
want() { [[ " $STEPS " == *" $1 "* ]]; }
if want tests; then
  step 150 $PY -m pytest -q -p no:cacheprovider tests/engine/test_triton_kernels.py
  step 300 env TANDEM_TEST_DEVICE=cuda:0 $PY -m pytest -q -p no:cacheprovider tests/engine/test_triton_exactness.py \
    "tests/engine/test_bidir_exactness.py::test_scheduler_with_bidirectional_blocks_matches_hf"
  # swapping (page-locked memory, a side stream), int8 and hidden caches, prefix caching and the
  # default policy on CUDA, against HF (about 5 minutes on an H100: each test starts a worker)
  step 420 env TANDEM_TEST_DEVICE=cuda:0 $PY -m pytest -q -p no:cacheprovider tests/engine/test_tandem_exactness.py \
    tests/engine/test_prefix_caching.py tests/engine/test_int8_pool.py tests/engine/test_hidden_exactness.py \
    "tests/engine/test_exactness.py::test_swapped_requests_match_hf"
fi
if want migration; then
  step 240 env TANDEM_TEST_TWO_DEVICES=cuda:0,0 $PY -m pytest -q -p no:cacheprovider tests/engine/test_migration.py
  # the pause of one KV (CUDA IPC) and one token migration against the request's size
  step 120 $PY -m bench skew --devices cuda:0,0 --model smollm2-random --placements --sweep 64 256 1024 4096 \
    --out gpu_skew.json
fi
# static placement against LB and Mell on a skewed trace, two workers sharing the GPU
want placement && step 400 $PY -m bench skew --devices cuda:0,0 --model smollm2-random --placements static lb mell \
  --rate ${SKEW_RATE:-4} --duration ${SKEW_DURATION:-30} --drain ${SKEW_DRAIN:-60} --pool-tokens 1024 --sweep --out gpu_placement.json
want sweep && step 300 $PY -m bench kernels --sweep
if want kernels; then
  step 90 $PY -m bench kernels --accuracy
  step 90 $PY -m bench kernels
fi
want offline && step 180 $PY -m bench gpu-offline
DURATION=${DURATION:-20}
PAPER=(--model opt13b-random --devices cuda:0 --kv-cache-gib ${KV_GIB:-8} --slo-ttft-ms 1000 --slo-tbt-ms 1000
       --duration "$DURATION" --drain ${DRAIN:-30} --max-output 512)
want apt && step 400 $PY -m bench online "${PAPER[@]}" --systems tandem-fcfs tandem-fcfs-prefill-first tandem-aptserve tandem \
  --rates ${APT_RATES:-2} --out gpu_apt.json
# memory-bound: 2 GiB of KV (~2,600 tokens of OPT-13B), where BROS and the default part ways
want bound && step 300 $PY -m bench mixed "${PAPER[@]}" --kv-cache-gib 2 --systems ${BOUND_SYSTEMS:-tandem-bros tandem} \
  --rates 2 --out gpu_bound.json
want bros && step 300 $PY -m bench mixed "${PAPER[@]}" --systems tandem-fcfs tandem-bros tandem --rates ${BROS_RATES:-1} --out gpu_bros.json
exit $status
