"""The step-plan wire codec is lossless over any sequence of plans, and small."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.plan import NewRequestData, StepPlan, StepResult
from shoal.runtime.wire.plan_codec import PlanDecoder, PlanEncoder
from shoal.runtime.wire.result_codec import decode_result, encode_result

BLOCK = 4


def make_plan(step_id: int, rows: list[tuple[str, int, int, list[int]]],
              new: list[NewRequestData], finished: list[str],
              scramble_positions: bool = False) -> StepPlan:
    """rows: (req_id, context length before the step, tokens this step, block ids)."""
    width = max((len(blocks) for *_, blocks in rows), default=0)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    for i, (req_id, before, count, blocks) in enumerate(rows):
        tables[i, :len(blocks)] = blocks
        for pos in range(before, before + count):
            input_ids.append(hash((req_id, pos)) % 50_000)
            positions.append(pos)
            slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        qsl.append(qsl[-1] + count)
        seq_lens.append(before + count)
    if scramble_positions and positions:
        positions[0] += 1  # not derivable: must travel explicitly
    return StepPlan(
        step_id=step_id,
        req_ids=[r[0] for r in rows],
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        query_start_loc=np.array(qsl, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=tables,
        slot_mapping=np.array(slots, dtype=np.int64),
        sample_rows=np.array([i % 3 != 1 for i in range(len(rows))], dtype=bool),
        new_requests=new,
        finished_req_ids=finished,
    )


def assert_same_plan(got: StepPlan, want: StepPlan) -> None:
    assert got.step_id == want.step_id
    assert got.req_ids == want.req_ids
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
                 "slot_mapping", "sample_rows"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert got.new_requests == want.new_requests
    assert got.finished_req_ids == want.finished_req_ids


# A scenario: each step, every live request decodes or prefills a chunk; requests arrive,
# finish, and get preempted (their table is revoked and rebuilt from other blocks).
actions = st.lists(st.tuples(st.sampled_from(["add", "finish", "preempt", "step"]),
                             st.integers(0, 10_000)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(actions)
def test_any_sequence_of_plans_decodes_to_the_same_plans(script):
    encoder, decoder = PlanEncoder(BLOCK), PlanDecoder(BLOCK)
    live: dict[str, list[int]] = {}  # req_id -> [context len, *block ids]
    next_block, next_req = 1, 0
    new: list[NewRequestData] = []
    finished: list[str] = []
    for step_id, (action, arg) in enumerate(script):
        if action == "add" or not live:
            req_id = f"req-{next_req}"
            next_req += 1
            live[req_id] = [0]
            new.append(NewRequestData(req_id, [arg % 97] * (arg % 9 + 1), [],
                                      SamplingParams(temperature=0.0, seed=arg)))
        elif action == "finish":
            victim = sorted(live)[arg % len(live)]
            del live[victim]
            finished.append(victim)
            continue
        elif action == "preempt":
            victim = sorted(live)[arg % len(live)]
            live[victim] = [0]
        rows = []
        for req_id, state in sorted(live.items()):
            before, blocks = state[0], state[1:]
            count = 1 if before and arg % 3 else arg % 7 + 1  # decode, or a prefill chunk
            while len(blocks) * BLOCK < before + count:
                blocks.append(next_block if arg % 5 else 0)  # block 0 is a real block too
                next_block += 1
            live[req_id] = [before + count, *blocks]
            rows.append((req_id, before, count, blocks))
        plan = make_plan(step_id, rows, new, finished, scramble_positions=arg % 11 == 0)
        new, finished = [], []
        assert_same_plan(decoder.decode(encoder.encode(plan)), plan)


def decoding_plan(num_reqs: int, context: int, step_id: int) -> StepPlan:
    rows = []
    for i in range(num_reqs):
        blocks = [1 + i * 1000 + b for b in range(context // BLOCK + 1)]
        rows.append((f"cmpl-{i:032x}-0", context, 1, blocks))
    return make_plan(step_id, rows, [], [])


def test_a_steady_decode_step_of_256_requests_fits_in_a_few_kilobytes():
    encoder, decoder = PlanEncoder(BLOCK), PlanDecoder(BLOCK)
    first = decoder.decode(encoder.encode(decoding_plan(256, 400, 0)))
    assert first.num_reqs == 256
    steady = decoding_plan(256, 401, 1)  # same tables: only ids, lengths and flags travel
    data = encoder.encode(steady)
    assert_same_plan(decoder.decode(data), steady)
    # 256 x (4 handle + 4 input id + 4 qsl + 4 seq len + 8 table keep/len) + bits + framing
    assert len(data) < 256 * 24 + 200
    assert len(data) < steady.block_tables.nbytes / 10


def test_a_plan_that_names_an_unknown_handle_is_rejected():
    encoder = PlanEncoder(BLOCK)
    encoder.encode(decoding_plan(2, 8, 0))
    data = encoder.encode(decoding_plan(2, 8, 1))  # handles assigned in a message never seen
    try:
        PlanDecoder(BLOCK).decode(data)
    except ValueError as exc:
        assert "unknown request handle" in str(exc)
    else:
        raise AssertionError("decoding without the handle assignments must fail")


def test_results_round_trip_and_req_ids_come_from_the_plan():
    plan = decoding_plan(3, 8, 0)  # rows 0 and 2 sample
    result = StepResult(step_id=0, req_ids=[plan.req_ids[0], plan.req_ids[2]],
                        sampled_token_ids=np.array([5, 7], dtype=np.int64),
                        logprobs=np.array([-0.5, -1.5], dtype=np.float32),
                        top_token_ids=np.array([[5, 1], [7, 2]], dtype=np.int64),
                        top_logprobs=np.array([[-0.5, -2], [-1.5, -3]], dtype=np.float32))
    got = decode_result(encode_result(result, plan), plan)
    assert got.req_ids == result.req_ids
    np.testing.assert_array_equal(got.sampled_token_ids, result.sampled_token_ids)
    np.testing.assert_array_equal(got.top_token_ids, result.top_token_ids)
    np.testing.assert_array_equal(got.top_logprobs, result.top_logprobs)
    np.testing.assert_array_equal(got.logprobs, result.logprobs)
    bare = StepResult(step_id=0, req_ids=["other"], sampled_token_ids=np.array([1]))
    got = decode_result(encode_result(bare, plan), plan)
    assert got.req_ids == ["other"] and got.logprobs is None and got.top_token_ids is None


def test_a_mixed_models_group_tables_cross_the_wire():
    """KV cache groups past the first (``kv/kv_groups.py``) travel whole beside group 0's."""
    sampling = SamplingParams(temperature=0.0)
    plan = make_plan(1, [("a", 0, 5, [3, 4]), ("b", 8, 1, [5, 6, 7])],
                     [NewRequestData("a", [1] * 5, [], sampling)], [])
    plan.group_block_tables = [np.array([[9, 10, 0], [0, 0, 11]], dtype=np.int32)]
    plan.group_slot_mappings = [np.array([36, 37, 38, 39, 40, 44], dtype=np.int64)]
    got = PlanDecoder(BLOCK).decode(PlanEncoder(BLOCK).encode(plan))
    assert_same_plan(got, plan)
    assert len(got.group_block_tables) == 1 and len(got.group_slot_mappings) == 1
    np.testing.assert_array_equal(got.group_block_tables[0], plan.group_block_tables[0])
    np.testing.assert_array_equal(got.group_slot_mappings[0], plan.group_slot_mappings[0])
