"""The vLLM plugin's vLLM-free parts, in the main venv: weight split, FFN link, launcher command."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from afd.config import AFDConfig
from afd.connector.base import PeerLost
from afd.models.loader import load_model
from afd.roles.ffn import build_ffn
from afd.vllm_plugin import afd_architecture
from afd.vllm_plugin.link import StepLink
from afd.vllm_plugin.serve import cpu_mla_backend, engine_env, engine_overrides, vllm_serve_argv
from afd.vllm_plugin.weights import attention_keys


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_attention_reads_exactly_what_our_attention_role_loads(checkpoints, arch, gate_on_attention):
    from afd.models.checkpoint import Checkpoint

    path = checkpoints[arch]
    ours = load_model(str(path), "attention", gate_on_attention)
    keys = attention_keys(Checkpoint(path).keys(), ours.crossing, gate_on_attention)
    assert set(keys) == set(ours.loaded_keys)
    assert not [k for k in keys if ".experts." in k or "shared_expert" in k]


def connect_link(path, config):
    """The plugin's link of attention rank `config` (its group, split and link settings)."""
    return StepLink.connect(str(path), torch.float32, config.group, config.split, config.link)


def _ffn_group(path, stages, gate_on_attention, address):
    base = AFDConfig(model=str(path), connector="loopback", ffn_address_template=address, stages=stages,
                     gate_on_attention=gate_on_attention, dtype="float32", device="cpu", peer_timeout_s=5.0)
    runner = build_ffn(base.replace(role="ffn"))
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    thread.start()
    return base, stop, thread


@pytest.mark.parametrize("stages,gate_on_attention", [(1, False), (2, False), (2, True)])
def test_link_returns_our_models_ffn_output(checkpoints, stages, gate_on_attention):
    """Three steps of every crossing layer through the link equal the monolithic model's FFN."""
    path = checkpoints["qwen3_moe"]
    base, stop, thread = _ffn_group(path, stages, gate_on_attention, f"link-{stages}-{gate_on_attention}")
    mono = load_model(str(path), "monolithic").model
    link = connect_link(path, base.replace(role="attention"))
    try:
        torch.manual_seed(0)
        for tokens in (7, 1, 4):
            for layer in link.plan.crossing:
                h = torch.randn(tokens, link.plan.spec.hidden_size)  # [tokens, hidden]
                if gate_on_attention:
                    x, logits = mono.layers[layer].gate_half(h)
                    want, got = mono.layers[layer].expert_half(x, logits), link.exchange(layer, x, logits)
                else:
                    want, got = mono.layers[layer].ffn_half(h), link.exchange(layer, h)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert link.step_id == 3
    finally:
        link.close()
        stop.set()
        thread.join(timeout=5)


def test_link_fails_fast_once_the_ffn_is_gone(checkpoints):
    path = checkpoints["qwen3_moe"]
    base, stop, thread = _ffn_group(path, 1, False, "link-gone")
    link = connect_link(path, base.replace(role="attention", peer_timeout_s=1.0))
    try:
        stop.set()
        thread.join(timeout=5)
        with pytest.raises(PeerLost):
            link.exchange(link.plan.crossing[0], torch.randn(2, 64))
        with pytest.raises(PeerLost, match="unreachable"):
            link.exchange(link.plan.crossing[0], torch.randn(2, 64))
    finally:
        link.close()


def test_link_layer_order_is_checked(checkpoints):
    path = checkpoints["qwen3_moe"]
    base, stop, thread = _ffn_group(path, 1, False, "link-order")
    link = connect_link(path, base.replace(role="attention"))
    try:
        link.exchange(0, torch.randn(3, 64))
        with pytest.raises(RuntimeError, match="planned 3"):
            link.exchange(1, torch.randn(5, 64))
    finally:
        link.close()
        stop.set()
        thread.join(timeout=5)


def test_vllm_serve_command_from_afd_config(checkpoints):
    path = str(checkpoints["qwen3_moe"])
    config = AFDConfig(model=path, http_port=8123, max_num_seqs=32, max_model_len=1024, served_model_name="tiny",
                       attention_engine="vllm")
    argv = vllm_serve_argv(config.load, config.api, config.scheduler, "float32", ["--enforce-eager"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", path]
    flags = dict(zip(argv[3:-1:2], argv[4:-1:2]))
    assert flags["--port"] == "8123" and flags["--served-model-name"] == "tiny"
    assert flags["--dtype"] == "float32" and flags["--max-num-seqs"] == "32" and flags["--max-model-len"] == "1024"
    assert json.loads(flags["--hf-overrides"]) == {"architectures": ["AFDQwen3MoeForCausalLM"]}
    assert argv[-1] == "--enforce-eager"
    assert "--kv-cache-dtype" not in argv  # auto: vLLM's own default
    fp8 = vllm_serve_argv(config.load, config.api, config.scheduler, "float32", kv_cache_dtype="fp8")
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8"  # AFD_KV_CACHE_DTYPE=fp8 reaches vLLM's own flag


def test_vllm_gets_the_tool_call_parser_ours_reads_with(checkpoints):
    """Issue 52: the attention engine vLLM reads `tool_choice: auto` calls as ours would: the architecture's parser by
    default (the tiny Qwen3's: vLLM's `hermes`, the same format), a named one, or none."""
    path = str(checkpoints["qwen3_moe"])

    def tool_flags(**settings):
        config = AFDConfig(model=path, attention_engine="vllm", **settings)
        argv = vllm_serve_argv(config.load, config.api, config.scheduler, "float32")
        return argv[argv.index("--enable-auto-tool-choice"):][:3] if "--enable-auto-tool-choice" in argv else []
    assert tool_flags() == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert tool_flags(tool_call_parser="kimi_k2") == ["--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2"]
    assert tool_flags(tool_call_parser="none") == []


def test_an_fp32_deepseek_on_a_cpu_asks_for_the_cpu_mla_backend(checkpoints):
    """vLLM prefers its AMX MLA backend on CPUs with AMX tiles, and it refuses float32 weights."""
    deepseek, qwen = str(checkpoints["deepseek_v2"]), str(checkpoints["qwen3_moe"])
    assert cpu_mla_backend(deepseek, "float32", "cpu") == "CPU_MLA"
    assert cpu_mla_backend(deepseek, "bfloat16", "cpu") is None and cpu_mla_backend(deepseek, "float32", "cuda") is None
    assert cpu_mla_backend(qwen, "float32", "cpu") is None
    config = AFDConfig(model=deepseek, attention_engine="vllm")
    argv = vllm_serve_argv(config.load, config.api, config.scheduler, "float32")
    assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
    chosen = vllm_serve_argv(config.load, config.api, config.scheduler, "float32", ["--attention-backend=X"])
    assert "--attention-backend" not in chosen and chosen[-1] == "--attention-backend=X"


def test_unsupported_architecture_is_named():
    assert afd_architecture("DeepseekV2ForCausalLM") == "AFDDeepseekV2ForCausalLM"
    with pytest.raises(ValueError, match="MixtralForCausalLM.*supported: Qwen3MoeForCausalLM, DeepseekV2ForCausalLM"):
        afd_architecture("MixtralForCausalLM")
    with pytest.raises(ValueError, match="no config.json"):
        engine_overrides("/nonexistent")


def test_engine_env_keeps_our_plugin_loaded():
    assert engine_env({"VLLM_PLUGINS": "other"})["VLLM_PLUGINS"] == "other,afd"
    assert "VLLM_PLUGINS" not in engine_env({})  # unset: vLLM loads every installed plugin
    assert engine_env({})["VLLM_NO_USAGE_STATS"] == "1"


def test_attention_engine_is_a_config_choice():
    from afd.config import ConfigError, load_config

    assert load_config(env={"AFD_ATTENTION_ENGINE": "vllm"}).load.attention_engine == "vllm"
    assert load_config(env={}).load.attention_engine == "afd"
    with pytest.raises(ConfigError, match="attention_engine='sglang'"):
        load_config(env={"AFD_ATTENTION_ENGINE": "sglang"})


def test_afd_serve_hands_a_vllm_attention_rank_to_vllm(checkpoints, monkeypatch):
    """`afd serve` in an attention pod with AFD_ATTENTION_ENGINE=vllm becomes vLLM's server."""
    import afd.vllm_plugin.serve as launcher
    from afd.cli import main

    seen = {}

    def fake_exec(group, load, api, scheduler, extra=None, kv_cache_dtype="auto"):
        seen.update(group=group, load=load, kv_cache_dtype=kv_cache_dtype)
        return 0

    monkeypatch.setattr(launcher, "exec_vllm_server", fake_exec)
    for var in [v for v in os.environ if v.startswith("AFD_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AFD_ATTENTION_ENGINE", "vllm")
    monkeypatch.setenv("AFD_MODEL", str(checkpoints["qwen3_moe"]))
    monkeypatch.setenv("AFD_RANK", "1")
    monkeypatch.setenv("AFD_NUM_ATTENTION_RANKS", "2")
    monkeypatch.setenv("AFD_KV_CACHE_DTYPE", "fp8")
    assert main(["serve", "--role", "attention"]) == 0
    assert seen["group"].rank == 1 and seen["load"].attention_engine == "vllm"
    assert seen["kv_cache_dtype"] == "fp8"  # on to vLLM's --kv-cache-dtype


def _wait(condition, timeout_s: float) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_link_heals_a_loss_while_idle(checkpoints):
    """The FFN rank restarts between steps: the keepalive thread re-handshakes, the next step works."""
    path = checkpoints["qwen3_moe"]
    base, stop, thread = _ffn_group(path, 1, False, "link-heal")
    link = connect_link(path, base.replace(role="attention", heartbeat_interval_s=0.1, peer_timeout_s=1.0))
    try:
        stop.set()
        thread.join(timeout=5)
        assert _wait(lambda: link.lost is not None, 5), "the keepalive did not notice the loss"
        _, stop, thread = _ffn_group(path, 1, False, "link-heal")
        assert _wait(lambda: link.lost is None, 15), f"not healed: {link.lost}"
        hidden = torch.randn(3, link.plan.spec.hidden_size)
        assert link.exchange(link.plan.crossing[0], hidden).shape == hidden.shape
    finally:
        link.close()
        stop.set()
        thread.join(timeout=5)


def test_link_leaves_a_draining_ffn_once_vllm_runs_nothing(checkpoints, monkeypatch):
    """A rolling FFN restart behind vLLM attention (issue 35.3): the link honours the drain notice
    as our engine does (one keeper, `LinkCare`), leaving once no step ran for a while, so the
    FFN's drain ends at the goodbye instead of its fallback; the draining FFN is then unreachable."""
    from afd.connector import ffn_link
    from afd.connector.attention_link import LEAVE_AFTER_NOTICE_S
    from afd.vllm_plugin import link as plugin_link

    monkeypatch.setattr(ffn_link, "DRAIN_NOTICE_S", 600.0)  # only the goodbye can end this drain
    monkeypatch.setattr(plugin_link, "IDLE_AFTER_S", 0.5, raising=False)
    path = checkpoints["qwen3_moe"]
    base = AFDConfig(model=str(path), connector="loopback", ffn_address_template="link-drain", dtype="float32",
                     device="cpu", peer_timeout_s=5.0, heartbeat_interval_s=0.1)
    runner = build_ffn(base.replace(role="ffn"))
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    thread.start()
    link = connect_link(path, base.replace(role="attention"))
    try:
        hidden = torch.randn(2, link.plan.spec.hidden_size)
        for layer in link.plan.crossing:  # one whole step
            assert link.exchange(layer, hidden).shape == hidden.shape
        import time

        started = time.monotonic()
        runner.request_drain()
        assert _wait(runner.drained, 10), "the idle vLLM attention rank did not leave the draining FFN"
        left_after = time.monotonic() - started
        assert LEAVE_AFTER_NOTICE_S <= left_after < 8, left_after
        assert "stopping" in (link.lost or ""), link.lost
        with pytest.raises(PeerLost, match="unreachable"):
            link.exchange(link.plan.crossing[0], hidden)
    finally:
        link.close()
        stop.set()
        thread.join(timeout=5)
