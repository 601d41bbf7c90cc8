#!/usr/bin/env bash
# The accelerator check: a few minutes on a machine with a GPU (or TPU).
#
#     bash benchmarks/on_device.sh [OUT]      # OUT: where the logs go (default benchmarks/results/device)
#
# Runs from the checkout (PYTHONPATH), with the JAX, Flax, Optax, msgpack,
# rich and scikit-learn the machine has (its `python3`; PYTHON names another):
# it installs nothing. Each part
# has a time limit of its own and writes its log to OUT; a part that fails
# does not stop the next.
#   1. devices.txt  the devices and versions JAX sees
#   2. tests.txt    tests/test_accelerator.py on the accelerator: the loop learns
#                   digits and steps as a hand-written step, a resumed run is the
#                   straight run bit for bit, the memory plan and MFU know the device
#   3. mfu.txt      benchmarks/mfu.py: steps a second and MFU, TrainLoop against a
#                   hand-written jax.jit step (the small MLP, a compute-bound MLP, a
#                   miniGPT), mfu.json beside it
#   4. startup.txt  benchmarks/startup.py --only mlp: time to the first step
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-benchmarks/results/device}")
mkdir -p "$out"
platform=${JAX_PLATFORMS:-cuda}
python=${PYTHON:-python3}
export JAX_PLATFORMS=$platform PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# XLA's own compilation (the suite's quick CPU flags are for its CPU runs) and
# deterministic reductions, so that a resumed run's bits are the straight run's
export FLAX_LOOP_SLOW=1 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
export JAX_COMPILATION_CACHE_DIR=$out/jax-cache
mkdir -p "$JAX_COMPILATION_CACHE_DIR"

$python - <<'PY' 2>&1 | tee "$out/devices.txt"
import jax, flax, optax
print("JAX", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)
print(jax.devices())
for device in jax.devices():
    print(device.device_kind, (device.memory_stats() or {}).get("bytes_limit"))
PY
# float32 products in float32 (a GPU's default for them is TensorFloat-32): the
# tests compare the loop with a hand-written step to 1e-4
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 $python -m pytest -q -p no:cacheprovider -n 0 \
    tests/test_accelerator.py 2>&1 | tee "$out/tests.txt"
timeout 240 $python benchmarks/mfu.py --rounds 3 --json "$out/mfu.json" 2>&1 | tee "$out/mfu.txt"
timeout 120 $python benchmarks/startup.py --only mlp --rounds 3 --json "$out/startup.json" \
    2>&1 | tee "$out/startup.txt"
rm -rf "$out/jax-cache"
