"""The front end in isolation: incremental detokenizer, stop strings, the output processor,
chat template."""

from __future__ import annotations

import pytest
from shoal.runtime.frontend.chat_template import ChatTemplate, ChatTemplateError
from shoal.runtime.frontend.detokenizer import IncrementalDetokenizer, held_back_length
from shoal.runtime.frontend.output_processor import OutputProcessor, PromptInput, fan_out
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreOutput, FinishReason

MIXED_TEXT = "Hello 👋🏽 世界, naïve café — 日本語のテキスト 🎉 def foo(): return 1"


def stream(tokenizer: Tokenizer, token_ids: list[int], **params) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**params))
    pieces, stop = [], None
    for token_id in token_ids:
        stop = detok.update([token_id])
        if stop is not None:
            break
        pieces.append(detok.take_new_text(finished=False))
    detok.flush()
    pieces.append(detok.take_new_text(finished=True))
    return pieces, stop


def test_emoji_and_cjk_stream_token_by_token_without_replacement_characters(tokenizer):
    token_ids = tokenizer.encode(MIXED_TEXT)
    assert len(token_ids) > len(MIXED_TEXT.split())  # multi-byte characters span tokens
    pieces, _ = stream(tokenizer, token_ids)
    assert "".join(pieces) == MIXED_TEXT
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement(tokenizer):
    token_ids = tokenizer.encode("ok 👋")
    pieces, _ = stream(tokenizer, token_ids[:-1])  # cut inside the emoji's bytes
    assert "".join(pieces).startswith("ok ")
    assert "".join(pieces).endswith("\ufffd")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_split_across_tokens_ends_the_text(tokenizer, include):
    stop = "世界, na"
    token_ids = tokenizer.encode(MIXED_TEXT)
    pieces, found = stream(tokenizer, token_ids, stop=[stop], include_stop_str_in_output=include)
    assert found == stop
    expected = MIXED_TEXT[:MIXED_TEXT.index(stop)] + (stop if include else "")
    assert "".join(pieces) == expected


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["STOPWORD"]))
    released = ""
    for token_id in tokenizer.encode("a STOP sign"):
        assert detok.update([token_id]) is None
        released += detok.take_new_text(finished=False)
        assert not released.endswith(("S", "ST", "STO", "STOP", "STOP "))
    detok.flush()
    released += detok.take_new_text(finished=True)
    assert released == "a STOP sign"


def test_held_back_length_is_the_longest_stop_prefix_at_the_end():
    assert held_back_length("abc", ["cd"]) == 1
    assert held_back_length("abcd", ["cdx", "bcdz"]) == 3
    assert held_back_length("abc", ["x"]) == 0
    assert held_back_length("", ["abc"]) == 0


def output(token_ids: list[int], finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id="r-0", version=0, new_token_ids=token_ids,
                            finish_reason=finish)


def test_fan_out_numbers_choices_across_prompts_with_distinct_seeds():
    prompts = [PromptInput([1, 2]), PromptInput([3])]
    choices = fan_out("r", prompts, [SamplingParams(n=2, seed=5), SamplingParams(n=3)])
    assert [(c.request_id, c.prompt_index, c.sample_index) for c in choices] == [
        ("r-0", 0, 0), ("r-1", 0, 1), ("r-2", 1, 0), ("r-3", 1, 1), ("r-4", 1, 2)]
    assert [c.params.seed for c in choices[:2]] == [5, 6]
    assert all(c.params.n == 1 for c in choices)


def test_the_output_processor_carries_held_back_tokens_and_aborts_on_a_stop_string(tokenizer):
    (choice,) = fan_out("r", [PromptInput([1])], [SamplingParams(stop=["STOPWORD"])])
    processor = OutputProcessor(tokenizer, choice)
    token_ids = tokenizer.encode("a STOPWORD b")
    deltas = [processor.add(output([t])) for t in token_ids]
    given = [d for d in deltas if d is not None]
    assert None in deltas  # "STOP..." was held back while it could start the stop string
    assert sum((d.token_ids for d in given), []) == choice.token_ids  # none lost or repeated
    assert "".join(d.text for d in given) == choice.text == "a "
    assert given[-1].finish_reason == "stop" and given[-1].stop_reason == "STOPWORD"
    assert processor.abort_engine and choice.finished
    assert processor.add(output([5])) is None  # after the end: ignored


def test_every_step_hands_out_each_steps_tokens_even_while_their_text_is_held_back(tokenizer):
    """A stream that asked for token ids or logprobs: each step's tokens when they are made
    (empty text while held back), as vLLM streams them; the text is the same."""
    (choice,) = fan_out("r", [PromptInput([1])], [SamplingParams(stop=["STOPWORD"])])
    processor = OutputProcessor(tokenizer, choice, every_step=True)
    token_ids = tokenizer.encode("a STOPWORD b")
    deltas = [processor.add(output([t])) for t in token_ids]
    assert None not in deltas[:len(choice.token_ids)]
    assert [d.token_ids for d in deltas if d is not None] == [[t] for t in choice.token_ids]
    assert "".join(d.text for d in deltas if d is not None) == choice.text == "a "
    assert any(d is not None and not d.text and d.finish_reason is None for d in deltas)


def test_the_output_processor_takes_the_engines_finish_reason(tokenizer):
    (choice,) = fan_out("r", [PromptInput([1])], [SamplingParams()])
    processor = OutputProcessor(tokenizer, choice)
    delta = processor.add(output(tokenizer.encode("done."), FinishReason.LENGTH))
    assert delta is not None and delta.finish_reason == "length" and delta.text == "done."
    assert not processor.abort_engine


def test_the_chat_template_renders_the_checkpoint_format(tokenizer):
    template = ChatTemplate(tokenizer.chat_template, tokenizer.template_kwargs())
    text = template.render([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_a_template_that_raises_is_a_clear_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_the_template_runs_in_a_sandbox():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
