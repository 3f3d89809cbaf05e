"""``make gpu-check``: compile every Triton kernel variant the launchers can produce for a
Hopper GPU (sm_90a) without one, and report shared memory, registers, spills and wgmma.

``variants.py`` holds the typed variant and the registry (one line per kernel module);
``compile.py`` compiles one variant and reads ptxas's report; ``__main__.py`` runs them all
in a process pool with a cache keyed by source hash. See docs/operations.md ("gpu-check").
"""
