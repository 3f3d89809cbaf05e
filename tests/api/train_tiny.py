"""Teach a tiny model its answers by rote: the tests that need real model output (harmony
channels, reasoning then a tool call) train a random tiny checkpoint until greedy decoding
writes each answer after its prompt."""

from __future__ import annotations

import torch

MARGIN = 2.0  # every answer token first by this many logits: greedy is stable across kernels


def train_until_greedy(model: torch.nn.Module, data: list[tuple[list[int], list[int]]],
                       max_steps: int) -> None:
    """Adam on (prompt ids, answer ids) pairs until each answer token is the model's top
    choice by ``MARGIN`` logits after its prefix; fails the test if it does not get there."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    margins: list[float] = []
    for _ in range(max_steps):
        optimizer.zero_grad()
        margins = []
        for prompt_ids, answer_ids in data:
            logits = model(torch.tensor([prompt_ids + answer_ids])).logits[
                0, len(prompt_ids) - 1:-1]
            target = torch.tensor(answer_ids)
            torch.nn.functional.cross_entropy(logits, target).backward()
            top = logits.detach().topk(2)
            right = top.indices[:, 0] == target
            margins.append(float(torch.where(
                right, top.values[:, 0] - top.values[:, 1], -1.0).min()))
        if min(margins) > MARGIN:
            break
        optimizer.step()
    assert min(margins) > MARGIN, f"training did not converge: margins {margins}"
    model.eval()
