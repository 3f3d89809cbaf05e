"""``--tokenizer-from-engine``: the router takes the model's tokenizer from an engine.

The router needs the engines' exact tokenizer and chat template to compute their block
hashes (token-precise affinity). Rather than loading the model source a second time (an
hf:// repo would need hub access and a token in the router pod, a ReadWriteOnce PVC cannot
be mounted by a pod on another node), it asks the first ready engine for ``GET /tokenizer``,
the front end's own ``Tokenizer.to_wire()``: the very object that engine encodes with.
Until that answer arrives (only while no engine is ready yet) requests are keyed in the
approximate mode, which matches nothing in a precise index: they go by load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.router.policies.request_keys import PromptTokenizer
from shoal.runtime.router.replicas.pool import ReplicaPool

log = logging.getLogger("shoal.router.tokenizer")

FETCH_TIMEOUT_S = 30.0  # a large vocabulary is a few MB of JSON


async def fetch_tokenizer(session: aiohttp.ClientSession, replica_url: str) -> PromptTokenizer:
    async with session.get(f"{replica_url}/tokenizer",
                           timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as response:
        if response.status != 200:
            raise ValueError(f"{replica_url}/tokenizer answered {response.status}")
        data = await response.json(content_type=None)
    if not isinstance(data, dict):
        raise ValueError(f"{replica_url}/tokenizer did not answer a JSON object")
    # building the tokenizer parses the whole vocabulary: off the event loop
    return await asyncio.to_thread(lambda: PromptTokenizer(Tokenizer.from_wire(data)))


async def load_from_engines(pool: ReplicaPool, install: Callable[[PromptTokenizer], None],
                            retry_s: float = 1.0) -> None:
    """Poll until a ready replica hands over its tokenizer, then ``install`` it, once."""
    async with aiohttp.ClientSession() as session:
        while True:
            for replica in pool.available():
                try:
                    tokenizer = await fetch_tokenizer(session, replica.url)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    log.warning("could not fetch the tokenizer from %s: %r", replica.url, exc)
                    continue
                install(tokenizer)
                log.info("token-precise keys: tokenizer fetched from %s", replica.url)
                return
            await asyncio.sleep(retry_s)
