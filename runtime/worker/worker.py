"""Worker: one rank's model shard, KV cache and sampler, driven by StepPlans.

The engine core (through an executor) calls, in order: ``load_model``, ``kv_bytes_per_block``
(to size the cache), ``init_kv_cache``, ``warmup``, then ``execute`` once per step. The
worker keeps per-request sampling state keyed by request id: created from
``plan.new_requests``, dropped on ``plan.finished_req_ids``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.model.config import ModelConfig, load_model_config
from shoal.runtime.model.parallel import ParallelContext
from shoal.runtime.sample.prompt_logprobs import prompt_rows, score_prompt_rows
from shoal.runtime.sample.sampler import Sampler, SamplerOutput
from shoal.runtime.sample.state import (
    RequestSamplingState,
    build_sampling_metadata,
    new_request_state,
)
from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.wire.plan import StepPlan, StepResult
from shoal.runtime.worker.dummy_step import (
    CPU_WARMUP_SEQ_TOKENS,
    dummy_seq_lens,
    dummy_step_plan,
)
from shoal.runtime.worker.lora_manager import LoraManager
from shoal.runtime.worker.model_runner import ModelRunner
from shoal.runtime.worker.pooler import PromptPooler

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"unknown device {name!r} (auto, cpu, cuda)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device,
                  checkpoint: torch.dtype = torch.float32) -> torch.dtype:
    """``--dtype``: ``auto`` on CPU is the checkpoint's own dtype (a bfloat16 checkpoint
    serves in bfloat16, as vLLM's CPU build does, at half float32's memory; a float32 one stays
    float32, the exact-HF path); on CUDA, bfloat16."""
    if name == "auto":
        return checkpoint if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext(rank, world_size)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
        self._model_config: ModelConfig | None = None
        self.dtype = resolve_dtype(config.dtype, self.device, self._checkpoint_dtype())
        self.runner: ModelRunner | None = None
        self.states: dict[str, RequestSamplingState] = {}
        self._scoring_prompts: set[str] = set()  # requests whose prompt logprobs are pending
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.graph_capture_seconds: float | None = None  # set by warmup when graphs are captured
        self._grammars: GrammarBackend | None = None  # prepared by warmup(), before ready
        self.lora: LoraManager | None = None  # with --enable-lora, made by load_model
        self.pooler = PromptPooler(config.pooler.pooling_type) if config.pooler else None

    # -- setup ---------------------------------------------------------------------------
    def _checkpoint_dtype(self) -> torch.dtype:
        """What ``--dtype auto`` follows; read only when it matters (tests build workers
        over paths that are never loaded)."""
        if self.config.dtype != "auto" or self.device.type != "cpu":
            return torch.float32
        return self.model_config().torch_dtype

    def model_config(self) -> ModelConfig:
        if self._model_config is None:
            self._model_config = load_model_config(self.config.model, self.config.hf_overrides)
        return self._model_config

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config().max_position_embeddings

    def load_model(self) -> None:
        from shoal.runtime.attention.kv_cache_dtype import attention_needs, kv_cache_torch_dtype
        from shoal.runtime.attention.selector import get_attention_backend
        from shoal.runtime.model.loader import build_model

        mc = self.model_config()
        kv_name = self.config.kv_cache_dtype
        backend = get_attention_backend(self.config.attention_backend, self.device, self.dtype,
                                        mc.attention_features
                                        | attention_needs(kv_name, mc.attention_features))
        max_positions = max(self.max_model_len, mc.max_position_embeddings)
        if self.config.pooler is not None:  # no logits: an LM head need not be stored
            mc = dataclasses.replace(mc, tie_word_embeddings=True)
        with torch.no_grad():  # not inference_mode: parameters stay ordinary tensors
            model = build_model(mc, self.config.model, backend, self.parallel, max_positions,
                                self.dtype, self.device, self.config.load_format,
                                self.config.seed + self.parallel.rank,
                                self.config.quantization)
        self.runner = ModelRunner(model, backend, self.device, self.dtype,
                                  self.config.block_size, kv_cache_torch_dtype(kv_name, self.dtype),
                                  state_slots=self.config.max_num_seqs,
                                  hybrid_kv=not self.config.disable_hybrid_kv_cache_manager)
        if self.config.enable_lora:
            self.lora = self._attach_lora(model)

    def _attach_lora(self, model) -> LoraManager:
        from shoal.runtime.model.lora import attach_lora

        config = self.config
        if self.model_config().mla is not None:
            raise ValueError(f"{self.model_config().architecture}: LoRA adapters on multi-head "
                             "latent attention are not supported (--enable-lora)")
        if self.model_config().linear_attn is not None:
            raise ValueError(f"{self.model_config().architecture}: LoRA adapters on a hybrid "
                             "model's linear-attention layers are not supported (--enable-lora)")
        made = attach_lora(model, config.max_loras, config.max_lora_rank, self.dtype,
                           self.device)
        return LoraManager(made, len(model.model.layers),
                           config.max_cpu_loras or config.max_loras, self.dtype, self.device)

    def add_lora(self, name: str, path: str) -> None:
        """Parse, check and register an adapter; ``LoraAdapterError`` says why it is bad."""
        if self.lora is None:
            raise RuntimeError("LoRA is not enabled (--enable-lora)")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        if self.lora is not None:
            self.lora.remove(name)

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("load_model must run first")
        return self.runner

    def kv_bytes_per_block(self) -> int:
        return self._runner().kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._runner().init_kv_cache(num_blocks)

    def state_bytes_per_request(self) -> int:
        states = self._runner().states
        return states.bytes_per_request if states is not None else 0

    def warmup(self) -> None:
        """Run one dummy step of the largest size the scheduler may send, then forget it;
        on CUDA, then capture the decode CUDA graphs (phase "capturing")."""
        self._run_dummy_step()
        from shoal.runtime.worker.cuda_graphs import capture_decode_graphs

        runner = self._runner()
        runner.decode_graphs = capture_decode_graphs(
            runner.model, runner.kv_caches, runner.backend, self.device, self.config.max_num_seqs,
            self.max_model_len, self.config.block_size,
            # LoRA steps run eager; so do hybrid models (their state slots are per step) and
            # models with several KV cache groups (one block table per group)
            self.config.enforce_eager or self.config.enable_lora
            or runner.states is not None or runner.kv_groups.hybrid)
        if runner.decode_graphs is not None:
            self.graph_capture_seconds = runner.decode_graphs.capture_seconds
        # before the engine reports ready: built later, it held the GIL against the first steps
        self.grammars().prepare()

    def profile_num_kv_blocks(self) -> int | None:
        """CUDA: the KV blocks that fit ``gpu_memory_utilization`` after a profiled max-size
        step (the arithmetic is logged); None on CPU, where the engine's budget applies."""
        if self.device.type != "cuda":
            return None
        from shoal.runtime.worker.memory_profile import size_kv_cache

        runner = self._runner()
        probe_blocks = -(-self._max_step_tokens() // self.config.block_size)
        runner.init_kv_cache(probe_blocks)  # just enough for the dummy step to run
        budget = size_kv_cache(self._run_dummy_step, self.device,
                               probe_blocks * self.kv_bytes_per_block(),
                               self.config.gpu_memory_utilization, self.kv_bytes_per_block(),
                               self.config.block_size)
        runner.kv_caches = []
        torch.cuda.empty_cache()
        return budget.num_blocks

    def _max_step_tokens(self) -> int:
        return max(1, min(self.config.max_num_batched_tokens, self.max_model_len))

    def _run_dummy_step(self) -> None:
        """The step ``dummy_step.py`` describes: one max-size sequence on a GPU (the memory
        profile's worst case), the same tokens in shorter sequences on a CPU."""
        split = CPU_WARMUP_SEQ_TOKENS if self.device.type == "cpu" else None
        seq_lens = dummy_seq_lens(self._max_step_tokens(), self.config.block_size, split,
                                  self.config.max_num_seqs)
        plan = dummy_step_plan(seq_lens, self.config.block_size, self._runner().num_blocks)
        self.execute(plan)
        self._runner().release_states(plan.req_ids)
        for req_id in plan.req_ids:
            self.states.pop(req_id, None)

    def grammars(self) -> GrammarBackend:
        if self._grammars is None:
            mc = self.model_config()
            self._grammars = GrammarBackend(self.config.model, mc.vocab_size, mc.eos_token_ids)
        return self._grammars

    # -- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        if self.pooler is not None:
            return self._execute_pooling(plan, self.pooler)
        runner = self._runner()
        lora = self.lora
        for req_id in plan.finished_req_ids:
            self.states.pop(req_id, None)
            self._scoring_prompts.discard(req_id)
            if lora is not None:
                lora.forget(req_id)
        vocab = self.model_config().vocab_size
        eos = self.model_config().eos_token_ids
        for new in plan.new_requests:
            if new.compiled_grammar is not None and new.sampling_params.structured is not None:
                self.grammars().install(new.sampling_params.structured, new.compiled_grammar)
            self.states[new.req_id] = new_request_state(
                new.sampling_params, new.prompt_token_ids, new.output_token_ids,
                new.generator_offset, eos, vocab, self.device,
                self.grammars() if new.sampling_params.structured is not None else None)
            if self.states[new.req_id].prompt_for_logprobs is not None:
                self._scoring_prompts.add(new.req_id)
            if new.lora_name is not None:
                if lora is None:
                    raise RuntimeError(f"request {new.req_id} names LoRA adapter "
                                       f"{new.lora_name!r} but LoRA is not enabled")
                lora.track(new.req_id, new.lora_name)
        if lora is not None:
            with torch.no_grad():
                lora.prepare(plan)
        sample_rows = np.asarray(plan.sample_rows, dtype=bool)
        sampled_ids = [rid for rid, s in zip(plan.req_ids, sample_rows, strict=True) if s]
        try:
            states = [self.states[rid] for rid in sampled_ids]
        except KeyError as exc:
            raise RuntimeError(f"request {exc.args[0]!r} was never sent to the worker "
                               "in new_requests") from None
        scored, extra_indices = [], None
        if self._scoring_prompts:  # rare: the per-row look is paid only while one exists
            wanted = {rid: (prompt, self.states[rid].params.prompt_logprobs or 0)
                      for rid in self._scoring_prompts
                      if (prompt := self.states[rid].prompt_for_logprobs) is not None}
            scored, extra_indices = prompt_rows(plan, wanted)
        with torch.inference_mode():
            logits, extra = runner.forward_with_extra_rows(plan, extra_indices)
            prompt_lps = score_prompt_rows(extra, scored) if extra is not None else None
            if not states:
                return StepResult(plan.step_id, [], np.zeros(0, dtype=np.int64),
                                  prompt_logprobs=prompt_lps)
            meta = build_sampling_metadata(states, vocab, self.device)
            out = self.sampler(logits, meta)
        if self._scoring_prompts:
            for rid, state in zip(sampled_ids, states, strict=True):
                state.prompt_for_logprobs = None  # the prompt is complete: nothing to score
                self._scoring_prompts.discard(rid)
        result = self._result(plan.step_id, sampled_ids, states, out)
        result.prompt_logprobs = prompt_lps
        return result

    def _execute_pooling(self, plan: StepPlan, pooler: PromptPooler) -> StepResult:
        """Prompts pooled, nothing sampled: each completed prompt's row gets token 0 as a
        placeholder (its request asked for one token, so the scheduler finishes it there)
        and its vector in ``pooled``."""
        pooler.forget(plan.finished_req_ids + [n.req_id for n in plan.new_requests])
        with torch.inference_mode():
            pooled = pooler.pool(plan, self._runner().forward_hidden(plan))
        done = [rid for rid, s in zip(plan.req_ids, np.asarray(plan.sample_rows).tolist(),
                                      strict=True) if s]
        return StepResult(plan.step_id, done, np.zeros(len(done), dtype=np.int64),
                          pooled=pooled or None)

    def _result(self, step_id: int, req_ids: list[str], states: list[RequestSamplingState],
                out: SamplerOutput) -> StepResult:
        tokens = out.sampled_token_ids.cpu().numpy().astype(np.int64, copy=False)
        for state, token in zip(states, tokens.tolist(), strict=True):
            state.append(token)
        result = StepResult(step_id, req_ids, tokens)
        if out.logprobs is not None:
            result.logprobs = out.logprobs.float().cpu().numpy()
            assert out.top_token_ids is not None and out.top_logprobs is not None
            result.top_token_ids = out.top_token_ids.cpu().numpy().astype(np.int64, copy=False)
            result.top_logprobs = out.top_logprobs.float().cpu().numpy()
        return result
