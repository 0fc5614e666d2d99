#!/usr/bin/env bash
# Downloads upstream Tokamax (PyPI) and the packages it imports into .whl_up,
# for `bash scripts/gpu_check.sh upstream` (device tool: carry [".whl", ".whl_up"]).
# The GPU machine has jax, jaxlib, numpy and triton already; none of these
# wheels may repeat a package twice. Run here (where pip reaches PyPI), once.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl_up/' .git/info/exclude 2>/dev/null || echo /.whl_up/ >> .git/info/exclude
rm -rf .whl_up && mkdir .whl_up
python=${PYTHON:-python3}
# tokamax imports qwix (which imports flax.linen), xprof (whose CLI imports
# etils, fire, protobuf), tensorboardx, jaxtyping, einshape, immutabledict.
# jax-triton 0.3.1 is the last for Triton 3.6 (the device's); tokamax 0.0.17's
# Triton layer_norm needs >= 0.4 (Triton >= 3.7), so that kernel cannot run.
$python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl_up \
  tokamax==0.0.17 absl-py einshape jaxtyping wadler-lindig immutabledict qwix \
  flax==0.12.12 msgpack treescope rich markdown-it-py mdurl pygments pyyaml \
  typing-extensions optax chex toolz tensorboardx protobuf six termcolor fire \
  xprof==2.24.2 etils zipp importlib-resources fsspec tqdm jax-triton==0.3.1
du -sh .whl_up
