"""GPipeStrategy: GPipe pipeline parallelism behind Lightning's strategy hooks.

How one step maps onto Lightning (see docs/how-it-works.md): ``training_step`` runs the stage's plan up to its
cut (fill-drain: the fill), ``backward`` the rest (the drain); the optimizer step, clipping, schedulers and
gradient accumulation stay Lightning's. Each hook hands its work to a piece with one concern: the options
(:mod:`~lightning_gpipe.config`), the mesh (:mod:`~lightning_gpipe.topology`), this run's pipeline
(:mod:`~lightning_gpipe.pipeline`, over :mod:`~lightning_gpipe.runtime` and :mod:`~lightning_gpipe.contract`),
checkpoints (:mod:`~lightning_gpipe.state_dict`), signals (:mod:`~lightning_gpipe.signals`), the stages' agreement
before each step (:mod:`~lightning_gpipe.agreement`) and optimizer steps (:mod:`~lightning_gpipe.optimization`).
"""

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
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
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lightning_gpipe import collectives, state_dict
from lightning_gpipe.agreement import StepAgreement
from lightning_gpipe.balance import LayerCost
from lightning_gpipe.balance.backbone import profile_backbone
from lightning_gpipe.config import Balance, PipelineConfig
from lightning_gpipe.data import same_batches
from lightning_gpipe.data_parallel import reduce_over_replicas
from lightning_gpipe.job import Job
from lightning_gpipe.optimization import pipelined, unpipelined
from lightning_gpipe.partition import find_backbone, materialize
from lightning_gpipe.pipeline import PipelineRun, split_into_stage
from lightning_gpipe.randomness import StageRandomness
from lightning_gpipe.relay import LogRelay, share_step_output
from lightning_gpipe.signals import StopSignals
from lightning_gpipe.stage import Stage
from lightning_gpipe.summary import replace_model_summary
from lightning_gpipe.topology import Size, Topology, groups, resolve_topology


class GPipeStrategy(ParallelStrategy):
    """Train a LightningModule whose ``nn.Sequential`` backbone is split into stages, one per device of a pipeline.

    GPipe (Huang et al. 2019, arXiv:1811.06965): each mini-batch is split into ``chunks`` micro-batches that flow
    through the stages (the fill), then flow back in reverse order (the drain); gradients accumulate and one
    optimizer step follows, so training is synchronous and equals single-device mini-batch training. Argument names
    follow torchgpipe.

    One OS process per stage, launched like DDP. The processes form a (data-parallel x pipeline) mesh: with
    ``data_parallel_size`` D and ``pipeline_parallel_size`` K, global rank ``r`` is stage ``r % K`` of replica
    ``r // K``; each replica reads its own shard of the data, and each stage's replicas average their gradients
    once per optimizer step with DDP (see docs/scaling.md). The backbone is the only part that is split: code
    before the backbone call must hold no parameters, and modules after it (heads, losses, metrics) run on the
    last stage. Skip connections between backbone layers (:mod:`lightning_gpipe.skip`) go straight from the
    stashing stage to the popping one; a parameter used on several stages (tied weights) is kept in step on
    each of them (:mod:`lightning_gpipe.ties`). Every stage reads the same batch, checked before each step
    (:mod:`lightning_gpipe.agreement`). See docs/contract.md.

    Args:
        balance: layers per stage, or ``"params"`` (default), ``"time"`` or ``"memory"`` for the best split.
        chunks: M, the micro-batches per mini-batch (default ``4 * K``).
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` (default) or ``"never"``.
        deferred_batch_norm: batch norm's running statistics updated once per mini-batch (default ``False``).
        defer_weight_grad: the zero-bubble B/W split of each backward (default ``False``).
        backbone: the ``nn.Sequential`` attribute to pipeline (default: the only one).
        balance_memory_limit: bytes one stage may hold when choosing the balance (default: no limit).
        start_method: ``"popen"`` (default) or ``"spawn"``.
        state_dict_type: checkpoints as one ``"full"`` file (default) or a ``"sharded"`` directory.
        schedule: ``"gpipe"`` (fill-drain, default) or ``"1f1b"``.
        pipeline_parallel_size: K, the stages of each pipeline (default ``"auto"``).
        data_parallel_size: D, the pipeline replicas (default ``"auto"``).
        timeout: the process group's timeout (30 minutes by default).
        stall_timeout: how long a stage may wait for another before the job ends naming it (5 minutes).
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        accelerator: as for Lightning's other parallel strategies; the Trainer fills it in.
        parallel_devices: the devices of this node, one per stage process; the Trainer fills them in.
        cluster_environment: how ranks are found; the Trainer fills it in.
        checkpoint_io: writes and reads full checkpoint files; Lightning's ``TorchCheckpointIO`` by default.
        precision_plugin: as for Lightning's other strategies; the Trainer fills it in from ``precision=``.

    Each option is documented in full in :class:`~lightning_gpipe.config.PipelineConfig`; they are kept in
    :attr:`config`.

    Raises:
        ValueError: for a bad option (see :class:`~lightning_gpipe.config.PipelineConfig`). Whether the mesh and
            ``balance`` fit the number of devices is checked before the processes start, and whether ``balance``
            fits the backbone when training starts, before the first step.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        balance: Balance = None,
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
        options = {k: v for k, v in locals().items() if k in PipelineConfig.__dataclass_fields__}
        self.config = PipelineConfig(**options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.layer_costs: Optional[list[LayerCost]] = None  # profiled per backbone layer, when a mode needs them
        self._num_nodes = 1
        self._whole_before_split = True
        self._pipeline_group: Optional[dist.ProcessGroup] = None  # the stages of this process's replica
        self._data_parallel_group: Optional[dist.ProcessGroup] = None  # the replicas of this process's stage
        self._run: Optional[PipelineRun] = None
        self._randomness = StageRandomness()  # one stream until setup_environment seeds the stage's own
        self._agreement: Optional[StepAgreement] = None
        self._signals: Optional[StopSignals] = None
        self._job = Job()  # one without a store until setup_environment creates the run's

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
        config = self.config
        sizes = (config.pipeline_parallel_size, config.data_parallel_size, config.balance)
        return resolve_topology(*sizes, self.num_processes, self.num_nodes)

    @property
    def stage_index(self) -> int:
        """Pipeline rank of this process (0 is the first stage)."""
        return self.topology.stage_of(self.global_rank)

    @property
    def replica_index(self) -> int:
        """Data-parallel rank of this process (the pipeline replica it belongs to, 0-based)."""
        return self.topology.replica_of(self.global_rank)

    @property
    def job(self) -> Job:
        """This process's part of the current run (failure board, position, stall watchdog, waiter; see
        :class:`~lightning_gpipe.job.Job`), created in ``setup_environment``; before it, and after ``teardown``,
        one without a store (nothing is published)."""
        return self._job

    @property
    def pipeline_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of this process's replica (its pipeline's stages); ``None`` before setup."""
        return self._pipeline_group

    @property
    def stage(self) -> Optional[Stage]:
        """This process's :class:`~lightning_gpipe.stage.Stage` while a model is split (``None`` before setup
        and after teardown); its ``events`` recorder is what the pipeline callbacks read."""
        return self._run.stage if self._run is not None else None

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
        return {"num_replicas": self.topology.data_parallel_size, "rank": self.replica_index}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make every stage of a pipeline read the same batches (see :func:`~lightning_gpipe.data.same_batches`)."""
        resample = self.lightning_module.trainer._accelerator_connector.use_distributed_sampler
        return same_batches(dataloader, self.replica_index, self.topology.data_parallel_size, resample)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.topology  # a mesh that does not fit the job fails here, before any process starts
        if self.config.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.config.start_method)

    @override
    def setup_environment(self) -> None:
        """Select the device, then join the process group, the failure board and the stall watchdog, and take the
        stages' shared random state (see :mod:`lightning_gpipe.randomness`)."""
        super().setup_environment()
        reset_seed()
        environment, topology = self.cluster_environment, self.topology
        environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend = self.config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(environment, backend, timeout=self.config.timeout)
        self._pipeline_group, self._data_parallel_group = groups(topology.mesh(self.root_device.type))
        names = {rank: topology.name(rank) for rank in range(topology.world_size)}
        store = dist.distributed_c10d._get_default_store()
        self._job.close()
        self._job = Job(store, self.global_rank, names, self.config.stall_limit(), self.world_size)
        self._randomness = StageRandomness.synchronized(self.stage_index, topology.num_stages, self.broadcast)
        replicas = topology.data_parallel_size
        self._agreement = StepAgreement(self.replica_index, replicas, self.root_device, names, self._job)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Create the modules of ``configure_model`` on the meta device: each stage materialises only its own part
        (see :func:`~lightning_gpipe.partition.materialize`), so no process holds the whole model."""
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
        """Split the module into this process's stage (:func:`~lightning_gpipe.pipeline.split_into_stage`), then
        set up precision (clipping over every stage, a shared scaler) and the local optimizers.

        Raises:
            ValueError: if the backbone, ``balance`` or the skip connections do not fit, or a module created on the
                meta device cannot be initialised (see :func:`~lightning_gpipe.partition.materialize`).
            RuntimeError: for a module with manual optimization.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self.accelerator.setup(trainer)
        replace_model_summary(trainer)  # Lightning's would count this stage's part only
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        _check_automatic_optimization(module)
        whole = not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        self._whole_before_split = self.broadcast(whole, src=0)  # rank 0's module, the user's, decides for all
        name = find_backbone(module, self.config.backbone)
        relay = LogRelay(self, self._last_stage_rank, self.pipeline_group, self._job)
        run = self._run = split_into_stage(
            module, name, self.config, self.topology, self.global_rank, self.root_device,
            self._layer_costs(module, name), self._randomness, self._share_from_last_stage, relay, self._job,
        )  # fmt: skip
        with self._randomness.stage():  # each stage initialises its own layers
            materialize(module, self.root_device)
        relay.relay_after_epoch_end_hooks(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        run.ties.synchronize()  # tied copies start equal, even when each stage initialised its own
        if fitting and self.topology.data_parallel_size > 1:
            run.sync_gradients(module, self._data_parallel_group, self.root_device)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        pipelined(self.precision_plugin, self.pipeline_group, run.ties.uncounted, self._job)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _layer_costs(self, module: "pl.LightningModule", name: str) -> Optional[list[LayerCost]]:
        """The backbone layers' costs where the balance needs them: measured once on global rank 0, shared."""
        layers = getattr(module, name)
        if self.config.profiled and (self.layer_costs is None or len(self.layer_costs) != len(layers)):
            chunks = self.config.chunks_for(self.topology.num_stages)
            profiling = self._job.position.unbounded_phase("profiling the backbone")
            with self.precision_plugin.train_step_context(), profiling:
                costs = profile_backbone(module, name, chunks, self.root_device) if self.is_global_zero else None
            self.layer_costs = self.broadcast(costs, src=0)
        return self.layer_costs if self.config.profiled else None

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Within a gradient-accumulation window, accumulate without averaging over the replicas (Lightning's
        loop enters this for every batch of the window but the last). Under ``schedule="1f1b"`` every batch's
        gradients are averaged: they are computed apart from the window's earlier ones (see
        :class:`~lightning_gpipe.gradients.StepGradients`), and the average of a sum is the sum of the averages."""
        sync = self._run.gradient_sync
        with nullcontext() if sync is None or self._run.runtime.per_micro_batch_loss else sync.disabled():
            yield

    @property
    def _last_stage_rank(self) -> int:
        return self.topology.rank_of(self.topology.num_stages - 1, self.replica_index)

    def _share_from_last_stage(self, obj: Any) -> Any:
        if not dist.is_initialized():
            return obj
        return collectives.broadcast_object(self._job, obj, self._last_stage_rank, group=self.pipeline_group)

    @override
    def on_train_start(self) -> None:
        """Check that every stage has as many training batches per epoch and take SIGTERM, SLURM's requeue signal
        and SIGINT at step boundaries (see :meth:`_start_loop`)."""
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
        """Check that every stage has as many validation batches (see :meth:`_start_loop`)."""
        self._start_loop("validation", self.lightning_module.trainer._evaluation_loop.max_batches)

    @override
    def on_test_start(self) -> None:
        """Check that every stage has as many test batches (see :meth:`_start_loop`)."""
        self._start_loop("test", self.lightning_module.trainer._evaluation_loop.max_batches)

    @override
    def on_predict_start(self) -> None:
        """Check that every stage has as many prediction batches (see :meth:`_start_loop`)."""
        self._start_loop("prediction", self.lightning_module.trainer.predict_loop.max_batches)

    def _start_loop(self, loop: str, counts: list) -> None:
        """Raise on every stage alike when the stages' loaders have different numbers of batches (a stage with
        fewer would stop while the others wait for it), then take the stop signals at step boundaries (one
        :class:`~lightning_gpipe.signals.StopSignals` per run, installed by every loop: Lightning registers its own
        handlers at the start of each ``fit``, ``validate``...).

        Raises:
            ValueError: naming each stage's number of batches.
        """
        every = collectives.all_gather_object(self._job, counts) if dist.is_initialized() else [counts]
        if any(other != every[0] for other in every):
            per_stage = ", ".join(f"{self._job.watchdog.name_of(rank)}: {n}" for rank, n in enumerate(every))
            raise ValueError(
                f"The stages have different numbers of {loop} batches ({per_stage}); every stage runs every batch"
                " of the pipeline, so all stages need the same data loaders: the same dataset length, batch size,"
                " `drop_last` and sampler on every process."
            )
        if self._signals is None:
            self._signals = StopSignals(self.lightning_module.trainer, self.launcher, self.cluster_environment)
        self._signals.install()

    @override
    def model_to_device(self) -> None:
        """Move this stage's part of the module to its device."""
        self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The plan up to its cut (fill-drain: the fill; 1F1B: the whole step, see
        :meth:`~lightning_gpipe.pipeline.PipelineRun.micro_batch_steps`). Every stage returns the last stage's
        output: the user's loss, or the dict holding it, so that callbacks see the step's loss on every rank (see
        :func:`~lightning_gpipe.relay.share_step_output`).

        Raises:
            TypeError, ValueError: under 1F1B, for a batch or backbone input that cannot be split by rows.
            RuntimeError: if the user's step does not call the backbone exactly once, or returns no
                loss on the last stage.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        run, context = self._run, self.precision_plugin.train_step_context
        if run.runtime.per_micro_batch_loss:
            self._job.position.begin_step(f"step {self.lightning_module.trainer.global_step}")
            with context(), self._job.board.reporting():
                output = run.micro_batch_steps(self.lightning_module, args, kwargs, self.precision_plugin)
        else:
            output = self._user_step("training_step", context, args, kwargs)
        if run.stage.is_last and output is None:
            raise RuntimeError(
                "`training_step` returned None on the last stage; under GPipeStrategy every step must return its"
                " loss, since all stages take part in the drain."
            )
        # every stage returns the loss, so that Lightning runs `backward` (the drain) on every stage
        return share_step_output(output, run.stage.is_last, self._share_from_last_stage, self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """The plan after its cut (fill-drain: the last stage backpropagates the loss to its boundary through the
        precision plugin, so loss scaling applies to the whole pipeline, then every stage drains its micro-batches;
        1F1B: the step's gradients, computed in :meth:`training_step`, are added to ``.grad``), between
        ``on_before_backward`` and ``on_after_backward``; then the last stage's logged values reach every stage.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        module, run, precision = self.lightning_module, self._run, self.precision_plugin
        self.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, module)
        if run.runtime.per_micro_batch_loss:
            run.step_gradients.hand_over()
        else:
            if run.stage.is_last:
                run.announce_loss_backward(closure_loss)
                with self._randomness.stage():
                    precision.backward(closure_loss, module, optimizer, *args, **kwargs)
            with precision.train_step_context(), self._job.board.reporting(), self._randomness.stage():
                run.runtime.backward()  # recomputes as the fill did, with the stage's random stream
        closure_loss = precision.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        with run.stage.events.span("relay"):
            run.relay(module.trainer)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs) -> Any:
        """Lightning's optimizer step, with the gradients of tied parameters summed over the stages that hold a
        copy right after the step's closure (see :mod:`lightning_gpipe.ties`)."""

        def closure_and_ties() -> Any:
            result = closure()
            self._run.ties.reduce_grads()
            return result

        return super().optimizer_step(optimizer, closure_and_ties, model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """A pipelined forward (see :meth:`_evaluation_step`); the user's output on the last stage, else ``None``."""
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """A pipelined forward (see :meth:`_evaluation_step`); the user's output on the last stage, else ``None``."""
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """A pipelined forward (see :meth:`_evaluation_step`); the last stage's prediction on every stage."""
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _evaluation_step(self, hook: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        """Agree on the batch, run the user's step, and relay its logged values (its prediction, for predict).

        Raises:
            BatchMismatchError: on every process, if the stages of a pipeline read different batches.
            RuntimeError: if the user's step does not call the backbone exactly once (plainly or through
                :func:`~lightning_gpipe.forward_and_share`).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._agree(args[0], f"{hook.removesuffix('_step').replace('predict', 'prediction')} batch {args[1]}")
        output = self._user_step(hook, context, args, kwargs)
        if hook == "predict_step":
            return self._share_from_last_stage(output)
        self._run.relay(self.lightning_module.trainer)
        return output

    def _user_step(self, hook: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        step = getattr(self.lightning_module, hook)
        self._job.position.begin_step(f"step {self.lightning_module.trainer.global_step}")
        with context(), self._job.board.reporting():
            return self._run.backbone_call.user_step(hook, lambda: step(*args, **kwargs))

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[str] = "mean") -> Any:
        """Reduce ``tensor`` over this stage's replicas (``self.log(..., sync_dist=True)`` calls this), as DDP does;
        the stages of a pipeline hold parts of one step, not copies, and never average with each other (see
        :func:`~lightning_gpipe.data_parallel.reduce_over_replicas`).

        Raises:
            ValueError: for a ``reduce_op`` other than ``"mean"``, ``"avg"`` or ``"sum"``.
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        replicas = self.topology.data_parallel_size if dist.is_initialized() else 1
        return reduce_over_replicas(tensor, reduce_op, self._data_parallel_group, replicas, self._job)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every process reaches this point (interruptibly, see :mod:`lightning_gpipe.collectives`)."""
        if dist.is_initialized():
            collectives.barrier(self._job)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send the picklable ``obj`` from global rank ``src`` to every process (interruptibly)."""
        return collectives.broadcast_object(self._job, obj, src) if dist.is_initialized() else obj

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are restored after the split, so each stage loads the entries of its own layers."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint under the original names (see :mod:`lightning_gpipe.state_dict`):
        ``"full"``, the whole model's on global rank 0 and ``{}`` elsewhere (a collective call); ``"sharded"``,
        this stage's part."""
        return self._whole_or_local(self.lightning_module.state_dict())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, whole or this stage's, like the model's state dict."""
        local = state_dict.optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))
        return self._whole_or_local(local)

    def _whole_or_local(self, local: dict[str, Any]) -> dict[str, Any]:
        if self.config.state_dict_type == "sharded":
            return local
        return state_dict.whole_on_rank_zero(local, self.replica_index, self.pipeline_group, self._job) or {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a checkpoint: one file from global rank 0 (``"full"``), or a directory from all stages (``"sharded"``);
        either replaces an existing one only once complete. Waiting for the writers does not count as a stall."""
        with self._job.position.unbounded_phase("writing a checkpoint"):
            if self.config.state_dict_type == "sharded":
                state_dict.save_sharded(checkpoint, filepath, self.global_rank, self._job)
            else:
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a full checkpoint file on every stage, or this stage's part of a sharded checkpoint directory.

        Raises:
            FileNotFoundError: for a directory that is not a sharded checkpoint (it has no ``meta.pt``).
        """
        with self._job.position.unbounded_phase("reading a checkpoint"):
            if not Path(checkpoint_path).is_dir():
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            template = state_dict.stage_template(self.lightning_module, self.optimizers, fitting)
            return state_dict.load_sharded(checkpoint_path, template, self._job)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load this stage's entries of the checkpoint's (whole or sharded) model state."""
        module = self.lightning_module
        module.load_state_dict(state_dict.local_entries(checkpoint["state_dict"], module), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this stage's entries of every optimizer's name-keyed state, whatever the split it was saved with
        (see :func:`~lightning_gpipe.state_dict.load_optimizer_states`)."""
        state_dict.load_optimizer_states(self.lightning_module, self.optimizers, checkpoint["optimizer_states"])
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Publish the exception so that the other stages exit naming it instead of hanging, then wait (a few
        seconds at most) until every process has read it (:meth:`~lightning_gpipe.failure.FailureBoard.linger`).
        Lightning's ``SIGTERMException`` is not published: every stage raises it at the same step, by agreement. On a
        ``KeyboardInterrupt`` it says where the other stages were last seen; Lightning's launcher then ends them."""
        if not isinstance(exception, SIGTERMException):
            self._job.board.report(exception)
            self._job.board.linger()
        if isinstance(exception, KeyboardInterrupt):  # the launcher ends the other stages next, whatever they do
            self._job.board.say(f"interrupted; ending every stage. {self._job.watchdog.last_positions()}.")

    @override
    def teardown(self) -> None:
        """Undo the split; after a completed run, global rank 0's module gets every stage's weights back.

        Only a module that was whole before the split is made whole again: one created on the meta device
        (``configure_model``, ``empty_init=True``) may not fit one process, so its other stages' layers stay on
        the meta device; load a checkpoint to get them.
        """
        module, run, whole = self.lightning_module, self._run, None
        if run is not None and module is not None:
            if module.trainer.state.status != TrainerStatus.INTERRUPTED and self._whole_before_split:
                local, group = module.state_dict(), self.pipeline_group
                whole = state_dict.whole_on_rank_zero(local, self.replica_index, group, self._job)
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                module.to_empty(device="cpu")  # materialize failed; Lightning's teardown cannot move meta tensors
        unpipelined(self.precision_plugin)
        super().teardown()
        if run is not None:
            run.close(module, whole)
        self._run = self._agreement = self._signals = None
        self._randomness = StageRandomness()
        self._job.close()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"gpipe"`` (popen launcher) and ``"gpipe_spawn"`` (spawn launcher)."""
        strategy_registry.register("gpipe", cls, description="GPipe pipeline parallelism")
        strategy_registry.register(
            "gpipe_spawn", cls, description="GPipe pipeline parallelism, spawn launcher", start_method="spawn"
        )


def _check_automatic_optimization(module: "pl.LightningModule") -> None:
    if not module.automatic_optimization:
        raise RuntimeError(
            "GPipeStrategy supports automatic optimization only: with `automatic_optimization = False` the"
            " user's step would have to run backward and the optimizer on every stage, but it stops at the"
            " backbone call on all stages but the last. Remove `self.automatic_optimization = False` and return"
            " the loss from `training_step`."
        )
