"""Per-layer profiling and Prometheus collectors shared by both roles."""
