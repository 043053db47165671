"""What the planner's cost model rests on: per-layer costs at any micro-batch size, and the machine's constants.

Layers are profiled at two micro-batch sizes (:class:`ProfiledCosts`): time per layer is modelled as affine in the
rows of a micro-batch, ``a + b * rows`` through the two measurements, extrapolated beyond them (so a small
micro-batch keeps the fixed cost of launching its operators, which is why smaller micro-batches are slower per
row), the transient bytes likewise (a transient may hold the weights' gradients, whatever the rows), and the
activation and output bytes as proportional to the rows. What runs after the backbone on the last stage (the rest of
the user's step: head and loss) is measured apart, in bytes, at every row count a plan runs it on (:class:`HeadCost`).
:class:`CostModel` holds what profiling one layer cannot see: the transfers between stages, the engine's cost per
micro-batch and per step, the optimizer step, the data-parallel all-reduce, the copies of activation offload between
the device and host memory, and the optimizer state's size (:func:`optimizer_state_factor`).
Its defaults were measured on a 2-core CPU machine (docs/planning.md, "Calibrating"); give your own for another machine.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_gpipe.planning.balance.costs import LayerCost


@dataclass(frozen=True)
class CostModel:
    """The constants of the planner's time and memory model (see docs/planning.md, "Calibrating").

    Args:
        transfer_latency: seconds per point-to-point message between stages (default 1 ms: gloo on one host).
        transfer_bandwidth: bytes per second of those messages (default 1 GB/s).
        micro_batch_overhead: seconds the engine adds on a stage per micro-batch (spans, sends, receives, records;
            default 2 ms).
        step_overhead: seconds Lightning's loop and the package's agreement add per step (default 20 ms).
        optimizer_bandwidth: bytes per second the optimizer step streams (parameters, gradients and state once
            each; default 2 GB/s).
        all_reduce_bandwidth: bytes per second of the data-parallel gradient all-reduce (default 0.5 GB/s).
        memory_margin: share of the memory limit kept free for what the model does not count (allocator slack,
            the user's head and loss); default 0.05.
        compute_scale: profiled layer times are multiplied by this: how much faster or slower a layer runs in the
            pipeline than profiled alone (the stages run at once and may slow each other: on a CPU they share memory
            bandwidth and caches, see ``benchmarks/hardware.py``); default 0.96.
        copy_bandwidth: bytes per second of a stage's own time that the activations and gradients it sends and
            receives cost it, on top of ``transfer_latency`` and ``transfer_bandwidth`` (which only delay the
            receiver): on a CPU, gloo's copies through the host's network stack run on the cores that compute (and
            the stage allocates every buffer it receives into). This is what makes interleaving (``virtual_stages``,
            v times the transfers) slower here; on GPUs, which copy by DMA, set ``math.inf``. Default 1.2 GB/s.
        host_bandwidth: bytes per second of a copy between a CUDA device and pinned host memory, each way: what
            activation offload (``offload="activations"``) costs where the schedule cannot hide it. Default 12 GB/s
            (PCIe 3.0 x16 measures 11-13 GB/s pinned; PCIe 4.0 about 25, 5.0 about 50); measure yours with
            :func:`~lightning_gpipe.planning.profiling.measure_host_bandwidth`. Not used on a CPU, where offload moves
            nothing.

    The defaults of ``micro_batch_overhead``, ``step_overhead``, ``compute_scale`` and ``copy_bandwidth`` were fitted
    together on the project's 2-core CPU machine, to 29 measured runs of the benchmark MLP and AmoebaNet-D
    (docs/planning.md, "Calibrating" and "A user's allocator").
    """

    transfer_latency: float = 1e-3
    transfer_bandwidth: float = 1e9
    micro_batch_overhead: float = 2e-3
    step_overhead: float = 2e-2
    optimizer_bandwidth: float = 2e9
    all_reduce_bandwidth: float = 5e8
    memory_margin: float = 0.05
    compute_scale: float = 0.96
    copy_bandwidth: float = 1.2e9
    host_bandwidth: float = 12e9

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` between neighbouring stages."""
        return self.transfer_latency + nbytes / self.transfer_bandwidth

    def copy_time(self, nbytes: float) -> float:
        """Seconds of a stage's own time to send or receive ``nbytes`` (see ``copy_bandwidth``)."""
        return nbytes / self.copy_bandwidth

    def host_copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between the device and pinned host memory, one way (see ``host_bandwidth``)."""
        return nbytes / self.host_bandwidth

    def optimizer_time(self, parameter_bytes: float, state_factor: float) -> float:
        """Seconds of one optimizer step over ``parameter_bytes`` with ``state_factor`` state tensors per parameter."""
        return (2 + state_factor) * parameter_bytes / self.optimizer_bandwidth

    def all_reduce_time(self, parameter_bytes: float, replicas: int) -> float:
        """Seconds of a ring all-reduce of ``parameter_bytes`` of gradients over ``replicas`` (0 for one)."""
        return 2 * (replicas - 1) / replicas * parameter_bytes / self.all_reduce_bandwidth


def optimizer_state_factor(optimizer: str | Any) -> int:
    """How many tensors of a parameter's size the optimizer keeps per parameter.

    Args:
        optimizer: a name (``"sgd"``: 0, ``"momentum"``: 1, ``"adam"``/``"adamw"``: 2, ``"amsgrad"``: 3) or a
            ``torch.optim.Optimizer``: SGD 0 (1 with momentum), Adam/AdamW 2 (3 with ``amsgrad``), Adagrad 1,
            RMSprop 1 (+1 with momentum, +1 centered), Adadelta 2, any other 2.

    Raises:
        ValueError: for an unknown name.
    """
    names = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "amsgrad": 3}
    if isinstance(optimizer, str):
        if optimizer.lower() not in names:
            raise ValueError(f"Unknown optimizer {optimizer!r}; give one of {', '.join(names)} or a torch optimizer.")
        return names[optimizer.lower()]
    kind, defaults = type(optimizer).__name__, getattr(optimizer, "defaults", {})
    if kind == "SGD":
        return int(bool(defaults.get("momentum", 0)))
    if kind in ("Adam", "AdamW"):
        return 2 + bool(defaults.get("amsgrad", False))
    if kind == "RMSprop":
        return 1 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered", False))
    return 1 if kind == "Adagrad" else 2


@dataclass(frozen=True)
class HeadCost:
    """What runs after the backbone on the last stage (the rest of the user's step: head, loss) and the loss's
    backward, measured at several row counts: the rows of one call of the step (the whole mini-batch under fill-drain,
    one micro-batch's under a schedule that runs the step per micro-batch).

    Args:
        rows: the rows of each measured call, ascending.
        peak_bytes: for each, the bytes of the tensors the call makes, at their peak over the step and the loss's
            backward, less the gradients of the backbone's output and of the head's parameters (counted with the
            last stage's buffers and gradients): the logits' softmax, the loss's graph, their gradients.
        parameter_bytes: the parameters and buffers of the modules outside the backbone (they live on the last stage).

    Raises:
        ValueError: for no measurement, or rows and bytes of different lengths.
    """

    rows: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    parameter_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.peak_bytes):
            raise ValueError(f"HeadCost needs one peak per measured row count, got {self.rows} and {self.peak_bytes}.")

    def at(self, rows: int) -> int:
        """The peak bytes of a call on ``rows`` rows: the measurement at those rows; between two, the straight line
        through them; beyond them, the nearest scaled by the rows."""
        pairs = sorted(zip(self.rows, self.peak_bytes))
        below = [pair for pair in pairs if pair[0] <= rows]
        above = [pair for pair in pairs if pair[0] >= rows]
        if below and above:
            (r0, b0), (r1, b1) = below[-1], above[0]
            return b0 if r0 == r1 else round(b0 + (b1 - b0) * (rows - r0) / (r1 - r0))
        near_rows, near_bytes = below[-1] if below else above[0]
        return round(near_bytes * rows / near_rows)


@dataclass(frozen=True)
class ProfiledCosts:
    """Per-layer costs measured at two micro-batch sizes, and the backbone input's size.

    Args:
        rows: the rows of the two profiled micro-batches, ``(large, small)``; may be equal.
        large: one :class:`~lightning_gpipe.planning.balance.LayerCost` per layer at ``rows[0]``.
        small: the same at ``rows[1]``.
        batch_rows: N, the rows of one mini-batch of the backbone input (per replica).
        input_bytes: bytes of the whole mini-batch's backbone input.
        head: what runs after the backbone on the last stage (:class:`HeadCost`); ``None`` (default) when it was not
            measured (the backbone's sample came from ``example_input_array``, with no training step to run).

    Raises:
        ValueError: if the two lists differ in length or a size is below 1.
    """

    rows: tuple[int, int]
    large: Sequence[LayerCost]
    small: Sequence[LayerCost]
    batch_rows: int
    input_bytes: int
    head: HeadCost | None = None

    def __post_init__(self) -> None:
        if len(self.large) != len(self.small) or min(*self.rows, self.batch_rows) < 1:
            raise ValueError(
                f"ProfiledCosts needs as many costs at both sizes ({len(self.large)} and {len(self.small)}) and"
                f" positive sizes (rows={self.rows}, batch_rows={self.batch_rows})."
            )

    def at(self, rows: int) -> list[LayerCost]:
        """Each layer's cost for a micro-batch of ``rows`` rows (see the module docstring)."""
        return [_interpolate(big, small, *self.rows, rows) for big, small in zip(self.large, self.small)]

    def for_micro_batches(self, micro_batches: int) -> list[LayerCost]:
        """Each layer's cost for the first (largest) of ``micro_batches`` micro-batches of the mini-batch (row counts as
        ``torch.tensor_split`` gives them)."""
        return self.at(math.ceil(self.batch_rows / min(micro_batches, self.batch_rows)))


def _interpolate(big: LayerCost, small: LayerCost, big_rows: int, small_rows: int, rows: int) -> LayerCost:
    """``big`` and ``small`` (measured at ``big_rows`` and ``small_rows``) at ``rows``: times and transient bytes
    affine (a transient may hold tensors of the parameters' size, the weights' gradients, whatever the rows), the
    other bytes scaled from ``big``; neither part of an affine cost is negative (else, from noise, it is ``big``'s
    scaled by the rows)."""

    def affine(t_big: float, t_small: float) -> float:
        slope = (t_big - t_small) / (big_rows - small_rows) if big_rows != small_rows else -1.0
        fixed = t_big - slope * big_rows
        return t_big * rows / big_rows if fixed < 0 or slope < 0 else fixed + slope * rows

    scale = rows / big_rows
    return replace(
        big,
        forward=affine(big.forward, small.forward),
        backward=affine(big.backward, small.backward),
        input_grad=affine(big.input_grad, small.input_grad),
        weight_grad=affine(big.weight_grad, small.weight_grad),
        activation_bytes=round(big.activation_bytes * scale),
        output_bytes=round(big.output_bytes * scale),
        input_saved_bytes=round(big.input_saved_bytes * scale),
        output_saved_bytes=round(big.output_saved_bytes * scale),
        transient_bytes=round(affine(big.transient_bytes, small.transient_bytes)),
        kept_grad_bytes=round(big.kept_grad_bytes * scale),
    )
