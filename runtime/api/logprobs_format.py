"""Engine logprobs -> the two OpenAI shapes (completions' parallel lists, chat's content)."""

from __future__ import annotations

from shoal.runtime.engine.messages import TokenLogprobs
from shoal.runtime.frontend.tokenizer import Tokenizer


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                        logprobs: list[TokenLogprobs], top_k: int, text_offset: int = 0) -> dict:
    tokens = [tokenizer.token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {tokenizer.token_text(t): v
             for t, v in zip(lp.top_token_ids[:top_k], lp.top_logprobs[:top_k], strict=True)}
            for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs],
                  top_k: int) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in
                                zip(lp.top_token_ids[:top_k], lp.top_logprobs[:top_k],
                                    strict=True)]
        content.append(item)
    return {"content": content}
