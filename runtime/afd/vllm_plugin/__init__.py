"""vLLM as the attention engine: vLLM's attention workers talk to our FFN ranks.

vLLM loads general plugins (entry point group `vllm.general_plugins`, ours is
`afd = afd.vllm_plugin:register`) in every process it starts; `register` adds the AFD
attention-role architectures to vLLM's model registry. A checkpoint selects one with
`--hf-overrides '{"architectures": ["AFDQwen3MoeForCausalLM"]}'` (`afd.vllm_plugin.serve`
does this); without the override vLLM serves the checkpoint as usual, monolithically.
The AFD settings (rank, topology, FFN addresses, stages, gate placement) come from the
same `AFD_*` environment as our own attention role.

Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

# HF architecture of the checkpoint → our attention-role architecture registered with vLLM
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": ("AFDQwen3MoeForCausalLM", "afd.vllm_plugin.qwen3_moe:AFDQwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("AFDDeepseekV2ForCausalLM", "afd.vllm_plugin.deepseek_v2:AFDDeepseekV2ForCausalLM"),
}


def register() -> None:
    """The `vllm.general_plugins` entry point; safe to call many times, in any process."""
    from vllm import ModelRegistry  # local import: vLLM is optional (its own venv); afd.cli imports this package without it

    for name, target in ARCHITECTURES.values():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, target)


def afd_architecture(hf_architecture: str) -> str:
    """The AFD attention-role architecture for a checkpoint's `architectures[0]`."""
    if hf_architecture not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise ValueError(f"architecture {hf_architecture!r} has no AFD attention role for vLLM (supported: {known})")
    return ARCHITECTURES[hf_architecture][0]
