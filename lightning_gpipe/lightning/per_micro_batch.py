"""The user's training step once per micro-batch (1F1B): the batch's rows, and row-weighted results.

Under 1F1B (PipeDream-Flush, Narayanan et al. 2021) micro-batch 0's loss is needed before the last
micro-batch enters the pipeline, so the last stage runs the user's ``training_step`` once per micro-batch,
on that micro-batch's rows of the batch. :func:`split_batch` splits every tensor of the batch along dim 0
as :func:`lightning_gpipe.engine.microbatch.scatter` splits the backbone input (:func:`torch.tensor_split`), so
micro-batch i's rows of the batch are the rows its backbone output came from. Each micro-batch's loss is
weighted by its share of the rows, so the summed gradients are those of the mean loss over the mini-batch,
and :class:`RowWeighted` combines what the steps return and log into row-weighted means: what one device
computes for values that are means over the rows.
"""

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_gpipe.engine import Value, batch_size

_FIX = "or use GPipeStrategy(schedule='gpipe'), which runs training_step once on the whole batch"


def batch_rows(batch: Any) -> int:
    """N, the size of dim 0 shared by every tensor of ``batch`` (a tensor or any collection of them).

    Raises:
        TypeError: for a batch holding no tensor.
        ValueError: if its tensors disagree on dim 0, or one of them is 0-dimensional.
    """
    shapes: list[tuple[int, ...]] = []
    apply_to_collection(batch, Tensor, lambda t: shapes.append(tuple(t.shape)))
    if not shapes:
        raise TypeError(
            f"schedule='1f1b' runs training_step once per micro-batch, on its rows of the batch, but this batch"
            f" ({type(batch).__name__}) holds no tensor to split; put the batch's rows in tensors, {_FIX}."
        )
    sizes = {shape[0] if shape else None for shape in shapes}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            "schedule='1f1b' runs training_step once per micro-batch, on its rows of the batch, so every tensor"
            f" of the batch needs the batch's rows in dim 0; got shapes {shapes}. Keep per-batch constants out"
            f" of the batch (e.g. as module attributes), {_FIX}."
        )
    return cast(int, sizes.pop())  # not None, checked above


def check_input_rows(value: Value, rows: int) -> None:
    """Check that the backbone input ``value`` has the batch's ``rows`` rows, row for row.

    Raises:
        ValueError: if its tensors' dim 0 is not ``rows`` (see also
            :func:`lightning_gpipe.engine.microbatch.batch_size`).
    """
    size = batch_size(value)
    if size != rows:
        raise ValueError(
            f"schedule='1f1b' runs training_step on each micro-batch's rows of the batch, so the backbone input"
            f" needs the batch's rows in dim 0 (its row i made from the batch's row i); the batch has {rows}"
            f" rows and the backbone input {size}. Build the backbone input row by row from the batch, {_FIX}."
        )


def split_batch(batch: Any, micro_batches: int) -> list[Any]:
    """``batch`` as ``micro_batches`` micro-batches of rows, split like the backbone input.

    Every tensor is split along dim 0 with :func:`torch.tensor_split` (when N does not divide by ``micro_batches``
    the first micro-batches are one row longer); other items are passed whole to every micro-batch.

    Args:
        batch: a tensor or a collection of tensors with N rows (see :func:`batch_rows`).
        micro_batches: M, the micro-batches (<= N).
    """
    splits: dict[int, tuple[Tensor, ...]] = {}

    def part(index: int) -> Any:
        def take(tensor: Tensor) -> Tensor:
            if id(tensor) not in splits:
                splits[id(tensor)] = torch.tensor_split(tensor, micro_batches)
            return splits[id(tensor)][index]

        return apply_to_collection(batch, Tensor, take)

    return [part(index) for index in range(micro_batches)]


def loss_of(output: Any, hook: str, index: int) -> Tensor:
    """The loss in what the user's ``hook`` returned for micro-batch ``index``: the Tensor, or a dict's ``"loss"``.

    Raises:
        RuntimeError: for anything else, e.g. ``None`` (a skipped step: every stage takes part in every step).
    """
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(
            f"`{hook}` returned {type(output).__name__} for micro-batch {index} on the last stage; under"
            " schedule='1f1b' every micro-batch's step must return its loss (a Tensor, or a dict with 'loss'),"
            " since all stages take part in every step."
        )
    return loss


@dataclass
class _Part:
    weight: float  # the micro-batch's share of the batch's rows
    output: Any
    logged: dict[str, dict[str, Any]]  # name -> the arguments of its last `self.log` call


class RowWeighted:
    """Runs the user's step on micro-batches, records what each returns and logs, and combines them by row share.

    Inside :meth:`run` the module's ``self.log`` (and so ``self.log_dict``) is recorded instead of logged.
    :meth:`finish` then logs each name once, as one device's step would: the row-weighted mean of the
    micro-batches' values (a mean-reduced loss logs what one device logs), with the same arguments, so the
    epoch aggregation and the batch size are Lightning's own for the whole batch. A torchmetrics ``Metric``
    is logged as the object (Lightning computes it); its step value is then its last micro-batch's.

    Args:
        module: the LightningModule.
        rows: N, the rows of the whole batch.
    """

    def __init__(self, module: Any, rows: int) -> None:
        self.module, self.rows = module, rows
        self._parts: list[_Part] = []
        self._signature = inspect.signature(module.log)

    def run(self, rows: int, step: Callable[[], Any]) -> Any:
        """Run ``step()``, the user's step on a micro-batch of ``rows`` rows, and return its output.

        ``rows=0`` runs it without recording (the step on the whole batch, which ends at the backbone call). What
        it records is detached: a loss's graph would keep the micro-batch's output and its gradient alive until the
        step ends.
        """
        logged: dict[str, dict[str, Any]] = {}
        with _recording_logs(self.module, self._signature, logged):
            output = step()
        if rows:
            self._parts.append(_Part(rows / self.rows, apply_to_collection(output, Tensor, Tensor.detach), logged))
        return output

    def finish(self) -> Any:
        """Log the row-weighted values and return the combined output: a Tensor output (the loss) as the
        row-weighted mean; a dict's single values likewise, its tensors of rows concatenated, and anything
        else as the list of the micro-batches' values."""
        names = list(dict.fromkeys(name for part in self._parts for name in part.logged))
        for name in names:
            calls = [(part.weight, part.logged[name]) for part in self._parts if name in part.logged]
            arguments = dict(calls[-1][1])
            values = [call["value"] for _, call in calls]
            if all(_single(value) for value in values):
                arguments["value"] = _row_mean(values, [weight for weight, _ in calls])
            if arguments.get("batch_size") is not None:
                arguments["batch_size"] = sum(call["batch_size"] for _, call in calls)
            self.module.log(**arguments)
        weights, outputs = [part.weight for part in self._parts], [part.output for part in self._parts]
        if isinstance(outputs[0], Mapping):
            return {key: _combine([o[key] for o in outputs], weights, key == "loss") for key in outputs[0]}
        return _combine(outputs, weights, True)


@contextmanager
def _recording_logs(module: Any, signature: inspect.Signature, logged: dict[str, dict[str, Any]]) -> Iterator[None]:
    """Inside, ``module.log(...)`` (whose ``signature`` is given) stores its arguments in ``logged`` by name."""

    def log(*args: Any, **kwargs: Any) -> None:
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        if isinstance(arguments["value"], Tensor):
            arguments["value"] = arguments["value"].detach()
        logged[arguments["name"]] = arguments

    module.__dict__["log"] = log
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def _single(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.numel() == 1)


def _row_mean(values: list[Any], weights: list[float]) -> Any:
    return sum(weight * value for weight, value in zip(weights, values)) / sum(weights)


def _combine(values: list[Any], weights: list[float], loss: bool) -> Any:
    values = [value.detach() if isinstance(value, Tensor) else value for value in values]
    if loss or all(_single(value) for value in values):
        return _row_mean(values, weights)
    if all(isinstance(value, Tensor) and value.dim() > 0 for value in values):
        return torch.cat(values)
    return values
