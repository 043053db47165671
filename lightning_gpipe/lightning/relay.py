"""Make what user code logs on the last stage known to every stage.

Only the last stage runs the part of a step after the backbone call, so only its
``self.log`` calls record values. Loggers write on global rank 0 (the first
stage), the progress bar shows there, and callbacks such as ``ModelCheckpoint``
and ``EarlyStopping`` read ``trainer.callback_metrics`` on every rank and must
decide alike. So after every step, and after the user's epoch-end hooks, the last
stage broadcasts its logged results to the other stages of its pipeline (Lightning's ``_ResultCollection`` entries,
with their accumulated epoch state) and every other stage takes them as its own.

What ``training_step`` returns reaches the other stages too (:func:`share_step_output`), so that a callback's
``on_train_batch_end(outputs=...)`` sees the step's real loss on every rank.
"""

import io
import pickle
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning._lightning import SCALAR_FIELDS as SCALAR_FIELDS
from lightning_gpipe.lightning._lightning import TENSOR_FIELDS as TENSOR_FIELDS
from lightning_gpipe.lightning._lightning import (
    logged_results,
    new_result_metric,
    result_metric_state,
    set_result_metric_state,
)
from lightning_gpipe.lightning.agreement import REGION_WORDS

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


class LogRelay:
    """Copies the last stage's logged results to every stage.

    Args:
        strategy: the running strategy; values logged with ``sync_dist=True`` keep a reference
            to its ``reduce``, which is resolved to each receiver's own strategy.
        src: global rank of the last stage, whose results are broadcast.
        group: the stages of the pipeline (``None``: every process, for a job of one pipeline).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the broadcasts use.
    """

    def __init__(
        self, strategy: "pl.strategies.Strategy", src: int, group: dist.ProcessGroup | None, job: "Job"
    ) -> None:
        self.strategy, self.src, self.group, self.job = strategy, src, group, job

    def __call__(self, trainer: "pl.Trainer") -> None:
        """Broadcast the last stage's current ``trainer._results`` entries; a collective call on all ranks.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        results = logged_results(trainer)
        if results is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        mine = dist.get_rank() == self.src
        sent = self._dumps(dict(results)) if mine else None
        payload = waiting.broadcast_object(self.job, sent, self.src, self.group)
        if not mine:
            results.clear()
            results.update(self._loads(payload))
            results.to(self.strategy.root_device)

    def relay_after_epoch_end_hooks(self, module: "pl.LightningModule") -> None:
        """Relay after each of the module's epoch-end hooks, which may log (e.g. ``metric.compute()``).

        They run before Lightning reads the epoch's metrics and before ``ModelCheckpoint`` and
        ``EarlyStopping`` act. The hooks are wrapped on the instance; undone by :meth:`unwrap_epoch_end_hooks`.
        """
        for name in EPOCH_END_HOOKS:
            setattr(module, name, _hook_then_relay(getattr(module, name), lambda: self(module.trainer)))

    @staticmethod
    def unwrap_epoch_end_hooks(module: "pl.LightningModule") -> None:
        """Remove the wrappers set by :meth:`relay_after_epoch_end_hooks`."""
        for name in EPOCH_END_HOOKS:
            module.__dict__.pop(name, None)

    def _dumps(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer)
        # an attribute of the instance, as pickle documents; typeshed declares it as a method
        pickler.persistent_id = lambda o: "strategy" if o is self.strategy else None  # type: ignore[method-assign]
        pickler.dump(obj)
        return buffer.getvalue()

    def _loads(self, data: bytes) -> Any:
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = lambda pid: self.strategy  # type: ignore[method-assign]  # as persistent_id
        return unpickler.load()


def share_step_output(output: Any, is_last: bool, share: Callable[[Any], Any], device: torch.device) -> Any:
    """The last stage's ``training_step`` output on every stage of the pipeline (a collective call).

    The last stage sends a detached CPU copy of its output (the loss, or the dict with its ``"loss"`` and any other
    entries) and returns its own; the other stages return the copy, its tensors on ``device``. Whatever the user's
    step returns travels once per step, so keep it small (the loss and a few scalars).

    Args:
        output: the user's output on the last stage (ignored on the others).
        is_last: whether this is the last stage.
        share: sends a picklable object from the last stage to every stage of the pipeline and returns it.
        device: where the other stages put the received tensors.

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    sent = apply_to_collection(output, Tensor, lambda tensor: tensor.detach().cpu()) if is_last else None
    received = share(sent)
    return output if is_last else apply_to_collection(received, Tensor, lambda tensor: tensor.to(device))


def _hook_then_relay(hook: Callable[[], None], relay: Callable[[], None]) -> Callable[[], None]:
    def hook_then_relay() -> None:
        hook()
        relay()

    return hook_then_relay


class StepRelay:
    """A training step's logged values and output, from the last stage of a pipeline to the others, without a
    device-to-host copy and with no host read of its own.

    At the end of ``backward`` the last stage describes its logged values (Lightning's ``_ResultMetric`` entries of
    ``trainer._results``: how they were logged, their counters, which tensors they hold) and the step's output in a
    few kilobytes (:meth:`pack`); the description travels in its replica's region of the step's agreement
    all-reduce (:class:`~lightning_gpipe.lightning.agreement.StepAgreement`), which every process reads once anyway,
    and the tensors as one buffer of bytes on the pipeline's group, on the device (:meth:`exchange`); on the CPU,
    where the region is the device's memory, the tensors' bytes ride in the region too when they fit (one collective
    fewer per step; the bytes are placed there with tensor operations, not read on the host). Every other
    stage rebuilds the entries around the received tensors and installs them in its ``trainer._results``, before
    Lightning's loop reads them (progress bar, loggers, ``callback_metrics``). The step's loss reaches the other
    stages as ``training_step`` ends (:meth:`share_loss`: one broadcast of a scalar, which orders the device and not
    the host on NCCL), inside an output shaped like the previous step's whose other tensors are filled in by
    :meth:`exchange`; the first step shares its output as :func:`share_step_output` does.

    Args:
        strategy: the running strategy (values logged with ``sync_dist=True`` keep a reference to its ``reduce``,
            resolved to each receiver's own).
        src: global rank of this pipeline's last stage.
        is_src: whether this process is it.
        group: the stages of the pipeline (``None``: the default group).
        control: the run's CPU (gloo) group, for a description too large for the region (``None``: ``group``).
        device: this process's device.
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the broadcasts use.
    """

    def __init__(
        self,
        strategy: Any,
        src: int,
        is_src: bool,
        group: dist.ProcessGroup | None,
        control: dist.ProcessGroup | None,
        device: torch.device,
        job: "Job",
    ) -> None:
        self.strategy, self.src, self.is_src, self.group = strategy, src, is_src, group
        self.control, self.device, self.job = control if control is not None else group, device, job
        self.output: Any = None  # the last step's output: the last stage's own, or its copy
        self.reshaped = False  # whether that output's shape differs from the one returned by share_loss
        self._description: tuple | None = None  # the last description: records, layout, output, output tensors
        self._placeholders: list[Tensor | None] = []  # the tensors of the output share_loss returned
        self._tensors: list[Tensor] = []
        self._pending: list = []  # the last stage's broadcasts, waited for before the next ones
        self._objects: dict[tuple[str, bytes], Any] = {}  # the rebuilt logged entries, by key and metadata

    @property
    def shaped(self) -> bool:
        """Whether an earlier step's output gives this step's output its shape (then :meth:`share_loss` shares it)."""
        return self._description is not None

    def share_loss(self, output: Any) -> Any:
        """At the end of ``training_step``: the step's output on every stage, its loss the last stage's, its other
        tensors filled in by :meth:`exchange` (a collective call of the pipeline; ``output``: the last stage's,
        ignored on the others)."""
        assert self._description is not None  # called only when shaped
        layout: list[tuple[str, tuple]]  # dtype name and shape of each tensor (see pack)
        _, layout, described, count, loss_slot = self._description
        if self.is_src:
            loss = cast(Tensor, _loss_of(output))  # the last stage's step returns its loss (Lightning requires it)
            sent = loss.detach().to(torch.float64).reshape(1)
            self._finish(self._pending)  # the last step's: long completed
            self._pending = [dist.broadcast(sent, self.src, group=self.group, async_op=True)]
            self._tensors = [sent]  # kept alive until it has completed
            return output
        received = torch.empty(1, dtype=torch.float64, device=self.device)
        self._finish([dist.broadcast(received, self.src, group=self.group, async_op=True)])
        placeholders = [_zeros(*meta, self.device) for meta in layout[:count]]
        if loss_slot is not None:
            placeholders[loss_slot] = received.reshape(()).to(getattr(torch, layout[loss_slot][0]))
        self._placeholders = [None if slot == loss_slot else t for slot, t in enumerate(placeholders)]
        return self._unpickle(described, placeholders)

    def pack(self, results: dict, output: Any) -> Tensor:
        """The last stage's description of its logged ``results`` and step ``output`` as the int64 words of its relay
        region, a CPU tensor (see :meth:`exchange`): a header (the description's length, negative when it does not
        fit; its tensors' bytes; whether those follow it), the description, and on the CPU the tensors' bytes when
        they fit; otherwise the tensors it names are kept for :meth:`exchange`."""
        tensors: list[Tensor] = []
        described = self._pickled(output, tensors)
        count = len(tensors)
        loss = _loss_of(output)
        loss_slot = next((slot for slot, t in enumerate(tensors) if t is loss), None)
        records = [self._record(key, value, tensors) for key, value in results.items()]
        layout = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
        self._description = (records, layout, described, count, loss_slot)
        self._tensors, self.output = tensors, output
        data = pickle.dumps(self._description, protocol=5)
        size = sum(_padded(t) for t in tensors)
        fits = len(data) <= 8 * (REGION_WORDS - _HEADER)
        description = torch.from_numpy(_to_words(data).copy())  # writable, as torch wants
        inline = fits and self.device.type == "cpu" and len(description) + size // 8 <= REGION_WORDS - _HEADER
        header = torch.tensor([len(data) if fits else -len(data), size, int(inline)], dtype=torch.int64)
        if not fits:
            return header
        words = [header, description]
        return torch.cat(words + [_buffer(tensors, self.device).view(torch.int64)] if inline else words)

    def exchange(self, region: np.ndarray, trainer: "pl.Trainer") -> None:
        """After the agreement: the last stage sends the tensors it packed, every other stage receives them and
        installs the last stage's logged values and output (a collective call of the pipeline, every stage with its
        replica's relay ``region``).

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        described, size, inline = int(region[0]), int(region[1]), bool(region[2])
        if described < 0:  # too large for the region: one more broadcast, of the description's bytes
            self._description = self._overflow(-described)
        elif not self.is_src:
            self._description = pickle.loads(_from_words(region[_HEADER:], described))
        self._finish(self._pending)  # the loss's broadcast: long completed
        self._pending = []
        if inline:  # the tensors' bytes follow the description in the region
            start = _HEADER + -(-described // 8)
            buffer = torch.from_numpy(region[start : start + size // 8]).view(torch.uint8)
        elif self.is_src:
            buffer = _buffer(self._tensors, self.device)
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        if size and not inline:
            self._pending = [dist.broadcast(buffer, self.src, group=self.group, async_op=True)]
        if not self.is_src:
            self._finish(self._pending)
            self._pending = []
        self._tensors = [buffer]  # the sent bytes kept alive until the next step
        if not self.is_src:
            assert self._description is not None  # received above
            self._land(trainer, _views(buffer, self._description[1]))

    def _land(self, trainer: "pl.Trainer", tensors: list[Tensor]) -> None:
        """Install the received logged values, and make the last stage's output this stage's: fill the placeholders
        :meth:`share_loss` returned where they have its tensors' shapes."""
        assert self._description is not None  # received by exchange
        records, layout, described, count, loss_slot = self._description
        self._install(logged_results(trainer), records, tensors)
        self.output = self._unpickle(described, tensors[:count])
        self.reshaped = len(self._placeholders) != count
        for placeholder, tensor in zip(self._placeholders, tensors[:count]):
            if placeholder is None:
                continue
            if placeholder.shape == tensor.shape and placeholder.dtype == tensor.dtype:
                placeholder.copy_(tensor)
            else:
                self.reshaped = True
        self._placeholders = []

    def _overflow(self, length: int) -> tuple:
        """The description of a step too large for the relay region, broadcast on the CPU group (one host read)."""
        data = torch.frombuffer(bytearray(pickle.dumps(self._description)), dtype=torch.uint8) if self.is_src else None
        data = data if data is not None else torch.empty(length, dtype=torch.uint8)
        waiting.broadcast(self.job, data, self.src, group=self.control)
        if self.is_src:
            assert self._description is not None  # set by this step's pack
            return self._description
        return pickle.loads(data.numpy().tobytes())

    def _record(self, key: str, value: Any, tensors: list[Tensor]) -> tuple:
        """One logged entry: a tensor ``_ResultMetric`` as its metadata, tensor fields and counters; anything else
        pickled whole, its tensors appended to ``tensors``."""
        state = result_metric_state(value)
        if state is None:
            return ("object", key, self._pickled(value, tensors))
        fields, scalars = state
        slots = []
        for tensor in fields.values():
            slots.append(None if tensor is None else len(tensors))
            if tensor is not None:
                tensors.append(tensor)
        meta = self._pickled(value.meta, [])
        return ("metric", key, meta, tuple(zip(fields, slots)), scalars)

    def _install(self, results: Any, records: list[tuple], tensors: list[Tensor]) -> None:
        """Replace ``results``'s entries by the last stage's, rebuilt around the received ``tensors``."""
        results.clear()
        for record in records:
            if record[0] == "object":
                results[record[1]] = self._unpickle(record[2], tensors)
                continue
            _, key, meta, slots, scalars = record
            if (key, meta) not in self._objects:
                self._objects[(key, meta)] = new_result_metric(self._unpickle(meta, []), self.device)
            value = self._objects[(key, meta)]
            received = {name: None if slot is None else tensors[slot] for name, slot in slots}
            set_result_metric_state(value, received, scalars)
            results[key] = value

    def _pickled(self, obj: Any, tensors: list[Tensor]) -> bytes:
        """``obj`` pickled, its tensors appended to ``tensors`` (by index) and the strategy by reference."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=5)

        def persistent_id(o: Any) -> Any:
            if o is self.strategy:
                return "strategy"
            if isinstance(o, Tensor):
                tensors.append(o)
                return len(tensors) - 1
            return None

        pickler.persistent_id = persistent_id  # type: ignore[method-assign]  # as in LogRelay._dumps
        pickler.dump(obj)
        return buffer.getvalue()

    def _unpickle(self, data: bytes, tensors: list[Tensor]) -> Any:
        unpickler = pickle.Unpickler(io.BytesIO(data))

        def persistent_load(pid: Any) -> Any:
            return self.strategy if pid == "strategy" else tensors[pid]

        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]  # as in LogRelay._loads
        return unpickler.load()

    def _finish(self, works: list) -> None:
        """Wait for received broadcasts: the compute stream on NCCL (:func:`~lightning_gpipe.faults.waiting.polls`),
        the host on gloo."""
        if waiting.polls(self.device, self.group):
            for work in works:
                work.wait()
        else:
            waiting.wait(self.job, works, self.job.watchdog.name_of(self.src))


_HEADER = 3
"""int64 words before the description in a relay region: its length, its tensors' bytes, whether they follow it."""


def _loss_of(output: Any) -> Tensor | None:
    """The loss in a step's output: the output itself, or its ``"loss"`` entry."""
    return output if isinstance(output, Tensor) else output.get("loss") if isinstance(output, Mapping) else None


def _zeros(dtype: str, shape: tuple, device: torch.device) -> Tensor:
    return torch.zeros(shape, dtype=getattr(torch, dtype), device=device)


def _padded(tensor: Tensor) -> int:
    """Bytes a tensor takes in the exchanged buffer: its own, rounded up to 8 (every view is aligned)."""
    return -(-tensor.numel() * tensor.element_size() // 8) * 8


def _buffer(tensors: list[Tensor], device: torch.device) -> Tensor:
    """``tensors``' bytes, each padded to 8, as one uint8 tensor on ``device`` (tensor operations only)."""
    parts = []
    for tensor in tensors:
        data = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        parts += [data, torch.zeros(_padded(tensor) - data.numel(), dtype=torch.uint8, device=device)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _views(buffer: Tensor, layout: list[tuple[str, tuple]]) -> list[Tensor]:
    """The tensors of ``layout`` (dtype name and shape each) in ``buffer``, as :func:`_buffer` packed them."""
    tensors, start = [], 0
    for dtype, shape in layout:
        kind = getattr(torch, dtype)
        size = int(torch.Size(shape).numel()) * kind.itemsize
        tensors.append(buffer[start : start + size].view(kind).reshape(shape))
        start += -(-size // 8) * 8
    return tensors


def _to_words(data: bytes) -> np.ndarray:
    return np.frombuffer(data + bytes(-len(data) % 8), dtype=np.int64)


def _from_words(words: np.ndarray, length: int) -> bytes:
    return words.astype(np.int64, copy=False).tobytes()[:length]
