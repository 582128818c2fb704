"""The engine's HTTP API around a loaded attention or monolithic rank (`engine_api`: in one process or with API
processes, with its probe server), and what it measures at start and while serving (`ceiling`,
`serving_metrics`). The roles' entry points are `afd.roles`."""
