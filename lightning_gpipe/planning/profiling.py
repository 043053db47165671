"""The planner's measurements: a backbone's layers at two micro-batch sizes, what runs after the backbone at every
size a plan runs it on, and a module's optimizer state."""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine import PeakBytes, Value, batch_size, leaves, scatter, tensors
from lightning_gpipe.planning.balance.profile import profile_with_output
from lightning_gpipe.planning.costs import HeadCost, ProfiledCosts, optimizer_state_factor
from lightning_gpipe.planning.search import MAX_MICRO_BATCHES, micro_batch_counts

PROFILED_MICRO_BATCHES = 8
"""The larger profiled micro-batch is one of this many (times for fewer micro-batches are extrapolated)."""


@dataclass(frozen=True)
class AfterBackbone:
    """What runs after the backbone on the last stage (the rest of the user's step: head, loss), as the planner
    runs it to measure it (:func:`profile_head`).

    Args:
        loss: ``loss(micro_batches, output)`` runs it on the first of ``micro_batches`` micro-batches of the batch's
            rows (1: the whole batch), with ``output`` standing for the backbone's output on those rows, and returns
            the loss (``None`` if there is none to differentiate).
        parameters: the parameters and buffers it holds (the modules outside the backbone), whose gradients the
            loss's backward makes.
        existing: the tensors it reads that exist before it runs and after (the batch's): views of them are not new
            memory.
        per_micro_batch: whether it can run on a micro-batch's rows (the batch splits row for row like the backbone
            input); if not, it is measured on the whole batch only.
    """

    loss: Callable[[int, Value], Tensor | None]
    parameters: Sequence[Tensor]
    existing: Sequence[Tensor] = ()
    per_micro_batch: bool = True


def profile_sizes(
    layers: nn.Sequential,
    value: Value,
    device: torch.device | str,
    micro_batches: int | None = None,
    split: bool = False,
    after: AfterBackbone | None = None,
) -> ProfiledCosts:
    """Profile ``layers`` (:func:`~lightning_gpipe.planning.balance.profile_layers`; with ``split``, the B/W split timed
    too, for a named schedule that splits its backwards, :attr:`~lightning_gpipe.planning.search.Constraints.splits`) on
    two micro-batches of the mini-batch ``value``: one of :data:`PROFILED_MICRO_BATCHES` and one of
    :data:`~lightning_gpipe.planning.search.MAX_MICRO_BATCHES` (or, when ``micro_batches`` is fixed, one of that many,
    twice the same size). Not the whole mini-batch: a layer's activations on all of it may not fit a device that
    trains the model in micro-batches. With ``after``, also what runs after the backbone (:func:`profile_head`), on
    the backbone's output, at the whole batch and at every micro-batch size the planner may choose.

    Raises:
        TypeError, ValueError: as :func:`~lightning_gpipe.engine.microbatch.batch_size` and
            :func:`~lightning_gpipe.planning.balance.profile_layers`.
    """
    rows = batch_size(value)
    fixed = micro_batches
    large_m, small_m = (fixed, fixed) if fixed is not None else (PROFILED_MICRO_BATCHES, MAX_MICRO_BATCHES)
    large, small = (scatter(value, m)[0] for m in (large_m, small_m))
    large_costs, output = profile_with_output(layers, large, device, split=split)
    same = small_m == large_m
    small_costs = large_costs if same else profile_with_output(layers, small, device, split=split)[0]
    sizes = (batch_size(large), batch_size(small))
    input_bytes = sum(t.numel() * t.element_size() for t in tensors(value))
    head = None
    if after is not None:
        counts = [1, *micro_batch_counts(rows, micro_batches)] if after.per_micro_batch else [1]
        head = profile_head(after, output, rows, counts)
    return ProfiledCosts(sizes, large_costs, small_costs, rows, input_bytes, head)


def profile_head(after: AfterBackbone, output: Value, batch_rows: int, counts: Sequence[int]) -> HeadCost:
    """Measure what runs after the backbone (``after``) on the first of M micro-batches of a batch of
    ``batch_rows`` rows, for each M of ``counts``: the bytes of the tensors it makes, at their peak over its
    run and the loss's backward, less the gradients that :class:`~lightning_gpipe.planning.predict.StageMemory` counts
    elsewhere (the backbone output's, with the last stage's buffers; the parameters', with its gradients).

    The backbone's output on those rows is ``output`` (its output on one profiled micro-batch) repeated along dim 0
    to the rows: the same shape as the real one, whose values a loss's memory does not depend on. The gradients it
    makes on the parameters are dropped again.

    Raises:
        TypeError, ValueError: as :func:`~lightning_gpipe.engine.microbatch.batch_size`; what ``after.loss``
            raises.
    """
    measured: dict[int, int] = {}
    for m in sorted(set(counts)):
        rows = math.ceil(batch_rows / min(m, batch_rows))  # the first of torch.tensor_split's micro-batches
        if rows not in measured:
            measured[rows] = _head_peak(after, m, _repeated(output, rows))
    parameter_bytes = sum(t.numel() * t.element_size() for t in after.parameters)
    return HeadCost(tuple(sorted(measured)), tuple(measured[r] for r in sorted(measured)), parameter_bytes)


def _repeated(value: Value, rows: int) -> Value:
    """``value``'s tensors repeated along dim 0 and cut to ``rows`` rows, as new leaves (floating ones require
    grad, as the backbone's output does on the last stage)."""

    def repeat(t: Tensor) -> Tensor:
        times = math.ceil(rows / t.shape[0])
        return t.repeat(times, *[1] * (t.dim() - 1))[:rows].clone()

    repeated = repeat(value) if isinstance(value, Tensor) else tuple(
        repeat(x) if isinstance(x, Tensor) else x for x in value
    )  # fmt: skip
    return leaves(repeated)


def _head_peak(after: AfterBackbone, micro_batches: int, output: Value) -> int:
    """The peak bytes of one run of ``after`` and its loss's backward, less the gradients it leaves on ``output`` and
    on the parameters (see :func:`profile_head`)."""
    before = [t.grad for t in after.parameters]
    with torch.enable_grad(), PeakBytes() as counted:
        for t in [*tensors(output), *after.parameters, *after.existing]:
            t.detach()  # seen once here, a view of it later is not counted as new memory
        start = counted.restart()
        loss = after.loss(micro_batches, output)
        if loss is not None and loss.requires_grad:
            torch.autograd.backward(loss, torch.ones_like(loss))
        peak = counted.peak - start
    made = [t.grad for t in tensors(output)]
    made += [t.grad for t, old in zip(after.parameters, before) if t.grad is not old]
    for t, old in zip(after.parameters, before):
        t.grad = old
    return max(peak - sum(g.numel() * g.element_size() for g in made if g is not None), 0)


def module_state_factor(module: Any) -> int | None:
    """The optimizer state factor (:func:`~lightning_gpipe.planning.costs.optimizer_state_factor`) of the optimizer
    ``module.configure_optimizers()`` returns (the first one); ``None`` if it cannot be called here (it needs the
    trainer, say) or returns no optimizer. The optimizer made is dropped (it holds no state yet)."""
    try:
        configured = module.configure_optimizers()
    except Exception:  # the user's hook may need what only a running Trainer has; the caller says what it assumes
        return None
    optimizer = _first_optimizer(configured)
    return None if optimizer is None else optimizer_state_factor(optimizer)


def _first_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    """The first optimizer in what ``configure_optimizers`` may return (an optimizer, a dict, a list or tuple)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def measure_host_bandwidth(device: torch.device | str = "cuda", nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a copy between ``device`` and pinned host memory, for
    ``CostModel(host_bandwidth=...)``: the median of ``repeats`` timed copies of ``nbytes`` each way (device to host,
    then back), each synchronized, after one untimed pair (the allocator's and the driver's first use).

    Args:
        device: a CUDA device (default the current one).
        nbytes: bytes of each copy (default 64 MiB: large enough that a copy's fixed cost does not count).
        repeats: timed copies each way (default 5).

    Raises:
        ValueError: for a device that is not CUDA (a CPU has no host-device copy to measure).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"measure_host_bandwidth needs a CUDA device, not {device.type!r}: activation offload moves nothing on a"
            " CPU, so its bandwidth does not matter there."
        )
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = []
    for n in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        on_host.copy_(on_device, non_blocking=True)
        on_device.copy_(on_host, non_blocking=True)
        end.record()
        end.synchronize()
        if n:  # the first pair is untimed
            seconds.append(start.elapsed_time(end) / 1e3 / 2)  # ms for two copies -> s per copy
    return nbytes / sorted(seconds)[len(seconds) // 2]
