"""Random number streams of a stage: one the stages of a pipeline share, one of each stage's own.

The data path must give every stage of a pipeline the same batch: the first stage feeds its rows to the
backbone, the last one pairs the backbone's output with the batch's labels. Whatever draws random numbers on the
way (a shuffling sampler without a seed of its own, the base seed of a DataLoader's workers, random augmentation
or masking in the main process, the user's data preparation before the backbone call) must therefore draw the
same numbers on every stage. The model's own draws (dropout in one stage's layers, a sampling head on the last
stage) differ from stage to stage by nature, and must not shift the data path's.

So each process keeps two streams of the generators that code draws from implicitly (torch's CPU and CUDA
generators, NumPy's and Python's ``random``, as :func:`lightning.fabric.utilities.seed.seed_everything` seeds):

- the **shared stream** is the process's ordinary global state. At the start of a run every process takes global
  rank 0's (:meth:`StageRandomness.synchronized`), and from then on only code that runs alike on every stage
  draws from it: Lightning's loops, the data loaders, the user's hooks and the part of a step before the
  backbone call;
- the **stage stream**, seeded from the run's seed and the pipeline rank, is swapped in for what one stage runs
  alone: its partition's forwards, recomputes and backwards, and on the last stage the rest of the user's step
  after the backbone call (head, loss) (:meth:`StageRandomness.stage`). Under fill-drain, where only Lightning's
  own code runs between ``training_step`` and ``backward`` (no hook in between is overridden:
  :func:`~lightning_gpipe.lightning.step.quiet_until_backward`), the stage stream stays in from the backbone call
  to the end of the drain: one exchange of the generators' states each way per step instead of two (most of an
  exchange's host time is NumPy's ``get_state``/``set_state``).

A pipeline of one stage keeps a single stream, so it draws exactly as one device does. With several stages,
dropout masks are independent between stages and reproducible for a given seed and number of stages, but not
equal to a single device's (one device draws every layer's masks from one stream, in layer order). The replicas
of one stage (data parallelism) share their seeds, as DDP's ranks do with ``seed_everything``.
"""

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from lightning_gpipe.lightning._lightning import collect_rng_states, set_rng_states


class StageRandomness:
    """The shared and the stage random stream of one stage process (see the module docstring).

    Args:
        states: the generator states the stage stream starts from (see :func:`stage_states`); ``None`` keeps one
            stream (a pipeline of one stage).
    """

    def __init__(self, states: dict[str, Any] | None = None) -> None:
        self._idle = states  # the stream not in use: the stage stream outside :meth:`stage`, the shared one inside
        self._depth = 0

    @classmethod
    def synchronized(
        cls, stage_index: int, num_stages: int, broadcast: Callable[[Any], Any] = lambda obj: obj
    ) -> "StageRandomness":
        """Give this process global rank 0's random state and seed its stage stream (a collective call).

        Args:
            stage_index: pipeline rank of this process.
            num_stages: K, the stages of the pipeline; with one stage the streams are one.
            broadcast: sends a picklable object from global rank 0 to every process and returns it (a collective
                call); the identity for a single process.
        """
        seed, states = broadcast((_run_seed(), collect_rng_states()))
        set_rng_states(states)
        return cls(stage_states(seed, stage_index) if num_stages > 1 else None)

    @contextmanager
    def stage(self) -> Iterator[None]:
        """Draw from this stage's own stream inside the block; the shared stream goes on where it was after it.

        Re-entrant: a nested block stays on the stage stream. When the block raises, its exception propagates even
        if putting the shared stream back fails too (e.g. an out-of-memory error left no room to copy the generator
        states): the failure board must name the step's error, and a failed step ends the run.
        """
        self._swap_in()
        try:
            yield
        except BaseException:
            with suppress(Exception):
                self._swap_out()
            raise
        self._swap_out()

    def _swap_in(self) -> None:
        self._depth += 1
        if self._depth == 1 and self._idle is not None:
            self._idle = _exchange(self._idle)

    def _swap_out(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._idle is not None:
            self._idle = _exchange(self._idle)


def stage_states(seed: int, stage_index: int) -> dict[str, Any]:
    """The generator states of the stage stream of pipeline rank ``stage_index`` in a run seeded with ``seed``,
    made without changing the current ones."""
    current = collect_rng_states()
    derived = int.from_bytes(hashlib.blake2b(f"{seed}/stage/{stage_index}".encode(), digest_size=8).digest(), "big")
    _seed_every_generator(derived)
    states = collect_rng_states()
    set_rng_states(current)
    return states


@contextmanager
def fixed_seed(seed: int = 0) -> Iterator[None]:
    """Draw from torch's, NumPy's and Python's generators seeded from ``seed`` inside the block, the same on every
    process; the states they had are put back after it, so the run draws as if the block had not run."""
    current = collect_rng_states()
    _seed_every_generator(seed)
    try:
        yield
    finally:
        set_rng_states(current)


def _seed_every_generator(seed: int) -> None:
    torch.manual_seed(seed >> 1)  # also seeds every CUDA device
    with suppress(ImportError):
        import numpy

        numpy.random.seed(seed % 2**32)
    import random

    random.seed(seed)


def _exchange(states: dict[str, Any]) -> dict[str, Any]:
    """Install ``states`` and return the ones they replace."""
    current = collect_rng_states()
    set_rng_states(states)
    return current


def _run_seed() -> int:
    """The run's seed: ``seed_everything``'s when it was called, else the seed torch's generator started from."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else torch.initial_seed()
