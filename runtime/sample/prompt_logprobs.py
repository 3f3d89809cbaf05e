"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``): for each
prompt token after the first, its log-probability given the tokens before it, as
log_softmax of the model's logits at the previous position, and the top alternatives there.

The worker asks the model runner for the logits at every prompt position a requesting row
computes this step (chunked prefill spreads them over steps; each chunk reports its own
positions). The scheduler never serves such a request from the prefix cache, so every
position is computed (the numbers are the model's, never a cached approximation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from shoal.runtime.wire.plan import PromptLogprobsChunk, StepPlan


@dataclass(frozen=True)
class PromptRow:
    req_id: str
    first_target: int  # prompt position of the first token scored in this step
    targets: list[int]  # the prompt tokens scored, in order
    top_k: int


def prompt_rows(plan: StepPlan, prompts: dict[str, tuple[list[int], int]]
                ) -> tuple[list[PromptRow], np.ndarray]:
    """The rows of ``plan`` whose request wants prompt logprobs (``prompts``: req id ->
    (prompt ids, top-k)), and the flat token indices whose logits score them."""
    rows: list[PromptRow] = []
    indices: list[np.ndarray] = []
    qsl = np.asarray(plan.query_start_loc)
    for row, req_id in enumerate(plan.req_ids):
        wanted = prompts.get(req_id)
        if wanted is None:
            continue
        prompt, top_k = wanted
        start, end = int(qsl[row]), int(qsl[row + 1])
        positions = np.asarray(plan.positions[start:end])
        keep = positions + 1 < len(prompt)  # the last prompt position predicts output
        if not keep.any():
            continue
        scored = positions[keep]
        rows.append(PromptRow(req_id, int(scored[0]) + 1,
                              [prompt[p + 1] for p in scored.tolist()], top_k))
        indices.append(np.arange(start, end, dtype=np.int64)[keep])
    flat = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    return rows, flat


def score_prompt_rows(logits: torch.Tensor, rows: list[PromptRow]
                      ) -> dict[str, PromptLogprobsChunk]:
    """``logits``: [sum of targets, V], the rows' positions in order."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    out: dict[str, PromptLogprobsChunk] = {}
    offset = 0
    for row in rows:
        part = logprobs[offset:offset + len(row.targets)]
        offset += len(row.targets)
        targets = torch.tensor(row.targets, dtype=torch.long, device=part.device)
        chosen = part.gather(1, targets.unsqueeze(1)).squeeze(1)
        if row.top_k:
            top_lp, top_ids = part.topk(row.top_k, dim=-1)
            ids, lps = top_ids.cpu().tolist(), top_lp.cpu().tolist()
        else:
            ids, lps = [[] for _ in row.targets], [[] for _ in row.targets]
        out[row.req_id] = PromptLogprobsChunk(row.first_target, chosen.cpu().tolist(), ids, lps)
    return out
