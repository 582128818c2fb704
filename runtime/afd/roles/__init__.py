"""Each role's wiring from its configuration, and `afd serve`'s entry for it: `attention` (weights, KV cache, the
FFN link, runner and graphs, behind the engine's HTTP API), `ffn` (weights, the link its peers connect to, the step
executor and the worker loop; no HTTP API) and `monolithic` (the whole model behind the same engine and API). What
they share: `share` (a role's share of the weights, graphs, the metrics registry) and `kv_sizing` (the KV cache's
size). The device is resolved once, by the role's builder, and passed down."""
