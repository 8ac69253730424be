#!/usr/bin/env bash
# The GPU check (recipe/gpu_check.py: SFT steps, then RL steps with the hf engine generating on the GPU, the
# recipe's train_step with Muon + AdamW, and the weights reloaded into the engine; tokens/s, MFU, peak memory),
# in one command for a GPU machine with no network (torch and transformers preinstalled). Ran on one H200 on
# 2026-12-04 (RESULTS.md; results/gpu/); scripts/gpu_sweep.sh runs it with its variants in one call.
#
# From a session whose task is lent a machine, in the repo's root (the checkout the session started in: the
# device call sends that one, so this script must be on its branch):
#   1. here:   bash scripts/fetch_gpu_wheels.sh        (the wheels below into .whl/, ignored by git)
#   2. device: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=420)
#      then give_back(). What comes back: $OUT/gpu_check.json (every number) and $OUT/gpu_check.log.
# On the H200 it took 67 s (model build on the GPU, 6 SFT steps of 16k tokens, 3 RL steps of 64 rollouts of
# 256 tokens, 3 weight reloads of 1.7 GiB), plus the machine's start; gpu_sweep.sh about 5 minutes.
#
# The device image has torch 2.11 and transformers 5.17 (KINDS.md) but not these pure-Python packages, which the
# recipe's modules import (recipe.config: hydra, omegaconf; recipe.envs: the math verifier). Carried as wheels,
# the versions of requirements.lock, all py3-none-any, none depending on torch:
#   hydra-core==1.3.8  omegaconf==2.3.1  antlr4-python3-runtime==4.9.3 (built here from its source archive)
#   math-verify==0.9.0  latex2sympy2_extended==1.11.0
#
# Arguments go to the check after --device cuda, so they override it: `bash scripts/gpu_check.sh --device cpu
# --size tiny --sft-steps 2 --rl-steps 1` runs the same path on a CPU. PYTHON picks the interpreter (default
# python3, the one that holds torch on the device machine); GPU_CHECK_SITE where the wheels go (/tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}  # where the carried wheels are installed (the device README's --target)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl || { echo "gpu_check.sh: error: installing the carried wheels (.whl/) failed" >&2; exit 1; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG_DIR=${OUT:-.}
LOG=$LOG_DIR/${GPU_CHECK_LOG:-gpu_check.log}  # appended to (scripts/gpu_sweep.sh runs several checks into one)
mkdir -p "$LOG_DIR"
echo "== gpu_check.sh $*" >>"$LOG"  # the log's own header for each check (gpu_sweep.sh's log holds several)
{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
  fi
  "$PY" -m recipe.gpu_check --device cuda "$@"
} 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
