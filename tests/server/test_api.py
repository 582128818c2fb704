"""The OpenAI-compatible API of an attention rank backed by a real (loopback) AFD group."""

import asyncio
import json

import httpx
import pytest
import torch

from afd.engine.generation import greedy_generate
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner

PROMPT_IDS = [[5 + i, 6 + 2 * i, 7, 8 + i % 5, 9] for i in range(32)]


def complete(server, **body):
    body.setdefault("model", server.model)
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def greedy_ids(checkpoint, prompts, max_tokens):
    loaded = load_model(str(checkpoint))
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 4096, torch.float32, "cpu")
    return greedy_generate(MonolithicRunner(loaded, cache), cache, prompts, max_tokens, ignore_eos=True).tokens


def test_32_concurrent_greedy_requests_equal_each_alone(server, checkpoints):
    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"model": server.model, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0} for p in PROMPT_IDS]
            return await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(run_all())
    together = [[server.state.tokenizer.convert_tokens_to_ids(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
                for r in responses]
    alone = greedy_ids(checkpoints["qwen3_moe"], PROMPT_IDS, 12)  # one reference model, no batching effects
    texts_alone = [complete(server, prompt=p, max_tokens=12, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
                   for p in PROMPT_IDS[:4]]
    assert [r.json()["choices"][0]["text"] for r in responses[:4]] == texts_alone
    assert all(r.status_code == 200 for r in responses)
    # token-level check through the reported logprobs tokens (decoded per token)
    assert [[server.state.tokenizer.decode([t]) for t in ids] for ids in alone] == [
        r.json()["choices"][0]["logprobs"]["tokens"] for r in responses]
    assert len(together) == 32


def stream_text(server, path, body):
    pieces, finish, usage = [], None, None
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                pieces.append(choice["text"] if "text" in choice else choice["delta"].get("content", ""))
                finish = choice["finish_reason"] or finish
    return "".join(pieces), finish, usage


def test_streaming_and_whole_responses_agree(server):
    body = {"model": server.model, "prompt": "Hello, world!", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    whole = complete(server, **body).json()
    text, finish, usage = stream_text(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert text == whole["choices"][0]["text"] and finish == whole["choices"][0]["finish_reason"] == "length"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: what each found in the cache
    assert [usage[k] for k in counts] == [whole["usage"][k] for k in counts] and usage["completion_tokens"] == 20
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 15, "temperature": 0}
    whole_chat = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    streamed, _, _ = stream_text(server, "/v1/chat/completions", {**chat, "stream": True})
    assert streamed == whole_chat["choices"][0]["message"]["content"]


def tokens_of(response):
    return [entry for entry in response.json()["choices"][0]["logprobs"]["tokens"]]


SAMPLE = {"prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True, "logprobs": 0}


def test_temperature_zero_is_greedy_and_temperature_one_is_not(server):
    greedy = tokens_of(complete(server, **SAMPLE, temperature=0))
    sampled = tokens_of(complete(server, **SAMPLE, temperature=1.0, seed=1))
    assert greedy != sampled


def test_seed_makes_sampling_reproducible(server):
    first = tokens_of(complete(server, **SAMPLE, temperature=1.0, seed=7))
    assert first == tokens_of(complete(server, **SAMPLE, temperature=1.0, seed=7))
    assert first != tokens_of(complete(server, **SAMPLE, temperature=1.0, seed=8))


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 0.01}])
def test_top_k_and_top_p_narrow_sampling_to_the_argmax(server, knob):
    greedy = tokens_of(complete(server, **SAMPLE, temperature=0))
    assert tokens_of(complete(server, **SAMPLE, temperature=1.0, seed=1, **knob)) == greedy


def test_top_k_two_stays_within_the_top_two(server):
    response = complete(server, **{**SAMPLE, "logprobs": 2}, temperature=5.0, seed=3, top_k=2)
    logprobs = response.json()["choices"][0]["logprobs"]
    for chosen, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert chosen in top
    assert logprobs["tokens"] != tokens_of(complete(server, **SAMPLE, temperature=0))


def test_max_tokens_and_logprobs(server):
    body = complete(server, prompt=[5, 6, 7], max_tokens=5, temperature=0, ignore_eos=True, logprobs=3).json()
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 5 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["top_logprobs"]) == 5
    for lp, top in zip(choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]):
        # keys are token texts, so two tokens that decode alike share one entry (as in OpenAI's format)
        assert 1 <= len(top) <= 3 and lp == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_stop_string_truncates_the_text(server):
    full = complete(server, prompt="Hello", max_tokens=30, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = complete(server, prompt="Hello", max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full[: full.index(stop)]
    streamed, finish, _ = stream_text(server, "/v1/completions", {"model": server.model, "prompt": "Hello", "max_tokens": 30,
                                                                 "temperature": 0, "ignore_eos": True, "stop": stop, "stream": True})
    assert streamed == cut["text"] and finish == "stop"


def test_stop_token_ids_end_generation(server):
    ids = [server.state.tokenizer.convert_tokens_to_ids(t) for t in tokens_of(complete(server, **SAMPLE, temperature=0))]
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    body = complete(server, **SAMPLE, temperature=0, stop_token_ids=[ids[stop_at]]).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == stop_at + 1


def test_eos_ends_generation_unless_ignored(server):
    engine = server.engine
    ids = [server.state.tokenizer.convert_tokens_to_ids(t) for t in tokens_of(complete(server, **SAMPLE, temperature=0))]
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    saved = engine.eos_token_ids
    engine.eos_token_ids = {ids[stop_at]}  # pretend that token is this model's EOS
    try:
        stopped = complete(server, **{**SAMPLE, "ignore_eos": False}, temperature=0).json()
        ignored = complete(server, **SAMPLE, temperature=0).json()
    finally:
        engine.eos_token_ids = saved
    assert stopped["usage"]["completion_tokens"] == stop_at + 1 and stopped["choices"][0]["finish_reason"] == "stop"
    assert ignored["usage"]["completion_tokens"] == SAMPLE["max_tokens"]


def test_models_and_health(server):
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == server.model
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "afd_time_to_first_token_seconds_count" in metrics and "afd_generation_tokens_total" in metrics


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "a", "max_tokens": "3"}, 400, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "a", "max_tokens": 10**9}, 400, "maximum context length"),
        ({"prompt": [1] * 5000}, 400, "maximum context length"),
        ({"prompt": [10**7]}, 400, "token ids"),
        ({"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
        ({"prompt": "a", "n": 2, "best_of": 3, "stream": True}, 400, "cannot be streamed"),
        ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, needle):
    response = complete(server, **body)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]


def test_malformed_json_and_bad_chat(server):
    raw = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": server.model, "messages": []})
    assert chat.status_code == 400


def test_client_disconnect_mid_stream_frees_the_sequence(server):
    import time

    body = {"model": server.model, "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
        assert server.engine.num_running == 1
    deadline = time.monotonic() + 10
    while (server.engine.num_running or server.engine.kv_cache.usage) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.num_running == 0 and server.engine.kv_cache.usage == 0


def test_the_official_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [server.model]
    completion = client.completions.create(model=server.model, prompt="Hello", max_tokens=6, temperature=0)
    assert completion.usage.completion_tokens <= 6 and completion.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="x", max_tokens=-1)
