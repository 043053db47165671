"""MeshStrategy: the processes of a (data-parallel x pipeline) mesh, as Lightning's parallel strategies see them.

One OS process per device, launched like DDP. This base of :class:`~lightning_gpipe.lightning.strategy.GPipeStrategy`
owns what every process of the job does alike, whatever runs in it: the launcher, the process groups of the mesh
(:func:`resolve_topology`, :class:`~lightning_gpipe.engine.Topology`), the failure board and the stall watchdog
(:mod:`~lightning_gpipe.faults.failure`, :mod:`~lightning_gpipe.faults.watchdog`), the shared random state
(:class:`~lightning_gpipe.lightning.contract.StageRandomness`), collectives that leave signals handled
(:mod:`~lightning_gpipe.faults.waiting`), and the agreement before every step
(:mod:`~lightning_gpipe.lightning.agreement`).
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_gpipe._torch import default_store
from lightning_gpipe.engine import Topology, groups
from lightning_gpipe.faults import Job, LauncherWatch, mark_launcher, waiting, watch_launcher
from lightning_gpipe.lightning._lightning import (
    LaunchedParallelStrategy,
    configure_model_after_split,
    default_process_group_backend,
    end_launched_processes,
    evaluation_max_batches,
    give_device_mesh,
    init_process_group,
    replace_sigterm_broadcast,
    uses_distributed_sampler,
)
from lightning_gpipe.lightning.agreement import RunAgreement, StepAgreement, StopSignals, same_batch_counts
from lightning_gpipe.lightning.backbone import find_backbone
from lightning_gpipe.lightning.config import (
    STALL_LIMIT_NOTE,
    PipelineConfig,
    Size,
    check_tensor_parallel_replicas,
    check_tensor_parallel_scaler,
    checked_size,
)
from lightning_gpipe.lightning.contract import StageRandomness
from lightning_gpipe.lightning.data import same_batches, same_datasets
from lightning_gpipe.lightning.data_parallel import reduce_over_replicas


class MeshStrategy(LaunchedParallelStrategy):
    """A parallel strategy whose processes form a (data-parallel x pipeline) mesh (see the module docstring).

    With ``data_parallel_size`` D and ``pipeline_parallel_size`` K, global rank ``r`` is stage ``r % K`` of
    replica ``r // K``; the stages of a replica read the same batches, and each replica its own shard.

    Args:
        config: the validated options (:class:`~lightning_gpipe.lightning.config.PipelineConfig`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            other parallel strategies; the Trainer fills them in.
    """

    def __init__(
        self,
        config: PipelineConfig,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.config = config
        self._num_nodes = 1
        self._pipeline_group: dist.ProcessGroup | None = None  # the stages of this process's replica
        self._data_parallel_group: dist.ProcessGroup | None = None  # the replicas of this process's stage
        self._control_group: dist.ProcessGroup | None = None  # gloo beside a device backend (NCCL); None: gloo
        self._device_mesh: DeviceMesh | None = None  # from setup_environment
        self.deferred_configure_model: Callable[[], None] | None = None  # runs the module's, after the split
        self._randomness = StageRandomness()  # one stream until setup_environment seeds the stage's own
        self._agreement: RunAgreement | None = None  # from setup_environment
        self._job = Job()  # one without a store until setup_environment creates the run's
        self._launcher_watch: LauncherWatch | None = None  # in a process a launcher started, from setup_environment

    @property
    @override
    def num_nodes(self) -> int:
        """Number of nodes the job spans."""
        return self._num_nodes

    @num_nodes.setter
    @override
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def num_processes(self) -> int:
        """Number of processes on this node, one per device."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        """The device of this process."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @override
    def model_to_device(self) -> None:
        """Move this process's part of the module (its stage) to its device."""
        assert self.model is not None  # the attached module, at least
        self.model.to(self.root_device)

    @property
    def topology(self) -> Topology:
        """The data-parallel x pipeline mesh of this job (see :func:`resolve_topology`).

        Raises:
            ValueError: if the mesh sizes or a list ``balance`` do not fit ``devices * num_nodes``, or for
                tensor-parallel stages whose replicas DDP would keep in step.
        """
        config = self.config
        assert config.virtual_stages is not None  # PipelineConfig gives the default
        sizes = (config.pipeline_parallel_size, config.data_parallel_size, config.balance)
        chunks, tensor = (config.virtual_stages, config.v_shape), config.tensor_parallel_size
        topology = resolve_topology(*sizes, self.num_processes, self.num_nodes, *chunks, tensor_parallel_size=tensor)
        check_tensor_parallel_replicas(config, topology.data_parallel_size)
        return topology

    @property
    def stage_index(self) -> int:
        """Pipeline rank of this process (0 is the first stage)."""
        return self.topology.stage_of(self.global_rank)

    @property
    def replica_index(self) -> int:
        """Data-parallel rank of this process (the pipeline replica it belongs to, 0-based)."""
        return self.topology.replica_of(self.global_rank)

    @property
    def pipeline_index(self) -> int:
        """The pipeline this process is a stage of (:meth:`~lightning_gpipe.engine.Topology.pipeline_of`: its
        data-parallel rank without tensor parallelism)."""
        return self.topology.pipeline_of(self.global_rank)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The job's device mesh (:meth:`~lightning_gpipe.engine.Topology.mesh`), named as Lightning's
        ``ModelParallelStrategy`` names its dimensions, ``"data_parallel"`` and ``"tensor_parallel"`` (with
        ``tensor_parallel_size > 1``), and ``"pipeline_parallel"``; the LightningModule sees it as
        ``self.device_mesh``. ``None`` before ``setup_environment``."""
        return self._device_mesh

    @property
    def job(self) -> Job:
        """This process's part of the current run (failure board, position, stall watchdog, waiter; see
        :class:`~lightning_gpipe.faults.job.Job`), created in ``setup_environment``; before it, and after ``teardown``,
        one without a store (nothing is published)."""
        return self._job

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The process group of this process's replica (its pipeline's stages); ``None`` before setup."""
        return self._pipeline_group

    @property
    def is_distributed(self) -> bool:
        """Whether there are several pipeline replicas: then Lightning gives each data loader a
        ``DistributedSampler`` over them (see :attr:`distributed_sampler_kwargs`)."""
        return self.topology.data_parallel_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """All stages of one pipeline read the same batches: the sampler sees the data-parallel world only."""
        return {"num_replicas": self.topology.data_parallel_size, "rank": self.replica_index}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make every stage of a pipeline read the same batches (see
        :func:`~lightning_gpipe.lightning.data.same_batches`)."""
        resample = uses_distributed_sampler(_trainer_of(self))
        return same_batches(dataloader, self.replica_index, self.topology.data_parallel_size, resample)

    @override
    def _launch_start_method(self) -> str:
        _ = self.topology  # a mesh that does not fit the job fails here, before any process starts
        check_tensor_parallel_scaler(self.config, getattr(self.precision_plugin, "scaler", None) is not None)
        if self.config.start_method != "popen" or not _environment_of(self).creates_processes_externally:
            mark_launcher()  # this process starts the others, which watch it (see faults.watchdog)
        return self.config.start_method

    @override
    def setup_environment(self) -> None:
        """Select the device, join the process groups, the failure board and the stall watchdog, take the stages'
        shared random state (see :class:`~lightning_gpipe.lightning.contract.StageRandomness`), and prepare the
        agreement before each step. Until the job's store exists, a failure ends the processes this one launched, and
        a process that a launcher started ends once the launcher has (see :mod:`~lightning_gpipe.faults.watchdog`)."""
        environment, topology = _environment_of(self), self.topology
        with _ending_launched_processes_on_failure(self.launcher):
            super().setup_environment()
            reset_seed()
            environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            environment.set_world_size(self.num_nodes * self.num_processes)
            # Lightning sets this attribute on its function at run time; its annotations do not declare it
            rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
            self._launcher_watch = watch_launcher(topology.name(self.global_rank), lambda: self._job.board)
            self._device_mesh, self._control_group = _join_process_groups(self)
            self._pipeline_group, self._data_parallel_group = groups(self._device_mesh)
            _share_mesh(self)
            names = {rank: topology.name(rank) for rank in range(topology.world_size)}
            store = default_store()
            self._job.close()
            limit = self.config.stall_limit()
            self._job = Job(store, self.global_rank, names, limit, self.world_size, STALL_LIMIT_NOTE)
        self._randomness = StageRandomness.synchronized(self.stage_index, topology.num_stages, self.broadcast)
        replicas, signals = topology.data_parallel_size, StopSignals(_trainer_of(self), self.launcher, environment)
        step = StepAgreement(self.replica_index, replicas, names, self._job, self._control_group)
        self._agreement = RunAgreement(step if self.world_size > 1 else None, signals)

    @override
    def on_train_start(self) -> None:
        """Check the stages' batch counts and take stop signals at step boundaries (see :meth:`_start_loop`). The
        stages agree on stop signals in every step (:class:`~lightning_gpipe.lightning.agreement.RunAgreement`), so
        Lightning's own per-step broadcast of rank 0's SIGTERM mark, a blocking collective with a device-to-host copy,
        is left out."""
        trainer = _trainer_of(self)
        self._start_loop("training", [trainer.num_training_batches])
        if self.world_size > 1:
            replace_sigterm_broadcast(trainer, _agreed_instead)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Take the batch's fingerprint on the host, before Lightning moves it to the device (see
        :func:`~lightning_gpipe.lightning.agreement.fingerprint`), then move it."""
        if self._agreement is not None:
            self._agreement.take(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_validation_start(self) -> None:
        """Check that every stage has as many validation batches (see :meth:`_start_loop`)."""
        self._start_loop("validation", evaluation_max_batches(_trainer_of(self)))

    @override
    def on_test_start(self) -> None:
        """Check that every stage has as many test batches (see :meth:`_start_loop`)."""
        self._start_loop("test", evaluation_max_batches(_trainer_of(self)))

    @override
    def on_predict_start(self) -> None:
        """Check that every stage has as many prediction batches (see :meth:`_start_loop`)."""
        self._start_loop("prediction", _trainer_of(self).predict_loop.max_batches)

    def _start_loop(self, loop: str, counts: list) -> None:
        """Check that the stages hold the same datasets (see :func:`~lightning_gpipe.lightning.data.same_datasets`)
        and loaders of as many batches (see :func:`~lightning_gpipe.lightning.agreement.same_batch_counts`), then take
        the stop signals at step boundaries (Lightning registers its handlers at the start of each loop)."""
        same_datasets(_trainer_of(self), loop, self.topology, self._job)
        same_batch_counts(loop, counts, self._job)
        assert self._agreement is not None  # made in setup_environment
        self._agreement.signals.install()

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce ``tensor`` over this stage's replicas (``self.log(..., sync_dist=True)`` calls this), as DDP does;
        the stages of a pipeline hold parts of one step, not copies, and never average with each other (see
        :func:`~lightning_gpipe.lightning.data_parallel.reduce_over_replicas`).

        Raises:
            ValueError: for a ``reduce_op`` other than ``"mean"``, ``"avg"`` or ``"sum"``.
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        replicas = self.topology.data_parallel_size if dist.is_initialized() else 1
        return reduce_over_replicas(tensor, reduce_op, self._data_parallel_group, replicas, self._job)

    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point (interruptibly: :mod:`lightning_gpipe.faults.waiting`)."""
        if dist.is_initialized():
            waiting.barrier(self._job)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send the picklable ``obj`` from global rank ``src`` to every process (interruptibly)."""
        return waiting.broadcast_object(self._job, obj, src) if dist.is_initialized() else obj

    @property
    def _last_stage_rank(self) -> int:
        return self.topology.rank_of(self.topology.last_stage, self.pipeline_index)

    def _share_from_last_stage(self, obj: Any) -> Any:
        """``obj`` of this pipeline's last stage, on every stage of the pipeline (a collective call)."""
        if not dist.is_initialized():
            return obj
        return waiting.broadcast_object(self._job, obj, self._last_stage_rank, group=self.pipeline_group)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Publish the exception so that the other processes exit naming it instead of hanging, then wait (a few
        seconds at most) until every process has read it (:meth:`~lightning_gpipe.faults.failure.FailureBoard.linger`).
        Lightning's ``SIGTERMException`` is not published: every stage raises it at the same step, by agreement. On a
        ``KeyboardInterrupt`` it says where the other stages were last seen; Lightning's launcher then ends them."""
        if not isinstance(exception, SIGTERMException):
            self._job.board.report(exception)
            self._job.board.linger()
        if isinstance(exception, KeyboardInterrupt):  # the launcher ends the other stages next, whatever they do
            self._job.board.say(f"interrupted; ending every stage. {self._job.watchdog.last_positions()}.")

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then stop watching the launcher, and close this run's agreement and job."""
        super().teardown()
        if self._launcher_watch is not None:  # first: a watch that then finds the job closed knows the run ended
            self._launcher_watch.stop()
        self._agreement = None
        self._randomness = StageRandomness()
        self._job.close()


def _environment_of(strategy: MeshStrategy) -> ClusterEnvironment:
    """The strategy's cluster environment, given by the Trainer before it configures the launcher."""
    environment = strategy.cluster_environment
    assert environment is not None  # given by the Trainer before it configures the launcher
    return environment


@contextmanager
def _ending_launched_processes_on_failure(launcher: Any) -> Iterator[None]:
    """End the processes ``launcher`` started (see :func:`~lightning_gpipe.lightning._lightning.
    end_launched_processes`) if the block raises: before the job's store exists, they cannot learn of it."""
    try:
        yield
    except BaseException:
        end_launched_processes(launcher)
        raise


def _join_process_groups(strategy: MeshStrategy) -> tuple[DeviceMesh, dist.ProcessGroup | None]:
    """Join the default process group (see :func:`~lightning_gpipe.lightning._lightning.init_process_group`), then
    create the mesh and its groups; return the mesh and the gloo group of the host-read messages beside a device
    backend (``None`` on gloo).

    Raises:
        RuntimeError: torch.distributed's error; when global rank 0 cannot listen on ``MASTER_PORT`` (another
            program does), of the same type, naming the port and what to do.
    """
    environment, device = _environment_of(strategy), strategy.root_device
    backend = strategy.config.process_group_backend or default_process_group_backend(device)
    try:
        init_process_group(environment, backend, strategy.config.timeout)
    except RuntimeError as error:
        if "EADDRINUSE" not in str(error):
            raise
        port, address = environment.main_port, environment.main_address
        raise type(error)(
            f"MASTER_PORT={port} is in use on {address} (EADDRINUSE): another program listens there, so global rank"
            " 0 cannot create the job's store. Set MASTER_PORT to a free port (without MASTER_PORT, Lightning's"
            " default environment picks a free one)."
        ) from error
    return strategy.topology.mesh(device.type), None if backend == "gloo" else dist.new_group(backend="gloo")


def _share_mesh(strategy: MeshStrategy) -> None:
    """Give the LightningModule the job's device mesh as ``self.device_mesh``, as Lightning's
    ``ModelParallelStrategy`` does in its ``setup_environment`` (before ``configure_model``); with tensor
    parallelism, ``configure_model`` is called again after the split, for the stage's layers
    (:attr:`deferred_configure_model`), and Lightning's call before it is skipped if the module already holds its
    backbone."""
    module = strategy.lightning_module
    if module is None:
        return
    give_device_mesh(module, strategy.device_mesh)
    if strategy.topology.tensor_parallel_size > 1:  # built in __init__: configure_model runs after the split only
        built = _has_backbone(module, strategy.config.backbone)
        strategy.deferred_configure_model = configure_model_after_split(module, skip_first=built)


def _has_backbone(module: "pl.LightningModule", name: str | None) -> bool:
    """Whether ``module`` holds its backbone before ``configure_model`` runs (else the hook creates it)."""
    try:
        find_backbone(module, name)
    except ValueError:
        return False
    return True


def _trainer_of(strategy: MeshStrategy) -> "pl.Trainer":
    """The Trainer of the strategy's module, attached before any of the hooks that ask for it run."""
    module = strategy.lightning_module
    assert module is not None  # attached by the Trainer (Strategy.connect) before setup_environment and the loops
    return module.trainer


def _agreed_instead() -> None:
    """Stands for Lightning's per-step broadcast of rank 0's SIGTERM mark: the stages agree on stop signals in
    every step instead (:meth:`~lightning_gpipe.lightning.agreement.RunAgreement.end_training_step`)."""


def resolve_topology(
    pipeline_parallel_size: Size,
    data_parallel_size: Size,
    balance: Any,
    devices_per_node: int,
    num_nodes: int,
    virtual_stages: int = 1,
    v_shape: bool = False,
    tensor_parallel_size: int = 1,
) -> Topology:
    """The mesh the strategy's arguments ask for, checked against the job's size.

    ``"auto"`` sizes follow Lightning's ``ModelParallelStrategy``: the pipeline takes the length of a list
    ``balance``, else the other size's quotient, else the devices of one node (each node holds one pipeline;
    the replicas are the nodes), in stages of ``tensor_parallel_size`` processes.

    Args:
        pipeline_parallel_size: K, the stages of each pipeline, or ``"auto"``.
        data_parallel_size: the pipeline replicas, or ``"auto"``.
        balance: the strategy's ``balance`` (a list fixes ``K * virtual_stages``).
        devices_per_node: processes per node (``devices``).
        num_nodes: nodes of the job.
        virtual_stages: model chunks per stage (default 1).
        v_shape: whether they are placed in a V (:class:`~lightning_gpipe.engine.Topology`).
        tensor_parallel_size: T, the tensor-parallel ranks of each stage (default 1).

    Raises:
        ValueError: if a size is neither a positive integer nor ``"auto"``, if the sizes' product is not the world
            size ``devices * num_nodes`` (T dividing a node's devices), if a list ``balance`` has another length than
            ``K * virtual_stages``, or for virtual stages on a one-stage pipeline.
    """
    tp = _checked_tensor_parallel(tensor_parallel_size, devices_per_node, num_nodes)
    per_node = devices_per_node // tp  # stages (of T processes each) per node, and in the job:
    stages = per_node * num_nodes
    pp = checked_size(pipeline_parallel_size, "pipeline_parallel_size")
    dp = checked_size(data_parallel_size, "data_parallel_size")
    stages_listed = _stages_listed(balance, virtual_stages)
    if pp == "auto":
        quotient = stages // dp if dp != "auto" and stages % dp == 0 else per_node
        pp = stages_listed if stages_listed is not None else quotient
    job = f"{stages * tp} processes (devices={devices_per_node} x num_nodes={num_nodes}{_in_stages(stages, tp)})"
    if stages_listed is not None and pipeline_parallel_size == "auto" and stages % pp:
        raise ValueError(
            f"GPipeStrategy(balance={list(balance)}) gives pipelines of {pp} stages, which cannot fill the job's"
            f" {job}: the number of processes must be a multiple of the stages. Give one layer count per stage of one"
            " pipeline."
        )
    if dp == "auto":
        dp = max(stages // pp, 1)
    if pp * dp != stages:
        tensor = (f", tensor_parallel_size={tp}", f" x {tp} tensor ranks") if tp > 1 else ("", "")
        raise ValueError(
            f"GPipeStrategy(pipeline_parallel_size={pipeline_parallel_size!r},"
            f" data_parallel_size={data_parallel_size!r}{tensor[0]}) makes a mesh of {pp} stages x {dp}"
            f" replicas{tensor[1]} = {pp * dp * tp} processes, but the job has {job}. Choose sizes whose product is"
            " devices * num_nodes, or leave them 'auto'."
        )
    _check_stages_listed(balance, pp, virtual_stages, pipeline_parallel_size, stages * tp)
    _check_virtual_stages(pp, virtual_stages, v_shape)
    return Topology(stages * tp, pp, virtual_stages=virtual_stages, v_shape=v_shape, tensor_parallel_size=tp)


def _in_stages(stages: int, tp: int) -> str:
    """How a message says that the job's processes make ``stages`` stages of ``tp`` processes ("" for ``tp`` 1)."""
    return f"; {stages} stages of tensor_parallel_size={tp}" if tp > 1 else ""


def _checked_tensor_parallel(tensor_parallel_size: int, devices_per_node: int, num_nodes: int) -> int:
    """``tensor_parallel_size``, if it divides the devices of a node (the tensor ranks of a stage share one node's
    links); else a ``ValueError`` naming the fix."""
    if devices_per_node % tensor_parallel_size == 0:
        return tensor_parallel_size
    raise ValueError(
        f"GPipeStrategy(tensor_parallel_size={tensor_parallel_size}) splits each stage's layers over"
        f" {tensor_parallel_size} processes of one node, but a node has devices={devices_per_node}"
        f" (num_nodes={num_nodes}). Choose a tensor_parallel_size that divides devices."
    )


def _stages_listed(balance: Any, virtual_stages: int) -> int | None:
    """The stages (processes) a list ``balance`` gives with ``virtual_stages`` model chunks each; ``None`` for a mode.

    Raises:
        ValueError: if the list's length is not a multiple of ``virtual_stages``.
    """
    if balance is None or isinstance(balance, str) or not isinstance(balance, Sequence):
        return None
    if len(balance) % virtual_stages:
        raise ValueError(
            f"GPipeStrategy(balance={list(balance)}, virtual_stages={virtual_stages}): give one layer count per"
            f" virtual stage, K * virtual_stages entries for K stages; {len(balance)} is not a multiple of"
            f" {virtual_stages}."
        )
    return len(balance) // virtual_stages


def _check_stages_listed(balance: Any, pp: int, virtual_stages: int, pipeline_parallel_size: Size, world: int) -> None:
    """Raise a ``ValueError`` if a list ``balance`` has another length than the ``pp * virtual_stages`` virtual stages
    of the mesh, resolved from ``pipeline_parallel_size`` on ``world`` processes."""
    if _stages_listed(balance, virtual_stages) is None or len(balance) == pp * virtual_stages:
        return
    per = "stage" if virtual_stages == 1 else f"virtual stage ({pp} stages x virtual_stages={virtual_stages})"
    raise ValueError(
        f"GPipeStrategy(balance={list(balance)}) gives {len(balance)} stages, but the pipeline has"
        f" {pp * virtual_stages} (pipeline_parallel_size={pipeline_parallel_size!r} of {world} processes). Give one"
        f" balance entry per {per}, or set pipeline_parallel_size to the length of balance."
    )


def _check_virtual_stages(pp: int, virtual_stages: int, v_shape: bool) -> None:
    """Raise a ``ValueError`` naming the fix for model chunks interleaved on a pipeline of one stage (``pp``)."""
    if pp > 1:
        return
    if v_shape:
        raise ValueError(
            "GPipeStrategy's V schedules ('zb-v', 'v-min', 'v-half', 'v-zb') place two model chunks per stage in a V"
            " across the stages, but the pipeline has one stage; use more devices per pipeline, or another schedule."
        )
    if virtual_stages > 1:
        raise ValueError(
            f"GPipeStrategy(virtual_stages={virtual_stages}) interleaves model chunks between stages, but the"
            " pipeline has one stage; use virtual_stages=1, or more devices per pipeline."
        )
