"""`AFD_API_PROCESS=1`: the HTTP API in child processes, the engine core in `afd serve` (vLLM V1's split).

One Python process shares one GIL between the engine thread, the output thread and the HTTP
event loop; the loop's per-token work (SSE formatting, socket writes) then delays the next
step's launch. Here the core process keeps the model, the FFN link, the engine, its output
thread (sampled tokens, EOS and length), the serving metrics and the probe server; the child
runs uvicorn with the same app (`create_app` behind `Failover`), tokenizes prompts,
detokenizes outputs and finds stop strings, formats events, and talks to the core over
`core_link` / `engine_client`. With `AFD_API_SERVERS=N` there are N such children, each binding
the HTTP port with SO_REUSEPORT, so the kernel spreads connections over N event loops (one
Python process's per-token HTTP work saturates one core near 15,000 tokens/s).

Lifecycle: the core starts the children once its engine runs and is ready when every child says
it listens. SIGTERM to the core is passed to the children, whose uvicorn finishes in-flight
requests within `shutdown_grace_s`; then the core stops. A child that exits on its own is
started again (its requests are aborted in the core; the model, the engine and the other
children keep serving), unless children died `RESTART_LIMIT` times within `RESTART_WINDOW_S`:
then the core exits non-zero and the kubelet restarts the pod. A core that dies takes the
children with it (parent-death signal).

The core side: `core` (starting and watching the children) and `core_link` (its end of the sockets); the child
side: `child` (uvicorn and the app; `python -m afd.server.api_process`), `engine_client` (the engine as the app
sees it) and `request_text`; `core_wire`: the messages between them.
"""
