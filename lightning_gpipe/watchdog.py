"""Where each stage is, for the others to read, and the stall watchdog that names a stage that stopped progressing.

Each stage process keeps its position: the step, the phase (the forward of micro-batch 3, the user's
``training_step`` after the backbone call, writing a checkpoint...), since when, and the stage it waits for,
if it waits. Setting it costs a few attribute writes; a heartbeat thread publishes it to the job's c10d
store once a second when it changed (:func:`start`), so a stage stuck in user code is still described by
its last position.

A stage that has waited for another longer than the stall limit (:mod:`lightning_gpipe.waiting` checks)
asks :func:`diagnose` who stopped: the stage that is not waiting and has been in its position longest,
and publishes that as the job's failure (:mod:`lightning_gpipe.failure`). Phases that may legitimately
last long (writing a checkpoint, profiling the backbone) are marked :func:`unbounded` and are not stalls.

The heartbeat thread also ends its process when the job failed elsewhere and this process did not follow
within :data:`GRACE` seconds (it is stuck outside the package's waits, e.g. in user code), or at once when
it is the stage the watchdog named, so that no process is left behind.
"""

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

from lightning_gpipe import failure
from lightning_gpipe.events import Recorder

INTERVAL = 1.0
"""Seconds between two publications of a stage's position (and two looks at the failure board)."""

GRACE = 10.0
"""Seconds a process may take to fail by itself once the job has failed elsewhere, before its heartbeat ends it."""

_KINDS = {
    "forward": "the forward of micro-batch {}",
    "recompute": "the recompute of micro-batch {}",
    "backward": "the backward of micro-batch {}",
    "weight": "the weight gradient of micro-batch {}",
    "send": "sending micro-batch {}",
    "recv": "receiving the gradients of micro-batch {}",
}

_WHOLE_STEP = {"send": "waiting for its sends to complete", "relay": "sharing the last stage's logged values"}


class _Here:
    """This process's position (set by the main thread, read by the heartbeat)."""

    step = "setup"
    phase = "setup"
    micro_batch: Optional[int] = None
    since = time.time()
    waits_for: Optional[str] = None
    unbounded = False
    version = 0


def _move(phase: str, micro_batch: Optional[int] = None, unbounded: bool = False) -> None:
    _Here.phase, _Here.micro_batch, _Here.unbounded, _Here.waits_for = phase, micro_batch, unbounded, None
    _Here.since = time.time()
    _Here.version += 1


def begin_step(step: str) -> None:
    """Record that this stage starts ``step`` (e.g. ``"step 17"``)."""
    _Here.step = step


def at(phase: str) -> None:
    """Record that this stage is now in ``phase`` (a phrase: ``"`training_step` after the backbone call"``)."""
    _move(phase)


@contextmanager
def unbounded(phase: str) -> Iterator[None]:
    """Mark ``phase`` (e.g. ``"writing a checkpoint"``) as one that may last long: stages waiting meanwhile do not
    count it as a stall."""
    _move(phase, unbounded=True)
    try:
        yield
    finally:
        _move(f"the end of {phase}")


@contextmanager
def waiting(peer: str) -> Iterator[None]:
    """Record that this stage waits for ``peer`` (``"stage 0"``, ``"every stage"``) inside the block."""
    _Here.waits_for, _Here.since = peer, time.time()
    _Here.version += 1
    try:
        yield
    finally:
        _Here.waits_for, _Here.since = None, time.time()
        _Here.version += 1


class TrackingRecorder(Recorder):
    """A :class:`~lightning_gpipe.events.Recorder` whose spans also move this stage's position.

    A stage and its link open a span for every forward, recompute, backward and transfer of a micro-batch,
    enabled or not, so the position follows the schedule at the cost of an attribute write per span.
    """

    def span(self, kind: str, micro_batch: Optional[int] = None, memory_of: Optional[tuple] = None):
        """Move the position to ``kind`` of ``micro_batch``, then as :meth:`Recorder.span`."""
        _move(kind, micro_batch)
        return super().span(kind, micro_batch, memory_of)


def describe(phase: str, micro_batch: Optional[int]) -> str:
    """The phrase of a position: ``describe("forward", 3)`` is ``"the forward of micro-batch 3"``."""
    if phase in _KINDS and micro_batch is not None:
        return _KINDS[phase].format(micro_batch)
    if phase in _WHOLE_STEP:
        return _WHOLE_STEP[phase]
    return phase if micro_batch is None else f"{phase} of micro-batch {micro_batch}"


class _Job:
    """The processes of this pipeline and how long a wait may last (set by :func:`start`)."""

    store: Optional[dist.Store] = None
    rank = 0
    names: dict[int, str] = {}
    limit = float("inf")
    heartbeat: Optional["_Heartbeat"] = None


def start(store: dist.Store, rank: int, names: dict[int, str], limit: float) -> None:
    """Publish this process's position to ``store`` from a heartbeat thread, until :func:`stop`.

    Call after :func:`lightning_gpipe.failure.attach` (positions live on the run's failure board).

    Args:
        store: the job's key-value store.
        rank: this process's global rank.
        names: global rank -> name of every process of this pipeline (this one included).
        limit: seconds a stage may wait for another before the wait counts as a stall.
    """
    stop()
    _Job.store, _Job.rank, _Job.names, _Job.limit = store, rank, names, limit
    _Here.step, _Here.waits_for = "setup", None
    _move("setup")
    _Job.heartbeat = _Heartbeat(store, rank)
    _Job.heartbeat.start()


def stop() -> None:
    """Stop the heartbeat thread (at the end of a run)."""
    heartbeat, _Job.heartbeat = _Job.heartbeat, None
    if heartbeat is not None:
        heartbeat.stopped.set()
        heartbeat.join(timeout=5 * INTERVAL)
    _Job.store, _Job.names, _Job.limit = None, {}, float("inf")


def name_of(rank: Optional[int]) -> str:
    """The name of global rank ``rank`` in messages (``"stage 0"``); ``None`` stands for both neighbours."""
    if rank is None:
        return "its neighbours"
    return _Job.names.get(rank, f"rank {rank}")


def limit() -> float:
    """Seconds a stage may wait for another before the wait counts as a stall (``inf`` outside a run)."""
    return _Job.limit


def diagnose(peer: str, waited: float) -> Optional[tuple[str, Optional[int]]]:
    """Name the stage that stopped progressing, for a stage that has waited ``waited`` s for ``peer``.

    Reads every stage's published position: the stage that is not waiting and has been in its position
    longest stopped progressing; if every stage waits, they wait for each other.

    Returns:
        ``(message, rank of that stage)`` (rank ``None`` when the stages wait for each other), or ``None``
        while that stage is in an :func:`unbounded` phase (a long wait is then no stall).

    Raises:
        RuntimeError: if the store cannot be reached (global rank 0's process is gone).
    """
    now, me = time.time(), _Job.names.get(_Job.rank, failure.stage_name())
    positions = {rank: _read(rank) for rank in _Job.names if rank != _Job.rank}
    gave_up = (
        f"{me} gave up after waiting {waited:.0f} s for {peer} (stall limit {_Job.limit:.0f} s, the shorter of"
        " GPipeStrategy's stall_timeout and 90% of its timeout: raise them if a step may legitimately take that long)"
    )
    silent = [rank for rank, position in positions.items() if position is None]
    if silent:
        return f"{_Job.names[silent[0]]} has published no position; {gave_up}", silent[0]
    working = {rank: p for rank, p in positions.items() if p["waits_for"] is None}
    if not working:
        waits = "; ".join(f"{_Job.names[r]} waits for {p['waits_for']} in {_phrase(p)}" for r, p in positions.items())
        return f"the stages wait for each other: {waits}; {gave_up}", None
    rank, position = min(working.items(), key=lambda item: item[1]["since"])
    if position["unbounded"]:
        return None
    age = now - position["since"]
    return f"{_Job.names[rank]} has been in {_phrase(position)} for {age:.0f} s; {gave_up}", rank


def last_positions() -> str:
    """Where the other stages of this pipeline were last seen, e.g. after a transport error that no stage explained:
    ``"stage 1 was last seen in the forward of micro-batch 2 at step 4, 0 s before"``."""
    now, seen = time.time(), []
    if _Job.store is None:
        return "no position is known outside a run"
    try:
        for rank in _Job.names:
            position = _read(rank) if rank != _Job.rank else None
            if position is not None:
                seen.append(
                    f"{_Job.names[rank]} was last seen in {_phrase(position)}, {now - position['since']:.0f} s before"
                )
    except RuntimeError:
        return "the job's store cannot be reached (global rank 0's process has ended)"
    return "; ".join(seen) or "no other stage published its position"


def mark_stalled(rank: int) -> None:
    """Tell the heartbeat of global rank ``rank`` that it is the stage the watchdog named, so it ends at once."""
    if _Job.store is not None:
        _Job.store.compare_set(failure.key("stalled"), "", str(rank))


def _phrase(position: dict) -> str:
    return f"{describe(position['phase'], position['micro_batch'])} at {position['step']}"


def _read(rank: int) -> Optional[dict]:
    where = failure.key(f"where/{rank}")
    if not _Job.store.check([where]):
        return None
    return json.loads(_Job.store.get(where))


class _Heartbeat(threading.Thread):
    """Publishes the position while it changes; ends the process when the job failed and it did not follow."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        super().__init__(daemon=True, name="lightning-gpipe-heartbeat")
        self.store, self.rank = store, rank
        self.stopped = threading.Event()
        self.published = -1
        self.trouble_since: Optional[float] = None

    def run(self) -> None:
        while not self.stopped.wait(INTERVAL):
            try:
                self._publish()
                cause, named = failure.published_cause(), self._named()
            except RuntimeError:
                cause, named = "the job's store, in global rank 0's process, cannot be reached: rank 0 has ended", False
            if cause is not None:
                self._end_if_left_behind(cause, named)

    def _publish(self) -> None:
        if _Here.version == self.published:
            return
        self.published = _Here.version
        position = {
            "step": _Here.step,
            "phase": _Here.phase,
            "micro_batch": _Here.micro_batch,
            "since": _Here.since,
            "waits_for": _Here.waits_for,
            "unbounded": _Here.unbounded,
        }
        self.store.set(failure.key(f"where/{self.rank}"), json.dumps(position))

    def _named(self) -> bool:
        stalled = failure.key("stalled")
        return self.store.check([stalled]) and self.store.get(stalled).decode() == str(self.rank)

    def _end_if_left_behind(self, cause: str, named: bool) -> None:
        now = time.monotonic()
        if self.trouble_since is None and not cause.startswith(f"{failure.stage_name()} "):
            failure.say(f"stopping: {cause}")  # at once, in case this process is killed before it says more
        self.trouble_since = self.trouble_since if self.trouble_since is not None else now
        if named or now - self.trouble_since > GRACE:
            left = "" if named else f" {now - self.trouble_since:.0f} s after the job failed"
            failure.say(f"ending this process{left}: {cause}")
            os._exit(1)
