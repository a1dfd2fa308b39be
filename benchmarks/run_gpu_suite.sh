#!/usr/bin/env bash
# The H100 run behind benchmarks/results/cuda_*: kernel tests, the shared-prefix grid against
# FlashInfer, the GQA study (32/8 heads, batch 256, suffix 128, prefix >= 8192) and the tree
# benchmark, each log written to OUT_DIR. Percentages of the roofline use the GPU's own peaks.
# Exits non-zero when any GPU test fails.
#
#   benchmarks/run_gpu_suite.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR holds FlashInfer's wheels (flashinfer-python 0.7.2.post1 and apache-tvm-ffi, cp312
# manylinux); they are unpacked into /tmp/site when FlashInfer is not importable already.
set -euo pipefail
out=${1:?usage: benchmarks/run_gpu_suite.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$wheels" ] && ! python -c "import flashinfer" 2>/dev/null; then
    mkdir -p /tmp/site
    for w in "$wheels"/*.whl; do python -m zipfile -e "$w" /tmp/site; done
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/cuda_env.log"
# the kernel tests run while FlashInfer JIT-compiles (neither is timed); the benchmarks run alone
python -m pytest -m cuda -n 4 -v -p no:cacheprovider tests/test_cuda_kernels.py \
    tests/test_cuda_reference.py tests/test_cuda_engine.py tests/test_cuda_cli.py \
    > "$out/cuda_tests.log" 2>&1 &
tests=$!
python benchmarks/cascade_gpu.py --warm-only > "$out/fi_warm.log" 2>&1
tail -2 "$out/fi_warm.log"
# a failed GPU test fails the suite (after the log is shown), before any benchmark runs
tests_rc=0
wait $tests || tests_rc=$?
tail -1 "$out/cuda_tests.log"
if [ "$tests_rc" -ne 0 ]; then
    echo "Error: GPU tests failed (exit $tests_rc); see $out/cuda_tests.log" >&2
    exit "$tests_rc"
fi
python benchmarks/cascade_gpu.py --skip-sweep --out "$out/cuda_cascade.json" 2>&1 \
    | tee "$out/cuda_cascade.log" | tail -4
python benchmarks/cascade_gpu.py --gqa --profile --no-flashinfer --out "$out/cuda_gqa.json" 2>&1 \
    | tee "$out/cuda_gqa.log" | grep "^GQA"
python benchmarks/tree_gpu.py --out "$out/cuda_tree.json" 2>&1 | tee "$out/cuda_tree.log" | tail -12
