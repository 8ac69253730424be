#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.sh) and the variants that say where its training time goes, one process
# each, in one device call (its README: few, full calls cost less device time than many small ones):
#   gpu_check.json        mid size, the trainer as on ranks (FSDP2 mixed precision, one rank), SFT and RL steps
#   autocast.json         mid, SFT and RL steps: float32 parameters under torch.autocast, as one process trains
#   sft_large.json        large (hidden 1536, 0.44B active), SFT only, FSDP2 mixed precision
#   sft_compile.json      mid, SFT only, each decoder layer torch.compile'd        (GPU_SWEEP_COMPILE=0: skipped)
#   sft_large_compile.json  large, likewise                                       (GPU_SWEEP_COMPILE=0: skipped)
# and every run's output appended to gpu_sweep.log, all under $OUT (else .). A variant that fails leaves its
# JSON with "ok": false and the error, and the next one runs. Arguments are appended to every run, so they win:
# `bash scripts/gpu_sweep.sh --device cpu --size tiny --sft-steps 1 --rl-steps 0` runs the sweep's path on a
# CPU (tests/test_gpu_check.py).
#   device: run(command="bash scripts/gpu_sweep.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-.}
export GPU_CHECK_LOG=gpu_sweep.log
failed=0
run() {  # name, seconds it may take before it is stopped, then the check's arguments
  local name=$1 limit=$2; shift 2
  timeout "$limit" bash scripts/gpu_check.sh --out "$OUT_DIR/$name.json" "$@" || {
    echo "gpu_sweep: $name failed (exit $?)" | tee -a "$OUT_DIR/$GPU_CHECK_LOG"; failed=1; }
}
run gpu_check 180 "$@"
run autocast 150 --trainer autocast "$@"
run sft_large 90 --size large --rl-steps 0 "$@"
if [ "${GPU_SWEEP_COMPILE:-1}" != 0 ]; then
  run sft_compile 120 --compile --rl-steps 0 "$@"
  run sft_large_compile 120 --size large --compile --rl-steps 0 "$@"
fi
exit $failed
