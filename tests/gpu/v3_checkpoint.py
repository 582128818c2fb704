"""A reduced DeepSeek-V3-shaped random checkpoint (the real MoE shapes, two layers), bf16 and FP8, written
from the GPU in one pass.

Hidden 7168, 256 routed + 1 shared experts of width 2048, top-8 by noaux_tc over 8 groups keeping 4, MLA
with a query LoRA, YaRN; layer 0 dense (width 2048: reduced), layer 1 MoE; the tokenizer of `afd up`'s
tiny model. Tensors under the published checkpoints' names, one expert's projections apiece; the FP8
folder holds the same weights block-quantized (`quantize_block_fp8`) with DeepSeek-V3's quantization_config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

V3_SHAPED = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=32768, hidden_size=7168,
    intermediate_size=2048, moe_intermediate_size=2048, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=16384,
    hidden_act="silu", rope_theta=10000, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# DeepSeek-V3.2's indexer at its real dimensions (64 heads of 128, wq_b from the 1536-wide query LoRA); index_topk 16,
# not 2,048, so that the tests' short prompts attend sparsely within 32 tokens
V32_SHAPED = dict(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_n_heads=64,
                  index_head_dim=128, index_topk=16)
EXPERTS_PER_FILE = 32  # bounds the host memory a file's tensors take before it is written


def _tensors(model, generator: torch.Generator, device: str):
    """(file group, checkpoint key, bf16 or float32 value on `device`) for every weight of `model` (meta)."""
    for name, param in model.named_parameters():
        group = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "model"
        if name.endswith(".mlp.experts.gate_up") or name.endswith(".mlp.experts.down"):
            prefix, kind = name.rsplit(".", 1)
            experts, rows = param.shape[0], param.shape[1]
            for expert in range(experts):
                value = torch.empty(param.shape[1:], dtype=torch.bfloat16, device=device).normal_(0, 0.02,
                                                                                                  generator=generator)
                file = f"{group}.experts{expert // EXPERTS_PER_FILE}"
                if kind == "down":
                    yield file, f"{prefix}.{expert}.down_proj.weight", value
                else:
                    yield file, f"{prefix}.{expert}.gate_proj.weight", value[: rows // 2]
                    yield file, f"{prefix}.{expert}.up_proj.weight", value[rows // 2:]
        elif name.endswith(".mlp.e_score_correction_bias"):  # float32, in the gate, as published
            bias = torch.empty(param.shape, device=device).normal_(0, 0.05, generator=generator)
            yield group, name.replace(".mlp.", ".mlp.gate."), bias
        elif name.endswith("k_norm.bias"):  # the indexer's LayerNorm
            yield group, name, torch.zeros(param.shape, dtype=torch.bfloat16, device=device)
        elif "norm" in name.rsplit(".", 2)[-2]:
            yield group, name, torch.ones(param.shape, dtype=torch.bfloat16, device=device)
        else:
            yield group, name, torch.empty(param.shape, dtype=torch.bfloat16, device=device).normal_(
                0, 0.02, generator=generator)


def write_v3_shaped(bf16_out: Path | None, fp8_out: Path | None, seed: int = 0, device: str = "cuda",
                    overrides: dict | None = None) -> tuple[Path | None, Path | None]:
    """Write the bf16 checkpoint to `bf16_out` and its FP8 block-quantized copy to `fp8_out` (`overrides`: config
    keys changed, e.g. smaller shapes for a CPU check of the layout); a folder given as None is not written (the
    other holds the same weights either way)."""
    from safetensors.torch import save_file

    from afd.checkpoint_tools.fp8_convert import SCALE_SUFFIX, is_quantized_weight, quantization_config
    from afd.models.loader import FAMILIES
    from afd.kernels.fp8_blocks import quantize_block_fp8
    from afd.models.spec import parse_spec
    from afd.local.up import ensure_tiny_model

    tiny = ensure_tiny_model()
    tiny_config = json.loads((tiny / "config.json").read_text())
    config = {**V3_SHAPED, **(overrides or {}), "bos_token_id": tiny_config.get("bos_token_id"),
              "eos_token_id": tiny_config.get("eos_token_id")}
    with torch.device("meta"):
        model = FAMILIES[config["model_type"]](config, parse_spec(config))  # V3's, or V3.2's (`V32_SHAPED`)
    outs = [out for out in (bf16_out, fp8_out) if out is not None]
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    files: dict[str, tuple[dict, dict]] = {}
    gates = []

    def flush(group: str) -> None:
        bf16, fp8 = files.pop(group)
        written = len(list(outs[0].glob("*.safetensors")))  # a group may come back (the final norm, the head)
        for folder, tensors in ((bf16_out, bf16), (fp8_out, fp8)):
            if folder is not None:
                save_file(tensors, str(folder / f"model-{written:05d}.safetensors"), metadata={"format": "pt"})

    for group, key, value in _tensors(model, generator, device):
        if files and group not in files:
            flush(next(iter(files)))  # groups come one after another
        bf16, fp8 = files.setdefault(group, ({}, {}))
        bf16[key] = value.cpu()
        if key.endswith(".mlp.gate.weight"):
            gates.append(key.removesuffix(".weight"))
        if is_quantized_weight(key, value):
            quant, scale = quantize_block_fp8(value)
            fp8[key], fp8[key + SCALE_SUFFIX] = quant.cpu(), scale.cpu()
        else:
            fp8[key] = bf16[key]
    while files:
        flush(next(iter(files)))
    if bf16_out is not None:
        (bf16_out / "config.json").write_text(json.dumps(config, indent=2))
    if fp8_out is not None:
        (fp8_out / "config.json").write_text(json.dumps(
            {**config, "quantization_config": quantization_config(config["model_type"], sorted(gates))}, indent=2))
    for folder in outs:
        for file in tiny.iterdir():
            if "token" in file.name or file.name.endswith(".jinja"):
                shutil.copy(file, folder / file.name)
        for file in folder.iterdir():
            file.chmod(0o644)  # readable by ranks running as another user
    return bf16_out, fp8_out
