"""A step's result on the wire: rank 0's sampled tokens and logprobs as raw arrays.

Request ids do not travel when they are what the plan implies (the rows with
``sample_rows`` set, in order), which is the Worker's contract; anything else is sent as is.
"""

from __future__ import annotations

import msgspec
import numpy as np
from shoal.runtime.wire.plan import PromptLogprobsChunk, StepPlan, StepResult


class ResultWire(msgspec.Struct, array_like=True):
    step_id: int
    req_ids: list[str] | None  # None: the plan's rows with sample_rows set, in order
    sampled_token_ids: bytes  # int64 [S]
    logprobs: bytes | None  # float32 [S]
    top_k: int
    top_token_ids: bytes | None  # int64 [S, K]
    top_logprobs: bytes | None  # float32 [S, K]
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    pooled: dict[str, bytes] | None = None


def sampled_req_ids(plan: StepPlan) -> list[str]:
    return [r for r, sampled in zip(plan.req_ids, plan.sample_rows.tolist(), strict=True)
            if sampled]


def _opt(array: np.ndarray | None, dtype: type) -> bytes | None:
    return None if array is None else np.ascontiguousarray(array, dtype=dtype).tobytes()


def encode_result(result: StepResult, plan: StepPlan) -> bytes:
    top = result.top_token_ids
    return msgspec.msgpack.encode(ResultWire(
        step_id=result.step_id,
        req_ids=None if result.req_ids == sampled_req_ids(plan) else list(result.req_ids),
        sampled_token_ids=np.ascontiguousarray(result.sampled_token_ids, np.int64).tobytes(),
        logprobs=_opt(result.logprobs, np.float32),
        top_k=0 if top is None else int(top.shape[1]),
        top_token_ids=_opt(top, np.int64),
        top_logprobs=_opt(result.top_logprobs, np.float32),
        prompt_logprobs=result.prompt_logprobs,
        pooled=result.pooled,
    ))


_result_decoder = msgspec.msgpack.Decoder(ResultWire)


def decode_result(data: bytes, plan: StepPlan) -> StepResult:
    wire = _result_decoder.decode(data)
    sampled = np.frombuffer(wire.sampled_token_ids, dtype=np.int64).copy()

    def matrix(raw: bytes | None, dtype: type) -> np.ndarray | None:
        if raw is None:
            return None
        return np.frombuffer(raw, dtype=dtype).reshape(len(sampled), wire.top_k).copy()

    return StepResult(
        step_id=wire.step_id,
        req_ids=sampled_req_ids(plan) if wire.req_ids is None else wire.req_ids,
        sampled_token_ids=sampled,
        logprobs=None if wire.logprobs is None
        else np.frombuffer(wire.logprobs, dtype=np.float32).copy(),
        top_token_ids=matrix(wire.top_token_ids, np.int64),
        top_logprobs=matrix(wire.top_logprobs, np.float32),
        prompt_logprobs=wire.prompt_logprobs,
        pooled=wire.pooled,
    )
