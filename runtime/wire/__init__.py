"""What crosses a process boundary inside a replica, in one place: the API <-> engine-core
messages (``messages.py``) and their ZeroMQ frames (``core_frames.py``), the step plan and
result the engine core and the workers exchange (``plan.py``) and their compact TP encoding
(``plan_codec.py``, ``result_codec.py``). Plain data and codecs: they import nothing of the
processes on either side (tests/packaging/test_architecture.py)."""
