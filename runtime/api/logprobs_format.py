"""Engine logprobs -> the OpenAI shapes (completions' parallel lists, chat's content) and
vLLM's ``prompt_logprobs`` list."""

from __future__ import annotations

from typing import Protocol

from shoal.runtime.wire.messages import TokenLogprobs


class Tokenizer(Protocol):
    """What names a token in logprobs: the tokenizer's text, or vLLM's token-id names."""

    def token_text(self, token_id: int) -> str: ...


class TokenIdNames:
    """vLLM's ``return_tokens_as_token_ids``: each token named ``token_id:N``, so tokens whose
    text is not valid UTF-8 on its own stay distinguishable."""

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def token_names(tokenizer: Tokenizer, as_token_ids: bool) -> Tokenizer:
    return TokenIdNames() if as_token_ids else tokenizer


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


def echo_logprobs(tokenizer: Tokenizer, prompt_ids: list[int],
                  prompt_logprobs: list[TokenLogprobs], top_k: int) -> dict:
    """The prompt's part of completions' logprobs with ``echo``: OpenAI's legacy shape, the
    first prompt token with ``None`` (nothing precedes it), offsets from 0."""
    scored = completion_logprobs(tokenizer, prompt_ids[1:], prompt_logprobs, top_k,
                                 len(tokenizer.token_text(prompt_ids[0])))
    return {"tokens": [tokenizer.token_text(prompt_ids[0]), *scored["tokens"]],
            "token_logprobs": [None, *scored["token_logprobs"]],
            "top_logprobs": [None, *scored["top_logprobs"]],
            "text_offset": [0, *scored["text_offset"]]}


def joined_logprobs(first: dict, second: dict | None) -> dict:
    """Completions' parallel lists, one after the other (echoed prompt, then the output)."""
    if second is None:
        return first
    shift = (first["text_offset"][-1] + len(first["tokens"][-1])) if first["tokens"] else 0
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int],
                         prompt_logprobs: list[TokenLogprobs], top_k: int) -> list[dict | None]:
    """vLLM's shape: ``None`` for the first prompt token, then per token a map token id ->
    {logprob, rank, decoded_token} holding the prompt's own token and the top ``top_k``."""
    out: list[dict | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], prompt_logprobs, strict=True):
        entry = {str(t): {"logprob": v, "rank": rank + 1,
                          "decoded_token": tokenizer.token_text(t)}
                 for rank, (t, v) in enumerate(zip(lp.top_token_ids[:top_k],
                                                   lp.top_logprobs[:top_k], strict=True))}
        if str(token_id) not in entry:
            entry[str(token_id)] = {"logprob": lp.logprob, "rank": None,
                                    "decoded_token": tokenizer.token_text(token_id)}
        out.append(entry)
    return out
