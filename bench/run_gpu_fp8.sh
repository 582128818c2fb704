#!/bin/bash
# Issue 32's FP8 work on the device machine in one call (logs and tuned tables under $OUT):
#   bash bench/run_gpu_fp8.sh
# torch._scaled_mm's block scales probed, the FP8/routing GPU tests, FP8 MoE tables tuned (TUNE_SHAPES) and their
# entries checked, the FP8 MoE layer benches (BENCH_SHAPES), then the DeepSeek-V3-shaped bf16/FP8 monolith =
# AFD-over-NCCL test (one GPU shared). Each step has its own time limit (seconds, overridable).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/runtime:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
start=$SECONDS
pytest_q="python3 -m pytest -q -p no:warnings -p no:cacheprovider"
[ "${PROBE:-1}" = 1 ] && timeout ${PROBE_TIMEOUT:-15} python3 bench/fp8_probe.py 2>&1 | tee $OUT/fp8_probe.log
timeout ${TESTS_TIMEOUT:-60} $pytest_q tests/gpu/test_gpu_fp8.py tests/runtime/test_moe_fp8.py \
  tests/runtime/test_routing_kernel.py --timeout 50 --maxfail 30 2>&1 | tee $OUT/fp8_tests.log | tail -25
for shape in ${TUNE_SHAPES:-deepseek-v3}; do
  timeout ${TUNE_TIMEOUT:-80} python3 bench/moe_tune.py --fp8 --shape $shape --tokens ${TUNE_TOKENS:-64,1024,4096} \
    --deadline ${TUNE_DEADLINE:-15} --workers 15 2>&1 | tee -a $OUT/moe_tune_fp8.log
done
cp runtime/afd/kernels/configs/*fp8*.json $OUT/ 2>/dev/null
timeout ${TABLES_TIMEOUT:-25} $pytest_q tests/gpu/test_gpu_fp8.py -k shipped --timeout 25 2>&1 | tee -a $OUT/fp8_tests.log | tail -5
for shape in ${BENCH_SHAPES:-deepseek-v3 qwen3-30b-a3b}; do
  timeout ${BENCH_TIMEOUT:-35} python3 bench/moe_layer_fp8.py --shape $shape --tokens ${BENCH_TOKENS:-64,256,1024,4096} \
    2>&1 | tee -a $OUT/moe_layer_fp8.log
done
echo "elapsed before the V3 test: $((SECONDS - start)) s"
AFD_GPU_SHARE_ONE=1 NCCL_DEBUG=WARN timeout ${V3_TIMEOUT:-130} $pytest_q tests/gpu/test_gpu_v3_afd.py -k "${V3_K:-bf16 or fp8}" --timeout 125 \
  2>&1 | tee $OUT/v3_afd.log | tail -30
echo "elapsed: $((SECONDS - start)) s"
