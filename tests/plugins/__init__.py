"""Debug plugins the tests load into engine processes by path (runtime/debug_plugins.py).

Tests pass ``FAULTS`` in ``SHOAL_DEBUG_PLUGINS`` and never import the plugin modules
themselves (an import would register their hooks in the test process too)."""

from pathlib import Path

FAULTS = str(Path(__file__).resolve().parent / "faults.py")
