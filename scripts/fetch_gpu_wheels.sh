#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), the pure-Python wheels that `scripts/gpu_check.sh` installs on the GPU
# machine, which has torch and transformers but neither network nor these packages. Run it here, once, with
# access to the package registry; then carry `.whl` in the device call (see scripts/gpu_check.sh).
#
# Why each is needed: recipe.rl.trainer imports recipe.config (hydra-core, omegaconf; both need antlr4 4.9.*),
# and recipe.inference.hf imports recipe.rollout, whose recipe.envs package imports the math verifier
# (math-verify, latex2sympy2_extended). Everything else the check imports (torch, transformers, tokenizers,
# safetensors, PyYAML, sympy, pyarrow, psutil, numpy, jinja2, tqdm, regex) is already on the device image
# (its published package list). The versions are requirements.lock's (tests/test_gpu_check.py checks that).
#
# antlr4-python3-runtime 4.9.3 is published as a source archive only, so it is built here into a
# py3-none-any wheel (pure Python: the same wheel serves the device's Python 3.12). Nothing here pulls torch:
# every download is --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEST=.whl
# name==version, as in requirements.lock
BINARY_WHEELS=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0
)
SOURCE_ONLY=(
  antlr4-python3-runtime==4.9.3
)

mkdir -p "$DEST"
# the device README's command: CPython 3.12, manylinux x86_64, wheels only, no dependencies
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${BINARY_WHEELS[@]}"
for spec in "${SOURCE_ONLY[@]}"; do
  name=${spec%%==*}
  if ! ls "$DEST"/"${name//-/_}"-*.whl >/dev/null 2>&1; then
    "$PY" -m pip wheel --no-deps --no-cache-dir -w "$DEST" "$spec"
  fi
done
# one version of each: two would stop the install on the device
ls -1 "$DEST"/*.whl
n=$(ls -1 "$DEST"/*.whl | wc -l)
want=$(( ${#BINARY_WHEELS[@]} + ${#SOURCE_ONLY[@]} ))
if [ "$n" -ne "$want" ]; then
  echo "fetch_gpu_wheels: $DEST holds $n wheels, expected $want: remove the stray ones" >&2
  exit 1
fi
du -sh "$DEST"
