"""GPipeStrategy: GPipe pipeline parallelism behind Lightning's strategy hooks.

How one step maps onto Lightning (see docs/how-it-works.md): ``training_step`` runs the stage's plan up to its
cut (fill-drain: the fill), ``backward`` the rest (the drain); the optimizer step, clipping, schedulers and
gradient accumulation stay Lightning's. Each hook hands its work to a piece with one concern: the processes of
the mesh, their agreement before each step and their failures (:class:`~lightning_gpipe.lightning.mesh.MeshStrategy`,
the base class), the options (:mod:`~lightning_gpipe.lightning.config`), this run's pipeline
(:class:`~lightning_gpipe.lightning.step.StageRun`, over the engine's :class:`~lightning_gpipe.engine.StagePipeline`
and the user contract, :mod:`~lightning_gpipe.lightning.contract`), checkpoints
(:mod:`~lightning_gpipe.lightning.state_dict`) and optimizer steps (:mod:`~lightning_gpipe.lightning.optimization`).
"""

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import fields
from datetime import timedelta
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor
from typing_extensions import override

from lightning_gpipe.engine import CompileOption, is_whole, replicas_mesh
from lightning_gpipe.lightning import step
from lightning_gpipe.lightning._lightning import attached_trainer, optimizers_to_device
from lightning_gpipe.lightning.backbone import find_backbone
from lightning_gpipe.lightning.build import Process, build_stage, stage_spec
from lightning_gpipe.lightning.checkpoints import CheckpointHooks
from lightning_gpipe.lightning.config import (
    Balance,
    CheckpointMode,
    OffloadMode,
    PipelineConfig,
    ScheduleName,
    ShardingStrategy,
    Size,
    StartMethod,
    StateDictType,
    one_stage_warning,
)
from lightning_gpipe.lightning.contract import check_automatic_optimization
from lightning_gpipe.lightning.measure import chosen_split, planned_config, shared_layer_costs
from lightning_gpipe.lightning.mesh import MeshStrategy
from lightning_gpipe.lightning.optimization import holders, pipelined, unpipelined
from lightning_gpipe.lightning.relay import LogRelay, StepRelay
from lightning_gpipe.lightning.resplit import ResplitHooks
from lightning_gpipe.lightning.step import StageRun
from lightning_gpipe.lightning.summary import replace_model_summary
from lightning_gpipe.planning import CostModel, LayerCost, PlanReport


class GPipeStrategy(CheckpointHooks, ResplitHooks, MeshStrategy):
    """Train a LightningModule whose ``nn.Sequential`` backbone is split into stages, one per device of a pipeline.

    GPipe (Huang et al. 2019, arXiv:1811.06965): each mini-batch is split into ``chunks`` micro-batches that flow
    through the stages (the fill), then flow back in reverse order (the drain); gradients accumulate and one
    optimizer step follows, so training is synchronous and equals single-device mini-batch training. Argument names
    follow torchgpipe.

    One OS process per stage, launched like DDP, in a (data-parallel x pipeline) mesh (see
    :class:`~lightning_gpipe.lightning.mesh.MeshStrategy`): each stage's replicas average their gradients once per
    optimizer step with DDP (see docs/scaling.md). The backbone is the only part that is split: code before the backbone
    call must hold no parameters, and modules after it (heads, losses, metrics) run on the last stage. Skip connections
    between backbone layers (:mod:`lightning_gpipe.engine.skip`) go straight from the stashing stage to the popping one;
    a parameter used on several stages (tied weights) is kept in step on each of them
    (:mod:`lightning_gpipe.engine.ties`). Every stage reads the same batch, checked before each step
    (:mod:`lightning_gpipe.lightning.agreement`). See docs/contract.md.

    Args:
        balance: layers per stage, or ``"params"`` (default), ``"time"`` or ``"memory"`` for the best split.
        chunks: M, the micro-batches per mini-batch (default ``4 * K``).
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` (``None``, default) or ``"never"``.
        deferred_batch_norm: batch norm's running statistics updated once per mini-batch (default ``False``).
        defer_weight_grad: the B/W split (``None``, default: chosen at fit start unless ``schedule``/``plan`` is set).
        backbone: the ``nn.Sequential`` attribute to pipeline (default: the only one).
        balance_memory_limit: bytes one stage may hold when choosing the balance (default: no limit).
        start_method: ``"popen"`` (default) or ``"spawn"``.
        state_dict_type: checkpoints as one ``"full"`` file (default) or a ``"sharded"`` directory.
        sharding_strategy: state whole per replica (``"NO_SHARD"``, DDP; ``None``, default, or planned) or sharded.
        schedule: ``"gpipe"`` (fill-drain; ``None``, default), ``"1f1b"``, ``"zb-h1"``, ``"zb-1p"``, ``"zb-v"``,
            ``"v-min"``, ``"v-half"`` or ``"v-zb"``, or a ``.csv`` file in torch's format (docs/planning.md).
        virtual_stages: model chunks per stage, interleaved (``None``, default: 1, or the planner's choice).
        pipeline_parallel_size: K, the stages of each pipeline (default ``"auto"``).
        data_parallel_size: D, the pipeline replicas (default ``"auto"``).
        tensor_parallel_size: T, the processes of each stage, over which ``configure_model`` splits its layers (1).
        timeout: the process group's timeout, a ``timedelta`` (30 minutes by default).
        stall_timeout: how long (a ``timedelta``) a stage may wait for another before the job ends naming it (5 min).
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        plan: ``"auto"`` chooses the options not given under ``memory_limit`` (docs/planning.md); default ``None``.
        memory_limit: bytes one device may hold under ``plan="auto"`` (default: CUDA's free memory; on the CPU give it).
        cost_model: the planner's constants for this machine (default: the package's).
        compile: ``torch.compile`` each stage's backbone layers (``True``, or its keyword arguments); default ``False``.
        offload: ``"activations"``: saved activations wait in host memory for their backward (``None``, default,
            or planned on CUDA).
        accelerator: as for Lightning's other parallel strategies; the Trainer fills it in.
        parallel_devices: the devices of this node, one per stage process; the Trainer fills them in.
        cluster_environment: how ranks are found; the Trainer fills it in.
        checkpoint_io: writes and reads full checkpoint files; Lightning's ``TorchCheckpointIO`` by default.
        precision_plugin: as for Lightning's other strategies; the Trainer fills it in from ``precision=``.

    Each option is documented in full in :class:`~lightning_gpipe.lightning.config.PipelineConfig` (:attr:`config`).

    Raises:
        ValueError: for a bad option (see :class:`~lightning_gpipe.lightning.config.PipelineConfig`); whether the mesh
            and ``balance`` fit the devices, before any process starts; if ``balance`` fits the backbone, before step 1.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        balance: Balance = None,
        chunks: int | None = None,
        checkpoint: CheckpointMode | None = None,
        deferred_batch_norm: bool = False,
        defer_weight_grad: bool | None = None,
        backbone: str | None = None,
        balance_memory_limit: int | None = None,
        start_method: StartMethod = "popen",
        state_dict_type: StateDictType = "full",
        sharding_strategy: ShardingStrategy | None = None,
        schedule: ScheduleName | None = None,
        virtual_stages: int | None = None,
        pipeline_parallel_size: Size = "auto",
        data_parallel_size: Size = "auto",
        tensor_parallel_size: int = 1,
        timeout: timedelta | None = default_pg_timeout,
        stall_timeout: timedelta | None = timedelta(minutes=5),
        process_group_backend: str | None = None,
        plan: Literal["auto"] | None = None,
        memory_limit: int | None = None,
        cost_model: CostModel | None = None,
        compile: CompileOption = False,
        offload: OffloadMode | None = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        given = locals()  # every option above, and the five the Trainer fills in
        config = PipelineConfig(**{option.name: given[option.name] for option in fields(PipelineConfig)})
        super().__init__(config, accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.layer_costs: list[LayerCost] | None = None  # profiled per backbone layer, when a mode needs them
        self.plan_report: PlanReport | None = None  # what plan="auto" chose and why, once planned
        self._requested = self.config  # the options as given; plan="auto" runs a config with the plan's values
        self._whole_before_split = True
        self._run: StageRun | None = None

    @property
    def run(self) -> StageRun | None:
        """This process's part of the run while a model is split (``None`` before setup and after teardown)."""
        return self._run

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Create the modules of ``configure_model`` on the meta device: each stage materialises only its own part
        (see :func:`~lightning_gpipe.engine.partition.materialize`), so no process holds the whole model."""
        with torch.device("meta"):
            yield

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
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
        """Split the module into this process's stage (:func:`~lightning_gpipe.lightning.build.build_stage`), then
        set up precision (clipping over every stage, a shared scaler) and the local optimizers.

        Raises:
            ValueError: if the backbone, ``balance`` or the skip connections do not fit, or a module created on the
                meta device cannot be initialised (see :func:`~lightning_gpipe.engine.partition.materialize`).
            RuntimeError: for a module with manual optimization.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        assert self.accelerator is not None  # given by the Trainer
        self.accelerator.setup(trainer)
        replace_model_summary(trainer)  # Lightning's would count this stage's part only
        if warning := one_stage_warning(self.config, self.topology.num_stages, self.root_device.type):
            rank_zero_warn(warning, category=PossibleUserWarning)
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        assert module is not None  # attached by the Trainer before setup
        check_automatic_optimization(module)
        self._whole_before_split = self.broadcast(is_whole(module), src=0)  # rank 0's module, the user's, decides
        name = find_backbone(module, self.config.backbone)
        if self.config.plan == "auto":
            self.config = planned_config(self, self._requested, module, name)
        last, group, device = self._last_stage_rank, self.pipeline_group, self.root_device
        relays = (
            LogRelay(self, last, group, self._job),
            StepRelay(self, last, self.global_rank == last, group, self._control_group, device, self._job),
        )
        process = Process(self.topology, self.global_rank, device, self._job, self._control_group)
        choosing = fitting and self.config.chooses_split and self.topology.num_stages > 1
        costs = shared_layer_costs(self, module, name, choosing)
        if choosing:
            self.config = chosen_split(self, module, name, costs)
        spec = stage_spec(module, name, self.config, process, costs)
        share = self._share_from_last_stage
        run = self._run = build_stage(module, name, spec, self._job, self._randomness, share, relays)
        run.start(module, self.root_device)
        assert self.model is not None  # the attached module, at least
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.topology.tensor_parallel_size > 1:  # after the split, before the data-parallel wrapping
            run.split_tensors(module, self.deferred_configure_model, self.topology.name(self.global_rank))
        run.ties.synchronize()  # tied copies start equal, even when each stage initialised its own
        if fitting and self.topology.data_parallel_size > 1:
            assert self.device_mesh is not None  # made in setup_environment
            replicas = replicas_mesh(self.device_mesh)
            run.sync_gradients(module, replicas, self.root_device, self.config.sharding_strategy)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        spread = holders(self.topology, run.fsdp is not None)
        pipelined(self.precision_plugin, self.pipeline_group, run.ties.uncounted, self._job, spread)
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate without averaging over the replicas within a gradient-accumulation window (see
        :meth:`~lightning_gpipe.lightning.step.StageRun.no_gradient_sync`)."""
        assert self._run is not None  # split in setup
        with self._run.no_gradient_sync():
            yield

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Act on the stop requests the processes agreed on in the last step, on every process alike (see
        :meth:`~lightning_gpipe.lightning.agreement.RunAgreement.begin_training_step`)."""
        assert self._agreement is not None  # made in setup_environment
        self._agreement.begin_training_step(batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The plan up to its cut; the last stage's output on every stage (see
        :func:`~lightning_gpipe.lightning.step.training_step`)."""
        run, module = self._run, self.lightning_module
        assert run is not None and module is not None  # split in setup
        return step.training_step(run, module, self.precision_plugin, args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any | None, *args: Any, **kwargs: Any) -> Tensor:
        """The plan after its cut (see :func:`~lightning_gpipe.lightning.step.backward`), between
        ``on_before_backward`` and ``on_after_backward``; then the step's agreement, which carries the last stage's
        logged values to every stage (see :func:`~lightning_gpipe.lightning.step.agree`)."""
        module, precision, run = self.lightning_module, self.precision_plugin, self._run
        assert module is not None and run is not None  # attached by the Trainer, split in setup
        self.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, module)
        step.backward(run, module, precision, closure_loss, optimizer, *args, **kwargs)
        closure_loss = precision.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        assert self._agreement is not None  # made in setup_environment
        with run.events.span("relay"):
            step.agree(run, module.trainer, self._agreement)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any | None = None, **kwargs) -> Any:
        """Lightning's optimizer step, with the gradients of tied parameters summed over the stages that hold a
        copy right after the step's closure (see :mod:`lightning_gpipe.engine.ties`); then the step's output that
        callbacks see is the last stage's (:func:`~lightning_gpipe.lightning.step.hand_output`)."""
        run = self._run
        assert run is not None  # split in setup
        stepped = run.ties.after(closure) if run.ties.held else closure  # `closure` keeps the step's output
        result = super().optimizer_step(optimizer, stepped, model, **kwargs)
        step.hand_output(run, closure)
        return result

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
        """Agree on the batch (:meth:`~lightning_gpipe.lightning.agreement.RunAgreement.before_step`), then run the
        step (see :func:`~lightning_gpipe.lightning.step.evaluation_step`)."""
        run, module, agreement = self._run, self.lightning_module, self._agreement
        assert run is not None and module is not None and agreement is not None  # split in setup
        which = f"{hook.removesuffix('_step').replace('predict', 'prediction')} batch {args[1]}"
        agreement.before_step(module.trainer.current_epoch, which)
        return step.evaluation_step(run, module, hook, context, args, kwargs)

    @override
    def teardown(self) -> None:
        """Undo the split (see :meth:`~lightning_gpipe.lightning.step.StageRun.close`): after a completed run, global
        rank 0's module gets every stage's weights back, if it was whole before the split, and the pipeline's own
        process groups (its links' and ties') are destroyed once every process has passed a barrier. Under the spawn
        launcher the main process runs no stage: its module, never attached to the Trainer, was not split."""
        module, run, whole = self.lightning_module, self._run, None
        trainer = attached_trainer(module) if module is not None else None
        completed = trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED
        if run is not None and completed:
            run.unshard()  # with sharding: every parameter whole again (a collective call of the replicas)
        if run is not None and completed and self._whole_before_split:
            assert module is not None  # completed
            whole = run.whole_state(module, self.pipeline_index, self.pipeline_group)
        if module is not None and not is_whole(module):
            module.to_empty(device="cpu")  # a failed materialize; Lightning's teardown cannot move meta tensors
        unpipelined(self.precision_plugin)
        if run is not None and completed:
            self.barrier()  # past it no process uses the pipeline's process groups, which `close` destroys
        super().teardown()
        if run is not None:
            assert module is not None  # the module it was split from stays attached
            run.close(module, whole, release_groups=completed)
        self._run = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"gpipe"`` (popen launcher) and ``"gpipe_spawn"`` (spawn launcher)."""
        strategy_registry.register("gpipe", cls, description="GPipe pipeline parallelism")
        strategy_registry.register(
            "gpipe_spawn", cls, description="GPipe pipeline parallelism, spawn launcher", start_method="spawn"
        )
