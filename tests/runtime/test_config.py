import pytest

from afd.config import AFDConfig, ConfigError, load_config


def test_env_contract_of_design_section_2():
    env = {
        "AFD_ROLE": "ffn",
        "AFD_RANK": "1",
        "AFD_NUM_ATTENTION_RANKS": "4",
        "AFD_NUM_FFN_RANKS": "2",
        "AFD_FFN_ADDRESS_TEMPLATE": "demo-g0-ffn-{rank}.demo-g0-ffn.ns.svc",
        "AFD_CONTROL_PORT": "7000",
        "AFD_DATA_PORT": "7001",
        "AFD_CONNECTOR": "zmq",
        "AFD_STAGES": "2",
        "AFD_GATE_ON_ATTENTION": "true",
        "AFD_MODEL": "/models/x",
        "AFD_HTTP_PORT": "8080",
        "AFD_METRICS_PORT": "9100",
    }
    config = load_config(env=env)
    group = config.group
    assert group.role == "ffn" and group.rank == 1 and config.split.stages == 2 and config.split.gate_on_attention
    assert str(group.topology) == "4A2F"
    assert config.link.ffn_host(1) == "demo-g0-ffn-1.demo-g0-ffn.ns.svc"
    assert config.link.ffn_ports(1) == (7000, 7001)
    with pytest.raises(Exception):
        config.split.stages = 1  # frozen
    with pytest.raises(Exception):
        config.split = config.split  # frozen


def test_rank_from_statefulset_ordinal():
    env = {"AFD_ROLE": "attention", "AFD_NUM_ATTENTION_RANKS": "4", "HOSTNAME": "demo-g0-attn-3"}
    assert load_config(env=env).group.rank == 3


def test_precedence_file_env_cli(tmp_path):
    path = tmp_path / "afd.yaml"
    path.write_text("topology: 2A1F\nstages: 2\nmodel: /from/file\n")
    config = load_config(cli={"model": "/from/cli"}, env={"AFD_STAGES": "1"}, file=path)
    assert (config.group.num_attention_ranks, config.group.num_ffn_ranks) == (2, 1)
    assert config.split.stages == 1 and config.load.model == "/from/cli"


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"AFD_STAGES": "3"}, "stages=3"),
        ({"AFD_STAGES": "two"}, "AFD_STAGES='two'"),
        ({"AFD_CONNECTOR": "tcp"}, "connector='tcp'"),
        ({"AFD_ROLE": "router"}, "role='router'"),
        ({"AFD_NUM_ATTENTION_RANKS": "1", "AFD_NUM_FFN_RANKS": "2"}, "A >= F"),
        ({"AFD_TOPOLOGY": "2B1F"}, "'2B1F'"),
        ({"AFD_RANK": "2", "AFD_NUM_ATTENTION_RANKS": "2"}, "rank=2"),
        ({"AFD_CONTROL_PORT": "70000"}, "control_port=70000"),
        ({"AFD_GATE_ON_ATTENTION": "maybe"}, "AFD_GATE_ON_ATTENTION='maybe'"),
        ({"AFD_PREFILL_ITL_RATIO": "-1"}, "prefill_itl_ratio=-1.0: must not be negative"),
        ({"AFD_API_SERVERS": "0"}, "api_servers=0: must be in 1..16"),
    ],
)
def test_errors_name_the_bad_value(env, needle):
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert needle in str(err.value)


def test_unknown_file_key_is_refused(tmp_path):
    path = tmp_path / "afd.json"
    path.write_text('{"stagez": 2}')
    with pytest.raises(ConfigError, match="unknown setting 'stagez'"):
        load_config(env={}, file=path)


def test_defaults_are_valid():
    assert AFDConfig().group.topology.num_attention == 1


def test_prefill_pacing_is_on_at_twice_a_decode_step_and_can_be_turned_off():
    assert AFDConfig().scheduler.prefill_itl_ratio == 0  # off by default: it cost 16 streams 25 % of their tokens/s (issue 33)
    assert load_config(env={"AFD_PREFILL_ITL_RATIO": "0"}).scheduler.prefill_itl_ratio == 0
    assert load_config(env={"AFD_PREFILL_ITL_RATIO": "1.5"}).scheduler.prefill_itl_ratio == 1.5


def test_the_api_runs_in_the_engines_process_unless_asked_for_api_processes():
    assert AFDConfig().api.api_children == 0
    assert load_config(env={"AFD_API_PROCESS": "1"}).api.api_children == 1
    assert load_config(env={"AFD_API_SERVERS": "4"}).api.api_children == 4  # more than one implies api_process
    assert load_config(env={"AFD_API_PROCESS": "true", "AFD_API_SERVERS": "2"}).api.api_children == 2
