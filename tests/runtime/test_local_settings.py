"""`afd up` and `afd generate` honour every setting `afd serve` honours, or refuse it by name (issue 35 item 2).

Nothing is started: `afd up`'s ranks are planned and their environments recorded by a stand-in for the
process starter, as are `afd generate`'s; each child's config is then rebuilt from that environment exactly
as the child would (`load_config`).
"""

import json
import os
from pathlib import Path

import pytest

import afd.local.up
from afd import cli
from afd.config import ENV_VARS, ConfigError, config_to_env, load_config, values_from_env

# a valid value for every AFD_* variable, unlike the defaults of `afd up` and `afd generate`
HONOURED = {
    "AFD_NUM_ATTENTION_RANKS": "4", "AFD_NUM_FFN_RANKS": "2", "AFD_FFN_EXPERT_PARALLEL": "2",
    "AFD_MAX_MESSAGE_BYTES": "12345678", "AFD_GATE_ON_ATTENTION": "true", "AFD_DTYPE": "bfloat16",
    "AFD_DEVICE": "cuda", "AFD_MAX_NUM_SEQS": "7", "AFD_MAX_MODEL_LEN": "99", "AFD_MAX_NUM_BATCHED_TOKENS": "333",
    "AFD_PREFILL_ITL_RATIO": "1.25", "AFD_PREFILL_BACKLOG_STEPS": "9", "AFD_KV_CACHE_BYTES": "1048576",
    "AFD_SERVED_MODEL_NAME": "demo-name", "AFD_FAILOVER_URL": "http://127.0.0.1:9/", "AFD_MAX_REQUEST_BYTES": "4096",
    "AFD_MAX_PROMPTS": "3", "AFD_MAX_PROMPT_CHARS": "77", "AFD_GROUP_TOKEN": "tok-1", "AFD_GROUP_SECRET": "s3cret",
    "AFD_CONNECT_TIMEOUT_S": "12.5", "AFD_PEER_TIMEOUT_S": "7.5", "AFD_HEARTBEAT_INTERVAL_S": "0.25",
    "AFD_SHUTDOWN_GRACE_S": "11", "AFD_PROFILE_EVERY": "3", "AFD_CUDA_GRAPHS": "true", "AFD_MIXED_GRAPH_TOKENS": "512",
    "AFD_FFN_BATCH_WINDOW_S": "0.002", "AFD_DBO_MIN_TOKENS": "64", "AFD_VLLM_ARGS": "--enforce-eager",
    "AFD_GPU_MEMORY_UTILIZATION": "0.5", "AFD_CEILING_BATCHES": "1,8", "AFD_CEILING_CONTEXT": "128",
    "AFD_API_PROCESS": "true", "AFD_API_SERVERS": "2", "AFD_FFN_HOLD_S": "4.5",
    "AFD_API_KEY": "key-1,key-2", "AFD_REASONING_PARSER": "qwen3", "AFD_REASONING_CONTENT": "true",
    "AFD_PREFIX_CACHING": "false", "AFD_KV_CACHE_DTYPE": "fp8", "AFD_TOOL_CALL_PARSER": "qwen3",
}
# set by each test: the model, and where the two commands' defaults differ
PER_COMMAND = {"up": {"AFD_STAGES": "1", "AFD_ATTENTION_ENGINE": "vllm"},
               "generate": {"AFD_STAGES": "2", "AFD_CONNECTOR": "loopback"}}
# what each command decides itself, with a valid value that is still refused
PLACEMENT = {"AFD_ROLE": "ffn", "AFD_RANK": "0", "AFD_FFN_SHARD": "0", "AFD_FFN_ADDRESS_TEMPLATE": "host-{rank}",
             "AFD_CONTROL_PORT": "25600", "AFD_DATA_PORT": "25601", "AFD_PORT_STRIDE": "4", "AFD_BIND_HOST": "127.0.0.1",
             "AFD_HTTP_HOST": "127.0.0.1", "AFD_HTTP_PORT": "8001", "AFD_METRICS_PORT": "9091"}
REFUSED = {"up": {**PLACEMENT, "AFD_CONNECTOR": "zmq"},
           "generate": {**PLACEMENT, "AFD_ATTENTION_ENGINE": "vllm"}}


def test_every_variable_is_either_honoured_or_refused_by_each_command():
    for command in ("up", "generate"):
        covered = {*HONOURED, *PER_COMMAND[command], *REFUSED[command], "AFD_MODEL"}
        assert covered == set(ENV_VARS), f"afd {command}: decide for {sorted(set(ENV_VARS) ^ covered)}"


@pytest.fixture
def clean_env(monkeypatch):
    """No AFD_* setting from the machine running the tests; a pod-like host name whose ordinal must not count."""
    for var in [*ENV_VARS, "AFD_TOPOLOGY", "AFD_CONFIG_FILE"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOSTNAME", "laptop-3")
    return monkeypatch


def up_children(argv, monkeypatch):
    """The environment of every rank `afd up <argv>` would start, as each child sees it."""
    from afd.local.up import Supervisor, plan_ranks

    planned = {}

    def fake_run_up(config, port, state_file, demo=True, front=None):
        planned.update(config=config, front=front)
        return 0

    monkeypatch.setattr(afd.local.up, "run_up", fake_run_up)
    assert cli.cmd_up(cli.build_parser().parse_args(["up", *argv])) == 0
    started = []

    class Recorder:
        children: dict = {}

        def start(self, name, args, env):
            started.append((name, {**os.environ, **env}))

    Supervisor(plan_ranks(planned["config"]), Recorder(), None, "http://127.0.0.1:1/v1").start_all()
    return planned, started


def test_afd_up_no_prefix_caching_reaches_every_attention_rank(clean_env, checkpoints):
    clean_env.setenv("AFD_MODEL", str(checkpoints["qwen3_moe"]))
    for flag, expected in (([], True), (["--no-prefix-caching"], False)):
        _, children = up_children(["--topology", "2A1F", *flag], clean_env)
        assert [load_config(env=env).kv.prefix_caching for name, env in children if name.startswith("attention")] == [
            expected, expected]


def generate_children(argv, tmp_path, monkeypatch):
    """The environment of every process `afd generate <argv>` (zmq) would start, as each child sees it."""
    import afd.local.group_processes as group_processes

    started = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            self.workdir = tmp_path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self, name, args, env):
            started.append((name, {**os.environ, **env}))
            if args[0] == "run-batch":  # answer the batch at once: one token per prompt
                count = len(json.loads(Path(args[2]).read_text())["prompts"])
                Path(args[4]).write_text(json.dumps({"tokens": [[1]] * count, "last_logits": [[0.0]] * count}))

        def wait(self, *args, **kwargs):
            pass

    monkeypatch.setattr(group_processes, "LocalProcesses", Recorder)
    assert cli.cmd_generate(cli.build_parser().parse_args(["generate", "--prompt-ids", "1,2", *argv])) == 0
    return started


def assert_carries(children, settings):
    assert children
    for name, env in children:
        config = load_config(env=env)
        for var, raw in settings.items():
            field = ENV_VARS[var]
            assert config.value(field) == values_from_env({var: raw})[field], f"{name}: {var}={raw} lost"


def test_afd_up_gives_every_rank_every_setting(clean_env, checkpoints):
    settings = {**HONOURED, **PER_COMMAND["up"], "AFD_MODEL": str(checkpoints["qwen3_moe"])}
    for var, value in settings.items():
        clean_env.setenv(var, value)
    planned, children = up_children([], clean_env)
    assert len(children) == 2 * 2 + 4  # 4A2F, two shards per FFN rank
    assert_carries(children, settings)
    assert sorted(load_config(env=env).group.rank for name, env in children if name.startswith("attention")) == [0, 1, 2, 3]
    assert planned["front"].max_request_bytes == 4096  # the front door's limit too


def test_afd_generate_gives_every_process_every_setting(clean_env, checkpoints, tmp_path):
    settings = {**HONOURED, "AFD_STAGES": "2", "AFD_MODEL": str(checkpoints["qwen3_moe"])}
    for var, value in settings.items():
        clean_env.setenv(var, value)
    children = generate_children([], tmp_path, clean_env)
    assert len(children) == 2 * 2 + 4
    assert_carries(children, settings)


def test_afd_generate_in_threads_gets_every_setting(clean_env, checkpoints):
    from types import SimpleNamespace

    import afd.local.group_threads as group_threads

    settings = {**HONOURED, **PER_COMMAND["generate"], "AFD_MODEL": str(checkpoints["qwen3_moe"])}
    for var, value in settings.items():
        clean_env.setenv(var, value)
    seen = []
    clean_env.setattr(group_threads, "generate_in_threads",
                      lambda config, prompts, *rest: seen.append(config) or SimpleNamespace(tokens=[[1]], last_logits=[]))
    assert cli.cmd_generate(cli.build_parser().parse_args(["generate", "--prompt-ids", "1,2"])) == 0
    assert_carries([("generate", config_to_env(seen[0]))], settings)


@pytest.mark.parametrize("command", ["up", "generate"])
def test_a_setting_the_command_decides_is_refused_by_name(command, clean_env, checkpoints, tmp_path):
    clean_env.setenv("AFD_MODEL", str(checkpoints["qwen3_moe"]))
    for var, value in REFUSED[command].items():
        with clean_env.context() as env:
            env.setenv(var, value)
            with pytest.raises(ConfigError, match=var):
                if command == "up":
                    up_children([], env)
                else:
                    generate_children([], tmp_path, env)


def test_flags_beat_variables_beat_the_file_beats_the_defaults(clean_env, checkpoints, tmp_path):
    settings = tmp_path / "afd.yaml"
    settings.write_text("kv_cache_bytes: 4096\ndbo_min_tokens: 8\ntopology: 3A1F\n")
    clean_env.setenv("AFD_DBO_MIN_TOKENS", "16")
    clean_env.setenv("AFD_TOPOLOGY", "4A2F")
    _, children = up_children(["--model", str(checkpoints["qwen3_moe"]), "--config", str(settings), "--topology", "2A1F"], clean_env)
    configs = [load_config(env=env) for _, env in children]
    assert len(configs) == 3 and all(str(c.group.topology) == "2A1F" and c.kv.kv_cache_bytes == 4096
                                     and c.split.dbo_min_tokens == 16 and c.split.stages == 2 for c in configs)


def test_monolithic_refuses_a_topology(clean_env, checkpoints):
    clean_env.setenv("AFD_TOPOLOGY", "2A1F")
    with pytest.raises(ConfigError, match="AFD_TOPOLOGY: --monolithic"):
        up_children(["--monolithic", "--model", str(checkpoints["qwen3_moe"])], clean_env)
    clean_env.delenv("AFD_TOPOLOGY")
    clean_env.setenv("AFD_KV_CACHE_BYTES", "8192")
    _, children = up_children(["--monolithic", "--model", str(checkpoints["qwen3_moe"])], clean_env)
    assert [(name, load_config(env=env).kv.kv_cache_bytes) for name, env in children] == [("monolithic-0", 8192)]


def _subcommand(name):
    import argparse

    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize("command, defaults", [("up", cli.UP_DEFAULTS), ("generate", cli.GENERATE_DEFAULTS)])
def test_help_names_the_default_and_variable_of_every_group_flag(command, defaults):
    options = {a.option_strings[-1]: a for a in _subcommand(command)._actions if a.option_strings}
    assert all(action.help for action in options.values()), [o for o, a in options.items() if not a.help]
    for flag in ("--topology", "--stages", "--gate"):
        assert f"(default {defaults[flag[2:]]}; AFD_" in options[flag].help, options[flag].help
    assert options["--gate"].choices == ("ffn", "attention")


def test_up_help_says_how_many_log_folders_are_kept():
    from afd.local.log_folders import KEEP

    assert f"the newest {KEEP} folders of finished runs are kept" in _subcommand("up").format_help().replace("\n", " ")


def test_the_defaults_the_help_names_are_the_ones_used(clean_env, checkpoints):
    _, children = up_children(["--model", str(checkpoints["qwen3_moe"])], clean_env)
    configs = [load_config(env=env) for _, env in children]
    assert {(str(c.group.topology), c.split.stages, c.split.gate_on_attention) for c in configs} == {("2A1F", 2, False)}
