"""A tiny stand-in for the Kubernetes API's EndpointSlice list and watch (run as a process).

GET .../endpointslices lists the slices it holds; with ``watch=true`` it streams the events
POSTed to /admin/event ({"type": "ADDED"|"MODIFIED"|"DELETED", "object": slice}) as JSON
lines, applying them to its list too. PATCH .../inferenceservices/NAME (the router's capacity
request) is recorded and listed at GET /admin/patches.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

SLICES: dict[str, dict] = {}
PATCHES: list[dict] = []
WATCHERS: list[asyncio.Queue] = []


async def endpointslices(request: Request) -> Response:
    if request.query_params.get("watch") == "true":
        queue: asyncio.Queue = asyncio.Queue()
        WATCHERS.append(queue)

        async def events():
            try:
                while True:
                    yield (json.dumps(await queue.get()) + "\n").encode()
            finally:
                WATCHERS.remove(queue)

        return StreamingResponse(events(), media_type="application/json")
    return JSONResponse({"kind": "EndpointSliceList", "metadata": {"resourceVersion": "1"},
                         "items": list(SLICES.values())})


async def event(request: Request) -> Response:
    body = await request.json()
    name = body["object"]["metadata"]["name"]
    if body["type"] == "DELETED":
        SLICES.pop(name, None)
    else:
        SLICES[name] = body["object"]
    for queue in WATCHERS:
        queue.put_nowait(body)
    return JSONResponse({"watchers": len(WATCHERS)})


async def patch_isvc(request: Request) -> Response:
    PATCHES.append({"name": request.path_params["name"],
                    "content_type": request.headers.get("content-type"),
                    "body": await request.json()})
    return JSONResponse({"metadata": {"name": request.path_params["name"]}})


async def patches(_: Request) -> Response:
    return JSONResponse(PATCHES)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--initial", default="[]", help="JSON list of slices to start with")
    args = parser.parse_args()
    for item in json.loads(args.initial):
        SLICES[item["metadata"]["name"]] = item
    app = Starlette(routes=[
        Route("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", endpointslices),
        Route("/admin/event", event, methods=["POST"]),
        Route("/apis/serving.shoal.dev/v1alpha1/namespaces/{ns}/inferenceservices/{name}",
              patch_isvc, methods=["PATCH"]),
        Route("/admin/patches", patches),
    ])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
