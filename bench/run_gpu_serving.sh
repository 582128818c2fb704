#!/bin/bash
# Issues 15 and 16 on the device machine, one phase per device call (each well inside its 10 minutes).
# MODES=afd (default; 2 GPUs, NCCL) or MODES=monolithic (one GPU); LEVELS (default 16,64,256):
#   PHASE=api      serve_gpu at LEVELS: the API in the engine's process, in one API process, in four
#   PHASE=arrive   64 streams, new prompts keep arriving (4 requests a stream): prefill pacing off, then ratio 2
#   PHASE=profile  py-spy samples of the API rank at 64 and 256 streams, default switch interval and 0.5 ms
#   PHASE=pace     bench/serving/engine_pace.py: the engine loop alone (no HTTP) against its ceiling, monolithic
#   PHASE=largest  serve_gpu --context 2048 --largest-batch: each mode at the most streams its KV cache holds
# Needs in .whl/ (carried): the wheels the README's "GPU path" section lists, and py-spy for PHASE=profile.
# Tables go to stdout, JSON and logs under $OUT.
set -u
source bench/gpu_env.sh || exit 1
export AFD_CONNECTOR=nccl PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
CK="--checkpoint-dir /tmp/ck --layers ${LAYERS:-27}"
MODES=${MODES:-afd}  # monolithic needs one GPU, afd two
LEVELS=${LEVELS:-16,64,256}
serve() {  # tag, then serve_gpu's arguments
    local tag=$1; shift
    echo "== $tag"
    python3 bench/serving/serve_gpu.py $CK "$@" 2>&1 | tee "$OUT/$tag.log" | grep -v "^checkpoint"
    [ -f "$OUT/serve_gpu.json" ] && mv "$OUT/serve_gpu.json" "$OUT/$tag.json"
}
case "${PHASE:-api}" in
api)
    AFD_API_PROCESS=0 serve api0 --modes $MODES --levels $LEVELS --output-tokens 256
    AFD_API_PROCESS=1 serve api1 --modes $MODES --levels $LEVELS --output-tokens 256
    AFD_API_SERVERS=4 serve api4 --modes $MODES --levels $LEVELS --output-tokens 256 ;;
pace)
    python3 bench/serving/engine_pace.py --checkpoint-dir /tmp/ck --layers ${LAYERS:-27} --levels 1,16,64,256 2>&1 | tee "$OUT/pace.log" ;;
largest)
    AFD_API_PROCESS=1 serve largest --modes $MODES --context 2048 --output-tokens 128 --largest-batch ;;
arrive)
    serve ratio0 --modes $MODES --levels 64 --requests-per-stream 4 --output-tokens 256 --prefill-itl-ratio 0
    serve ratio2 --modes $MODES --levels 64 --requests-per-stream 4 --output-tokens 256 --prefill-itl-ratio 2 ;;
profile)
    for streams in ${PROFILE_STREAMS:-64 256}; do
        OUT=/tmp/stacks python3 bench/serving/serve_profile.py $CK --modes $MODES --streams "$streams" --seconds 6 2>&1 \
            | tee "$OUT/profile-$streams.log"  # raw stacks stay in /tmp/stacks: $OUT brings back 8 files at most
        OUT=/tmp/stacks AFD_SWITCH_INTERVAL_S=0.0005 python3 bench/serving/serve_profile.py $CK --modes $MODES --streams "$streams" --seconds 6 \
            2>&1 | tee "$OUT/profile-$streams-si.log"
    done ;;
*) echo "PHASE must be api, arrive, profile, pace or largest" >&2; exit 2 ;;
esac
