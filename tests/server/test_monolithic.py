"""The monolithic role: the same engine and API with the FFN local; its greedy output equals the reference."""

import signal
import subprocess
import sys

import httpx
from afd.config import AFDConfig
from afd.local.up import plan_ranks
from tests.server.conftest import _free_port
from tests.server.test_api import PROMPT_IDS, greedy_ids
from tests.server.test_up import read_state, wait_for


def test_afd_up_monolithic_plans_one_rank_with_the_api():
    ranks = plan_ranks(AFDConfig(role="monolithic", model="m"))
    assert [(r.role, r.rank) for r in ranks] == [("monolithic", 0)]
    assert ranks[0].config.group.role == "monolithic" and "api" in ranks[0].describe(1)


def test_monolithic_server_answers_like_the_reference(checkpoints, tmp_path):
    """`afd up --monolithic` end to end: greedy completions equal the unsplit model's, metrics say monolithic."""
    state_file = tmp_path / "state.json"
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--monolithic", "--model", str(checkpoints["qwen3_moe"]),
                           "--port", str(_free_port()), "--state-file", str(state_file), "--no-demo"], stderr=subprocess.DEVNULL)
    try:
        state = wait_for(lambda: read_state(state_file), 300, "afd up --monolithic to start")
        assert [rank["role"] for rank in state["ranks"]] == ["monolithic"]
        api = state["api"]
        model = httpx.get(f"{api}/models").json()["data"][0]["id"]
        texts = [httpx.post(f"{api}/completions", json={"model": model, "prompt": p, "max_tokens": 6, "temperature": 0,
                                                         "ignore_eos": True, "logprobs": 0}, timeout=60).json()
                 for p in PROMPT_IDS[:4]]
        metrics = httpx.get(state["ranks"][0]["metrics"]).text
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    from afd.engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoints["qwen3_moe"]))
    served = [r["choices"][0]["logprobs"]["tokens"] for r in texts]  # each token's text
    assert served == [[tokenizer.decode([t]) for t in ids] for ids in greedy_ids(checkpoints["qwen3_moe"], PROMPT_IDS[:4], 6)]
    assert 'afd_kv_cache_capacity_tokens{rank="0",role="monolithic"}' in metrics
    assert 'afd_weights_resident_bytes{rank="0",role="monolithic"}' in metrics  # the role builder's series
