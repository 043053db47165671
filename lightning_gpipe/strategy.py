"""GPipeStrategy: GPipe pipeline parallelism behind Lightning's strategy hooks.

How one step maps onto Lightning (see docs/how-it-works.md): ``training_step`` is the
fill, ``backward`` is the drain, and the optimizer step, clipping, schedulers and
gradient accumulation stay Lightning's. Under ``schedule="1f1b"``, ``training_step`` runs the
whole step and ``backward`` hands its gradients over. This module only wires the hooks; the
work is done by :mod:`lightning_gpipe.partition`, :mod:`lightning_gpipe.contract`,
:mod:`lightning_gpipe.schedule`, :mod:`lightning_gpipe.stage`, :mod:`lightning_gpipe.transfer`
and :mod:`lightning_gpipe.relay`.
"""

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_gpipe import collectives, failure, state_dict, watchdog
from lightning_gpipe.agreement import StepAgreement
from lightning_gpipe.balance import MODES, LayerCost, resolve_balance
from lightning_gpipe.balance.backbone import profile_backbone
from lightning_gpipe.batchnorm import convert_deferred_batch_norm, revert_deferred_batch_norm
from lightning_gpipe.contract import BackboneCall
from lightning_gpipe.data import same_batches
from lightning_gpipe.data_parallel import GradientSync
from lightning_gpipe.gradients import StepGradients
from lightning_gpipe.optimization import SharedGradScaler, clip_grad_norm_
from lightning_gpipe.partition import Split, find_backbone, materialize
from lightning_gpipe.randomness import StageRandomness
from lightning_gpipe.rematerialization import CHECKPOINT_MODES
from lightning_gpipe.relay import LogRelay, share_step_output
from lightning_gpipe.runtime import Runtime
from lightning_gpipe.schedule import SCHEDULES
from lightning_gpipe.signals import StopSignals
from lightning_gpipe.skip import SkipLayout
from lightning_gpipe.skip.links import SkipLinks
from lightning_gpipe.stage import Stage
from lightning_gpipe.summary import replace_model_summary
from lightning_gpipe.ties import TiedParameters, find_ties
from lightning_gpipe.topology import Size, Topology, checked_size, groups, resolve_topology
from lightning_gpipe.transfer import Link


class GPipeStrategy(ParallelStrategy):
    """Train a LightningModule whose ``nn.Sequential`` backbone is split into stages, one per device of a pipeline.

    GPipe (Huang et al. 2019, arXiv:1811.06965): each mini-batch is split into
    ``chunks`` micro-batches that flow through the stages (the fill), then flow
    back in reverse order (the drain); gradients accumulate and one optimizer step
    follows, so training is synchronous and equals single-device mini-batch
    training. Argument names follow torchgpipe.

    One OS process per stage, launched like DDP. The processes form a (data-parallel x pipeline) mesh: with
    ``data_parallel_size`` D and ``pipeline_parallel_size`` K, global rank ``r`` is stage ``r % K`` of replica
    ``r // K``; each replica reads its own shard of the data, and each stage's replicas average their gradients
    once per optimizer step with DDP (see docs/scaling.md). The backbone is the only part that is split: code
    before the backbone call must hold no parameters, and modules after it (heads, losses, metrics) run on the
    last stage. Skip connections between backbone layers (:mod:`lightning_gpipe.skip`) go straight from the
    stashing stage to the popping one; a parameter used on several stages (tied weights) is kept in step on
    each of them (:mod:`lightning_gpipe.ties`). See docs/contract.md.

    Args:
        balance: how many consecutive backbone layers each stage holds. A list gives them, one entry per
            device, e.g. ``[3, 5]``. A mode chooses the contiguous split whose costliest stage is cheapest
            (exactly, see :func:`~lightning_gpipe.balance.solve`): ``"params"`` by parameter count,
            ``"time"`` by forward + backward time, ``"memory"`` by saved activations + parameters. ``None``
            (default) means ``"params"``. ``"time"`` and ``"memory"`` profile each layer, one at a time on
            global rank 0's device, on the first micro-batch of the module's ``example_input_array`` (the
            input of ``forward``) or else of the first training batch; the costs are kept in
            :attr:`layer_costs` and reused by later runs of the same strategy. See docs/balance.md.
        balance_memory_limit: bytes one stage may hold, counted as its layers' profiled saved activations
            and parameters for one micro-batch (see :func:`~lightning_gpipe.balance.balance_by`); the
            split is the best one within it. ``None`` (default) for no limit. Profiles like ``"time"``.
        chunks: M, the number of micro-batches per mini-batch. ``None`` (default) uses ``4 * K`` for K > 1
            stages, the point from which the paper finds the bubble negligible, and 1 for a single stage (no
            bubble to hide, so micro-batches would only cost time; set ``chunks`` to trade time for
            activation memory with re-materialization on one device). A batch with fewer rows
            than ``chunks`` runs as one micro-batch per row; a batch that does not divide evenly gives
            uneven micro-batches (as :func:`torch.tensor_split`).
        checkpoint: re-materialization: ``"always"`` recomputes every micro-batch's forward in the
            drain, ``"except_last"`` (default) all but the last micro-batch, ``"never"`` keeps all
            activations.
        schedule: ``"gpipe"`` (default) is GPipe's fill-drain: all M forwards, then all M backwards, so a
            stage holds M micro-batches. ``"1f1b"`` is PipeDream-Flush's one-forward-one-backward schedule
            (Narayanan et al. 2021): each micro-batch's backward starts as soon as its loss exists, so stage k
            of K holds at most ``K - k`` micro-batches; same gradients, same bubble. Under ``"1f1b"`` the last
            stage runs ``training_step`` once per micro-batch on its rows of the batch, weighting each loss
            by its share of the rows (see docs/contract.md, "1F1B"). Evaluation is the same forward for both.
        deferred_batch_norm: ``True`` makes the backbone's ``nn.BatchNorm1d/2d/3d`` layers normalise with
            micro-batch statistics but update their running statistics once per mini-batch, equal to
            single-device batch norm's (see :class:`~lightning_gpipe.batchnorm.DeferredBatchNorm`); the
            plain layers are back in the module after the run. ``False`` (default) leaves batch norm as
            it is: every micro-batch, and every recompute, updates the running statistics.
        defer_weight_grad: ``True`` splits each micro-batch's backward on the stages after the first into the
            input gradient, sent to the previous stage at once, and the weight gradient, computed after the send
            (zero-bubble pipeline parallelism's B/W split, Qi et al. 2023), so the previous stage starts each
            backward one weight gradient earlier. Same gradients. Under fill-drain with ``checkpoint="never"``
            the last stage runs every weight gradient after its last input gradient (its graphs are all held
            at the fill's end anyway); elsewhere a micro-batch's graph is held no longer than without the
            split (docs/how-it-works.md). ``False`` (default) computes both in one backward.
        pipeline_parallel_size: K, the stages of each pipeline. ``"auto"`` (default): the length of a list
            ``balance``, else ``devices * num_nodes / data_parallel_size`` if that is given, else ``devices`` (one
            pipeline per node).
        data_parallel_size: D, the pipeline replicas, each training on its own shard of every batch.
            ``"auto"`` (default): ``devices * num_nodes / K``. ``K * D`` must equal ``devices * num_nodes``.
        backbone: name of the ``nn.Sequential`` attribute to pipeline; ``None`` finds the only one.
        start_method: ``"popen"`` (default) re-runs the user's script once per extra stage, like
            ``torchrun``; ``"spawn"`` starts worker processes from the main one and loads every
            stage's trained weights back into the main process's module.
        state_dict_type: ``"full"`` (default) writes a checkpoint as one file holding every stage's weights and
            optimizer state, gathered on global rank 0; it loads into the plain LightningModule without the
            strategy. ``"sharded"`` writes a directory with torch.distributed.checkpoint, each stage its own
            part, for models too large to gather. Both resume with any number of stages and any ``balance``.
        timeout: the process group's timeout: how long a collective or transfer may wait before
            torch.distributed gives up (30 minutes by default); it also caps ``stall_timeout``.
        stall_timeout: how long a stage may wait for another (a transfer, or a collective of the package's)
            before the job ends, naming the stage that stopped progressing and where it was, e.g. "stage 1 has
            been in the forward of micro-batch 3 at step 17 for 300 s". 5 minutes by default, and at most 90% of
            ``timeout`` (so that it speaks before torch.distributed gives up); ``None`` leaves only that. Writing
            a checkpoint and profiling the backbone do not count as stalls. See docs/training.md, "Failures and
            stalls".
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        accelerator: as for Lightning's other parallel strategies; the Trainer fills it in.
        parallel_devices: the devices of this node, one per stage process; the Trainer fills them in.
        cluster_environment: how ranks are found (Lightning's, e.g. ``TorchElasticEnvironment``); the Trainer
            fills it in.
        checkpoint_io: writes and reads full checkpoint files; Lightning's ``TorchCheckpointIO`` by default.
        precision_plugin: as for Lightning's other strategies; the Trainer fills it in from ``precision=``.

    Raises:
        ValueError: for ``chunks < 1``, an unknown ``checkpoint`` mode, ``schedule``, ``start_method`` or
            ``state_dict_type``, a ``balance`` that is neither a mode nor a list of integers, or a
            ``balance_memory_limit`` that is not a positive integer or comes with a list ``balance``, a
            ``stall_timeout`` that is not a positive ``timedelta``, or a mesh size that is neither a positive
            integer nor ``"auto"``. Whether the mesh and ``balance`` fit the number of devices is checked before the
            processes start, and whether ``balance`` fits the backbone when training starts, before the first step.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        balance: Union[None, Literal["params", "time", "memory"], Sequence[int]] = None,
        chunks: Optional[int] = None,
        checkpoint: Literal["always", "except_last", "never"] = "except_last",
        deferred_batch_norm: bool = False,
        defer_weight_grad: bool = False,
        backbone: Optional[str] = None,
        balance_memory_limit: Optional[int] = None,
        start_method: Literal["popen", "spawn"] = "popen",
        state_dict_type: Literal["full", "sharded"] = "full",
        schedule: Literal["gpipe", "1f1b"] = "gpipe",
        pipeline_parallel_size: Size = "auto",
        data_parallel_size: Size = "auto",
        timeout: Optional[timedelta] = default_pg_timeout,
        stall_timeout: Optional[timedelta] = timedelta(minutes=5),
        process_group_backend: Optional[str] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        _check_arguments(balance, balance_memory_limit, chunks, checkpoint, start_method, state_dict_type, schedule)
        self.pipeline_parallel_size = checked_size(pipeline_parallel_size, "pipeline_parallel_size")
        self.data_parallel_size = checked_size(data_parallel_size, "data_parallel_size")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.balance = balance if balance is None or isinstance(balance, str) else list(balance)
        self.balance_memory_limit = balance_memory_limit
        self.layer_costs: Optional[list[LayerCost]] = None  # profiled per backbone layer, when a mode needs them
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.deferred_batch_norm = deferred_batch_norm
        self.defer_weight_grad = defer_weight_grad
        self.backbone = backbone
        self._start_method = start_method
        self.state_dict_type = state_dict_type
        self._timeout = timeout
        self.stall_timeout = _checked_stall_timeout(stall_timeout)
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._split: Optional[Split] = None
        self._whole_before_split = True
        self._stage: Optional[Stage] = None
        self._runtime: Optional[Runtime] = None
        self._step_gradients = StepGradients()
        self._backbone_call: Optional[BackboneCall] = None
        self._relay: Optional[LogRelay] = None
        self._pipeline_group: Optional[dist.ProcessGroup] = None  # the stages of this process's replica
        self._data_parallel_group: Optional[dist.ProcessGroup] = None  # the replicas of this process's stage
        self._gradient_sync: Optional[GradientSync] = None
        self._ties: Optional[TiedParameters] = None
        self._randomness = StageRandomness()  # one stream until setup_environment seeds the stage's own
        self._agreement: Optional[StepAgreement] = None
        self._signals: Optional[StopSignals] = None

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
        """Number of stage processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        """The device of this process's stage."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def topology(self) -> Topology:
        """The data-parallel x pipeline mesh of this job (see :func:`~lightning_gpipe.topology.resolve_topology`).

        Raises:
            ValueError: if the mesh sizes or a list ``balance`` do not fit ``devices * num_nodes``.
        """
        return resolve_topology(
            self.pipeline_parallel_size, self.data_parallel_size, self.balance, self.num_processes, self.num_nodes
        )

    @property
    def stage_index(self) -> int:
        """Pipeline rank of this process (0 is the first stage)."""
        return self.topology.stage_of(self.global_rank)

    @property
    def replica_index(self) -> int:
        """Data-parallel rank of this process (the pipeline replica it belongs to, 0-based)."""
        return self.topology.replica_of(self.global_rank)

    @property
    def pipeline_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of this process's replica (its pipeline's stages); ``None`` before setup."""
        return self._pipeline_group

    @property
    def stage(self) -> Optional[Stage]:
        """This process's :class:`~lightning_gpipe.stage.Stage` while a model is split (``None`` before setup
        and after teardown); its ``events`` recorder is what the pipeline callbacks read."""
        return self._stage

    @property
    def is_distributed(self) -> bool:
        """Whether there are several pipeline replicas: then Lightning gives each data loader a
        ``DistributedSampler`` over them (see :attr:`distributed_sampler_kwargs`). One pipeline reads the data as
        one device does, a shuffled loader drawing its order from the seed and the epoch (see
        :meth:`process_dataloader`)."""
        return self.topology.data_parallel_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """All stages of one pipeline read the same batches: the sampler sees the data-parallel world only."""
        return {"num_replicas": self.topology.data_parallel_size, "rank": self.topology.replica_of(self.global_rank)}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make every stage of a pipeline read the same batches: a shuffled loader of one pipeline orders its rows
        from the seed and the epoch, and worker processes are seeded by data-parallel rank (see
        :func:`~lightning_gpipe.data.same_batches`)."""
        resample = self.lightning_module.trainer._accelerator_connector.use_distributed_sampler
        return same_batches(dataloader, self.replica_index, self.topology.data_parallel_size, resample)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.topology  # a mesh that does not fit the job fails here, before any process starts
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Select the device, then join the process group, the failure board and the stall watchdog."""
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        store, topology = dist.distributed_c10d._get_default_store(), self.topology
        self._pipeline_group, self._data_parallel_group = groups(topology.mesh(self.root_device.type))
        names = {rank: topology.name(rank) for rank in range(topology.world_size)}
        failure.attach(store, names[self.global_rank], self.world_size)
        # 90% of the process group's timeout at most, so that the watchdog names the stalled stage before gloo gives up
        limits = [0.9 * self._timeout.total_seconds()] if self._timeout is not None else []
        limits += [self.stall_timeout.total_seconds()] if self.stall_timeout is not None else []
        watchdog.start(store, self.global_rank, names, min(limits, default=float("inf")))
        self._randomness = StageRandomness.synchronized(self.stage_index, topology.num_stages, self.broadcast)
        self._agreement = StepAgreement(self.replica_index, topology.data_parallel_size, self.root_device, names)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Create the modules of ``configure_model`` on the meta device: each stage materialises only its own part.

        After the split, every module of this stage whose tensors are on the meta device is
        allocated on the stage's device and initialised with its ``reset_parameters()``
        (see :func:`~lightning_gpipe.partition.materialize`), so no process holds the whole model.
        """
        with torch.device("meta"):
            yield

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Like other strategies; with ``empty_init=True`` (``Trainer.init_module(empty_init=True)``) modules are
        created on the meta device and each stage materialises only its own part, as in ``configure_model``."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Split the module into this process's stage, then set up precision and the local optimizers.

        Raises:
            ValueError: if the backbone or ``balance`` does not fit (see
                :func:`~lightning_gpipe.partition.find_backbone` and
                :func:`~lightning_gpipe.partition.resolve_balance`), or if a module created on the meta
                device cannot be initialised (see :func:`~lightning_gpipe.partition.materialize`), or if the
                backbone's skip connections do not pair up (see :func:`~lightning_gpipe.skip.verify_skippables`).
            RuntimeError: for a module with manual optimization.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        replace_model_summary(trainer)  # Lightning's would count this stage's part only
        module = self.lightning_module
        if not module.automatic_optimization:
            raise RuntimeError(
                "GPipeStrategy supports automatic optimization only: with `automatic_optimization = False` the"
                " user's step would have to run backward and the optimizer on every stage, but it stops at the"
                " backbone call on all stages but the last. Remove `self.automatic_optimization = False` and return"
                " the loss from `training_step`."
            )
        whole = not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        self._whole_before_split = self.broadcast(whole, src=0)  # rank 0's module, the user's, decides for all
        self._split_module(module)
        with self._randomness.stage():  # each stage initialises its own layers
            materialize(module, self.root_device)
        self._relay.relay_after_epoch_end_hooks(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._ties.synchronize()  # tied copies start equal, even when each stage initialised its own
        if trainer.state.fn == TrainerFn.FITTING:
            self._sync_gradients_over_replicas(module)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._agree_on_optimizer_steps()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _sync_gradients_over_replicas(self, module: "pl.LightningModule") -> None:
        """With several replicas, let DDP average this stage's gradients over its data-parallel group (see
        :mod:`lightning_gpipe.data_parallel`): what the stage trains is its partition, and on the last stage also
        the modules after the backbone."""
        if self.topology.data_parallel_size == 1:
            return
        trained = module if self._stage.is_last else self._split.partition
        if not GradientSync.trains(trained):
            return
        self._gradient_sync = GradientSync(trained, self._data_parallel_group, self.root_device)
        if GradientSync.trains(self._split.partition):
            self._stage.before_last_backward = self._gradient_sync.prepare

    def _announce_loss_backward(self, loss: Tensor) -> None:
        """On the last stage, announce the step's last backward to the gradient sync when it is the loss's: the
        partition trains nothing, or a one-stage pipeline runs the step unsplit (nothing left to drain)."""
        sync = self._gradient_sync
        if sync is not None and (self._stage.before_last_backward is None or not self._stage.draining):
            sync.prepare([loss])

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Within a gradient-accumulation window, accumulate without averaging over the replicas (Lightning's
        loop enters this for every batch of the window but the last). Under ``schedule="1f1b"`` every batch's
        gradients are averaged: they are computed apart from the window's earlier ones (see
        :class:`~lightning_gpipe.gradients.StepGradients`), and the average of a sum is the sum of the averages."""
        sync = self._gradient_sync
        if sync is None or self._runtime.per_micro_batch_loss:
            yield
            return
        sync.enabled = False
        try:
            yield
        finally:
            sync.enabled = True

    def _agree_on_optimizer_steps(self) -> None:
        """Clip by the norm of all stages' gradients and share the scaler's found-inf decision.

        Lightning asks the precision plugin to clip; its ``clip_grad_by_norm`` is replaced on this
        instance by the global version (:func:`~lightning_gpipe.optimization.clip_grad_norm_`).
        """
        precision = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
            clip_grad_norm_(
                precision.main_params(optimizer), clip_val, group=self._pipeline_group, uncounted=self._ties.uncounted()
            )

        precision.clip_grad_by_norm = clip_grad_by_norm
        scaler = getattr(precision, "scaler", None)
        if scaler is not None and not isinstance(scaler, SharedGradScaler):
            precision.scaler = SharedGradScaler.from_scaler(scaler)

    def _split_module(self, module: "pl.LightningModule") -> None:
        topology, stage_index = self.topology, self.stage_index
        name = find_backbone(module, self.backbone)
        layers, chunks = getattr(module, name), self._chunks(topology.num_stages)
        profiled = self.balance in ("time", "memory") or self.balance_memory_limit is not None
        if profiled and (self.layer_costs is None or len(self.layer_costs) != len(layers)):
            with self.precision_plugin.train_step_context(), watchdog.unbounded("profiling the backbone"):
                # rank 0 measures, every stage splits alike
                costs = profile_backbone(module, name, chunks, self.root_device) if self.is_global_zero else None
            self.layer_costs = self.broadcast(costs, src=0)
        balance = resolve_balance(
            self.balance, layers, topology.num_stages, self.layer_costs if profiled else None, self.balance_memory_limit
        )
        skips = SkipLayout(layers, balance)  # checks the stash/pop pairs on every stage alike, before any step
        if self.deferred_batch_norm:
            convert_deferred_batch_norm(getattr(module, name))  # the whole backbone, so that `Split.undo` puts it back
        ties = find_ties(module, name, balance)  # before the split, while every name leads to one object
        self._split = Split(module, name, balance, stage_index)
        self._ties = TiedParameters(ties, module, topology, self.global_rank)
        replica, num_stages = topology.replica_of(self.global_rank), topology.num_stages
        link = Link(
            prev_rank=topology.rank_of(stage_index - 1, replica) if stage_index > 0 else None,
            next_rank=topology.rank_of(stage_index + 1, replica) if stage_index < num_stages - 1 else None,
            device=self.root_device,
            events=watchdog.TrackingRecorder(),
        )
        peers = {
            "outgoing": {topology.rank_of(k, replica): keys for k, keys in skips.outgoing(stage_index).items()},
            "incoming": {topology.rank_of(k, replica): keys for k, keys in skips.incoming(stage_index).items()},
        }
        self._stage = Stage(
            self._split.partition,
            link,
            stage_index,
            num_stages,
            chunks,
            self.checkpoint,
            self.defer_weight_grad,
            SkipLinks(**peers, device=self.root_device, events=link.events),
        )
        self._runtime = Runtime(self._stage, self.schedule, num_stages)
        self._backbone_call = BackboneCall(
            self._runtime, self._stage.is_last, share=self._share_from_last_stage, randomness=self._randomness
        )
        self._split.partition.pipeline = self._backbone_call
        self._relay = LogRelay(self, src=self._last_stage_rank, group=self._pipeline_group)

    def _chunks(self, num_stages: int) -> int:
        if self.chunks is not None:
            return self.chunks
        return 4 * num_stages if num_stages > 1 else 1

    @property
    def _last_stage_rank(self) -> int:
        return self.topology.rank_of(self.topology.num_stages - 1, self.topology.replica_of(self.global_rank))

    def _share_from_last_stage(self, obj: Any) -> Any:
        if not dist.is_initialized():
            return obj
        return collectives.broadcast_object(obj, self._last_stage_rank, group=self._pipeline_group)

    @override
    def on_train_start(self) -> None:
        """Check that every stage has as many training batches per epoch (see :meth:`_agree_on_batches`) and take
        SIGTERM, SLURM's requeue signal and SIGINT at step boundaries (see :mod:`lightning_gpipe.signals`)."""
        self._start_loop("training", [self.lightning_module.trainer.num_training_batches])

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Agree with every process before the step (one all-reduce, see :mod:`lightning_gpipe.agreement`): the stages
        of each pipeline must have read the same batch, and a SIGTERM or requeue signal that reached any process
        takes effect on all of them at this step (see :meth:`~lightning_gpipe.signals.StopSignals.act`).

        Raises:
            BatchMismatchError: on every process, if the stages of a pipeline read different batches.
            SIGTERMException: after a SLURM requeue's checkpoint.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._agree(batch, f"training batch {batch_idx}", training=True)

    def _agree(self, batch: Any, which: str, training: bool = False) -> None:
        """The agreement before one step of a loop (see :meth:`on_train_batch_start`); ``which`` names the batch."""
        epoch = self.lightning_module.trainer.current_epoch
        agreed = self._agreement.agree(batch, self._signals.requests(), lambda: f"epoch {epoch}, {which}")
        self._signals.act(agreed, training)

    @override
    def on_validation_start(self) -> None:
        """Check that every stage has as many validation batches (see :meth:`_agree_on_batches`)."""
        self._start_loop("validation", self.lightning_module.trainer._evaluation_loop.max_batches)

    @override
    def on_test_start(self) -> None:
        """Check that every stage has as many test batches (see :meth:`_agree_on_batches`)."""
        self._start_loop("test", self.lightning_module.trainer._evaluation_loop.max_batches)

    @override
    def on_predict_start(self) -> None:
        """Check that every stage has as many prediction batches (see :meth:`_agree_on_batches`)."""
        self._start_loop("prediction", self.lightning_module.trainer.predict_loop.max_batches)

    def _start_loop(self, loop: str, counts: list) -> None:
        """Agree on the loop's batch counts, and take the stop signals at step boundaries from now on (with one
        :class:`~lightning_gpipe.signals.StopSignals` per run, installed again by every loop: Lightning registers its
        own handlers at the start of each ``fit``, ``validate``...)."""
        self._agree_on_batches(loop, counts)
        if self._signals is None:
            trainer = self.lightning_module.trainer
            self._signals = StopSignals(trainer, self.launcher, self.cluster_environment)
        self._signals.install()

    def _agree_on_batches(self, loop: str, counts: list) -> None:
        """Raise on every stage alike when the stages' data loaders have different numbers of batches: a stage
        with fewer would stop while the others wait for its micro-batches (a collective call).

        Raises:
            ValueError: naming each stage's number of batches.
        """
        if not dist.is_initialized():
            return
        every = collectives.all_gather_object(counts)
        if any(other != every[0] for other in every):
            per_stage = ", ".join(f"{watchdog.name_of(rank)}: {n}" for rank, n in enumerate(every))
            raise ValueError(
                f"The stages have different numbers of {loop} batches ({per_stage}); every stage runs every batch"
                " of the pipeline, so all stages need the same data loaders: the same dataset length, batch size,"
                " `drop_last` and sampler on every process."
            )

    @override
    def model_to_device(self) -> None:
        """Move this stage's part of the module to its device."""
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The fill; under ``schedule="1f1b"`` the whole step. Every stage returns the last stage's output: the
        user's loss, or the dict holding it (under 1F1B, the row-weighted combination of the micro-batches'
        outputs), so that callbacks see the step's loss on every rank; the other stages receive a detached copy
        (see :func:`~lightning_gpipe.relay.share_step_output`).

        Raises:
            TypeError, ValueError: under 1F1B, for a batch or backbone input that cannot be split by rows (see
                :meth:`~lightning_gpipe.contract.BackboneCall.micro_batch_steps`).
            RuntimeError: if the user's step does not call the backbone exactly once, or returns no
                loss on the last stage.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self._runtime.per_micro_batch_loss:
            output = self._one_f_one_b_step(args, kwargs)
        else:
            output = self._user_step("training_step", self.precision_plugin.train_step_context, args, kwargs)
        if self._stage.is_last and output is None:
            raise RuntimeError(
                "`training_step` returned None on the last stage; under GPipeStrategy every step must return its"
                " loss, since all stages take part in the drain."
            )
        # every stage returns the loss, so that Lightning runs `backward` (the drain) on every stage
        return share_step_output(output, self._stage.is_last, self._share_from_last_stage, self.root_device)

    def _one_f_one_b_step(self, args: tuple, kwargs: dict) -> Any:
        """The whole 1F1B step; its gradients are kept apart until :meth:`backward` (Lightning zeroes the
        previous step's in between, on the first batch of an accumulation window: those are freed at once)."""
        module = self.lightning_module
        trainer = module.trainer
        zeroed = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0  # as Lightning's loop
        gradients = self._step_gradients.computing(list(module.parameters()), zeroed_after=zeroed)
        watchdog.begin_step(f"step {trainer.global_step}")  # as _user_step
        with self.precision_plugin.train_step_context(), failure.reporting(), gradients:
            return self._backbone_call.micro_batch_steps(
                module, "training_step", args, kwargs, self._backward_micro_batch
            )

    def _backward_micro_batch(self, loss: Tensor, last: bool) -> None:
        """Backpropagate one micro-batch's weighted loss (1F1B) as Lightning's backward does a step's: divided by
        ``accumulate_grad_batches``, scaled by the precision plugin's gradient scaler if it has one, through
        ``LightningModule.backward``; without the step's ``on_before_backward`` hooks, which :meth:`backward` runs.
        ``last``: whether it is the step's last micro-batch."""
        if last:
            self._announce_loss_backward(loss)
        loss = loss / self.lightning_module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        self.precision_plugin.backward(scaler.scale(loss) if scaler is not None else loss, self.lightning_module, None)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """The drain: the last stage backpropagates the loss to its boundary, then every stage its micro-batches.

        The loss goes through the precision plugin (so loss scaling applies to the whole pipeline);
        ``on_after_backward`` runs once all of this stage's gradients are accumulated. Under ``schedule="1f1b"``
        the gradients were computed in :meth:`training_step`: they are added to ``.grad`` here, between
        ``on_before_backward`` (which sees the step's loss) and ``on_after_backward``.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._runtime.per_micro_batch_loss:
            self._step_gradients.hand_over()
        else:
            if self._stage.is_last:
                self._announce_loss_backward(closure_loss)
                with self._randomness.stage():
                    self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            with self.precision_plugin.train_step_context(), failure.reporting(), self._randomness.stage():
                self._runtime.backward()  # recomputes as the fill did, with the stage's random stream
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        with self._stage.events.span("relay"):
            self._relay(module.trainer)
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step, with the gradients of tied parameters summed over the stages that hold a
        copy right after the step's closure (the last backward), before the hooks that see the gradients,
        clipping and the step (see :mod:`lightning_gpipe.ties`).

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """

        def closure_and_ties() -> Any:
            result = closure()
            self._ties.reduce_grads()
            return result

        return super().optimizer_step(optimizer, closure_and_ties, model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """A pipelined forward; returns the user's output on the last stage, ``None`` on the others.

        Raises:
            RuntimeError: if the user's step does not call the backbone exactly once (plainly or through
                :func:`~lightning_gpipe.forward_and_share`).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._agree(args[0], f"validation batch {args[1]}")
        output = self._user_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)
        self._relay(self.lightning_module.trainer)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """A pipelined forward; returns the user's output on the last stage, ``None`` on the others.

        Raises:
            RuntimeError: if the user's step does not call the backbone exactly once (plainly or through
                :func:`~lightning_gpipe.forward_and_share`).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._agree(args[0], f"test batch {args[1]}")
        output = self._user_step("test_step", self.precision_plugin.test_step_context, args, kwargs)
        self._relay(self.lightning_module.trainer)
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """A pipelined forward; the last stage's prediction is returned on every stage (a collective call).

        Raises:
            RuntimeError: if the user's step does not call the backbone exactly once (plainly or through
                :func:`~lightning_gpipe.forward_and_share`).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._agree(args[0], f"prediction batch {args[1]}")
        output = self._user_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        return self._share_from_last_stage(output)

    def _user_step(self, hook: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        step = getattr(self.lightning_module, hook)
        watchdog.begin_step(f"step {self.lightning_module.trainer.global_step}")
        with context(), failure.reporting():
            return self._backbone_call.user_step(hook, lambda: step(*args, **kwargs))

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[str] = "mean") -> Any:
        """Reduce ``tensor`` over this stage's replicas (``self.log(..., sync_dist=True)`` calls this), as DDP does.

        The values to synchronise are logged on the last stage only, and the logging relay
        (:mod:`lightning_gpipe.relay`) copies them to the other stages; stages of one pipeline hold
        different parts of one step, not copies, so they never average with each other. The replicas of a
        stage (its data-parallel group) do: their mean (``reduce_op`` ``"mean"``, the default, or ``"avg"``) or
        sum (``"sum"``). With one replica, or for a non-tensor, ``tensor`` is returned unchanged.

        Raises:
            ValueError: for another ``reduce_op``.
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        op = (reduce_op or "mean").lower() if isinstance(reduce_op, (str, type(None))) else reduce_op
        if op not in ("mean", "avg", "sum", dist.ReduceOp.SUM):
            raise ValueError(f"GPipeStrategy.reduce(reduce_op={reduce_op!r}): choose 'mean', 'avg' or 'sum'.")
        replicas = self.topology.data_parallel_size if dist.is_initialized() else 1
        if not isinstance(tensor, Tensor) or replicas == 1:
            return tensor
        mean = op in ("mean", "avg")
        result = tensor.to(torch.get_default_dtype()) if mean and not tensor.is_floating_point() else tensor.clone()
        collectives.all_reduce(result, group=self._data_parallel_group)
        return result / replicas if mean else result

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every process reaches this point.

        Raises:
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        if dist.is_initialized():
            collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send the picklable ``obj`` from global rank ``src`` to every process.

        Raises:
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        if not dist.is_initialized():
            return obj
        return collectives.broadcast_object(obj, src)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are restored after the split, so each stage loads the entries of its own layers."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict for a checkpoint (a collective call with ``state_dict_type="full"``).

        ``"full"``: the whole model's on global rank 0 (the union of the stages', under the original
        names, so it loads into the module without the strategy); ``{}`` elsewhere, where nothing is
        written. ``"sharded"``: this stage's part.
        """
        local = self.lightning_module.state_dict()
        if self.state_dict_type == "sharded":
            return local
        return self._gather_whole(local) or {}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, like the model's state dict (a collective call).

        ``"full"``: every stage's entries on global rank 0 (see :mod:`lightning_gpipe.state_dict`);
        ``"sharded"``: this stage's.
        """
        local = state_dict.optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))
        if self.state_dict_type == "sharded":
            return local
        return self._gather_whole(local) or {}

    def _gather_whole(self, local: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The union of replica 0's stages' ``local`` dicts on global rank 0; ``None`` elsewhere. The other replicas
        hold copies of replica 0's, so they send nothing (a collective call of replica 0's pipeline)."""
        if dist.is_initialized() and self.replica_index != 0:
            return None
        return state_dict.gather_union(local, self._pipeline_group)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a checkpoint: one file from global rank 0 (``"full"``), or a directory from all stages (``"sharded"``).

        Both replace an existing checkpoint at ``filepath`` only once the new one is complete. Stages waiting for
        the writers meanwhile do not count the wait as a stall.
        """
        with watchdog.unbounded("writing a checkpoint"):
            if self.state_dict_type == "sharded":
                state_dict.save_sharded(checkpoint, filepath, self.global_rank)
            else:
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a full checkpoint file on every stage, or this stage's part of a sharded checkpoint directory.

        Raises:
            FileNotFoundError: for a directory that is not a sharded checkpoint (it has no ``meta.pt``).
        """
        if not state_dict.is_sharded(checkpoint_path) and not Path(checkpoint_path).is_dir():
            with watchdog.unbounded("reading a checkpoint"):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        template: dict[str, Any] = {"state_dict": module.state_dict()}
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            template["optimizer_states"] = [  # this stage's, whatever `state_dict_type` this run writes
                state_dict.optimizer_state(module, getattr(optimizer, "_optimizer", optimizer))
                for optimizer in self.optimizers
            ]
        with watchdog.unbounded("reading a checkpoint"):
            return state_dict.load_sharded(checkpoint_path, template)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load this stage's entries of the checkpoint's (whole or sharded) model state."""
        module = self.lightning_module
        module.load_state_dict(state_dict.local_entries(checkpoint["state_dict"], module), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this stage's entries of every optimizer's name-keyed state, whatever the split it was saved with.

        Raises:
            ValueError: for a checkpoint whose optimizer state is keyed by index (written without this strategy).
        """
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if "param_groups" in state:
                raise ValueError(
                    "This checkpoint's optimizer state was written without GPipeStrategy (keyed by parameter"
                    " index, not name), so it cannot be split between stages. Resume it with the strategy it was"
                    " written with, or load only the weights: `Module.load_from_checkpoint(path)`."
                )
            state_dict.load_optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer), state)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Publish the exception so that the other stages exit naming it instead of hanging.

        Lightning's ``SIGTERMException`` is not published: every stage raises it at the same step, by agreement.
        Then it waits (a few seconds at most) until every process has read the cause (see
        :func:`~lightning_gpipe.failure.linger`). On a ``KeyboardInterrupt`` it says where the other stages were
        last seen (one may be stuck in user code); Lightning's launcher then ends them.
        """
        if not isinstance(exception, SIGTERMException):
            failure.report(exception)
            failure.linger()
        if isinstance(exception, KeyboardInterrupt):  # the launcher ends the other stages next, whatever they do
            failure.say(f"interrupted; ending every stage. {watchdog.last_positions()}.")

    @override
    def teardown(self) -> None:
        """Undo the split; after a completed run, global rank 0's module gets every stage's weights back.

        Only a module that was whole before the split is made whole again: one created on the meta
        device (``configure_model``, ``empty_init=True``) may not fit one process, so its other stages'
        layers stay on the meta device; load a checkpoint to get them.
        """
        module = self.lightning_module
        full = None
        if self._split is not None and module is not None:
            if module.trainer.state.status != TrainerStatus.INTERRUPTED and self._whole_before_split:
                full = self._gather_whole(module.state_dict())
            LogRelay.unwrap_epoch_end_hooks(module)
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                module.to_empty(device="cpu")  # materialize failed; Lightning's teardown cannot move meta tensors
        super().teardown()
        if self._split is not None:
            self._split.undo(full)
            revert_deferred_batch_norm(self._split.sequential)
            self._split = self._stage = self._runtime = self._backbone_call = self._relay = self._ties = None
            self._gradient_sync = None
        self._agreement = self._signals = None
        self._randomness = StageRandomness()
        watchdog.stop()
        failure.detach()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"gpipe"`` (popen launcher) and ``"gpipe_spawn"`` (spawn launcher)."""
        strategy_registry.register("gpipe", cls, description="GPipe pipeline parallelism")
        strategy_registry.register(
            "gpipe_spawn", cls, description="GPipe pipeline parallelism, spawn launcher", start_method="spawn"
        )


def _check_arguments(
    balance: Any,
    balance_memory_limit: Any,
    chunks: Any,
    checkpoint: Any,
    start_method: Any,
    state_dict_type: Any,
    schedule: Any,
) -> None:
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"GPipeStrategy(chunks={chunks!r}): chunks is the number of micro-batches, an integer >= 1.")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"GPipeStrategy(checkpoint={checkpoint!r}): choose one of {', '.join(CHECKPOINT_MODES)}.")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"GPipeStrategy(schedule={schedule!r}): choose 'gpipe' (fill-drain) or '1f1b' (one forward, one backward)."
        )
    if start_method not in ("popen", "spawn"):
        raise ValueError(f"GPipeStrategy(start_method={start_method!r}): choose 'popen' or 'spawn'.")
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"GPipeStrategy(state_dict_type={state_dict_type!r}): choose 'full' or 'sharded'.")
    automatic = balance is None or balance in MODES
    if not automatic and (
        isinstance(balance, (str, bytes)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in balance)
    ):
        raise ValueError(
            f"GPipeStrategy(balance={balance!r}): choose 'params', 'time' or 'memory', or give the number of"
            " backbone layers of each stage as a list of integers, e.g. balance=[3, 5]."
        )
    if balance_memory_limit is not None and (
        not isinstance(balance_memory_limit, int) or isinstance(balance_memory_limit, bool) or balance_memory_limit < 1
    ):
        raise ValueError(
            f"GPipeStrategy(balance_memory_limit={balance_memory_limit!r}): give the bytes one stage may hold, an"
            " integer >= 1, or None for no limit."
        )
    if balance_memory_limit is not None and not automatic:
        raise ValueError(
            f"GPipeStrategy(balance={balance!r}, balance_memory_limit=...): the memory limit steers an automatic"
            " balance; use balance='time' (or 'params', 'memory') with it, or drop the limit."
        )


def _checked_stall_timeout(stall_timeout: Any) -> Optional[timedelta]:
    if stall_timeout is not None and (not isinstance(stall_timeout, timedelta) or stall_timeout <= timedelta(0)):
        raise ValueError(
            f"GPipeStrategy(stall_timeout={stall_timeout!r}): give how long a stage may wait for another as a positive"
            " `datetime.timedelta`, e.g. timedelta(minutes=5), or None to leave only the process group's `timeout`."
        )
    return stall_timeout
