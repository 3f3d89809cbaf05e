"""A small OpenAI-ish engine stand-in for proxy tests (run as a process on 127.0.0.x).

It streams SSE chunks slowly, records which prompts it served, counts requests whose client
went away mid-stream (``aborted``), and can be told to answer /ready and requests with an
error status, so the router's retry, ejection and cancellation paths can be observed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

STATE = {"open": 0, "aborted": 0, "served": 0, "prompts": [], "ready": True, "fail": 0,
         "fail_retry_safe": False}


INSTANCE = uuid.uuid4().hex[:16]  # as shoal serve: its tag in response ids, on /ready


async def ready(_: Request) -> Response:
    return JSONResponse({"instance": INSTANCE}, status_code=200 if STATE["ready"] else 503)


async def responses(request: Request) -> Response:
    """A Responses stand-in: who served it, and the previous id it was asked to continue."""
    body = json.loads(await request.body())
    STATE.setdefault("previous", []).append(body.get("previous_response_id"))
    return JSONResponse({"id": f"resp_{INSTANCE}_{uuid.uuid4().hex}",
                         "replica": request.app.state.name})


async def messages(request: Request) -> Response:
    """An Anthropic Messages stand-in: the path and the Anthropic headers it was sent (a
    stream is served as /v1/completions streams)."""
    body = json.loads(await request.body())
    if body.get("stream"):
        return await completions(request)
    return JSONResponse({"replica": request.app.state.name, "path": request.url.path,
                         **{h: request.headers.get(h)
                            for h in ("x-api-key", "anthropic-version")}})


async def health(_: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(_: Request) -> Response:
    return PlainTextResponse(
        f'shoal:num_requests_running{{model_name="fake"}} {STATE["open"]}\n'
        f'shoal:num_requests_waiting{{model_name="fake"}} 0\n'
        f'shoal:kv_cache_usage_perc{{model_name="fake"}} 0.1\n')


async def admin(request: Request) -> Response:
    if request.method == "POST":
        STATE.update(await request.json())
    return JSONResponse(STATE)


async def completions(request: Request) -> Response:
    try:  # like shoal serve: a body it cannot decode is the client's error
        body = json.loads(await request.body())
    except (ValueError, RecursionError):
        STATE["bad_bodies"] = STATE.get("bad_bodies", 0) + 1
        return JSONResponse({"error": {"message": "bad body", "code": 400}}, status_code=400)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and any(isinstance(t, int) and not 0 <= t < 1000
                                        for t in prompt):
        STATE["bad_bodies"] = STATE.get("bad_bodies", 0) + 1
        return JSONResponse({"error": {"message": "token id out of range", "code": 400}},
                            status_code=400)
    if STATE["fail"]:  # like shoal serve: the retry-safe mark only where no work was done
        STATE["failed"] = STATE.get("failed", 0) + 1
        headers = {"x-shoal-retry-safe": "1"} if STATE["fail_retry_safe"] else {}
        return JSONResponse({"error": {"message": "unavailable", "code": "engine_died"}},
                            status_code=STATE["fail"], headers=headers)
    STATE["prompts"].append(body.get("prompt") or body.get("messages"))
    name = request.app.state.name
    params = body.get("kv_transfer_params")
    STATE.setdefault("kv_params", []).append(params)
    if isinstance(params, dict) and params.get("do_remote_decode"):  # a P/D prefill leg
        STATE["prefilled"] = STATE.get("prefilled", 0) + 1
        host, port = name.rsplit(":", 1)
        return JSONResponse({"replica": name, "text": "x", "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": name,
            "remote_host": host, "remote_port": int(port), "remote_block_ids": [0]}})
    chunks = int(body.get("max_tokens", 5))
    delay = float(body.get("delay", 0.0))
    if not body.get("stream"):
        deadline = asyncio.get_running_loop().time() + delay * chunks
        while asyncio.get_running_loop().time() < deadline:  # like an engine: watch the client
            if await request.is_disconnected():
                STATE["aborted"] += 1
                return Response(status_code=499)
            await asyncio.sleep(0.02)
        STATE["served"] += 1
        return JSONResponse({"replica": name, "text": "x" * chunks})

    async def events():
        STATE["open"] += 1
        finished = False
        try:
            for i in range(chunks):
                await asyncio.sleep(delay)
                yield f"data: {json.dumps({'replica': name, 'i': i})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            finished = True
            STATE["served"] += 1
        finally:
            STATE["open"] -= 1
            if not finished:
                STATE["aborted"] += 1

    return StreamingResponse(events(), media_type="text/event-stream")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()  # engine flags it does not model are ignored
    app = Starlette(routes=[
        Route("/ready", ready), Route("/health", health), Route("/metrics", metrics),
        Route("/admin", admin, methods=["GET", "POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages, methods=["POST"]),
    ])
    app.state.name = f"{args.host}:{args.port}"
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
