"""When a request is done, decided after each sampled token (pure)."""

from __future__ import annotations

from shoal.runtime.engine.messages import FinishReason
from shoal.runtime.scheduler.request import Request


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
