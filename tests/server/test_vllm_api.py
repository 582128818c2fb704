"""What a vLLM user sends, through a rank's OpenAI API (a loopback AFD group): sampling controls, and a 400
naming the field for each bad value."""

import json

import httpx
import pytest
import torch

from afd.engine.request import SamplingParams
from afd.server.api_process import core_wire

PROMPT = [5, 6, 7, 8, 9]


def post(server, path, **body):
    body.setdefault("model", server.model)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def completion(server, **body):
    response = post(server, "/v1/completions", **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def token_texts(server, ids):
    """What a completion's logprobs list as tokens for `ids`: each token's own text."""
    return [server.state.tokenizer.decode([t]) for t in ids]


def test_repetition_penalty_through_completions_equals_transformers(server, checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], dtype=torch.float32)
    model.generation_config.eos_token_id = None
    want = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, repetition_penalty=1.3,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    choice = completion(server, prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                        logprobs=0)
    assert choice["logprobs"]["tokens"] == token_texts(server, want)


def test_logit_bias_and_bad_words_through_chat(server):
    tokenizer = server.state.tokenizer
    word = next(w for w in (" the", " fox", " and") if len(tokenizer.encode(w, add_special_tokens=False)) == 1)
    target = tokenizer.encode(word, add_special_tokens=False)[0]
    messages = [{"role": "user", "content": "Hi"}]
    forced = post(server, "/v1/chat/completions", messages=messages, max_tokens=4, temperature=0.8, seed=1,
                  logit_bias={str(target): 100}, logprobs=True).json()["choices"][0]
    assert [c["token"] for c in forced["logprobs"]["content"]] == [word] * 4
    banned = post(server, "/v1/chat/completions", messages=messages, max_tokens=4, temperature=0,
                  logit_bias={str(target): 100}, bad_words=[word.strip()], logprobs=True).json()["choices"][0]
    assert word not in [c["token"] for c in banned["logprobs"]["content"]]


def output_ids(server, **body) -> list[int]:
    """The output token ids of a streamed completion (the ids a relay asks for)."""
    from afd.server.api.resume import IDS_HEADER

    _, text = streamed(server, "/v1/completions", headers={IDS_HEADER: "1"}, **body)
    return [int(t) for line in text.split("\n") if line.startswith(": afd-ids ") for t in line[10:].split(",")]


def occurs(sequence: list[int], ids: list[int]) -> bool:
    return any(ids[j: j + len(sequence)] == sequence for j in range(len(ids)))


def test_a_bad_word_of_several_tokens_is_banned_only_after_its_prefix(server):
    tokenizer = server.state.tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    body = dict(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    ids = output_ids(server, **body)
    chosen = None
    for at in range(1, len(ids) - 1):  # a word of two output tokens, the first time they follow each other
        pair, word = ids[at: at + 2], tokenizer.decode(ids[at: at + 2]).lstrip()
        spaced = encode(" " + word)  # vLLM bans this form too (same token count, other first token)
        if encode(word) == pair and not occurs(pair, ids[: at + 1]) and (spaced == pair or not occurs(spaced, ids)):
            chosen = at, pair, word
            break
    assert chosen, f"no two output tokens that tokenize back to themselves in {ids}"
    at, pair, word = chosen
    banned = output_ids(server, bad_words=[word], **body)
    assert banned[: at + 1] == ids[: at + 1]  # the same up to the word's first token
    assert banned[at + 1] != ids[at + 1]  # then its last token is banned
    assert not occurs(pair, banned) and len(banned) == 16


def test_min_p_penalties_top_k_together_are_served(server):
    choice = completion(server, prompt="The quick brown fox", max_tokens=8, temperature=0.7, top_k=20, min_p=0.05,
                        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, seed=7, ignore_eos=True)
    again = completion(server, prompt="The quick brown fox", max_tokens=8, temperature=0.7, top_k=20, min_p=0.05,
                       repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, seed=7, ignore_eos=True)
    assert choice["text"] == again["text"] and choice["finish_reason"] == "length"


def test_allowed_token_ids_limit_what_is_sampled(server):
    choice = completion(server, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=2, allowed_token_ids=[30, 31],
                        ignore_eos=True, logprobs=0)
    assert set(choice["logprobs"]["tokens"]) <= set(token_texts(server, [30, 31]))


def test_stop_string_kept_and_special_tokens_shown_when_asked(server):
    plain = completion(server, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)["text"]
    stop = plain[3:6]
    kept = completion(server, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                      include_stop_str_in_output=True)
    assert kept["text"] == plain[: plain.index(stop) + len(stop)] and kept["finish_reason"] == "stop"
    special = server.state.tokenizer.convert_tokens_to_ids("<|im_start|>")
    shown = completion(server, prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={str(special): 100},
                       skip_special_tokens=False)
    hidden = completion(server, prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={str(special): 100})
    assert shown["text"] == "<|im_start|>" * 2 and hidden["text"] == ""


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("min_p", 1.5), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("min_tokens", -1), ("min_tokens", 99), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"999999": 1}), ("logit_bias", {"5": 101}), ("allowed_token_ids", []),
    ("allowed_token_ids", [10**7]), ("bad_words", ["the quick brown fox jumps over the lazy dog " * 3]),
    ("bad_words", [""]),
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", 1),
])
def test_bad_values_are_400_naming_the_field(server, field, value):
    response = post(server, "/v1/completions", prompt="Hi", max_tokens=4, **{field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field)


def test_sampling_controls_cross_the_api_process_wire():
    params = SamplingParams(max_tokens=5, repetition_penalty=1.2, min_p=0.1, min_tokens=2, logit_bias=((3, 1.5),),
                            allowed_token_ids=(1, 3), banned_token_ids=(4,), banned_sequences=((5, 6, 7),),
                            include_stop_str_in_output=True,
                            skip_special_tokens=False, spaces_between_special_tokens=False)
    decoded = core_wire.decode_request(core_wire.encode_submit(0, "r", [1, 2], params, 0.0))
    assert decoded[4] == params


# -- /tokenize and /detokenize --------------------------------------------------------------------------------
def test_tokenize_a_prompt_and_messages_as_vllm_answers(server):
    tokenizer = server.state.tokenizer
    answer = post(server, "/tokenize", prompt="Hello world", return_token_strs=True).json()
    ids = tokenizer.encode("Hello world")
    assert answer == {"count": len(ids), "max_model_len": server.state.max_model_len, "tokens": ids,
                      "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()  # model is optional
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat["tokens"] == list(rendered) and chat["token_strs"] is None
    bare = post(server, "/tokenize", messages=messages, add_generation_prompt=False).json()
    assert bare["tokens"] == list(rendered)[: bare["count"]] and bare["count"] < chat["count"]


def test_detokenize_inverts_tokenize(server):
    ids = post(server, "/tokenize", prompt="The quick brown fox").json()["tokens"]
    assert post(server, "/detokenize", tokens=ids).json() == {"prompt": "The quick brown fox"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenize_bodies_name_the_field(server, path, body, status, param):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"].startswith(param)


# -- echo with logprobs, prompt_logprobs ---------------------------------------------------------------------
def hf_prompt_logprobs(checkpoint, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_gives_the_prompt_logprobs_of_transformers(server, checkpoints):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want = hf_prompt_logprobs(checkpoints["qwen3_moe"], prompt)
    choice = completion(server, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1, ignore_eos=True)
    shown = choice["logprobs"]
    assert shown["tokens"][: len(prompt)] == token_texts(server, prompt) and len(shown["tokens"]) == len(prompt) + 2
    assert shown["token_logprobs"][0] is None and shown["top_logprobs"][0] is None
    for p in range(1, len(prompt)):
        assert shown["token_logprobs"][p] == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-4)
        best = int(want[p - 1].argmax())
        assert shown["top_logprobs"][p] == pytest.approx({token_texts(server, [best])[0]: float(want[p - 1, best])},
                                                         abs=1e-4)
    assert choice["text"].startswith(server.state.tokenizer.decode(prompt))
    assert shown["text_offset"][len(prompt)] == len(server.state.tokenizer.decode(prompt))


def test_prompt_logprobs_field_as_vllm_gives_it(server, checkpoints):
    prompt = [5, 6, 7, 8]
    want = hf_prompt_logprobs(checkpoints["qwen3_moe"], prompt)
    choice = completion(server, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=0)
    shown = choice["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(prompt) and choice["logprobs"] is None
    for p in range(1, len(prompt)):
        entry = shown[p][str(prompt[p])]
        assert entry["logprob"] == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-4)
        assert entry["rank"] == int((want[p - 1] > want[p - 1, prompt[p]]).sum()) + 1
        assert entry["decoded_token"] == token_texts(server, [prompt[p]])[0]
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                prompt_logprobs=2).json()
    assert chat["prompt_logprobs"][0] is None and all(len(item) >= 2 for item in chat["prompt_logprobs"][1:])


def streamed(server, path, headers=None, **body):
    """(the data chunks, the raw text) of a streamed request."""
    body = {"model": server.model, "stream": True, **body}
    response = httpx.post(f"{server.url}{path}", json=body, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: {")]
    assert response.text.endswith("data: [DONE]\n\n")
    return chunks, response.text


def test_echo_logprobs_and_prompt_logprobs_streamed_equal_the_unstreamed_answer(server, checkpoints):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = dict(prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    whole = completion(server, **body)
    chunks, _ = streamed(server, "/v1/completions", **body)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(server.state.tokenizer.decode(prompt))
    assert first["logprobs"]["token_logprobs"][0] is None and first["prompt_logprobs"] == whole["prompt_logprobs"]
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
    joined = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in whole["logprobs"]}
    assert joined == whole["logprobs"]  # prompt and generated tokens, their offsets running on over the chunks
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    want = hf_prompt_logprobs(checkpoints["qwen3_moe"], prompt)
    assert first["logprobs"]["token_logprobs"][1] == pytest.approx(float(want[0, prompt[1]]), abs=1e-4)
    messages = [{"role": "user", "content": "Hi"}]
    chat_whole = post(server, "/v1/chat/completions", messages=messages, max_tokens=3, temperature=0,
                      prompt_logprobs=1).json()
    chat_chunks, _ = streamed(server, "/v1/chat/completions", messages=messages, max_tokens=3, temperature=0,
                              prompt_logprobs=1)
    assert chat_chunks[0]["prompt_logprobs"] == chat_whole["prompt_logprobs"]
    assert all("prompt_logprobs" not in c for c in chat_chunks[1:])


# -- n and best_of -------------------------------------------------------------------------------------------
def prompt_tokens_counted(server) -> float:
    """afd_prompt_tokens_total of the test server's rank."""
    return sum(sample.value for metric in server.state.registry.collect() if metric.name == "afd_prompt_tokens"
               for sample in metric.samples if sample.name == "afd_prompt_tokens_total")


def test_n_choices_each_reproducible_with_its_own_seed(server):
    body = dict(prompt="The quick brown fox", max_tokens=6, temperature=1.0, ignore_eos=True)
    counted = prompt_tokens_counted(server)
    answer = post(server, "/v1/completions", n=4, seed=11, **body).json()
    assert prompt_tokens_counted(server) - counted == answer["usage"]["prompt_tokens"]  # prefilled once
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert texts == [completion(server, seed=11 + j, **body)["text"] for j in range(4)]
    prompt_tokens = len(server.state.tokenizer.encode("The quick brown fox"))
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24, "total_tokens": prompt_tokens + 24,
                               "prompt_tokens_details": {"cached_tokens": answer["usage"]["prompt_tokens_details"]["cached_tokens"]}}
    assert 0 <= answer["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt_tokens
    chat_body = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=1.0, ignore_eos=True)
    chat = post(server, "/v1/chat/completions", n=2, seed=5, **chat_body).json()
    alone = [post(server, "/v1/chat/completions", seed=5 + j, **chat_body).json()["choices"][0] for j in range(2)]
    assert [c["message"] for c in chat["choices"]] == [c["message"] for c in alone]
    assert chat["usage"]["completion_tokens"] == 8


def test_best_of_returns_the_likeliest_candidate_and_counts_them_all(server):
    body = dict(prompt=PROMPT, max_tokens=5, temperature=1.0, ignore_eos=True)
    candidates = [completion(server, seed=3 + j, logprobs=0, **body) for j in range(3)]
    likeliest = max(candidates, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    answer = post(server, "/v1/completions", best_of=3, seed=3, **body).json()
    (choice,) = answer["choices"]
    assert choice["text"] == likeliest["text"] and choice["logprobs"] is None
    assert answer["usage"]["completion_tokens"] == 15


def test_n_choices_streamed_each_under_its_index_equal_the_unstreamed_ones(server):
    body = dict(prompt="The quick brown fox", max_tokens=6, temperature=1.0, ignore_eos=True, seed=11, n=3)
    whole = post(server, "/v1/completions", **body).json()
    chunks, text = streamed(server, "/v1/completions", stream_options={"include_usage": True}, **body)
    *events, last = chunks
    assert all(len(c["choices"]) == 1 for c in events) and len({c["id"] for c in chunks}) == 1
    by_index = {i: [c["choices"][0] for c in events if c["choices"][0]["index"] == i] for i in range(3)}
    assert sorted({c["choices"][0]["index"] for c in events}) == [0, 1, 2]
    assert [("".join(p["text"] for p in by_index[i]), [p["finish_reason"] for p in by_index[i]][-1])
            for i in range(3)] == [(c["text"], c["finish_reason"]) for c in whole["choices"]]
    counts = lambda usage: [usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")]  # noqa: E731
    assert last["choices"] == [] and counts(last["usage"]) == counts(whole["usage"])  # the prompt once, every choice's tokens
    assert "afd-" not in text
    chat = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=1.0, ignore_eos=True, seed=5,
                n=2)
    chat_whole = post(server, "/v1/chat/completions", **chat).json()
    chat_chunks, _ = streamed(server, "/v1/chat/completions", **chat)
    for i, choice in enumerate(chat_whole["choices"]):
        deltas = [c["choices"][0]["delta"] for c in chat_chunks if c["choices"][0]["index"] == i]
        assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
        assert "".join(d["content"] for d in deltas) == choice["message"]["content"]


def test_an_n_stream_moved_mid_way_continues_each_choice_from_its_own_tokens(server):
    from afd.server.api.resume import IDS_HEADER, RESUME_HEADER, Resume, StreamReader, sign

    body = dict(prompt="Hi", max_tokens=6, n=3, temperature=1.0, seed=9, ignore_eos=True,
                stream_options={"include_usage": True})
    chunks, text = streamed(server, "/v1/completions", headers={IDS_HEADER: "1"}, **body)
    assert text.startswith(": afd-choices 3\n") and ": afd-ids 2:" in text
    by_index = lambda cs: ["".join(c["choices"][0]["text"] for c in cs if c["choices"] and c["choices"][0]["index"] == i)
                           for i in range(3)]  # noqa: E731
    whole, events = by_index(chunks), text.encode().split(b"\n\n")
    cut = b"\n\n".join(events[:8]) + b"\n\n"  # 8 of 18 token events went out
    reader, full = StreamReader(), StreamReader()
    reader.feed(cut)
    full.feed(text.encode())
    assert reader.resumable and full.finished and not full.resumable
    before = by_index([json.loads(line[6:]) for line in cut.decode().split("\n") if line.startswith("data: {")])
    server.state.resume_key = b"secret"
    try:
        moved, _ = streamed(server, "/v1/completions", headers={RESUME_HEADER: sign(b"secret", reader.resume())}, **body)
        one_done = Resume(reader.stream_id, tuple(full.ids[0]), tuple(map(tuple, reader.resume().more)), (0,))
        rest, _ = streamed(server, "/v1/completions", headers={RESUME_HEADER: sign(b"secret", one_done)}, **body)
        mismatched = httpx.post(f"{server.url}/v1/completions", headers={RESUME_HEADER: sign(b"secret", one_done)},
                                json={"model": server.model, **body, "n": 2, "stream": True}, timeout=30)
    finally:
        server.state.resume_key = b""
    assert [b + a for b, a in zip(before, by_index(moved))] == whole  # nothing twice, nothing lost, each its seed
    counts = lambda usage: [usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")]  # noqa: E731
    assert counts(moved[-1]["usage"]) == counts(rest[-1]["usage"]) == counts(chunks[-1]["usage"])  # cached: as found
    assert {c["id"] for c in moved} == {chunks[0]["id"]}
    assert by_index(rest)[0] == "" and [before[i] + by_index(rest)[i] for i in (1, 2)] == whole[1:]
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == RESUME_HEADER


@pytest.mark.parametrize("body, field", [
    ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"best_of": 0}, "best_of"), ({"n": 100, "prompt": ["a", "b"]}, "n"),
])
def test_bad_n_and_best_of_name_their_field(server, body, field):
    response = post(server, "/v1/completions", **{"prompt": "Hi", "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_min_tokens_holds_stop_strings_back_too(server):
    tokenizer = server.state.tokenizer
    words = [w for w in (" the", " fox", " and", " dog") if len(tokenizer.encode(w, add_special_tokens=False)) == 1]
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=allowed, logprobs=0)
    first = completion(server, **body)  # whole words only, so text and tokens line up
    plain, tokens = first["text"], first["logprobs"]["tokens"]
    stop = tokens[0]
    assert completion(server, stop=[stop], **body)["text"] == ""  # found at once without min_tokens
    held = completion(server, stop=[stop], min_tokens=4, **body)["text"]
    assert held.startswith("".join(tokens[:3])) and plain.startswith(held)


def test_tokenize_messages_with_special_tokens_encodes_the_rendered_text(server):
    tokenizer = server.state.tokenizer
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = post(server, "/tokenize", messages=messages, add_special_tokens=True).json()
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=True)
