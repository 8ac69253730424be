#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.sh) and the variants that say where its training time goes, one process
# each, in one device call (its README: few, full calls cost less device time than many small ones). Each
# profiles one more step after its timed ones (--profile: kernel time by kind, the top kernels):
#   gpu_check.json           mid size, the trainer as on ranks (FSDP2 mixed precision, one rank), SFT and RL steps
#   sft_compile.json         mid, SFT only, each decoder layer torch.compile'd      (GPU_SWEEP_COMPILE=0: skipped)
#   sft_compile_b16.json     mid, likewise, 16 rows of 2048 tokens a step          (GPU_SWEEP_COMPILE=0: skipped)
#   sft_large_compile_b16.json  large (hidden 1536, 0.44B active), likewise        (GPU_SWEEP_COMPILE=0: skipped)
#   sft_large_tuned.json     large, likewise, each layer's gathered weights kept from forward to backward and a
#                            fused AdamW: the levers the profiles point at (docs/performance.md; not yet run)
#   rl_batch512.json         mid, RL steps of 64 prompts x 8 samples (512 rollouts, generated 512 at a time)
# and every run's output appended to gpu_sweep.log, all under $OUT (else .). A variant that fails leaves its
# JSON with "ok": false and the error, and the next one runs. Arguments are appended to every run, so they win:
# `bash scripts/gpu_sweep.sh --device cpu --size tiny --sft-steps 1 --rl-steps 1` runs the sweep's path on a
# CPU (tests/test_gpu_check.py). Each JSON holds the arguments it ran with (argv): `bash scripts/gpu_check.sh
# ARGV` runs that variant alone. The variants without --profile, and autocast (--trainer autocast), are
# gpu_check.sh's flags too.
#   device: run(command="GPU_CHECK_COMMIT=<commit> bash scripts/gpu_sweep.sh", carry=[".whl"], timeout_s=420)
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
run gpu_check 120 --profile --rl-steps 2 "$@"
if [ "${GPU_SWEEP_COMPILE:-1}" != 0 ]; then
  run sft_compile 75 --compile --rl-steps 0 --profile "$@"
  run sft_compile_b16 75 --compile --rl-steps 0 --sft-batch 16 --profile "$@"
  run sft_large_compile_b16 75 --size large --compile --rl-steps 0 --sft-batch 16 --profile "$@"
  run sft_large_tuned 75 --size large --compile --rl-steps 0 --sft-batch 16 --keep-gathered --fused-adamw \
    --profile "$@"
fi
run rl_batch512 150 --sft-steps 1 --rl-steps 2 --prompts 64 --rollouts 8 --gen-batch 512 --micro-batch 32 \
  --profile "$@"
exit $failed
