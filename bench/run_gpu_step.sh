#!/bin/bash
# Issue 33's decode-step figures on the device machine in one call (issue 34's penalty cost too); everything into
# $OUT/log.txt, the benches' JSON into $OUT/json.tgz (refreshed after each step, so a cut run keeps what it had):
#   bash bench/run_gpu_step.sh
# Run it in a tree of one commit (others' uncommitted edits travel with the working tree): carry
# `git archive HEAD | gzip >.h2tree/tree.tgz`, unpack it under /tmp, copy .whl there and run it there.
# Steps, most wanted first, each with its own time limit (STEPS picks some: tests floor serve0 serve2):
#   tests   the kernels' tests and the GPU parity tests the fused glue touches (AFD over NCCL == monolith, gate on
#           either side; graph replay == eager; piecewise prompt graphs == eager; no Triton compile while serving)
#   floor   bench/step/step_floor.py, both shapes, batches 1,64,256, contexts 128,2048
#   serve0  serve_gpu monolithic at 1,16,64,256 streams, 64 again with penalties, 64 with arriving prompts; pacer off
#   serve2  the same bursts (16,64,256) and arriving prompts with AFD_PREFILL_ITL_RATIO=2
#   kvfp8   issue 54's FP8 KV cache (not in the default STEPS): its kernel and GPU tests, the decode step 256 x 2,048
#           FP8 / bf16 cache at V2-Lite shape (goal <= 0.9), greedy agreement on a DeepSeek-V3-shaped model
set -u
source bench/gpu_env.sh || exit 1
export AFD_GPU_SHARE_ONE=1
start=$SECONDS LOG=$OUT/log.txt JSON=/tmp/afd_json
mkdir -p $JSON
save() { tar czf $OUT/json.tgz -C $JSON . 2>/dev/null; }
step() {  # step SECONDS COMMAND...: the command's output into the log, its JSON under $JSON
  local limit=$1; shift
  echo "=== +$((SECONDS - start)) s: $*" | tee -a $LOG
  OUT=$JSON timeout $limit "$@" 2>&1 | tee -a $LOG | tail -n 40
  save
}
steps=" ${STEPS:-tests floor serve0 serve2} "
gpu=tests/gpu/test_gpu_path.py
if [[ $steps == *" tests "* ]]; then
  step ${TESTS_TIMEOUT:-180} python3 -m pytest -q -rfE -p no:cacheprovider --timeout 100 --maxfail 20 \
    tests/runtime/test_norm_rope.py tests/runtime/test_decode_kernels.py tests/runtime/test_routing_kernel.py \
    "tests/runtime/test_moe_triton_settings.py::test_the_one_program_layout_equals_the_four_launch_layout" \
    "$gpu::test_latent_decode_kernel_equals_the_reference" "$gpu::test_graph_replay_equals_eager_output" \
    "$gpu::test_bf16_afd_over_nccl_equals_bf16_monolithic[1A1F-2-True-ffn]" \
    "$gpu::test_bf16_afd_over_nccl_equals_bf16_monolithic[1A1F-1-False-attention]" \
    "$gpu::test_piecewise_prompt_graphs_equal_eager_steps" tests/gpu/test_compile_watch_gpu.py
fi
if [[ $steps == *" floor "* ]]; then
  step ${FLOOR_TIMEOUT:-200} python3 bench/step/step_floor.py --steps ${FLOOR_STEPS:-10} --batches ${FLOOR_BATCHES:-1,64,256}
fi
serve="python3 bench/serving/serve_gpu.py --modes monolithic --output-tokens 256"
if [[ $steps == *" serve0 "* ]]; then
  AFD_API_PROCESS=1 step ${SERVE0_TIMEOUT:-130} $serve --prefill-itl-ratio 0 --levels ${SERVE0_LEVELS:-1,16,64,256} \
    --penalty-levels 64 --arriving-levels 64
  mv $JSON/serve_gpu.json $JSON/serve_gpu_ratio0.json 2>/dev/null; save
fi
if [[ $steps == *" serve2 "* ]]; then
  AFD_API_PROCESS=1 step ${SERVE2_TIMEOUT:-100} $serve --prefill-itl-ratio 2 --levels ${SERVE2_LEVELS:-16,64,256} \
    --arriving-levels 64
  mv $JSON/serve_gpu.json $JSON/serve_gpu_ratio2.json 2>/dev/null; save
fi
if [[ $steps == *" kvfp8 "* ]]; then
  step ${KVFP8_TESTS_TIMEOUT:-300} python3 -m pytest -q -rfE -p no:cacheprovider --timeout 150 --maxfail 20 \
    tests/runtime/test_kv_fp8_kernels.py tests/gpu/test_gpu_kv_fp8.py
  step ${KVFP8_STEP_TIMEOUT:-240} python3 bench/step/kv_fp8.py step --batch 256 --context 2048
  step ${KVFP8_AGREE_TIMEOUT:-180} python3 bench/step/kv_fp8.py agreement --shape deepseek-v3 --layers 4 --experts 16
fi
echo "=== done at +$((SECONDS - start)) s" | tee -a $LOG
