"""Each role reads only its own tensors from disk; together they read the checkpoint exactly once."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from afd.models.checkpoint import Checkpoint, CheckpointError
from afd.models.loader import load_model
from afd.models.spec import moe_layer_mask

ATTENTION_ONLY = re.compile(r"embed_tokens|self_attn|input_layernorm|^model\.norm|^lm_head")
EXPERTS = re.compile(r"mlp\.experts\.|mlp\.shared_experts\.")
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"  # noaux_tc: it chooses the experts, so it lives with them


def _main_layer_keys(path) -> set[str]:
    """The checkpoint's tensors less its MTP layers (layer index ≥ num_hidden_layers), which no role reads."""
    checkpoint = Checkpoint(path)
    layers = checkpoint.config["num_hidden_layers"]
    return {k for k in checkpoint.keys() if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)}


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe", "deepseek_v2_full", "deepseek_v3", "deepseek_v3_fp8",
                                  "qwen3_moe_fp8", "glm4_moe", "glm4_moe_fp8"])
@pytest.mark.parametrize("gate", ["ffn", "attention"])
def test_roles_partition_the_checkpoint(name, gate, checkpoints):
    """FP8 checkpoints too: each weight's scale is read by the role that reads the weight."""
    path = str(checkpoints[name])
    on_attention = gate == "attention"
    attention = set(load_model(path, "attention", on_attention).loaded_keys)
    ffn = set(load_model(path, "ffn", on_attention).loaded_keys)
    everything = _main_layer_keys(path)
    assert attention | ffn == everything
    assert not attention & ffn
    assert not any(EXPERTS.search(key) for key in attention), "attention read expert weights"
    assert not any(ATTENTION_ONLY.search(key) for key in ffn), "ffn read embeddings, attention or the LM head"
    moe = moe_layer_mask(Checkpoint(path).config)
    for key in ffn:
        layer = int(key.split(".")[2])
        if on_attention:
            assert moe[layer] and (EXPERTS.search(key) or key.endswith(ROUTER_BIAS)), \
                f"ffn read {key} although the gate runs on attention"
    gates = {key for key in everything if key.endswith("mlp.gate.weight")}
    assert gates <= (attention if on_attention else ffn)


def test_gate_on_attention_keeps_dense_layers_local(checkpoints):
    path = str(checkpoints["qwen3_moe"])  # mlp_only_layers=[0]
    loaded = load_model(path, "attention", gate_on_attention=True)
    assert loaded.crossing == (1, 2, 3)
    assert "model.layers.0.mlp.down_proj.weight" in loaded.loaded_keys
    assert load_model(path, "attention", gate_on_attention=False).crossing == (0, 1, 2, 3)


def test_sharded_checkpoint_loads_the_same_tensors(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    source = checkpoints["qwen3_moe"]
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(str(source / "model.safetensors"))
    keys = sorted(tensors)
    half = len(keys) // 2
    save_file({k: tensors[k] for k in keys[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in keys[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    whole = load_model(str(source)).model.state_dict()
    sharded = load_model(str(tmp_path)).model.state_dict()
    assert whole.keys() == sharded.keys()
    assert all((whole[k] == sharded[k]).all() for k in whole)


def test_fingerprints_tell_checkpoints_apart(checkpoints):
    same = Checkpoint(checkpoints["deepseek_v2"]).fingerprint()
    assert same == Checkpoint(checkpoints["deepseek_v2"]).fingerprint()
    assert same != Checkpoint(checkpoints["deepseek_v2_seed1"]).fingerprint()


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no config.json"),
        (lambda d: (d / "config.json").write_text("{"), "not valid JSON"),
        (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "unsupported architecture model_type='llama'"),
        (lambda d: (d / "config.json").write_text('{"model_type": "qwen3_moe"}'), "no *.safetensors"),
    ],
)
def test_bad_checkpoint_folders(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        Checkpoint(tmp_path)


def test_missing_folder():
    with pytest.raises(CheckpointError, match="no such folder"):
        Checkpoint("/nonexistent/model")


def test_tiny_checkpoints_are_world_readable(checkpoints):
    """Issue 22: non-root role pods (uid 10001) read a host-path model written by root."""
    folder = checkpoints["qwen3_moe"]
    assert folder.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_an_unreadable_weight_file_says_permission_denied(checkpoints):
    """Not safetensors' "No such file or directory" for a file that is there."""
    scratch = Path(tempfile.mkdtemp(prefix="afd-perm-"))  # pytest's tmp_path is 0700: no other uid gets in
    try:
        folder = scratch / "ckpt"
        shutil.copytree(checkpoints["qwen3_moe"], folder)
        scratch.chmod(0o755)
        (folder / "model.safetensors").chmod(0o600 if os.geteuid() == 0 else 0o000)
        message = _checkpoint_error_as_another_user(folder)
    finally:
        shutil.rmtree(scratch)
    assert "model.safetensors: permission denied (mode 0" in message, message
    assert "No such file" not in message and "chmod" in message


def _checkpoint_error_as_another_user(folder: Path) -> str:
    """The CheckpointError message of opening `folder` as a user who may not read its weights
    (this user when not root; else uid 65534 through setpriv, since root reads anything)."""
    if os.geteuid() != 0:
        with pytest.raises(CheckpointError) as err:
            Checkpoint(folder)
        return str(err.value)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv to drop privileges")
    def as_nobody(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=120)

    probe = as_nobody("import afd.models.checkpoint")  # whether that user can run the package at all
    if probe.returncode != 0:
        pytest.skip(f"uid 65534 cannot run the package from this checkout: {probe.stderr[-300:]}")
    result = as_nobody(f"from afd.models.checkpoint import Checkpoint\nCheckpoint({str(folder)!r})")
    # the package runs: anything but a CheckpointError (a raw OSError, or no error at all) is the regression
    assert result.returncode != 0 and "CheckpointError" in result.stderr, result.stderr[-1000:]
    return result.stderr.strip().splitlines()[-1]
