"""HF transformers (and peft) greedy decoding as the reference: each step's top-2 logit margin
comes with the tokens, so a divergence can be told from a near-tie (BRIEF §6). One
implementation for the engine, API and LoRA tests."""

from __future__ import annotations

from pathlib import Path

NEAR_TIE = 1e-4  # top-2 logit margin below which a greedy argmax is a coin toss


def greedy_with_margins(model, prompt: list[int],
                        max_new_tokens: int) -> tuple[list[int], list[float]]:
    """``model``'s greedy continuation of ``prompt`` (exactly ``max_new_tokens``, no EOS
    stop) and the top-2 logit margin at each step."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    margins = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(prompt):].tolist(), margins


def load_reference(model_dir: str | Path, adapter_dir: Path | None = None):
    """transformers' float32 model of a checkpoint (a multimodal wrapper through the
    image-text-to-text class transformers maps it to), with a peft adapter when given."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except ValueError:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


class HFGreedy:
    """One checkpoint's (and adapter's) greedy reference, memoised per (prompt, length)."""

    def __init__(self, model_dir: str | Path, adapter_dir: Path | None = None) -> None:
        self.model = load_reference(model_dir, adapter_dir)
        self.model.generation_config.eos_token_id = None  # compared with ignore_eos=True
        self._memo: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            self._memo[key] = greedy_with_margins(self.model, prompt, max_new_tokens)
        return self._memo[key]

    def agrees(self, prompt: list[int], got: list[int], near_tie: float = NEAR_TIE) -> bool:
        """``got`` equals the reference's greedy tokens, or first differs where the
        reference's top-2 margin is a near-tie (float rounding may flip it; later tokens
        then follow another prefix)."""
        want, margins = self.generate(prompt, len(got))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                return margins[i] < near_tie
        return True
