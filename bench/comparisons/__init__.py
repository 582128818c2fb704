"""Against other systems: vLLM serving, DeepGEMM's MoE GEMMs."""
