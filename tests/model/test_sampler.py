"""The sampler: per-row parameters, exact distributions, seeds independent of batch mates."""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from shoal.runtime.sample.state import build_sampling_metadata, new_request_state
from shoal.runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
EOS = [0]
# chi-square critical value, 7 degrees of freedom, p = 0.001
CHI2_CRIT_DF7 = 24.32


def states_for(params_list, vocab=VOCAB, prompts=None, outputs=None):
    return [new_request_state(p, (prompts or {}).get(i, [1]), (outputs or {}).get(i, []), 0, EOS,
                              vocab, CPU) for i, p in enumerate(params_list)]


def sample(logits, params_list, generator_seed=0, states=None, **kw):
    states = states or states_for(params_list, logits.shape[1], **kw)
    meta = build_sampling_metadata(states, logits.shape[1], CPU)
    return Sampler(torch.Generator().manual_seed(generator_seed))(logits, meta)


def test_all_greedy_batch_is_the_argmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_1_equals_greedy_even_at_high_temperature():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    mixed = [SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=2.0)] * 3
    for seed in range(5):
        out = sample(logits, mixed, generator_seed=seed)
        assert out.sampled_token_ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()
    # and through the filter itself, not only the greedy shortcut
    kept = apply_top_k_top_p(logits.clone(), torch.ones(6, dtype=torch.long), None)
    assert (torch.isfinite(kept).sum(-1) == 1).all()
    assert kept.argmax(-1).tolist() == logits.argmax(-1).tolist()


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_distribution_matches_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    temperature, n = 0.7, 40_000
    out = sample(logits.expand(n, VOCAB).contiguous(),
                 [SamplingParams(temperature=temperature)] * n, generator_seed=1234)
    tokens = out.sampled_token_ids
    right = torch.softmax(logits[0] / temperature, -1)
    assert _chi_square(tokens, right) < CHI2_CRIT_DF7
    # the test has power: the same samples reject a slightly wrong temperature
    for wrong in (0.6, 0.8):
        assert _chi_square(tokens, torch.softmax(logits[0] / wrong, -1)) > 10 * CHI2_CRIT_DF7


def test_seeded_rows_reproduce_regardless_of_batch_mates():
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(4, 64, generator=gen) for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(rows_params, row_of_seeded, shared_seed):
        states = states_for(rows_params, vocab=64)
        sampler = Sampler(torch.Generator().manual_seed(shared_seed))
        got = []
        for logits in steps:
            batch = logits[: len(rows_params)].clone()
            batch[row_of_seeded] = logits[3]
            meta = build_sampling_metadata(states, 64, CPU)
            got.append(int(sampler(batch, meta).sampled_token_ids[row_of_seeded]))
        return got

    alone = run([seeded], 0, shared_seed=0)
    crowded = run([SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_p=0.9),
                   seeded, SamplingParams(temperature=0.0)], 2, shared_seed=99)
    assert alone == crowded
    assert len(set(alone)) > 1  # really sampling, not a constant
    other_seed = run([SamplingParams(temperature=1.0, seed=43)], 0, shared_seed=0)
    assert other_seed != alone


def test_seeded_stream_resumes_after_preemption_from_the_generator_offset():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=7)
    state = new_request_state(params, [1], [], 0, EOS, 64, CPU)
    sampler = Sampler(torch.Generator().manual_seed(0))
    full = [int(sampler(logits, build_sampling_metadata([state], 64, CPU)).sampled_token_ids[0])
            for _ in range(8)]
    resumed = new_request_state(params, [1], full[:5], 5, EOS, 64, CPU)
    rest = [int(sampler(logits, build_sampling_metadata([resumed], 64, CPU)).sampled_token_ids[0])
            for _ in range(3)]
    assert rest == full[5:]


def test_top_k_top_p_and_min_p_masks():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    finite = lambda t: torch.isfinite(t[0]).nonzero().flatten().tolist()  # noqa: E731
    assert finite(apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)) == [0, 1]
    # smallest set reaching p: 0.4 + 0.3 = 0.7 >= 0.65; p=0.7 exactly still needs only two
    assert finite(apply_top_k_top_p(logits.clone(), None, torch.tensor([0.65]))) == [0, 1]
    assert finite(apply_top_k_top_p(logits.clone(), None, torch.tensor([0.8]))) == [0, 1, 2]
    assert finite(apply_top_k_top_p(logits.clone(), None, torch.tensor([0.01]))) == [0]
    assert finite(apply_top_k_top_p(logits.clone(), torch.tensor([3]),
                                    torch.tensor([0.99]))) == [0, 1, 2]
    # min_p 0.3: keep tokens with p >= 0.3 * 0.4 = 0.12
    kept = logits.clone()
    apply_min_p(kept, torch.tensor([0.3]))
    assert finite(kept) == [0, 1, 2]


def test_filters_are_per_row_and_samples_stay_inside_them():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.5, top_k=3), SamplingParams(temperature=1.5, top_p=0.3),
              SamplingParams(temperature=1.5, min_p=0.5)]
    allowed = [set(logits[0].topk(3).indices.tolist())]
    order = (logits[1] / 1.5).softmax(-1).sort(descending=True)  # filters see tempered probs
    cum = order.values.cumsum(0)
    allowed.append(set(order.indices[: int((cum < 0.3).sum()) + 1].tolist()))
    probs2 = logits[2].softmax(-1) ** (1 / 1.5)
    probs2 = probs2 / probs2.sum()
    allowed.append(set((probs2 >= 0.5 * probs2.max()).nonzero().flatten().tolist()))
    seen: list[set[int]] = [set(), set(), set()]
    for seed in range(200):
        for row, token in enumerate(sample(logits, params, seed).sampled_token_ids.tolist()):
            seen[row].add(token)
    for row in range(3):
        assert seen[row] <= allowed[row]
        assert len(seen[row]) > 1 or len(allowed[row]) == 1


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for t in range(out.numel()):
        if t in prompt or t in output:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + (pres if count else 0.0)
    return out


def test_penalties_match_a_straightforward_reference():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 16, generator=gen) * 3
    prompts = {0: [1, 2, 3], 1: [4, 4, 5], 2: [6]}
    outputs = {0: [2, 2, 9], 1: [], 2: [6, 7, 7, 7]}
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.4,
                             presence_penalty=1.1)]
    states = states_for(params, vocab=16, prompts=prompts, outputs=outputs)
    meta = build_sampling_metadata(states, 16, CPU)
    from shoal.runtime.sample.sampler import apply_penalties

    ours = logits.clone()
    apply_penalties(ours, meta)
    for row, p in enumerate(params):
        ref = reference_penalties(logits[row], prompts[row], outputs[row], p.repetition_penalty,
                                  p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(ours[row], ref)
    # counts follow tokens appended after the state was made
    states[1].append(4)
    meta = build_sampling_metadata(states, 16, CPU)
    assert meta.output_counts[1, 4] == 1


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0] = 10.0  # EOS would win
    logits[0, 3] = 9.0  # a stop token id would come next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    state = new_request_state(params, [1], [], 0, EOS, VOCAB, CPU)
    sampler = Sampler()
    tokens = []
    for _ in range(3):
        token = int(sampler(logits, build_sampling_metadata([state], VOCAB, CPU))
                    .sampled_token_ids[0])
        state.append(token)
        tokens.append(token)
    assert tokens[:2] != [0, 0] and 0 not in tokens[:2] and 3 not in tokens[:2]
    assert tokens[2] == 0


def test_logprobs_are_raw_log_softmax_with_the_batch_max_top_k():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.5, logprobs=0, repetition_penalty=2.0),
              SamplingParams(temperature=0.0)]
    before = logits.clone()
    out = sample(logits, params)
    assert torch.equal(logits, before)  # the caller's logits are never modified
    raw = torch.log_softmax(logits, -1)
    assert out.top_token_ids.shape == (3, 2)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, raw.topk(2, -1).values)
    assert out.top_token_ids[0].tolist() == raw[0].topk(2).indices.tolist()


def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        new_request_state(SamplingParams(repetition_penalty=1.2), [VOCAB + 3], [], 0, EOS, VOCAB,
                          CPU)


def test_logit_bias_is_added_per_row_after_raw_logprobs():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0
    params = [SamplingParams(temperature=0.0, logit_bias={5: 3.0}, logprobs=0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={2: -100.0, 7: 0.5})]
    out = sample(logits, params)
    assert out.sampled_token_ids.tolist() == [5, 2, 7]
    # logprobs are of the model's distribution, before the bias (as vLLM reports them)
    assert out.logprobs is not None
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[5].item())
    # a biased token can still be sampled away from when its bias is small and others win
    hot = sample(torch.tensor([[0.0, 10.0] + [0.0] * (VOCAB - 2)]),
                 [SamplingParams(temperature=1.0, seed=1, logit_bias={0: 1.0})])
    assert hot.sampled_token_ids.tolist() == [1]
