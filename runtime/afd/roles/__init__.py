"""The roles' wiring, one module each: `attention`, `ffn`, `monolithic`."""
