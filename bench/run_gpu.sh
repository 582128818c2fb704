#!/bin/bash
# Everything the device machine runs in one call: GPU tests, then the benchmarks. Logs under $OUT.
set -u
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; from afd.connector.transports.nccl import lib as nccl_lib; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', nccl_lib.version(), 'gpus', torch.cuda.device_count())"

NCCL_DEBUG=WARN timeout 120 python3 bench/cluster/nccl_smoke.py 2>&1 | tee $OUT/nccl_smoke.log
# bench/kernels/moe_tune.py (re)writes the MoE block-size table for a new GPU or shape; run it before moe_layer.py there
timeout 200 python3 bench/kernels/moe_layer.py 2>&1 | tee $OUT/moe_layer.log
NCCL_DEBUG=WARN timeout 400 python3 -m pytest -q tests/gpu -p no:warnings -p no:cacheprovider --timeout 90 2>&1 | tee $OUT/gpu_tests.log | tail -30
timeout 150 python3 bench/step/graphs_vs_eager.py 2>&1 | tee $OUT/graphs_vs_eager.log

NCCL_DEBUG=WARN NVSHMEM_DISABLE_NVLS=1 timeout 300 python3 bench/cluster/afd_decode.py --layers 27 --batches 32,128,192,256,384,512 --steps 30 --profile-steps 5 --deadline 285 2>&1 | tee $OUT/afd_decode.log
# expert parallelism: per-layer dispatch/combine to 2 FFN shards vs a bare NCCL exchange of the same bytes
NCCL_DEBUG=WARN timeout 200 python3 bench/cluster/ep_exchange.py --shards 2 --hidden 2048 --layers 26 2>&1 | tee $OUT/ep_exchange.log
NCCL_DEBUG=WARN timeout 200 python3 bench/cluster/ep_exchange.py --shards 2 --hidden 7168 --layers 58 --rows 16,64,256 2>&1 | tee -a $OUT/ep_exchange.log
