"""vLLM as the attention engine, end to end: vLLM attention ranks + our FFN ranks as processes.

vLLM lives in its own venv (`scripts/install_vllm.sh` → `.venv-vllm`, or `AFD_VLLM_PYTHON`);
these tests skip when it is missing. Our FFN ranks run `afd serve` from this venv over zmq
on 127.0.0.1, exactly as in a pod. Greedy tokens must equal vLLM's own monolithic output
and transformers' for 1A1F and 2A1F, one and two stages, gate on either side, for Qwen3-MoE
and DeepSeek-V2 (vLLM's MLA attention on the CPU).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from afd.local.offline_batch import split_prompts
from afd.config import AFDConfig, config_to_env
from afd.local.group_processes import local_zmq_config
from afd.local.children import LocalProcesses, free_port_block

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
NEW_TOKENS = 12
VLLM_TIMEOUT_S = 420


def _vllm_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFD_")}
    env.update(VLLM_NO_USAGE_STATS="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


@functools.cache
def vllm_python() -> str | None:
    """The interpreter of the vLLM venv, when vLLM imports there."""
    python = os.environ.get("AFD_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        return None
    probe = subprocess.run([python, "-c", "import vllm, afd.vllm_plugin"], capture_output=True, env=_vllm_env({}), timeout=120)
    return python if probe.returncode == 0 else None


pytestmark = pytest.mark.skipif(
    vllm_python() is None, reason="vLLM not installed: run scripts/install_vllm.sh (own venv .venv-vllm)"
)


def _start_vllm(workdir: Path, name: str, job: dict, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    job_file, out_file = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    log = open(workdir / f"{name}.log", "wb")
    child = subprocess.Popen([vllm_python(), "-m", "afd.vllm_plugin.generate", str(job_file), str(out_file)],
                             env=_vllm_env(env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return child, out_file


def _finish(workdir: Path, name: str, child: subprocess.Popen, out_file: Path) -> dict:
    try:
        code = child.wait(timeout=VLLM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        code = "timeout"
    if code != 0:
        tail = (workdir / f"{name}.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"vLLM {name} failed ({code}):\n{tail}")
    return json.loads(out_file.read_text())


# Shapes vLLM's CPU kernels take: attention head_dim 32/64; MLA kv_lora_rank 512 with a 64-wide
# rope part (head 576); its CPU router wants expert groups even for plain greedy top-k.
OVERRIDES = {
    "qwen3_moe": {"head_dim": 32},
    "deepseek_v2": {"kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
                    "n_group": 1, "topk_group": 1},
}


class Arch:
    """One family's checkpoint and its reference outputs, made on first use."""

    def __init__(self, name: str, root: Path):
        self.name, self.root, self._path, self._hf, self._vllm = name, root, None, None, None

    @property
    def path(self) -> Path:
        if self._path is None:
            from afd.checkpoint_tools.tiny import make_tiny_model

            self._path = make_tiny_model(self.name, self.root / self.name, seed=0, overrides=OVERRIDES[self.name])
        return self._path

    @property
    def transformers_tokens(self) -> list[list[int]]:
        if self._hf is None:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
            self._hf = []
            for prompt in PROMPTS:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=0)
                self._hf.append(out[0, len(prompt):].tolist())
        return self._hf

    @property
    def vllm_tokens(self) -> list[list[int]]:
        if self._vllm is None:
            job = {"model": str(self.path), "prompts": PROMPTS, "max_tokens": NEW_TOKENS, "afd": False}
            child, out = _start_vllm(self.root, f"{self.name}-monolithic", job, {"OMP_NUM_THREADS": "2"})
            self._vllm = _finish(self.root, f"{self.name}-monolithic", child, out)["tokens"]
        return self._vllm


@pytest.fixture(scope="module")
def arches(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return {name: Arch(name, root) for name in OVERRIDES}


@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_vllm_monolithic_equals_transformers(arches, arch):
    assert arches[arch].vllm_tokens == arches[arch].transformers_tokens


def run_afd_with_vllm(checkpoint: Path, topology: str, stages: int, gate_on_attention: bool) -> list[dict]:
    """One result per attention rank (its block of PROMPTS) from vLLM attention ranks + our FFN ranks."""
    base = AFDConfig(model=str(checkpoint), stages=stages, gate_on_attention=gate_on_attention, dtype="float32",
                     device="cpu", attention_engine="vllm", connect_timeout_s=120.0, peer_timeout_s=60.0)
    from afd.config import values_from_topology

    config = local_zmq_config(base.replace(**values_from_topology(topology)))
    ranks = config.topology
    blocks = split_prompts(len(PROMPTS), ranks.num_attention)
    metrics = free_port_block(ranks.num_ffn)
    threads = {"OMP_NUM_THREADS": "1"}
    with LocalProcesses() as processes:
        for rank in range(ranks.num_ffn):
            ffn = config.replace(role="ffn", rank=rank, http_host="127.0.0.1", metrics_port=metrics + rank)
            processes.start(f"ffn-{rank}", ["serve"], {**config_to_env(ffn), **threads})
        children = []
        for rank, block in enumerate(blocks):
            job = {"model": str(checkpoint), "prompts": [PROMPTS[i] for i in block], "max_tokens": NEW_TOKENS, "afd": True}
            env = {**config_to_env(config.replace(role="attention", rank=rank)), **threads}
            children.append((f"attention-{rank}", *_start_vllm(processes.workdir, f"attention-{rank}", job, env)))
        results = [_finish(processes.workdir, name, child, out) for name, child, out in children]
        for rank in range(ranks.num_ffn):
            assert processes.children[f"ffn-{rank}"].poll() is None, processes.last_error(f"ffn-{rank}")
    tokens = [None] * len(PROMPTS)
    for block, result in zip(blocks, results):
        for position, index in enumerate(block):
            tokens[index] = result["tokens"][position]
    return [{"tokens": tokens}, *results]


@pytest.mark.parametrize(
    "arch,topology,stages,gate",
    [
        ("qwen3_moe", "1A1F", 1, "ffn"),
        ("qwen3_moe", "1A1F", 2, "attention"),
        ("qwen3_moe", "2A1F", 1, "attention"),
        ("qwen3_moe", "2A1F", 2, "ffn"),
        ("deepseek_v2", "1A1F", 2, "attention"),
        ("deepseek_v2", "2A1F", 1, "ffn"),
    ],
)
def test_vllm_attention_with_our_ffn_equals_vllm_and_transformers(arches, arch, topology, stages, gate):
    model = arches[arch]
    merged, *ranks = run_afd_with_vllm(model.path, topology, stages, gate == "attention")
    assert merged["tokens"] == model.vllm_tokens
    assert merged["tokens"] == model.transformers_tokens
    for result in ranks:  # the attention side never read nor built an expert weight
        assert result["read_keys"] and not [k for k in result["read_keys"] if ".experts." in k]
        assert not [p for p in result["params"] if "experts" in p]
        remote_norms = [p for p in result["params"] if "post_attention_layernorm" in p]
        if gate == "ffn":
            assert remote_norms == [] and not [p for p in result["params"] if ".mlp." in p]
        else:
            assert any(p.endswith("mlp.gate.weight") for p in result["params"])
