#!/usr/bin/env bash
# On a lent GPU host, once the wheels are in (bundle.sh's pieces, then `source .../unpack.sh`): the GPU tests
# and `python -m bench gpu`, everything written into $OUT (default ./gpu-out), so one device call (600 s; the
# machine's start and the wheels' unpacking come before this script) brings back what a session needs.
#
#   bash bench/gpu_check.sh                 # ends within TOTAL_S (450 s) on an H100 with the defaults below
#
# The bench gets what the tests leave of TOTAL_S (--budget-s): it skips the sections that would not fit and
# names them, and writes its JSON after every section. If it runs on past its budget, `timeout` sends it
# SIGINT (it stops its server and keeps the JSON) and SIGKILL only 15 s later. BENCH_ARGS adds to or overrides
# its options; TESTS_S caps the tests. Where the frontend's and the inference process's time goes at a live
# level: BENCH_ARGS="--profile $OUT/profile ..." with py-spy installed beside the bench's python (not in the
# bundle: carry its manylinux wheel, `pip download --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 py-spy`, and install it before this script); without it each level says there is no
# profile, and runs.
#
# The arithmetic on an H100 (docs/benchmarks.md: a first call per (session, batch size) F = 3.1-5.7 s, cuDNN
# EXHAUSTIVE; steady unet_328 calls 2.47 ms at 1 frame, 16.2 ms at 16, 58.2 ms at 64), with the bench's own
# estimates (bench/gpu.py: priors at the worst F, 5.7 s, until the run measures its own):
#   nvidia-smi and the imports                                                          ~5 s
#   GPU tests: ~15 first calls (unet_328 at sizes 1-8, fp16 probes) 47-86 s + CPU references, cut at TESTS_S
#                                                                                     <= 150 s  -> <= 155 s
#   bench.grouped at 16: four first calls 15 s + its sessions and timed calls (an H200: 34 s in all), cut at
#   GROUPED_S                                                                          <= 60 s  -> <= 215 s
#   bench: --budget-s = TOTAL_S 450 - 30 - what came before, >= 205 s; limits.max_batch 32: 6 prepared sizes,
#   8 batches served (1 2 3 4 8 16 24 32); seconds from the bench's start:
#     its start: imports, the demo avatar                                               ~5 s
#     1 first call per size after ready: a server 15 s, its load 6 F + 2 s, 8 x 11 calls    54 s ->  59
#     2 the anchor: 6 x (F + --seconds 3) + 1 s                                         53 s -> 112
#     3 served infer: 8 x (3 s + two calls) + 1 s                                       27 s -> 139
#     4 live, --live-s 8: windows at 48, 150, 200 and PCM at 48, each + 3 s + 0.02 s a session   53 s -> 192
#     5 first frame of 4 models (written, loaded, a second's speech) 15 s, a load while 20 speak 13 s  -> 220
#     6 own vs shared 10 F + 11 s = 69 s (-> 289: runs when the tests took <= ~100 s); alternating 2 s; each
#       further variant: a server 15 s + its load 36 s (fp16: + 2 F) + 27 s = 78-89 s, where it fits (at F
#       3.1 s with tests of 100 s: fp16); residency: the rest, --residency-s clipped to it
#   A section may overrun its estimate: SIGINT at TOTAL_S - 15, SIGKILL at TOTAL_S. The script ends by TOTAL_S
#   450 s and its last lines: inside 8 minutes (480 s), with the call's start and unpacking inside its 600 s.
set -uo pipefail
total=${TOTAL_S:-450}
out=${OUT:-gpu-out}
mkdir -p "$out"
{ nvidia-smi; python3 -c "import onnxruntime as o, cupy; print('onnxruntime', o.__version__, 'cupy', cupy.__version__)"; } \
    > "$out/device.txt" 2>&1
# fp16's converter is not in every bundle: without it fp16 runs fp32 (logged), and the bench says so
python3 -c "import onnxconverter_common" 2>/dev/null || echo "onnxconverter-common missing: fp16 variants run fp32" >> "$out/device.txt"
timeout -s INT -k 10 "${TESTS_S:-150}" python3 -m pytest -q -s -p no:cacheprovider --durations=10 \
    -k "not standin" tests/test_gpu.py tests/test_gpu_install.py > "$out/gpu-tests.txt" 2>&1   # (CI runs the stand-in's)
echo "gpu tests: exit $? after ${SECONDS} s" >> "$out/device.txt"
# the N-model form at 16 frames of 16 avatars against 16 frames of one, in one process (GROUPED_S caps it)
timeout -s INT -k 5 "${GROUPED_S:-60}" python3 -m bench.grouped --sizes 16 --seconds 1 --budget-s $((${GROUPED_S:-60} - 10)) \
    --json "$out/grouped.json" > "$out/grouped.txt" 2>&1
echo "bench.grouped: exit $? after ${SECONDS} s" >> "$out/device.txt"
left=$((total - SECONDS))
if ((left < 90)); then
  echo "bench gpu: not run, ${left} s of TOTAL_S ${total} left" >> "$out/device.txt"
else
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  timeout -s INT -k 15 $((left - 15)) python3 -m bench gpu --budget-s $((left - 30)) --seconds 3 --live-s 8 \
      --levels 48,150,200 --pcm-levels 48 --residency-s 240 --json "$out/bench-gpu.json" ${BENCH_ARGS:-} \
      > "$out/bench-gpu.txt" 2>&1
  echo "bench gpu: exit $? after ${SECONDS} s (124: past its budget, stopped by SIGINT, JSON kept)" >> "$out/device.txt"
fi
tail -n 3 "$out/gpu-tests.txt"; grep -A 2 "one model ms" "$out/grouped.txt"; tail -n 60 "$out/bench-gpu.txt" 2>/dev/null
tail -n 5 "$out/device.txt"
