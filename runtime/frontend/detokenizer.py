"""Incremental detokenization with stop strings, for streaming.

Text for new tokens is found by decoding a short window: the tokens since the last emitted
boundary (``prefix``) with and without the newest ones; the difference is the new text. When
that text ends in U+FFFD the newest token ends inside a multi-byte character, so nothing is
released until a later token completes it (a sequence that never completes is flushed as
U+FFFD when the request ends). Text that could be the start of a stop string is held back
until it is known not to be one; a stop string found ends the request (the caller aborts it
in the engine) and is cut from the output unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


def held_back_length(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.token_ids: list[int] = []
        self.output_text = ""  # decoded so far (up to the stop string, once one is found)
        self.stop_string: str | None = None  # the stop string that ended the request
        self._prefix_offset = 0  # window start for decoding
        self._read_offset = 0  # tokens before this are part of output_text
        self._emitted = 0  # characters of output_text already handed out
        self._stop_scan_from = 0  # stop strings cannot start before this index

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one is now complete (then ignore the rest)."""
        if self.stopped:
            return self.stop_string
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_new()
            if self.stops and self._find_stop():
                return self.stop_string
        return None

    def _decode_new(self, final: bool = False) -> str:
        window = self.token_ids[self._prefix_offset:]
        prefix_text = self.tokenizer.decode(
            self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full_text = self.tokenizer.decode(window, self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) and not final:
            if full_text.startswith(prefix_text):
                # e.g. a skipped special token: nothing to show, move the boundary on
                self._read_offset = len(self.token_ids)
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # the newest token ends inside a multi-byte character: wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]

    def _find_stop(self) -> bool:
        longest = max(len(s) for s in self.stops)
        start = max(self._stop_scan_from, 0)
        found_at, found = -1, None
        for stop in self.stops:
            index = self.output_text.find(stop, start)
            if index != -1 and (found_at == -1 or index < found_at):
                found_at, found = index, stop
        if found is None:
            self._stop_scan_from = max(0, len(self.output_text) - longest + 1)
            return False
        self.stop_string = found
        end = found_at + len(found) if self.include_stop else found_at
        self.output_text = self.output_text[:end]
        return True

    def flush(self) -> None:
        """The request ended: release text held for an incomplete character."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            self.output_text += self._decode_new(final=True)

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out yet; while running, keeps back a possible stop-string start."""
        end = len(self.output_text)
        if not finished and not self.stopped and self.stops:
            end -= held_back_length(self.output_text, self.stops)
        end = max(end, self._emitted)
        text = self.output_text[self._emitted:end]
        self._emitted = end
        return text
