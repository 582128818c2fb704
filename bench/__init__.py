"""The benchmarks, by subject; each script runs as `python3 bench/<folder>/<name>.py` from the repository root.

- `harness/`: what every bench measures with (timing, ceilings, percentiles, $OUT), the sample shapes, random
  weights and checkpoints, decode steps, API clients; at the bottom: it imports no other bench folder.
- `kernels/`: one kernel or MoE layer on one GPU, and the tuners that write the kernels' tables.
- `step/`: one model step (decode, mixed, attention only) against its floor, on one GPU or process.
- `serving/`: the serving processes through the OpenAI API, the engine loop, the output path.
- `cluster/`: ranks together: AFD decode over NCCL, expert-parallel exchange, NCCL pairs, the planner, SLO traces.
- `comparisons/`: against other systems (vLLM, DeepGEMM).

A folder imports only folders listed before it here (and `afd`'s public names); `tests/runtime/test_layering.py`
checks it. The GPU runs: `bench/run_gpu*.sh` (environment: `bench/gpu_env.sh`).
"""
