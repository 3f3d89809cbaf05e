"""Engine-area fixtures: a minimal KV sequence for block-manager tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from shoal.runtime.kv.block_hash import ExtraKeys

from ..hf_reference import NEAR_TIE, HFGreedy


@pytest.fixture(autouse=True, scope="module")
def engine_tests_run_single_threaded(one_torch_thread):
    """(``one_torch_thread``: tiny models gain nothing from threads.)"""


@dataclass
class Seq:
    req_id: str
    all_token_ids: list[int]
    block_hashes: list[int] = field(default_factory=list)
    extra_digest: bytes = ExtraKeys().digest()


@pytest.fixture
def make_seq():
    def make(req_id: str, tokens: list[int], salt: str | None = None) -> Seq:
        return Seq(req_id, list(tokens), extra_digest=ExtraKeys(cache_salt=salt).digest())

    return make


# -- a fake executor that checks what the scheduler and KV manager tell it ---------------------

class ContextHashExecutor:
    """Stands in for the model: stores each scheduled token in a fake KV cache at its slot,
    reads every row's whole context back through its block table (so a wrong table, slot or
    a block overwritten while shared shows up as a wrong context), and "samples" a token that
    is a hash of that context. ``expected_next`` computes the same from the true tokens."""

    FIRST_TOKEN = 3  # sampled tokens avoid the fake EOS ids 0..2 unless a script says so

    def __init__(self, vocab_size: int = 512, max_positions: int = 4096,
                 block_bytes: int = 1024) -> None:
        from shoal.runtime.model.config import ModelConfig

        self._model_config = ModelConfig(
            architecture="ContextHash", vocab_size=vocab_size, hidden_size=8, num_layers=1,
            num_heads=1, num_kv_heads=1, head_dim=8, intermediate_size=8,
            max_position_embeddings=max_positions, eos_token_ids=[0])
        self.block_bytes = block_bytes
        self.block_size = 16
        self.tokens: dict[int, tuple[int, int]] = {}  # slot -> (token id, position)
        self.plans = []
        self.known: set[str] = set()
        self.script: dict[str, list[int]] = {}  # req_id -> tokens to emit first (tests of stops)
        self.emitted: dict[str, int] = {}

    @property
    def model_config(self):
        return self._model_config

    def kv_bytes_per_block(self) -> int:
        return self.block_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def expected_next(self, context: list[int]) -> int:
        import numpy as np

        ctx = np.asarray(context, dtype=np.int64)
        value = int(((ctx + 1) * (np.arange(len(ctx)) % 7 + 1)).sum())
        return self.FIRST_TOKEN + value % (self._model_config.vocab_size - self.FIRST_TOKEN)

    def execute(self, plan):
        import numpy as np
        from shoal.runtime.wire.plan import StepResult

        self.plans.append(plan)
        for req_id in plan.finished_req_ids:
            self.known.discard(req_id)
        for new in plan.new_requests:
            assert new.req_id not in self.known, f"{new.req_id} sent twice without finishing"
            self.known.add(new.req_id)
        slots = plan.slot_mapping
        for slot, token, pos in zip(slots.tolist(), plan.input_ids.tolist(),
                                    plan.positions.tolist(), strict=True):
            self.tokens[slot] = (token, pos)
        sampled, req_ids = [], []
        block_size = self.block_size
        for row, req_id in enumerate(plan.req_ids):
            assert req_id in self.known, f"{req_id} scheduled but never sent as a new request"
            seq_len = int(plan.seq_lens[row])
            context = []
            for pos in range(seq_len):
                block = int(plan.block_tables[row, pos // block_size])
                token, stored_pos = self.tokens[block * block_size + pos % block_size]
                assert stored_pos == pos, f"{req_id}: slot for position {pos} holds {stored_pos}"
                context.append(token)
            if plan.sample_rows[row]:
                req_ids.append(req_id)
                script = self.script.get(req_id)
                done = self.emitted.get(req_id, 0)
                if script and done < len(script):
                    sampled.append(script[done])
                    self.emitted[req_id] = done + 1
                else:
                    sampled.append(self.expected_next(context))
        return StepResult(plan.step_id, req_ids, np.asarray(sampled, dtype=np.int64))


@pytest.fixture
def fake_engine():
    """fake_engine(**engine_args) -> (EngineCore over a ContextHashExecutor, the executor)."""
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore

    def make(vocab_size: int = 512, **kwargs):
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("block_size", 4)
        executor = ContextHashExecutor(vocab_size)
        executor.block_size = kwargs["block_size"]
        core = EngineCore(EngineConfig.from_kwargs("fake", **kwargs), executor=executor)
        return core, executor

    return make


@pytest.fixture
def run_to_completion():
    """Step until idle, checking invariants after every step; returns req_id -> tokens and
    req_id -> finish reason (outputs for one request must never follow its finish)."""

    def run(core, max_steps: int = 10_000, on_step=None):
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, object] = {}
        for step in range(max_steps):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                assert out.request_id not in reasons, f"output after finish: {out}"
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
            core.check_invariants()
            if on_step is not None:
                on_step(step)
        assert not core.has_unfinished_requests(), "engine did not finish"
        core.check_invariants()
        assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
        return tokens, reasons

    return run


# -- HF transformers as the reference ---------------------------------------------------------

@pytest.fixture
def assert_matches_hf():
    """Compare engine outputs with HF greedy; a first divergence counts only where HF's
    top-2 margin is not a near-tie. Returns the number of near-tie divergences."""

    def check(reference: HFGreedy, prompts: dict[str, list[int]], outputs: dict[str, list[int]],
              max_new_tokens: dict[str, int]) -> int:
        near_ties = 0
        for req_id, prompt in prompts.items():
            want, margins = reference.generate(prompt, max_new_tokens[req_id])
            got = outputs[req_id]
            assert len(got) == len(want), f"{req_id}: {len(got)} tokens, HF made {len(want)}"
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                if g != w:
                    assert margins[i] < NEAR_TIE, (
                        f"{req_id}: token {i} is {g}, HF greedy gives {w} "
                        f"(HF top-2 margin {margins[i]:.3g})")
                    near_ties += 1
                    break
        return near_ties

    return check
