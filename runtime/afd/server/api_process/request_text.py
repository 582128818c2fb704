"""The text of one request's outputs, made in the API process (`AFD_API_PROCESS`) from the core's token ids.

The engine core then only samples tokens and ends requests on EOS, stop tokens and length;
detokenization and stop strings (the larger part of its output thread's work per token) run
here, as `afd.engine.outputs` does them in one process: the same text, the same held-back
prefix of a possible stop string, the same finish reasons. A stop string found here ends the
request here; the caller aborts it in the core.
"""

from __future__ import annotations

from afd.engine.request import RequestOutput, SamplingParams
from afd.engine.text.detokenizer import IncrementalDetokenizer
from afd.engine.text.stop_strings import StopChecker


class RequestText:
    def __init__(self, tokenizer, stop: tuple[str, ...], params: SamplingParams | None = None):
        """`params`: the request's text options (special tokens, whether the stop string is kept); default vLLM's."""
        params = params or SamplingParams()
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                                  params.spaces_between_special_tokens)
        self.checker = StopChecker(stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens  # stop strings count only after this many tokens

    def fill(self, output: RequestOutput) -> bool:
        """Put the text into `output` (finishing it on a stop string); whether a stop string ended it here."""
        checker = self.checker
        if output.finish_reason != "stop":  # the core's "stop" is EOS or a stop token: not shown as text
            before = output.completion_tokens - len(output.token_ids)  # tokens of earlier outputs
            for index, token in enumerate(output.token_ids, start=1):
                checker.add(self.detokenizer.add(token), look=before + index >= self.min_tokens)
        ended_here = checker.stopped and not output.finished
        if checker.stopped:  # a stop string wins over the length, as in the engine
            output.finished, output.finish_reason = True, "stop"
        output.text = checker.take(final=output.finished)
        return ended_here
