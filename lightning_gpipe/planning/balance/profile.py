"""Measuring what each backbone layer costs on one sample micro-batch, one layer at a time.

PipeDream (Narayanan et al. 2019, section 3.1) partitions from a profile of each layer's
compute time, activation and parameter sizes; torchgpipe's ``balance`` module profiles
time and CUDA memory layer by layer. Here each layer is copied onto the device on its own
(so the whole model never has to fit one device), run forward and backward on the
previous layer's output, and dropped again. Activation memory is counted exactly from
what autograd saves, so it works on every device, the CPU included. A skip tensor a layer stashes
(:mod:`lightning_gpipe.engine.skip`) counts as one of its outputs, and is handed to the later layer that pops it.
"""

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.engine import (
    Partition,
    PeakBytes,
    SavedBytes,
    SkipTracker,
    Value,
    backward_input,
    leaves,
    materialize,
    tensors,
    tracking,
)
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.repeats import Repeats


def profile_layers(
    layers: nn.Sequential,
    sample: Value,
    device: torch.device | str = "cpu",
    repeats: int | Repeats = Repeats(),
    warmup: int = 2,
    split: bool = False,
) -> list[LayerCost]:
    """Measure the cost of each layer of ``layers`` for the micro-batch ``sample``.

    Each layer is copied onto ``device`` (materialised with :func:`~lightning_gpipe.engine.partition.materialize`
    if it is on the meta device), put in training mode, run ``warmup`` times untimed, then timed until ``repeats``
    has enough runs (:class:`~lightning_gpipe.planning.balance.repeats.Repeats`: until their spread settles, within a
    cap): forward, then backward with a gradient of ones on its outputs that require grad. Times are the medians. Run
    inside an autocast region (a precision plugin's step context), the layer runs in its precision; where that region
    caches the casts of the weights (as a pipeline step does, once per step for all its micro-batches), the timed runs
    reuse the cast the warm-up made, and the casts go with the copy (``torch.clear_autocast_cache``), never held for
    the whole backbone. The copy is dropped before the next layer, whose input is this layer's output
    (detached; it requires grad where the output did), so only one layer is ever on the device. A layer that
    modifies its input in place (``nn.ReLU(inplace=True)``) runs on copies of it, as a stage runs it
    (:meth:`~lightning_gpipe.engine.microbatch.Partition.run`, found by one forward without autograd first). The
    given layers, their gradients and the random number generators are left unchanged.

    Args:
        layers: the backbone; each layer takes and returns a Tensor or a tuple of Tensors.
        sample: the backbone input for one micro-batch (profile at the micro-batch size: small
            matrix products cost more per row). Non-tensor items of a tuple are passed unchanged.
        device: where to run the layers: ``"cpu"`` or a CUDA device. On the CPU times are the CPU time of
            the calling thread (which takes part in every parallel operator, so this is the wall time without
            the moments the OS gives the core to other processes: robust on a shared machine); on CUDA the
            wall time, after synchronising the device.
        repeats: when a layer has been timed enough: a :class:`~lightning_gpipe.planning.balance.repeats.Repeats`
            (default ``Repeats()``: 5 to 40 runs, until their interquartile range is within 5% of their median or
            they took 2 s), or a number of runs (>= 1). The medians are kept.
        warmup: untimed runs per layer before the timed ones (>= 0). One more forward and backward,
            untimed, counts the saved activations and the transient bytes.
        split: also time the backward split into B and W as the engine runs it
            (:func:`~lightning_gpipe.engine.weightgrad.backward_input`, then the deferred W, alone), in runs of their
            own, warmed up and repeated alike, after the whole backward's (default ``False``: not measured,
            ``input_grad`` and ``weight_grad`` are 0). A layer whose input has no gradient (the backbone's first, on
            data) has no B: its whole backward is W.

    Returns:
        One :class:`LayerCost` per layer, in order: ``forward`` and ``backward`` in seconds,
        ``activation_bytes`` (tensors autograd saves for the backward, excluding the layer's own
        parameters and buffers, each storage counted once), ``output_bytes``,
        ``parameter_bytes`` (parameters and buffers) and ``transient_bytes`` (the forward's or the
        backward's peak beyond what it keeps), all in bytes; with ``split``, ``input_grad`` and ``weight_grad`` in
        seconds and ``kept_grad_bytes`` (what B keeps for W) in bytes.

    Raises:
        ValueError: if ``repeats`` is a number below 1 or ``warmup`` below 0, or a meta-device layer cannot be
            initialised.
        TypeError: if a layer returns anything but a Tensor or a tuple of Tensors.

    Any error a layer's profile raises is raised again with the layer named first (of its type where that takes a
    message, else a RuntimeError): ``Profiling backbone layer 3 (Bottleneck) failed: RuntimeError: ...``.
    """
    return profile_with_output(layers, sample, device, repeats, warmup, split)[0]


def profile_with_output(
    layers: nn.Sequential,
    sample: Value,
    device: torch.device | str = "cpu",
    repeats: int | Repeats = Repeats(),
    warmup: int = 2,
    split: bool = False,
) -> tuple[list[LayerCost], Value]:
    """:func:`profile_layers`, and the last layer's output on the sample (on ``device``, cut from autograd): the
    backbone's output on one micro-batch, on which the planner measures what runs after the backbone.

    Raises:
        ValueError, TypeError: as :func:`profile_layers`.
    """
    if isinstance(repeats, int) and repeats < 1 or warmup < 0:
        raise ValueError(f"profile_layers needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}.")
    rule = Repeats.exactly(repeats) if isinstance(repeats, int) else repeats
    device = torch.device(device)
    value = leaves(sample, requires_grad=False, device=device)
    skips: dict = {}  # what the layers so far stashed, for later layers to pop
    costs = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for name, layer in children(layers).items():  # every position, a layer used at two (tied) included
            try:
                cost, value = _profile_copy(name, layer, value, skips, device, (rule, warmup, split))
            except Exception as error:
                raise _naming_layer(error, name, layer) from error
            costs.append(cost)
    return costs, value


def _naming_layer(error: Exception, name: str, layer: nn.Module) -> Exception:
    """``error`` with the layer it came from named first: of its type where that takes a message, else a
    RuntimeError."""
    message = f"Profiling backbone layer {name} ({type(layer).__name__}) failed: {type(error).__name__}: {error}"
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 - an exception type whose constructor takes other arguments
        return RuntimeError(message)


def _profile_copy(
    name: str, layer: nn.Module, value: Value, skips: dict, device: torch.device, options: tuple[Repeats, int, bool]
) -> tuple[LayerCost, Value]:
    """Profile a copy of ``layer`` on ``device`` (materialised there); its cost and its output as the next layer's
    input. ``skips`` gets what it stashed; ``options``: repeats, warmup and split, as :func:`profile_layers`'s. The
    casts of the copy's weights an enclosing autocast region cached go with it."""
    replica = copy.deepcopy(layer)
    materialize(replica, device)
    partition = Partition({name: replica.to(device).train()})
    with torch.no_grad(), tracking(SkipTracker(skips)):
        partition.run(value, kept=True)  # finds whether it modifies its input in place (on copies), so the runs
        # below copy its input where the engine will, and only there
    cost, output, stashed = _profile(partition, value, skips, device, *options)
    torch.clear_autocast_cache()
    skips.update({key: leaves(t, requires_grad=None, device=device) for key, t in stashed.items()})
    return cost, leaves(output, requires_grad=None, device=device)


def _profile(
    layer: Partition, value: Value, skips: dict, device: torch.device, repeats: Repeats, warmup: int, split: bool
) -> tuple:
    saved, output, stashed, transient = _counted_run(layer, value, skips)
    grads = [torch.ones_like(t) for t in _differentiable(output, stashed)]
    runs = _timed(repeats, warmup, lambda: _run(layer, value, skips, grads, device))
    halves = _timed(repeats, warmup, lambda: _split_run(layer, value, skips, grads, device)) if split else []
    cost = LayerCost(
        forward=statistics.median(forward for forward, _ in runs),
        backward=statistics.median(backward for _, backward in runs),
        activation_bytes=sum(saved.values()),
        output_bytes=sum(_nbytes(t) for t in tensors(output)),
        parameter_bytes=sum(_nbytes(t) for t in _state(layer)),
        input_saved_bytes=_shared(saved, value),
        output_saved_bytes=_shared(saved, output),
        transient_bytes=transient,
        input_grad=statistics.median(b for b, _, _ in halves) if halves else 0.0,
        weight_grad=statistics.median(w for _, w, _ in halves) if halves else 0.0,
        kept_grad_bytes=halves[0][2] if halves else 0,
    )
    return cost, output, stashed


def _timed(repeats: Repeats, warmup: int, run: Callable[[], tuple]) -> list[tuple]:
    """``run`` ``warmup`` times, then as often as ``repeats`` asks of its first two times' sum (a run's whole
    backward and forward, or its B and W); the timed runs' results."""
    for _ in range(warmup):
        run()
    return repeats.collect(run, lambda times: times[0] + times[1])


def _run(layer: Partition, value: Value, skips: dict, grads: list[Tensor], device: torch.device) -> tuple:
    """One timed forward and backward; returns (forward seconds, backward seconds)."""
    clock = _clock(device)
    start = clock()
    outputs = _forward(layer, value, skips)
    middle = clock()
    if grads:
        torch.autograd.backward(outputs, grads)
    end = clock()
    _clear_grads(value, skips)
    return middle - start, end - middle


def _split_run(layer: Partition, value: Value, skips: dict, grads: list[Tensor], device: torch.device) -> tuple:
    """One forward, then its backward timed in two halves as the engine splits it; returns (B seconds, W seconds,
    bytes B keeps for W). Without a differentiable input (or output) the whole backward is W."""
    clock = _clock(device)
    outputs = _forward(layer, value, skips)
    inputs = [t for t in _inputs(value, skips) if t.requires_grad]
    start, kept = clock(), 0
    if outputs and inputs:
        weight = backward_input(outputs, grads, inputs)
        middle, kept = clock(), weight.kept_bytes
        weight()
    else:
        middle = start
        if outputs:
            torch.autograd.backward(outputs, grads)
    end = clock()
    _clear_grads(value, skips)
    return middle - start, end - middle, kept


def _forward(layer: Partition, value: Value, skips: dict) -> list[Tensor]:
    """The layer's forward on ``value`` (popping from ``skips``); its outputs and stashed tensors that require
    grad."""
    with tracking(SkipTracker(skips)) as tracker:
        output = layer.run(value, kept=True)
    return _differentiable(output, tracker.stashed)


def _inputs(value: Value, skips: dict) -> list[Tensor]:
    """What a layer's run takes: the tensors of ``value`` and the skip tensors it may pop."""
    return [*tensors(value), *skips.values()]


def _clear_grads(value: Value, skips: dict) -> None:
    """Drop the gradients a backward left on the layer's inputs."""
    for t in _inputs(value, skips):
        t.grad = None


def _counted_run(layer: Partition, value: Value, skips: dict) -> tuple[dict[int, int], Value, dict, int]:
    """One untimed forward and backward, counted: the storages autograd saves in the forward (not the layer's own
    state; address -> bytes), the output, the skip tensors the layer stashed, and the transient bytes (see
    :class:`~lightning_gpipe.planning.balance.costs.LayerCost`) from
    :class:`~lightning_gpipe.engine.events.PeakBytes`."""
    with PeakBytes() as counted:
        with SavedBytes(exclude=_state(layer)) as saved, tracking(SkipTracker(skips)) as tracker:
            output = layer.run(value, kept=True)
        forward = counted.peak - counted.live
        outputs = _differentiable(output, tracker.stashed)
        grads = [torch.ones_like(t) for t in outputs]
        start = counted.restart()
        if outputs:
            torch.autograd.backward(outputs, grads)
        backward = counted.peak - max(start, counted.live)
        del grads
    for t in [*_inputs(value, skips), *_state(layer)]:
        t.grad = None
    return saved.storages, output, tracker.stashed, max(forward, backward)


def _shared(saved: dict[int, int], value: Value) -> int:
    """Bytes of the ``saved`` storages that hold ``value``'s tensors."""
    return sum(saved.get(address, 0) for address in {t.untyped_storage().data_ptr() for t in tensors(value)})


def _differentiable(value: Value, stashed: dict) -> list[Tensor]:
    return [t for t in [*tensors(value), *stashed.values()] if t.requires_grad]


def _state(layer: nn.Module) -> Iterator[Tensor]:
    return chain(layer.parameters(), layer.buffers())


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _clock(device: torch.device) -> Callable[[], float]:
    """Seconds: this thread's CPU time on the CPU, else wall time (after the queued work, on CUDA)."""
    if device.type == "cpu":
        return time.thread_time

    def wall() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return wall
