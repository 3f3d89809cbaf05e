"""Sampling parameters: what a request asks of the sampler and the stop logic.

A msgspec Struct because it crosses the API -> engine-core boundary inside
``EngineCoreRequest``. ``validate()`` runs in the front end, before any engine state is
reserved; the engine core calls it again (cheap) so the offline API gets the same errors.
It is total: every number is checked against what the engine can hold (int64 on the wire,
the vocabulary, the configured limits), every string for valid UTF-8, so a request that
passes cannot fail to serialize or trip the sampler.
"""

from __future__ import annotations

import math

import msgspec
from shoal.runtime.structured.spec import GrammarSpec, grammar_bounds_error

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestLimits(msgspec.Struct, kw_only=True, frozen=True):
    """What one request may ask for; configured by ``shoal serve`` flags. ``vocab_size`` and
    ``max_model_len`` are the engine's (0: not known yet, not checked)."""

    max_logprobs: int = 20
    max_n: int = 64
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 1024
    max_cache_salt_chars: int = 256
    vocab_size: int = 0
    max_model_len: int = 0
    # the OpenAI API rejects prompt + max_tokens > max_model_len; the offline LLM stops at it
    max_tokens_within_context: bool = False


DEFAULT_LIMITS = RequestLimits()


class InvalidParameter(ValueError):
    """A request parameter is out of range. ``param`` names it for the error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)  # applied by the detokenizer
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the sampled token
    prompt_logprobs: int | None = None  # per prompt token (after the first); top alternatives
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    skip_special_tokens: bool = True
    structured: GrammarSpec | None = None  # output constrained to a grammar (size bounded
    # here, compiled off the engine loop: runtime/structured/)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """Raise InvalidParameter naming the first parameter out of range."""
        _check(_is_int(self.n) and 1 <= self.n <= limits.max_n, "n",
               f"n must be in [1, {limits.max_n}], got {self.n}")
        _check(_finite(self.temperature) and self.temperature >= 0.0, "temperature",
               f"temperature must be a finite non-negative number, got {self.temperature}")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"top_p must be in (0, 1], got {self.top_p}")
        top_k_max = limits.vocab_size or INT64_MAX
        _check(_is_int(self.top_k) and -1 <= self.top_k <= top_k_max, "top_k",
               f"top_k must be -1 or 0 (disabled) or in [1, {top_k_max}], got {self.top_k}")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"min_p must be in [0, 1], got {self.min_p}")
        _check(_finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(_finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty",
               f"repetition_penalty must be a finite positive number, got {self.repetition_penalty}")
        if self.seed is not None:  # choice i of n samples with seed + i: all must be int64
            _check(_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1),
                   "seed", f"seed must be in [{INT64_MIN}, {INT64_MAX - (self.n - 1)}] "
                   f"(int64, and seed + n - 1 too), got {self.seed}")
        if self.max_tokens is not None:
            _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX, "max_tokens",
                   f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= INT64_MAX, "min_tokens",
               f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check(_is_int(self.logprobs) and 0 <= self.logprobs <= limits.max_logprobs,
                   "logprobs", f"logprobs must be in [0, {limits.max_logprobs}], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check(_is_int(self.prompt_logprobs)
                   and 0 <= self.prompt_logprobs <= limits.max_logprobs, "prompt_logprobs",
                   f"prompt_logprobs must be in [0, {limits.max_logprobs}], "
                   f"got {self.prompt_logprobs}")
        if self.logit_bias:
            top = limits.vocab_size or INT64_MAX + 1
            _check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                   "logit_bias values must be in [-100, 100]")
            _check(all(_is_int(t) and 0 <= t < top for t in self.logit_bias), "logit_bias",
                   f"logit_bias keys must be token ids in [0, {top})")
        self._validate_stops(limits)
        if self.structured is not None:
            error = grammar_bounds_error(self.structured)
            _check(error is None, self.structured.param, error or "")

    def _validate_stops(self, limits: RequestLimits) -> None:
        _check(len(self.stop) <= limits.max_stop_strings, "stop",
               f"at most {limits.max_stop_strings} stop strings, got {len(self.stop)}")
        for text in self.stop:
            _check(isinstance(text, str) and 0 < len(text) <= limits.max_stop_string_chars,
                   "stop", f"stop strings must have 1 to {limits.max_stop_string_chars} "
                   "characters")
            check_text(text, "stop")
        _check(len(self.stop_token_ids) <= limits.max_stop_token_ids, "stop_token_ids",
               f"at most {limits.max_stop_token_ids} stop_token_ids, got {len(self.stop_token_ids)}")
        top = limits.vocab_size or INT64_MAX + 1
        _check(all(_is_int(t) and 0 <= t < top for t in self.stop_token_ids), "stop_token_ids",
               f"stop_token_ids must be token ids in [0, {top})")


SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def sampling_params_from_kwargs(**kwargs: object) -> SamplingParams:
    """Build and validate; an unknown keyword is an error naming it, not a silent no-op."""
    for key in kwargs:
        if key not in SAMPLING_FIELDS:
            raise InvalidParameter(key, f"unknown sampling parameter: {key!r}")
    try:
        params = msgspec.convert(kwargs, SamplingParams)
    except msgspec.ValidationError as exc:
        param = str(exc).rsplit("$.", 1)[-1].rstrip("`'\"") if "$." in str(exc) else "sampling_params"
        raise InvalidParameter(param, f"invalid sampling parameter: {exc}") from exc
    params.validate()
    return params


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of an n > 1 request is its own engine request (n = 1); seeded ones
    get distinct streams (seed + index, within int64 by ``validate``)."""
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


def check_text(text: str, param: str) -> None:
    """Strings must encode as UTF-8: a lone surrogate (JSON ``"\\ud800"``) cannot cross msgpack
    or reach the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameter(param, f"{param} is not valid Unicode text (a lone surrogate at "
                               f"position {exc.start})") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
