"""Sampling parameters and the state of one request inside the engine."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 100.0
MAX_BANNED_SEQUENCE = 16  # tokens of one multi-token bad word (the device keeps this many of each output's last tokens)


class InvalidRequest(ValueError):
    """A request the server must answer with HTTP 400; `param` names the culprit."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """What vLLM users expect: greedy when temperature is 0, else temperature/top-k/top-p sampling."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report, 0 = only the chosen token
    # Logits controls (`afd.engine.sampling.logits_controls`); a request that sets none takes the plain sampler.
    presence_penalty: float = 0.0  # OpenAI: minus this once for each token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # transformers/vLLM: a token in the prompt or output is divided (>0) or multiplied
    min_p: float = 0.0  # drop tokens whose probability is under min_p times the likeliest one's
    min_tokens: int = 0  # EOS and stop tokens are held back until this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled (empty: all)
    banned_token_ids: tuple[int, ...] = ()  # never sampled (single-token `bad_words`)
    # multi-token `bad_words` (vLLM's rule): a word's last token is banned when its other tokens end the output
    banned_sequences: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None  # the prompt's logprobs from the prefill, with this many alternatives
    grammar: str | None = None  # structured output: an llguidance grammar (`afd.engine.structured_output.grammars`)
    cache_salt: str | None = None  # prefix caching: only requests with the same salt (or none) share cached blocks

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (off) or positive, got {self.top_k}", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs}",
                                 "prompt_logprobs")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                                 f"{self.repetition_penalty}", "repetition_penalty")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not 2 <= len(s) <= MAX_BANNED_SEQUENCE for s in self.banned_sequences):
            raise InvalidRequest(f"bad_words: a word is 2..{MAX_BANNED_SEQUENCE} tokens", "bad_words")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}",
                                 "min_tokens")
        # Read per row and step: worked out once. `plain`: none of logits controls, prompt logprobs, grammar.
        object.__setattr__(self, "_adjusts", bool(self.penalized or self.min_tokens or self.logit_bias
                                                  or self.allowed_token_ids or self.banned_token_ids
                                                  or self.banned_sequences))
        object.__setattr__(self, "plain", not (self._adjusts or self.prompt_logprobs is not None or self.grammar))

    @property
    def penalized(self) -> bool:
        """Needs the sequence's token counts (presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def adjusts_logits(self) -> bool:
        """Any control that changes the logits before sampling (min_p acts in the sampler itself)."""
        return self._adjusts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # of token_id among the vocabulary (1: the likeliest); prompt logprobs only


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a streaming delta)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first output, when asked: None first
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (`usage.prompt_tokens_details.cached_tokens`)


@dataclass(eq=False)  # identity: `in` and `remove` on batches must not compare prompts
class Request:
    """A request as the engine tracks it.

    The engine thread owns scheduling state (blocks, cached_tokens, scheduled_outputs,
    sample_step/row); the output side owns what was delivered (output_ids, the text
    state, first/last token times, done).
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    # Unique across processes: responses behind one Service carry ids no other rank reuses.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    blocks: tuple[int, ...] = ()
    cached_tokens: int = 0  # tokens whose keys and values are in the KV cache
    generator: object = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    detokenizer: object = None
    stop_checker: object = None
    chunk: int = 0  # prompt tokens the scheduler gave this step (chunked prefill)
    queued_step: int = 0  # the scheduler's step count when it was queued (the prefill deadline counts from it)
    scheduled_outputs: int = 0  # tokens sampled or being sampled in a launched step
    final_scheduled: bool = False  # its last token is in a launched step: not scheduled again
    sample_step: int = -1  # the step whose sampled tokens hold this request's next input, and its row there
    sample_row: int = -1
    done: bool = False  # its final output (or error) was delivered; later tokens are dropped
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # gathered over its prompt chunks
    grammar: object = None  # its llguidance matcher (structured output), advanced by the engine thread
    carried: int = 0  # output tokens produced on an earlier rank, at the end of prompt_ids (`afd.engine.recovery.carry`)
    # The choices of one prompt share its prefill and full KV blocks (`afd.engine.scheduling.shared_prompt`).
    group: str | None = None  # requests of one group with the same prompt may share it
    shares: "Request | None" = None  # the request whose prefill this one takes its prompt's KV cache from
    riders: list["Request"] = field(default_factory=list)  # the requests taking this one's prefill
    # Prefix caching (`afd.engine.scheduling.prefix_hits`).
    prefix_hit: int = 0  # prompt tokens found cached at admission (its prefill started after them)
    block_names: list[bytes] | None = None  # the names of its full prompt blocks, worked out on first use
    published: int = 0  # its first blocks that are published (or were found cached)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
