"""The engine core's heartbeat reports how long the current step has gone without progress
(``core_proc.LoopProgress``): a long step that keeps computing is slow, not stuck (a prefill
on a loaded 2-core machine ran past the 30 s limit and the engine was declared dead); a step
that uses no CPU (waiting on a stopped rank, a lock) is stalled from its start. Clocks are
injected, so nothing here depends on the machine's speed."""

from __future__ import annotations

from shoal.runtime.engine.core_proc import LoopProgress


class Clocks:
    def __init__(self) -> None:
        self.wall, self.cpu = 100.0, 5.0

    def advance(self, wall: float, cpu: float = 0.0) -> None:
        self.wall += wall
        self.cpu += cpu


def _progress() -> tuple[LoopProgress, Clocks]:
    clocks = Clocks()
    return LoopProgress(lambda: clocks.wall, lambda: clocks.cpu), clocks


def test_no_step_is_never_stalled() -> None:
    progress, clocks = _progress()
    clocks.advance(60.0)
    assert progress.step_stalled_s() == 0.0


def test_a_long_step_that_computes_is_not_stalled() -> None:
    progress, clocks = _progress()
    progress.begin_step()
    for _ in range(120):  # two minutes of heartbeats, a fifth of a core each
        clocks.advance(0.5, cpu=0.1)
        assert progress.step_stalled_s() == 0.0


def test_a_step_without_cpu_is_stalled_from_its_start() -> None:
    progress, clocks = _progress()
    progress.begin_step()
    for beat in range(1, 80):
        clocks.advance(0.5, cpu=0.001)  # the heartbeat thread's own crumbs
        assert progress.step_stalled_s() == 0.5 * beat


def test_a_step_that_stops_computing_is_stalled_from_its_last_progress() -> None:
    progress, clocks = _progress()
    progress.begin_step()
    clocks.advance(10.0, cpu=8.0)
    assert progress.step_stalled_s() == 0.0
    clocks.advance(0.5)
    assert progress.step_stalled_s() == 0.5
    clocks.advance(40.0)
    assert progress.step_stalled_s() == 40.5


def test_each_step_counts_from_its_own_start() -> None:
    progress, clocks = _progress()
    progress.begin_step()
    clocks.advance(5.0, cpu=5.0)
    assert progress.step_stalled_s() == 0.0
    progress.end_step()
    clocks.advance(1.0)
    assert progress.step_stalled_s() == 0.0
    progress.begin_step()  # the next step, before any beat saw it compute
    clocks.advance(2.0)
    assert progress.step_stalled_s() == 2.0


def test_a_step_whose_ranks_compute_is_not_stalled() -> None:
    """With tensor parallelism the core waits on its ranks without CPU: their CPU counts."""
    progress, clocks = _progress()
    ranks = {"cpu": 0.0}
    progress.count_workers(lambda: ranks["cpu"])
    progress.begin_step()
    for _ in range(120):
        clocks.advance(0.5)
        ranks["cpu"] += 0.2
        assert progress.step_stalled_s() == 0.0
    clocks.advance(0.5)  # the ranks stop (a stopped rank, its peer waiting in a collective)
    assert progress.step_stalled_s() == 0.5
