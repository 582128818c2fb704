"""Runs in the vLLM venv (not ours): vLLM's own tool-call and reasoning parsers on texts, as its chat server calls them
(`vllm.parser.parser_manager.ParserManager`), whole and streamed one token per delta and in two deltas cut at every
token. `python vllm_parsers_run.py job.json out.json`; the job: {"markup": [...], "cases": [{"tool_parser",
"reasoning_parser", "text", "prompt", "tools", "tool_choice", "chat_template_kwargs"}]}; the answer per case:
{"whole": [reasoning, content, [[name, arguments]...]], "streamed": [the same, assembled from the deltas]...}.

The tokenizer is made here: one token per character, and each markup string (the families' special tokens) one
token, as in the real checkpoints, so vLLM's token-id checks see what they would."""

from __future__ import annotations

import json
import sys


def tokenizer_of(texts: list[str], markup: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted({c for text in texts for c in text} | {c for mark in markup for c in mark} | {"?"})
    vocab = {c: i for i, c in enumerate(chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="?"))
    backend.decoder = decoders.Fuse()
    backend.add_tokens([AddedToken(mark, special=False, normalized=False) for mark in markup])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="?")


def run_case(case: dict, tokenizer) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if case.get("tools"):
        body.update(tools=case["tools"], tool_choice=case.get("tool_choice", "auto"))
    if case.get("chat_template_kwargs") is not None:
        body["chat_template_kwargs"] = case["chat_template_kwargs"]
    parser_cls = ParserManager.get_parser(tool_parser_name=case.get("tool_parser"),
                                          reasoning_parser_name=case.get("reasoning_parser"),
                                          enable_auto_tools=bool(case.get("tool_parser")), model_name="m")
    kwargs = case.get("chat_template_kwargs") or {}

    def fresh():
        request = ChatCompletionRequest(**body)
        parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs, model_config=None)
        return parser, parser.adjust_request(request)

    text, prompt_ids = case["text"], tokenizer.encode(case.get("prompt") or "hi", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    parser, request = fresh()
    reasoning, content, calls = parser.parse(text, request, enable_auto_tools=bool(case.get("tool_parser")),
                                             model_output_token_ids=ids)
    result = {"whole": [reasoning, content, [[c.name, c.arguments] for c in calls or []]]}
    splits = [[ids[i:i + 1] for i in range(len(ids))]] + [[ids[:k], ids[k:]] for k in range(1, len(ids))]
    result["streamed"] = [streamed(fresh, tokenizer, prompt_ids, pieces) for pieces in splits]
    return result


def streamed(fresh, tokenizer, prompt_ids, pieces) -> list:
    parser, request = fresh()
    reasoning, content, calls = "", "", {}
    for at, piece in enumerate(pieces):
        delta = parser.parse_delta(tokenizer.decode(piece), piece, request, prompt_ids,
                                   finished=at == len(pieces) - 1)
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", 0])
            function = call.function
            name = getattr(function, "name", None) if function is not None else None
            arguments = getattr(function, "arguments", None) if function is not None else None
            if isinstance(function, dict):
                name, arguments = function.get("name"), function.get("arguments")
            entry[0] += name or ""
            entry[1] += arguments or ""
            entry[2] += call.id is not None
    return [reasoning or None, content or None, [calls[i] for i in sorted(calls)]]


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    tokenizer = tokenizer_of([case["text"] for case in job["cases"]] + [c.get("prompt") or "hi" for c in job["cases"]],
                             job["markup"])
    json.dump([run_case(case, tokenizer) for case in job["cases"]], open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
