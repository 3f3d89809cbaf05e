"""When a request is done: the one definition, decided after each sampled token.

``check_stop`` decides (pure). The running batch keeps two cheap proxies per row so most
rows never reach it: ``steps_left`` (tokens until ``max_tokens`` or ``max_model_len``) and
the union of every row's stop ids; ``maybe_stopped`` picks the rows a step may have
finished, and ``check_stop`` decides those.
"""

from __future__ import annotations

import numpy as np
from shoal.runtime.scheduler.request import Request
from shoal.runtime.wire.messages import FinishReason


def check_stop(req: Request, token_id: int, max_model_len: int
               ) -> tuple[FinishReason | None, int | None]:
    """(finish reason, stop token id) after ``token_id`` was appended to ``req``."""
    params = req.sampling_params
    num_out = len(req.output_token_ids)
    if num_out >= params.min_tokens:
        if token_id in req.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if token_id in req.stop_token_ids:
            return FinishReason.STOP, token_id
    if num_out >= req.max_tokens or len(req.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


def steps_left(req: Request, max_model_len: int) -> int:
    """Tokens ``req`` may still sample before ``max_tokens`` or ``max_model_len`` ends it:
    at 0 after a step, ``check_stop`` must look."""
    return min(req.max_tokens - len(req.output_token_ids),
               max_model_len - len(req.all_token_ids))


def may_stop_ids(req: Request) -> frozenset[int]:
    """Tokens after which ``check_stop`` must look (EOS unless ignored, stop token ids)."""
    params = req.sampling_params
    return req.stop_token_ids | (frozenset() if params.ignore_eos else req.eos_token_ids)


def maybe_stopped(tokens: np.ndarray, rows_steps_left: np.ndarray, stop_ids: np.ndarray
                  ) -> np.ndarray:
    """Indices of the rows that may have finished with ``tokens`` (their steps left already
    counted down): the candidates for ``check_stop``; every row that did is among them."""
    maybe = rows_steps_left <= 0
    if stop_ids.size:
        maybe |= np.isin(tokens, stop_ids)
    return np.flatnonzero(maybe)
