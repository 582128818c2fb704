#!/bin/bash
# Issue 20 on the device machine: rank-loss recovery tests over NCCL, then the NCCL teardown timings. Logs under $OUT.
# Needs the wheels of pyzmq, pydantic(-core), annotated-types, typing-inspection, typing-extensions, fastapi,
# starlette, uvicorn, opentelemetry-api in .whl/ (carried); see the README's "GPU path" section.
# PYTEST_K: a -k expression (spaces allowed); AFD_RECOVERY_STREAM_TOKENS: tokens per stream (3000).
set -u
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; from afd.connector.transports.nccl import lib as nccl_lib; print('torch', torch.__version__, 'nccl', nccl_lib.version(), 'gpus', torch.cuda.device_count())"
AFD_GPU_RESULTS=$OUT/recovery.jsonl AFD_GPU_LOGS=$OUT/children.log NCCL_DEBUG=WARN timeout ${RECOVERY_S:-400} \
    python3 -m pytest -q -rA tests/gpu/test_gpu_recovery.py ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} -p no:cacheprovider --timeout 380 2>&1 | tee $OUT/gpu_recovery.log | tail -40
grep -h "destroyed in\|teardown of the pair\|linked again\|re-handshake with\|aborting the NCCL pair\|dropping attention peer" $OUT/children.log | cut -c1-300 | tail -40
[ "${TEARDOWN_S:-140}" = 0 ] || NCCL_DEBUG=WARN timeout ${TEARDOWN_S:-140} python3 bench/cluster/nccl_teardown.py 2>&1 | tee $OUT/nccl_teardown.log
