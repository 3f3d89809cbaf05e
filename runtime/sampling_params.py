"""Sampling parameters: what a request asks of the sampler and the stop logic.

A msgspec Struct because it crosses the API -> engine-core boundary inside
``EngineCoreRequest``. ``validate()`` runs in the front end, before any engine state is
reserved; the engine core calls it again (cheap) so the offline API gets the same errors.
"""

from __future__ import annotations

import msgspec


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
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, max_logprobs: int = 20) -> None:
        """Raise InvalidParameter naming the first parameter out of range."""
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature",
               f"temperature must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens",
                   f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens",
               f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= max_logprobs, "logprobs",
                   f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative token ids")


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


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
