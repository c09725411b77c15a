#!/usr/bin/env bash
# On a lent GPU host, once the wheels are in (bundle.sh's pieces, then `source .../unpack.sh`): the GPU tests
# and `python -m bench gpu`, each under a timeout, everything written into $OUT (default ./gpu-out), so one
# device call brings back what a session needs. BENCH_ARGS adds to or overrides the bench's options.
#
#   bash bench/gpu_check.sh                       # about 10 minutes on an H100 with the defaults below
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
{ nvidia-smi; python3 -c "import onnxruntime as o, cupy; print('onnxruntime', o.__version__, 'cupy', cupy.__version__)"; } \
    > "$out/device.txt" 2>&1
# fp16's converter is not in every bundle: without it fp16 runs fp32 (logged), and the bench says so
python3 -c "import onnxconverter_common" 2>/dev/null || echo "onnxconverter-common missing: fp16 variants run fp32" >> "$out/device.txt"
timeout "${TESTS_S:-180}" python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py tests/test_gpu_install.py \
    > "$out/gpu-tests.txt" 2>&1
echo "gpu tests: exit $?" >> "$out/device.txt"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout "${BENCH_S:-420}" python3 -m bench gpu --seconds 8 --levels 48,150,200 --residency-s 90 \
    --json "$out/bench-gpu.json" ${BENCH_ARGS:-} > "$out/bench-gpu.txt" 2>&1
echo "bench gpu: exit $?" >> "$out/device.txt"
tail -n 3 "$out/gpu-tests.txt"; tail -n 60 "$out/bench-gpu.txt"; cat "$out/device.txt" | tail -n 4
