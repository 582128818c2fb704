"""`afd serve`: the role entry points (`attention`: the engine and the HTTP API, in one process or with API
processes; `ffn`: the FFN worker loop), each with its probe server, and what they measure at start and while
serving (`ceiling`, `serving_metrics`)."""
