"""`afd generate` with one real process per rank over zmq on 127.0.0.1, and its failure modes."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error

PROCESS_CASES = [
    ("deepseek_v2", "2A1F", 2, "attention"),
    ("qwen3_moe", "3A2F", 1, "ffn"),
    ("qwen3_moe", "2A2F", 2, "attention"),
    ("deepseek_v2", "1A1F", 1, "ffn"),
    ("deepseek_v3", "3A2F", 2, "ffn"),
    ("deepseek_v3_fp8", "2A1F", 1, "attention"),
]


def afd(*args, marker=None, **kwargs):
    env = {**os.environ, "AFD_TEST_MARKER": marker or uuid.uuid4().hex}
    return subprocess.run([sys.executable, "-m", "afd", *map(str, args)], capture_output=True, text=True, env=env, timeout=300, **kwargs)


def processes_with_marker(marker):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"AFD_TEST_MARKER={marker}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def prompt_args(prompts):
    return [arg for prompt in prompts for arg in ("--prompt-ids", ",".join(map(str, prompt)))]


@pytest.mark.parametrize("name, topology, stages, gate", PROCESS_CASES)
def test_generate_over_zmq_processes_equals_transformers(name, topology, stages, gate, checkpoints, hf_reference):
    marker = uuid.uuid4().hex
    done = afd(
        "generate", "--model", checkpoints[name], "--topology", topology, "--stages", stages, "--gate", gate,
        *prompt_args(PROMPTS), "--max-tokens", NEW_TOKENS, "--ignore-eos", "--json", "--with-logits", marker=marker,
    )
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout.strip().splitlines()[-1])
    tokens, logits = hf_reference(name)
    assert output["outputs"] == tokens
    assert max_relative_error(output["last_logits"], logits) < 1e-4
    assert processes_with_marker(marker) == []


def bad_input_cases(checkpoints, tmp_path):
    (tmp_path / "empty").mkdir()
    good = ["--prompt-ids", "1,2,3", "--max-tokens", "4"]
    return {
        "missing folder": (["--model", tmp_path / "missing", *good], "no such folder"),
        "empty folder": (["--model", tmp_path / "empty", *good], "no config.json"),
        "unsupported architecture": (["--model", _llama(tmp_path), *good], "unsupported architecture"),
        "1A2F": (["--model", checkpoints["qwen3_moe"], "--topology", "1A2F", *good], "A >= F"),
        "0A1F": (["--model", checkpoints["qwen3_moe"], "--topology", "0A1F", *good], "at least one attention rank"),
        "2B1F": (["--model", checkpoints["qwen3_moe"], "--topology", "2B1F", *good], "'2B1F'"),
        "stages 3": (["--model", checkpoints["qwen3_moe"], "--stages", "3", *good], "stages=3"),
        "different checkpoints": (
            ["--model", checkpoints["deepseek_v2"], "--ffn-model", checkpoints["deepseek_v2_seed1"], "--topology", "2A1F", *good],
            "model fingerprint differs",
        ),
    }


def _llama(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    "case",
    ["missing folder", "empty folder", "unsupported architecture", "1A2F", "0A1F", "2B1F", "stages 3", "different checkpoints"],
)
def test_bad_input_gives_one_error_line_and_leaves_nothing_running(case, checkpoints, tmp_path):
    args, needle = bad_input_cases(checkpoints, tmp_path)[case]
    marker = uuid.uuid4().hex
    done = afd("generate", *args, marker=marker)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], done.stderr
    assert processes_with_marker(marker) == []


def _start_long_generate(checkpoint, marker, tmp_path):
    """A 2A1F `afd generate` of 3000 tokens, once it decodes: its FFN rank has both attention ranks connected (its
    log folder under `tmp_path`). A fixed wait is not enough: on a busy machine the ranks still import torch for
    half a minute, when a rank cannot yet act on SIGTERM and is killed at the end of the grace period."""
    env = {**os.environ, "AFD_TEST_MARKER": marker, "TMPDIR": str(tmp_path)}  # TMPDIR: where the log folder goes
    # a prompt per attention rank: a rank given none finishes at once and leaves the group (not a stop to test)
    args = ["generate", "--model", checkpoint, "--topology", "2A1F", *prompt_args([[1, 2, 3], [4, 5, 6]]),
            "--max-tokens", "3000", "--ignore-eos"]
    parent = subprocess.Popen([sys.executable, "-m", "afd", *map(str, args)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 180
    while not _ffn_log(tmp_path).count(" connected (") >= 2:
        assert parent.poll() is None and time.monotonic() < deadline, f"no 2A1F group decoding:\n{_ffn_log(tmp_path)}"
        time.sleep(0.2)
    assert len(processes_with_marker(marker)) == 4  # parent + 3 ranks
    time.sleep(1)  # a few steps
    return parent


def _ffn_log(tmp_path) -> str:
    return "".join(log.read_text(errors="replace") for log in tmp_path.glob("afd-local-*/ffn-0.log"))


def _wait_gone(marker, timeout_s):
    deadline = time.monotonic() + timeout_s
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_with_marker(marker)


def test_ctrl_c_stops_every_process(checkpoints, tmp_path):
    marker = uuid.uuid4().hex
    parent = _start_long_generate(checkpoints["qwen3_moe"], marker, tmp_path)
    os.killpg(parent.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    parent.wait(timeout=15)
    assert parent.returncode != 0
    assert _wait_gone(marker, 10) == []


def test_children_die_with_a_killed_parent(checkpoints, tmp_path):
    marker = uuid.uuid4().hex
    parent = _start_long_generate(checkpoints["qwen3_moe"], marker, tmp_path)
    parent.kill()
    parent.wait(timeout=5)
    assert _wait_gone(marker, 10) == []


def test_ffn_serve_exits_cleanly_on_sigterm(checkpoints):
    from afd.local.children import free_port_block

    port = free_port_block(2)
    env = {**os.environ, "AFD_ROLE": "ffn", "AFD_MODEL": str(checkpoints["qwen3_moe"]), "AFD_BIND_HOST": "127.0.0.1",
           "AFD_CONTROL_PORT": str(port), "AFD_DATA_PORT": str(port + 1)}
    server = subprocess.Popen([sys.executable, "-m", "afd", "serve"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.2)
        with __import__("socket").socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
    server.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert server.wait(timeout=5) == 0
    assert time.monotonic() - started < 5
    assert "ffn rank 0 stopped" in server.stderr.read()


def test_make_tiny_model_cli(tmp_path):
    out = tmp_path / "tiny"
    done = afd("make-tiny-model", "--arch", "qwen3_moe", "--out", out, "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    again = afd("make-tiny-model", "--arch", "qwen3_moe", "--out", out)
    assert again.returncode == 1 and "not empty" in again.stderr
    wrong = afd("make-tiny-model", "--arch", "llama", "--out", tmp_path / "x")
    assert wrong.returncode == 1 and "--arch 'llama'" in wrong.stderr


def test_make_tiny_model_cli_writes_fp8_deepseek_v3_and_refuses_fp8_elsewhere(tmp_path):
    import json

    out = tmp_path / "v3"
    done = afd("make-tiny-model", "--arch", "deepseek_v3", "--fp8", "--out", out)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["quantization_config"]["weight_block_size"] == [128, 128]
    wrong = afd("make-tiny-model", "--arch", "deepseek_v2", "--fp8", "--out", tmp_path / "v2")
    assert wrong.returncode == 1 and "--fp8: FP8 checkpoints are made for deepseek_v3, " in wrong.stderr and "not 'deepseek_v2'" in wrong.stderr
