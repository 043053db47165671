"""The one place the package touches Lightning's private API.

A pipelined run needs a few things Lightning keeps to itself: its own launchers and process-group setup (as
``DDPStrategy`` uses them), the logged values of the running loop (the relay copies the last stage's to the other
stages), the per-step SIGTERM broadcast and the signal connector's handlers (the stages agree on stop signals
instead), and a few flags and loaders of the fit loop. Lightning may rename or remove any of them in any release,
so every use lives here, one small function (or class, or constant) each, whose docstring says why the package
needs it and on which Lightning versions it was checked. No other module of ``lightning_gpipe`` imports a private
Lightning name or reads or writes a private attribute of a Lightning object; ``tests/unit/test_private_api.py``
fails when one does, and ``tests/unit/test_lightning_internals.py`` when an upgrade removes what is used here.

Checked on: lightning 2.6.0, 2.6.6 (``pyproject.toml`` asks for ``lightning>=2.6.0,<2.7``).

When Lightning changes: read each function's Lightning counterpart in the new version's source (the names are in
the function bodies), adapt the body here (keeping the function's contract, so that the callers stay as they are),
run ``tests/unit/test_lightning_internals.py``, ``tests/unit/test_private_api.py`` and the distributed tests, then
add the version to every "Checked on" line you verified and widen the pin in ``pyproject.toml``.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from lightning.pytorch.utilities.data import _update_dataloader
from torch import Tensor
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from torch.utils.data import DataLoader

# ------------------------------------------------------------------------------------------------ random state


def collect_rng_states() -> dict[str, Any]:
    """The current states of torch's (CPU and CUDA), NumPy's and Python's global random generators, as Lightning
    collects them for its checkpoints (``lightning.fabric.utilities.seed._collect_rng_states``).

    Why: profiling must leave the random streams as they were (the data order, the initialisation), and each stage
    swaps the stages' shared stream with its own (:class:`~lightning_gpipe.lightning.contract.StageRandomness`);
    Lightning's helper covers every generator it seeds, so ours stays in step with ``seed_everything``.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return _collect_rng_states()


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back generator states :func:`collect_rng_states` returned (``_set_rng_states``).

    Args:
        states: the states to restore.

    Why: the other half of :func:`collect_rng_states`.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    _set_rng_states(states)


# ----------------------------------------------------------------------------------- processes and launching


def default_process_group_backend(device: torch.device) -> str:
    """The process-group backend Lightning's strategies pick for ``device`` (NCCL for CUDA, gloo for the CPU;
    ``lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device``).

    Args:
        device: the device of this process.

    Why: the mesh joins the process group as ``DDPStrategy`` does when ``process_group_backend`` is not given.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return _get_default_process_group_backend_for_device(device)


def init_process_group(environment: "ClusterEnvironment", backend: str, timeout: timedelta | None) -> None:
    """Join the default process group as Lightning's strategies do: address, port, rank and world size from the
    cluster environment (``lightning.fabric.utilities.distributed._init_dist_connection``).

    Args:
        environment: the strategy's cluster environment, its global rank and world size already set.
        backend: the process-group backend.
        timeout: the collectives' timeout (``None``: torch.distributed's default).

    Why: the mesh's processes join exactly as a DDP job's do, whatever the cluster (SLURM, torchelastic, ...).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    _init_dist_connection(environment, backend, timeout=timeout)


class LaunchedParallelStrategy(ParallelStrategy):
    """Lightning's ``ParallelStrategy`` whose processes Lightning's own launchers start, as ``DDPStrategy``'s are:
    ``_SubprocessScriptLauncher`` (the script run again per process) for the start method ``"popen"``, else
    ``_MultiProcessingLauncher`` (``"spawn"``, ``"fork"``, ``"forkserver"``).

    Why: Lightning asks a strategy for its launcher through the private hook ``Strategy._configure_launcher``, which
    must set the private ``Strategy._launcher``; the launcher classes are private too. A subclass says how to start
    its processes in ``_launch_start_method`` and never touches those names.

    Checked on: lightning 2.6.0, 2.6.6.
    """

    if TYPE_CHECKING:  # what the launchers read; Lightning's ``ParallelStrategy`` leaves both to its subclasses

        @property
        def num_processes(self) -> int:
            """Number of processes on this node."""
            raise NotImplementedError

        @property
        def num_nodes(self) -> int:
            """Number of nodes the job spans."""
            raise NotImplementedError

    def _launch_start_method(self) -> str:
        """How to start the processes: ``"popen"`` or a multiprocessing start method. Called when Lightning
        configures the launcher, before any process starts: raise here to refuse the launch.

        Raises:
            NotImplementedError: unless a subclass says.
        """
        raise NotImplementedError

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        start_method = self._launch_start_method()
        if start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            multiprocessing_method = cast(Literal["spawn", "fork", "forkserver"], start_method)  # not "popen"
            self._launcher = _MultiProcessingLauncher(self, start_method=multiprocessing_method)


def end_launched_processes(launcher: Any) -> None:
    """End the processes that Lightning's subprocess-script launcher ``launcher`` started (its ``procs``: kill them
    and wait until they have ended); any other launcher's are left to it.

    Args:
        launcher: the strategy's launcher (``Strategy.launcher``), or ``None``.

    Why: a main process whose run fails before the job's store exists cannot tell the processes it started, which
    would wait for the store until the process group's timeout (:mod:`~lightning_gpipe.faults.watchdog`). The list is
    emptied first: Lightning's child-process observer reads the same list and, seeing a process that exited
    non-zero, kills this process too, before it could raise its own error.

    Checked on: lightning 2.6.6.
    """
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return  # the spawn launcher's main process runs no stage; torch ends the others when one fails
    processes = list(launcher.procs)
    launcher.procs.clear()
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the state tensors of ``optimizers`` to ``device`` (``lightning.fabric.utilities.optimizer.
    _optimizers_to_device``).

    Args:
        optimizers: the optimizers whose state to move.
        device: where to.

    Why: after setup and after a checkpoint is restored the optimizer state must sit on the stage's device, as
    ``DDPStrategy`` moves it.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    _optimizers_to_device(optimizers, device)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (its ``_optimizer``), or ``optimizer`` itself when it has
    none (already a torch optimizer).

    Args:
        optimizer: a ``LightningOptimizer`` or a torch optimizer.

    Why: torch.distributed.checkpoint keys an optimizer's state by parameter name and needs the torch optimizer.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return getattr(optimizer, "_optimizer", optimizer)


def set_plugin_class(plugin: Any, plugin_class: type) -> None:
    """Change the class of the precision plugin instance ``plugin`` to ``plugin_class`` (its ``__class__``).

    Args:
        plugin: the strategy's precision plugin.
        plugin_class: a subclass of the plugin's class (:func:`~lightning_gpipe.lightning.optimization.pipelined`),
            or that subclass's base, to give the plugin its own class back.

    Why: Lightning clips gradients through the precision plugin and has no strategy hook for it, and the norm must
    span all stages; a subclass of the plugin's own class keeps every ``isinstance`` check of Lightning's
    (``MixedPrecision``, ...). It relies on Lightning's precision plugins having no ``__slots__`` and on nothing of
    Lightning's keeping the plugin's class aside during a run.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    plugin.__class__ = plugin_class


def with_sampler(dataloader: "DataLoader", sampler: Any) -> "DataLoader":
    """A copy of ``dataloader`` that draws from ``sampler``, re-created from its constructor arguments as Lightning
    re-creates a loader for DDP (``lightning.pytorch.utilities.data._update_dataloader``).

    Args:
        dataloader: the loader to copy.
        sampler: the sampler of the copy.

    Why: a one-pipeline shuffled loader gets a seeded one-replica ``DistributedSampler`` so that every stage reads
    the same batches (:func:`~lightning_gpipe.lightning.data.same_batches`); Lightning's helper handles the user's
    ``DataLoader`` subclasses as it does for DDP.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return _update_dataloader(dataloader, sampler)


# ---------------------------------------------------------------------------------------------- the Trainer


def uses_distributed_sampler(trainer: "pl.Trainer") -> bool:
    """``Trainer(use_distributed_sampler=...)`` as given (``trainer._accelerator_connector``).

    Args:
        trainer: the running Trainer.

    Why: :func:`~lightning_gpipe.lightning.data.same_batches` replaces a loader's sampler only where the user let
    Lightning do so; the Trainer keeps the flag on its private accelerator connector.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return trainer._accelerator_connector.use_distributed_sampler


def evaluation_max_batches(trainer: "pl.Trainer") -> list:
    """The number of batches of each loader of the running validation or test loop (``trainer._evaluation_loop``).

    Args:
        trainer: a Trainer in validation or test, or fitting (its validation loop).

    Why: every stage must run as many evaluation batches (:func:`~lightning_gpipe.lightning.agreement.
    same_batch_counts`); the Trainer names the running evaluation loop only through this private property.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return trainer._evaluation_loop.max_batches


def training_dataloaders(trainer: "pl.Trainer") -> Any:
    """The training loader(s) as the module or the datamodule returns them, before the fit loop sets them up
    (``trainer.fit_loop._data_source.dataloader()``).

    Args:
        trainer: a fitting Trainer.

    Why: profiling the backbone for ``balance`` needs a sample batch when ``example_input_array`` is not set,
    before the loop starts.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return trainer.fit_loop._data_source.dataloader()


def backward_skipped(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop skips this training step's backward (``trainer.fit_loop._skip_backward``, e.g. set by
    ``StochasticWeightAveraging`` in its last epoch).

    Args:
        trainer: a fitting Trainer.

    Why: under fill-drain the stage's random stream stays in from the backbone call to the end of the drain only
    when the backward comes (:func:`~lightning_gpipe.lightning.step.quiet_until_backward`).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return trainer.fit_loop._skip_backward


def replace_sigterm_broadcast(trainer: "pl.Trainer", replacement: Callable[[], None]) -> None:
    """Replace, on this Trainer's training epoch loop, Lightning's per-step broadcast of rank 0's SIGTERM mark
    (``trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor``) by ``replacement``.

    Args:
        trainer: the running Trainer.
        replacement: called instead, with no arguments, where Lightning broadcasts.

    Why: the stages agree on stop signals in every step (:mod:`~lightning_gpipe.lightning.agreement`); Lightning's
    broadcast is a blocking collective with a device-to-host copy in every step, and would pair with another
    stage's collective.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    # a method patched on the instance: Lightning declares it as a method, which mypy does not let be assigned
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = replacement  # type: ignore[method-assign]


def give_device_mesh(module: "pl.LightningModule", mesh: Any) -> None:
    """Make ``mesh`` the module's ``self.device_mesh`` (``module._device_mesh``), as Lightning's
    ``ModelParallelStrategy.setup_environment`` does.

    Why: a LightningModule reads its mesh through the read-only ``device_mesh`` property, which Lightning's
    strategies fill by this attribute; a user who moves from ``ModelParallelStrategy`` keeps
    ``self.device_mesh["tensor_parallel"]``.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    module._device_mesh = mesh


def configure_model_after_split(module: "pl.LightningModule", skip_first: bool) -> Callable[[], None] | None:
    """What calls ``module.configure_model()`` after the split (``None`` if the module does not override the hook);
    with ``skip_first``, Lightning's next call of it (the one before the split) does nothing.

    Why: Lightning calls the hook (``trainer.call._call_configure_model``, through ``getattr(module,
    "configure_model")``) after ``setup_environment`` and before ``Strategy.setup``, on the whole module; with tensor
    parallelism it must also run after the split, on the layers the stage holds (:mod:`~lightning_gpipe.lightning.
    tensor_parallel`): Lightning asks the hook to be idempotent, as it calls it for every fit, validation, test and
    prediction. Where the module already holds its layers, its only call comes after the split: an attribute of the
    instance stands for the method until the returned function removes it.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("configure_model", module):
        return None
    hook = module.configure_model

    def call() -> None:
        vars(module).pop("configure_model", None)
        hook()

    if skip_first:
        module.configure_model = lambda: None  # type: ignore[method-assign]
    return call


def attached_trainer(module: "pl.LightningModule") -> "pl.Trainer | None":
    """The Trainer ``module`` is attached to, or ``None`` (``module._trainer``; ``module.trainer`` raises instead).

    Args:
        module: a LightningModule.

    Why: ``configure_optimizers`` of the Hugging Face modules reads ``estimated_stepping_batches`` when there is a
    Trainer, and must work without one.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return module._trainer


def closure_result(closure: Any) -> Any:
    """The result of an automatic-optimization ``Closure`` after it ran (its ``_result``, a ``ClosureResult`` whose
    ``loss`` and ``extra`` Lightning hands to ``on_train_batch_end``), or ``None``.

    Args:
        closure: what the optimizer step calls (a ``Closure``, or any callable).

    Why: on a stage before the last, the step's output becomes the last stage's when its shape changed
    (:func:`~lightning_gpipe.lightning.step.hand_output`).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return getattr(closure, "_result", None)


def summary_max_depth(callback: Any) -> int:
    """The ``max_depth`` a ``ModelSummary`` callback was made with (its ``_max_depth``; there is no public one).

    Args:
        callback: a ``ModelSummary`` (or ``RichModelSummary``).

    Why: :func:`~lightning_gpipe.lightning.summary.replace_model_summary` puts a pipeline summary of the same depth
    in its place.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return callback._max_depth


def summary_kwargs(callback: Any) -> dict[str, Any]:
    """The keyword arguments a ``ModelSummary`` callback passes on to ``summarize`` (its ``_summarize_kwargs``).

    Args:
        callback: a ``ModelSummary`` (or ``RichModelSummary``).

    Why: the other half of :func:`summary_max_depth`.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return callback._summarize_kwargs


# ------------------------------------------------------------------------------------------ the signal connector


def original_signal_handler(trainer: "pl.Trainer", signum: int) -> Any:
    """The handler of ``signum`` before Lightning registered its own for this run (``trainer._signal_connector.
    _original_handlers``), or ``None``.

    Args:
        trainer: the running Trainer.
        signum: the signal.

    Why: the stages' marking SIGTERM handler calls the user's own after it, as Lightning's does, and the requeue
    signal is left alone when the user handles it.

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return trainer._signal_connector._original_handlers.get(signum)


def mark_sigterm(trainer: "pl.Trainer") -> None:
    """Set Lightning's SIGTERM mark (``trainer._signal_connector.received_sigterm``), which its loops check at the
    end of each batch to stop.

    Args:
        trainer: the running Trainer.

    Why: every stage sets it at the same step, once the stages agree on a SIGTERM (:mod:`~lightning_gpipe.lightning.
    signals`).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    trainer._signal_connector.received_sigterm = True


def requeue(trainer: "pl.Trainer", signum: int) -> None:
    """Run Lightning's SLURM requeue handler (``trainer._signal_connector._slurm_sigusr_handler_fn``): save the HPC
    checkpoint and, on global rank 0, ``scontrol requeue`` the job.

    Args:
        trainer: the running Trainer.
        signum: the requeue signal.

    Why: every stage runs it at the same step, once the stages agree on a requeue, instead of inside the signal
    handler (:class:`~lightning_gpipe.lightning.agreement.StopSignals`).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    # Lightning annotates the frame as FrameType; its handler never reads it, and there is no frame to give here
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ logged values


def logged_results(trainer: "pl.Trainer") -> Any:
    """The running loop's logged values (``trainer._results``, a ``_ResultCollection``: a dict of ``_ResultMetric``
    by key), or ``None`` outside a loop.

    Args:
        trainer: the Trainer.

    Why: only the last stage runs the user's ``self.log`` calls; the relays copy its logged values, with their
    epoch accumulation state, to the other stages (:mod:`~lightning_gpipe.lightning.relay`).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return trainer._results


TENSOR_FIELDS = ("value", "cumulated_batch_size", "_forward_cache", "_computed")
"""The attributes of a logged value (Lightning's ``_ResultMetric``, a torchmetrics ``Metric``) that hold its tensors.

Checked on: lightning 2.6.0, 2.6.6 (torchmetrics 1.9.0)."""

SCALAR_FIELDS = ("_update_count", "has_reset", "_is_synced", "_should_unsync")
"""The attributes of a logged value that change from step to step and are not tensors.

Checked on: lightning 2.6.0, 2.6.6 (torchmetrics 1.9.0)."""


def result_metric_state(value: Any) -> tuple[dict[str, Tensor | None], tuple] | None:
    """What changes from step to step in a logged tensor value: its :data:`TENSOR_FIELDS` that it has (by name, in
    that order) and its :data:`SCALAR_FIELDS` (in that order, ``None`` where it has none); ``None`` for anything
    that is not a ``_ResultMetric`` of tensors (a logged torchmetrics ``Metric``).

    Args:
        value: an entry of :func:`logged_results`.

    Why: the step relay describes each logged value by its metadata and these fields, and sends the tensors
    without a device-to-host copy (:class:`~lightning_gpipe.lightning.relay.StepRelay`).

    Checked on: lightning 2.6.0, 2.6.6 (torchmetrics 1.9.0).
    """
    fields = getattr(value, "__dict__", {})
    names = [name for name in TENSOR_FIELDS if name in fields]
    if not (getattr(value, "is_tensor", False) and all(isinstance(fields[n], (Tensor, type(None))) for n in names)):
        return None
    return {name: fields[name] for name in names}, tuple(fields.get(name) for name in SCALAR_FIELDS)


def set_result_metric_state(value: Any, tensors: Mapping[str, Tensor | None], scalars: Sequence) -> None:
    """Give the logged value ``value`` the state :func:`result_metric_state` returned on another stage.

    Args:
        value: a ``_ResultMetric`` (see :func:`new_result_metric`).
        tensors: its tensor fields, by name.
        scalars: its :data:`SCALAR_FIELDS`, in that order.

    Why: the other half of :func:`result_metric_state`.

    Checked on: lightning 2.6.0, 2.6.6 (torchmetrics 1.9.0).
    """
    for name, tensor in tensors.items():
        object.__setattr__(value, name, tensor)
    for name, scalar in zip(SCALAR_FIELDS, scalars):
        object.__setattr__(value, name, scalar)


def new_result_metric(meta: Any, device: torch.device) -> Any:
    """A new Lightning ``_ResultMetric`` of tensor values with the metadata ``meta`` (a ``_Metadata``), on ``device``.

    Args:
        meta: how the value was logged, as the last stage's entry holds it.
        device: where its tensors go.

    Why: the step relay rebuilds the last stage's logged values around the received tensors
    (:class:`~lightning_gpipe.lightning.relay.StepRelay`).

    Checked on: lightning 2.6.0, 2.6.6.
    """
    return _ResultMetric(meta, is_tensor=True).to(device)
