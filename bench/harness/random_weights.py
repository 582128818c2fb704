"""Random bf16 weights: a model built in memory at any sample shape (`random_model`), or a DeepSeek-V2-Lite-shaped
checkpoint written from the device in seconds (`write_v2_lite`):

    python bench/harness/random_weights.py --out /tmp/v2lite --layers 27 [--device cuda]

Hugging Face layout: config.json, one safetensors file per decoder layer (plus one for the
embeddings, final norm and LM head) under the model's tensor names, experts stacked as
`mlp.experts.gate_up_proj` / `down_proj` (transformers' fused layout), and the tokenizer of
`afd up`'s tiny model (prompts are sent as token ids; generated ids beyond it decode to "").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.shapes import V2_LITE  # noqa: E402


def random_model(config: dict, role: str = "monolithic", gate_on_attention: bool = False, seed: int = 0):
    """A `role`-pruned model with random bf16 weights on the current GPU (shared experts folded in)."""
    from afd.models.loader import build_share, finish_share

    model, spec, crossing = build_share(config, role, gate_on_attention, torch.bfloat16, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02, generator=generator)
    finish_share(model, torch.bfloat16, "cuda")
    return model, spec, crossing


def write_v2_lite(out: Path, layers: int, device: str = "cuda", seed: int = 0) -> Path:
    """Write the checkpoint to `out` (replacing it) and return `out`."""
    from safetensors.torch import save_file

    from afd.models import deepseek_v2
    from afd.models.spec import parse_spec
    from afd.local.up import ensure_tiny_model

    tiny = ensure_tiny_model()
    tiny_config = json.loads((tiny / "config.json").read_text())
    config = {**V2_LITE, "num_hidden_layers": layers, "torch_dtype": "bfloat16", "architectures": ["DeepseekV2ForCausalLM"],
              "bos_token_id": tiny_config.get("bos_token_id"), "eos_token_id": tiny_config.get("eos_token_id"),
              "tie_word_embeddings": False}
    spec = parse_spec(config)
    with torch.device("meta"):
        model = deepseek_v2.build(config, spec)
    if out.exists():
        shutil.rmtree(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        group = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "model"
        if name.endswith(".mlp.experts.gate_up") or name.endswith(".mlp.experts.down"):
            name += "_proj"
        if "norm" in name.rsplit(".", 2)[-2]:
            value = torch.ones(param.shape, dtype=torch.bfloat16, device=device)
        else:
            value = torch.empty(param.shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=generator)
        groups.setdefault(group, {})[name] = value
    for index, (group, tensors) in enumerate(groups.items()):
        file = partial / f"model-{index:05d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(file))
        file.chmod(0o644)  # readable by ranks running as another user
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for file in tiny.iterdir():
        if "token" in file.name or file.name.endswith(".jinja"):
            shutil.copy(file, partial / file.name)
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    started = time.monotonic()
    write_v2_lite(Path(args.out), args.layers, args.device)
    print(f"wrote {args.out} ({args.layers} layers) in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
