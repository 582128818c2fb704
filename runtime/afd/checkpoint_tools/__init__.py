"""Tools that write checkpoints: a tiny random model of a supported family (`tiny`), a bf16 checkpoint in the
published FP8 block format (`fp8_convert`)."""
