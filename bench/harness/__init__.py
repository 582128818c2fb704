"""What the benchmarks share: `measure` (timing, ceilings, kernel counts, percentiles, $OUT), `shapes` (the sample
models' dims), `random_weights` (random models and checkpoints), `decode_steps` (KV cache, decode graphs, step
timing), `clients` and `steady_streams` (clients of the OpenAI API, a local `afd up`)."""
