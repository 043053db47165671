"""Where each stage is, for the others to read, and the stall watchdog that names a stage that stopped progressing.

Each stage process keeps its :class:`Position`: the step, the phase (the forward of micro-batch 3, the user's
``training_step`` after the backbone call, writing a checkpoint...), the action of the stage's plan it executes
(:class:`lightning_gpipe.engine.pipeline.Runtime`: "action 5 of 24"), since when, and the stage it waits for, if it
waits. Setting it costs a few attribute writes; a heartbeat thread of the :class:`Watchdog` publishes it to the job's
c10d store once a second when it changed (:meth:`Watchdog.start`), so a stage stuck in user code is still described
by its last position.

A stage that has waited for another longer than the stall limit (:mod:`lightning_gpipe.faults.waiting` checks)
asks :meth:`Watchdog.diagnose` who stopped: the stage that is not waiting and has been in its position longest,
and publishes that as the job's failure (:mod:`lightning_gpipe.faults.failure`). Phases that may legitimately
last long (writing a checkpoint, profiling the backbone) are marked :meth:`Position.unbounded` and are not stalls.

The heartbeat thread also ends its process when the job failed elsewhere and this process did not follow
within :data:`GRACE` seconds (it is stuck outside the package's waits, e.g. in user code), or at once when
it is the stage the watchdog named, so that no process is left behind.

Both are instance state of one run (:class:`lightning_gpipe.faults.job.Job` creates them); the module keeps no state.

**The launcher watch.** Lightning's launchers start the stage processes from the user's main process: the
subprocess-script launcher runs the script again once per further stage (the main process is global rank 0), the
spawn launcher starts every stage (the main process waits for them). Until the job's store exists, the processes
cannot tell each other anything: one that waits for the store of a main process that has ended, or talks to another
program listening on ``MASTER_PORT``, waits for the process group's ``timeout`` (30 minutes by default). So the
launching process marks itself in the environment that the processes it starts inherit (:func:`mark_launcher`), and
each of them watches it during a run (:func:`watch_launcher`, the strategy's state): once the launcher has ended, it
publishes that as the job's failure if the job's store exists (under the spawn launcher the store outlives the main
process, and every stage then stops naming the cause) and ends within :data:`GRACE` seconds unless it ended by
itself; before the job's store exists, at once. A launching process whose run fails before the job's store exists
ends the processes it started itself (:meth:`lightning_gpipe.lightning.mesh.MeshStrategy.setup_environment`).
"""

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any, NoReturn, cast

import torch.distributed as dist

from lightning_gpipe.faults.failure import FailureBoard, say

INTERVAL = 1.0
"""Seconds between two publications of a stage's position (and two looks at the failure board)."""

GRACE = 10.0
"""Seconds a process may take to fail by itself once the job has failed elsewhere, before its heartbeat ends it (or
once its launcher has ended, before the launcher watch does)."""

LAUNCHER = "LIGHTNING_GPIPE_LAUNCHER"
"""The environment variable holding the process id of the process that launched this one (see the module
docstring)."""

_NOTHING = nullcontext()
"""The block :meth:`Position.span` returns."""

_KINDS = {
    "forward": "the forward of micro-batch {}",
    "recompute": "the recompute of micro-batch {}",
    "backward": "the backward of micro-batch {}",
    "weight": "the weight gradient of micro-batch {}",
    "send": "sending micro-batch {}",
    "recv": "receiving the gradients of micro-batch {}",
    "loss": "the loss of micro-batch {}",
    "expect": "posting the receive of the gradients of micro-batch {}",
}

_WHOLE_STEP = {
    "send": "waiting for its sends to complete",
    "flush": "waiting for its sends to complete",
    "relay": "sharing the last stage's logged values",
    "loss": "the loss of the whole mini-batch",
}


class Position:
    """This process's position (set by the main thread, read by the heartbeat thread of a :class:`Watchdog`).

    Attributes:
        step: the step, e.g. ``"step 17"`` (``"setup"`` before the first).
        phase: what the stage does: a span's kind (``"forward"``) or a phrase (``"writing a checkpoint"``).
        micro_batch: the micro-batch of ``phase``, or ``None``.
        action: the action of the stage's plan being executed, as ``(number, of, kind, micro_batch, model_chunk)``
            (``number`` 1-based, ``of`` the plan's length, ``model_chunk`` the model chunk), or ``None`` outside the
            runtime's plan.
        since: when the position last changed (``time.time()``).
        waits_for: whom the stage waits for (``"stage 0"``), or ``None``.
        unbounded: whether ``phase`` may last long without counting as a stall.
        version: counts the changes (the heartbeat publishes a position when it changed).
    """

    def __init__(self) -> None:
        self.step, self.phase = "setup", "setup"
        self.micro_batch: int | None = None
        self.action: tuple[int, int, str, int | None, int] | None = None
        self.since = time.time()
        self.waits_for: str | None = None
        self.unbounded = False
        self.version = 0

    def move(self, phase: str, micro_batch: int | None = None, unbounded: bool = False) -> None:
        """Record that this stage is now in ``phase`` (of ``micro_batch``), not waiting."""
        self.phase, self.micro_batch, self.unbounded, self.waits_for = phase, micro_batch, unbounded, None
        self.since = time.time()
        self.version += 1

    def span(
        self, kind: str, micro_batch: int | None = None, memory_of: tuple | None = None, model_chunk: int = 0
    ) -> AbstractContextManager[None]:
        """:meth:`move` to ``kind`` of ``micro_batch``; returns a block that does nothing. A stage's span recorder
        (:class:`lightning_gpipe.engine.events.TrackingRecorder`) is this while it records nothing; ``memory_of``
        and ``model_chunk`` are its arguments, unused here."""
        self.move(kind, micro_batch)
        return _NOTHING

    def begin_step(self, step: str) -> None:
        """Record that this stage starts ``step`` (e.g. ``"step 17"``)."""
        self.step = step

    def at(self, phase: str) -> None:
        """Record that this stage is now in ``phase`` (a phrase: ``"`training_step` after the backbone call"``)."""
        self.move(phase)

    def act(self, number: int, of: int, kind: str, micro_batch: int | None, model_chunk: int = 0) -> None:
        """Record that this stage executes action ``number`` (1-based) of its plan of ``of`` actions, ``kind`` of
        ``micro_batch`` on model chunk ``model_chunk`` (see :class:`lightning_gpipe.engine.actions.Action`); the phase
        becomes
        that action's until a span inside it moves on."""
        self.action = (number, of, kind, micro_batch, model_chunk)
        self.move(kind, micro_batch)

    def leave_plan(self) -> None:
        """Record that this stage no longer executes an action of its plan."""
        self.action = None
        self.version += 1

    @contextmanager
    def unbounded_phase(self, phase: str) -> Iterator[None]:
        """Mark ``phase`` (e.g. ``"writing a checkpoint"``) as one that may last long: stages waiting meanwhile do
        not count it as a stall."""
        self.move(phase, unbounded=True)
        try:
            yield
        finally:
            self.move(f"the end of {phase}")

    @contextmanager
    def waiting(self, peer: str) -> Iterator[None]:
        """Record that this stage waits for ``peer`` (``"stage 0"``, ``"every stage"``) inside the block."""
        self.waits_for, self.since = peer, time.time()
        self.version += 1
        try:
            yield
        finally:
            self.waits_for, self.since = None, time.time()
            self.version += 1

    def record(self) -> dict[str, Any]:
        """The position as published to the store (JSON-serialisable)."""
        return {
            "step": self.step,
            "phase": self.phase,
            "micro_batch": self.micro_batch,
            "since": self.since,
            "waits_for": self.waits_for,
            "unbounded": self.unbounded,
            "action": None if self.action is None else dict(zip(_ACTION, self.action)),
        }


def describe(phase: str, micro_batch: int | None) -> str:
    """The phrase of a position: ``describe("forward", 3)`` is ``"the forward of micro-batch 3"``."""
    if phase in _KINDS and micro_batch is not None:
        return _KINDS[phase].format(micro_batch)
    if phase in _WHOLE_STEP:
        return _WHOLE_STEP[phase]
    return phase if micro_batch is None else f"{phase} of micro-batch {micro_batch}"


_ACTION = ("number", "of", "kind", "micro_batch", "model_chunk")
"""The fields of :attr:`Position.action`, as published."""


def phrase(position: dict[str, Any]) -> str:
    """Where a published position (:meth:`Position.record`) is, for messages: ``"the forward of micro-batch 3 at
    step 17"``, or inside the runtime's plan ``"action 5 of 24 of its plan, the forward of micro-batch 3, at step
    17"`` (the phase follows in parentheses when it is not the action's own: ``"action 7 of 24 of its plan, the
    backward of micro-batch 2 (receiving the gradients of micro-batch 2), at step 17"``; with virtual stages the
    model chunk follows the action: ``"the forward of micro-batch 3 on model chunk 1"``)."""
    where = describe(position["phase"], position["micro_batch"])
    action = position.get("action")
    if action is None:
        return f"{where} at {position['step']}"
    planned = describe(action["kind"], action["micro_batch"])
    inside = "" if planned == where else f" ({where})"
    model_chunk = f" on model chunk {action['model_chunk']}" if action.get("model_chunk") else ""
    number = f"action {action['number']} of {action['of']} of its plan"
    return f"{number}, {planned}{model_chunk}{inside}, at {position['step']}"


class Watchdog:
    """This process's stall watchdog for one run: publishes its :class:`Position` and reads the other stages'.

    Args:
        board: this run's failure board (positions live next to the failure cause).
        position: this process's position.
        rank: this process's global rank.
        names: global rank -> name of every process of this pipeline (this one included); only this process's
            by default.
        limit: seconds a stage may wait for another before the wait counts as a stall (no limit by default).
        limit_note: where ``limit`` comes from and how to raise it, in the caller's terms, for the stall's message
            (none by default).
    """

    def __init__(
        self,
        board: FailureBoard,
        position: Position,
        rank: int = 0,
        names: dict[int, str] | None = None,
        limit: float = float("inf"),
        limit_note: str = "",
    ) -> None:
        self.board, self.position, self.rank = board, position, rank
        self.names = dict(names) if names is not None else {rank: board.name}
        self.limit, self.limit_note = limit, limit_note
        self._heartbeat: _Heartbeat | None = None

    def start(self) -> None:
        """Publish the position from a heartbeat thread, until :meth:`stop` (does nothing without a store, or when
        the thread runs already)."""
        if self._heartbeat is None and self.board.store is not None:
            self._heartbeat = _Heartbeat(self)
            self._heartbeat.start()

    def stop(self) -> None:
        """Stop the heartbeat thread (at the end of a run); the stall limit is then infinite."""
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stopped.set()
            heartbeat.join(timeout=5 * INTERVAL)
        self.limit = float("inf")

    def name_of(self, rank: int | None) -> str:
        """The name of global rank ``rank`` in messages (``"stage 0"``); ``None`` stands for both neighbours."""
        if rank is None:
            return "its neighbours"
        return self.names.get(rank, f"rank {rank}")

    def diagnose(self, peer: str, waited: float) -> tuple[str, int | None] | None:
        """Name the stage that stopped progressing, for a stage that has waited ``waited`` s for ``peer``.

        Reads every stage's published position: the stage that is not waiting and has been in its position
        longest stopped progressing; if every stage waits, they wait for each other.

        Returns:
            ``(message, rank of that stage)`` (rank ``None`` when the stages wait for each other), or ``None``
            while that stage is in an unbounded phase (a long wait is then no stall).

        Raises:
            RuntimeError: if the store cannot be reached (global rank 0's process is gone).
        """
        names = self.names
        now, me = time.time(), names.get(self.rank, self.board.name)
        positions = {rank: self._read(rank) for rank in names if rank != self.rank}
        note = f", {self.limit_note}" if self.limit_note else ""
        gave_up = f"{me} gave up after waiting {waited:.0f} s for {peer} (stall limit {self.limit:.0f} s{note})"
        silent = [rank for rank, position in positions.items() if position is None]
        if silent:
            return f"{names[silent[0]]} has published no position; {gave_up}", silent[0]
        published = cast("dict[int, dict[str, Any]]", positions)  # none silent
        working = {rank: p for rank, p in published.items() if p["waits_for"] is None}
        if not working:
            waits = "; ".join(f"{names[r]} waits for {p['waits_for']} in {phrase(p)}" for r, p in published.items())
            return f"the stages wait for each other: {waits}; {gave_up}", None
        rank, position = min(working.items(), key=lambda item: item[1]["since"])
        if position["unbounded"]:
            return None
        age = now - position["since"]
        return f"{names[rank]} has been in {phrase(position)} for {age:.0f} s; {gave_up}", rank

    def last_positions(self) -> str:
        """Where the other stages of this pipeline were last seen, e.g. after a transport error that no stage
        explained: ``"stage 1 was last seen in the forward of micro-batch 2 at step 4, 0 s before"``."""
        now, seen = time.time(), []
        if self.board.store is None:
            return "no position is known outside a run"
        try:
            for rank in self.names:
                position = self._read(rank) if rank != self.rank else None
                if position is not None:
                    age = now - position["since"]
                    seen.append(f"{self.names[rank]} was last seen in {phrase(position)}, {age:.0f} s before")
        except RuntimeError:
            return self.board.store_lost()
        return "; ".join(seen) or "no other stage published its position"

    def mark_stalled(self, rank: int) -> None:
        """Tell the heartbeat of global rank ``rank`` that it is the stage the watchdog named, so it ends at once."""
        if self.board.store is not None:
            self.board.store.compare_set(self.board.key("stalled"), "", str(rank))

    def _read(self, rank: int) -> dict[str, Any] | None:
        where, store = self.board.key(f"where/{rank}"), self.board.store
        assert store is not None  # read during a run, which has a store
        if not store.check([where]):
            return None
        return json.loads(store.get(where))


class _Heartbeat(threading.Thread):
    """Publishes the position while it changes; ends the process when the job failed and it did not follow."""

    def __init__(self, watchdog: Watchdog) -> None:
        super().__init__(daemon=True, name="lightning-gpipe-heartbeat")
        self.board, self.position, self.rank = watchdog.board, watchdog.position, watchdog.rank
        self.store = cast(dist.Store, watchdog.board.store)  # started only with a store (Watchdog.start)
        self.stopped = threading.Event()
        self.published = -1
        self.trouble_since: float | None = None

    def run(self) -> None:
        while not self.stopped.wait(INTERVAL):
            try:
                self._publish()
                cause, named = self.board.published_cause(), self._named()
            except RuntimeError:
                cause, named = self.board.store_lost(), False
            if cause is not None:
                self._end_if_left_behind(cause, named)

    def _publish(self) -> None:
        position = self.position
        if position.version == self.published:
            return
        self.published = position.version
        self.store.set(self.board.key(f"where/{self.rank}"), json.dumps(position.record()))

    def _named(self) -> bool:
        stalled = self.board.key("stalled")
        return self.store.check([stalled]) and self.store.get(stalled).decode() == str(self.rank)

    def _end_if_left_behind(self, cause: str, named: bool) -> None:
        now = time.monotonic()
        if self.trouble_since is None and not cause.startswith(f"{self.board.name} "):
            self.board.say(f"stopping: {cause}")  # at once, in case this process is killed before it says more
        self.trouble_since = self.trouble_since if self.trouble_since is not None else now
        if named or now - self.trouble_since > GRACE:
            left = "" if named else f" {now - self.trouble_since:.0f} s after the job failed"
            self.board.say(f"ending this process{left}: {cause}")
            end_process()


def end_process() -> NoReturn:
    """End this process at once with exit code 1 (``os._exit``: its threads may be stuck where no exception reaches),
    and first its child processes (``SIGKILL``): a data loader's worker ends by itself once it sees its parent gone,
    but one stuck before its loop (a fork that hung in a library's at-fork handler) would outlive the stage, holding
    the job's output pipes open, so that whatever reads them never ends."""
    for child in _children(os.getpid()):
        with suppress(OSError):  # it has ended meanwhile
            os.kill(child, signal.SIGKILL)
    os._exit(1)


def _children(pid: int) -> list[int]:
    """The ids of process ``pid``'s child processes, from ``/proc`` (none where there is no ``/proc``)."""
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    return [entry for entry in entries if (fields := _stat(entry)) is not None and fields[1] == str(pid)]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the process's name (its state, then its parent's id, ...); ``None``
    where there is no such file (the process has ended, or no ``/proc``: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ the launcher watch


def mark_launcher() -> None:
    """Mark this process as the launcher of the processes it starts from now on (they inherit the mark)."""
    os.environ[LAUNCHER] = str(os.getpid())


class LauncherWatch(threading.Thread):
    """Ends this process when the process that launched it has ended (see the module docstring).

    Args:
        launcher: the launcher's process id (this process's parent).
        name: how messages name this process (``"stage 1"``).
        board: gives the failure board of the strategy's current run (one without a store until the job's store
            exists, and after the run).
    """

    def __init__(self, launcher: int, name: str, board: Callable[[], FailureBoard]) -> None:
        super().__init__(daemon=True, name="lightning-gpipe-launcher-watch")
        self.launcher, self.name, self.board = launcher, name, board
        self.stopped = threading.Event()

    def run(self) -> None:
        """Look once a second whether the launcher has ended, until :meth:`stop`."""
        while os.getppid() == self.launcher:  # a process whose parent ends gets another parent
            if self.stopped.wait(INTERVAL):
                return
        self._end()

    def stop(self) -> None:
        """Stop watching (at the end of the run: the launcher may then end before this process)."""
        self.stopped.set()

    def _end(self) -> None:
        cause = f"the process that launched this one (pid {self.launcher}) has ended"
        board = self.board()
        if board.store is not None:
            board.publish(cause)  # where the store outlives the launcher (spawn), every stage stops naming it
            if self.stopped.wait(GRACE):  # the run ended by itself meanwhile (its transfers failed, naming it)
                return
        elif self.stopped.is_set():  # the run ended (it stops the watch before it closes its job)
            return
        say(self.name, f"ending this process: {cause}")
        end_process()


def watch_launcher(name: str, board: Callable[[], FailureBoard]) -> LauncherWatch | None:
    """Start watching the process that launched this one (see :class:`LauncherWatch`); ``None`` for a process that
    no launcher of the package started (the main process, a process of torchrun or SLURM) or that is not its child.
    """
    value = os.environ.get(LAUNCHER)
    if value is None or int(value) == os.getpid():
        return None
    launcher = int(value)
    if os.getppid() != launcher and not _ended(launcher):
        return None  # not its child (a process of torchrun started from it, say): its own launcher ends it
    watch = LauncherWatch(launcher, name, board)
    watch.start()
    return watch


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: it is gone, or a zombie that its parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    fields = _stat(pid)
    return fields is not None and fields[0] == "Z"  # without /proc (not Linux): it exists
