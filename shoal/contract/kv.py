"""The KV block size the engines use unless told otherwise: the router keys prompt prefixes
in blocks of the engines' size, and the operator renders the same default into both."""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16
