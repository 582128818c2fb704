"""FP8 parity against a reading of the published block format that does not go through our code.

The other FP8 parity tests compare our model with transformers on weights dequantized by our own
`dequantize_block_fp8`: they pin the architecture, not how the format is read. Here the reference dequantizes
each checkpoint from the format's definition, written out below: a float8_e4m3fn `weight` [out, in] with a float32
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)], the real weight being w = q · scale_inv[i // 128, j // 128]
per 128×128 block, the partial blocks at the right and bottom edges included. transformers then runs the plain
copy (its own FP8 loading needs `accelerate` and a GPU here), and our runtime, reading the FP8 folder itself,
must match it.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import max_relative_error, transformers_greedy
from tests.runtime.test_models import monolithic_generate

BLOCK = 128  # the format's block edge: quantization_config.weight_block_size [128, 128]


def dequantize_by_definition(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """w[i, j] = q[i, j] · scale_inv[i // 128, j // 128], block by block (edge blocks cut by the slices)."""
    rows, cols = q.shape
    assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)), (q.shape, scale_inv.shape)
    w = torch.empty(rows, cols, dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            block = (slice(bi * BLOCK, (bi + 1) * BLOCK), slice(bj * BLOCK, (bj + 1) * BLOCK))
            w[block] = q[block].to(torch.float32) * scale_inv[bi, bj]
    return w


def reference_copy(source: Path, target: Path) -> tuple[Path, int, int]:
    """`source` with every FP8 weight dequantized by the definition and no quantization_config; (folder, weights
    dequantized, of them those with a partial edge block)."""
    target.mkdir()
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, target / item.name)
    config = json.loads((source / "config.json").read_text())
    assert config.pop("quantization_config")["weight_block_size"] == [BLOCK, BLOCK]
    (target / "config.json").write_text(json.dumps(config))
    dequantized = partial = 0
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        plain = {}
        for key, tensor in tensors.items():
            if key.endswith("_scale_inv"):
                assert key.removesuffix("_scale_inv") in tensors, key
            elif key + "_scale_inv" in tensors:
                plain[key] = dequantize_by_definition(tensor, tensors[key + "_scale_inv"])
                dequantized += 1
                partial += any(size % BLOCK for size in tensor.shape)
            else:
                assert tensor.dtype != torch.float8_e4m3fn, f"{key}: FP8 without a scale"
                plain[key] = tensor
        save_file(plain, str(target / file.name), metadata={"format": "pt"})
    return target, dequantized, partial


@pytest.fixture(scope="module")
def references(checkpoints, tmp_path_factory):
    """name → (tokens, last logits) of transformers on the checkpoint dequantized by the definition."""
    root, cache = tmp_path_factory.mktemp("fp8_by_definition"), {}

    def reference(name):
        if name not in cache:
            folder, dequantized, partial = reference_copy(Path(checkpoints[name]), root / name)
            assert dequantized > 0 and partial > 0  # FP8 weights read, edge blocks among them
            cache[name] = transformers_greedy(folder)
        return cache[name]

    return reference


def test_the_definition_reads_a_hand_made_block_layout():
    """The reference itself, on a weight whose blocks are told apart: 130×260 (edge blocks of 2 rows and 4 columns),
    each block's q a constant, scales all different."""
    q = torch.zeros(130, 260)
    scale_inv = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    q[:128, :128], q[:128, 128:256], q[:128, 256:] = 1.0, 1.5, 2.0
    q[128:, :128], q[128:, 128:256], q[128:, 256:] = 0.5, 0.25, 3.0
    w = dequantize_by_definition(q.to(torch.float8_e4m3fn), scale_inv)
    assert w[0, 0] == 1.0 and w[127, 255] == 3.0 and w[0, 259] == 8.0
    assert w[129, 0] == 4.0 and w[128, 200] == 4.0 and w[129, 259] == 96.0


@pytest.mark.parametrize("name", ["qwen3_moe_fp8", "deepseek_v3_fp8", "glm4_moe_fp8"])
def test_fp8_monolith_equals_transformers_on_the_format_read_by_its_definition(name, checkpoints, references):
    tokens, logits = references(name)
    result = monolithic_generate(checkpoints[name])
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4
