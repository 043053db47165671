"""GPipeStrategy's options, checked once: one frozen object, one table of allowed values per option.

:class:`PipelineConfig` holds what ``GPipeStrategy(...)`` was given (see its docstring for each option) and raises
a ``ValueError`` naming the fix for a bad value, before any process starts. Whether the mesh and a list
``balance`` fit the devices is checked when the launcher is configured
(:func:`lightning_gpipe.lightning.mesh.resolve_topology`), and whether ``balance`` fits the backbone at setup
(:mod:`lightning_gpipe.planning.balance`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, cast, get_args

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_gpipe.engine import (
    DEFERRED_BY_DEFAULT,
    PLACED_BY_COST,
    V_SHAPED,
    CompileOption,
    ScheduleTable,
    compile_options,
    is_schedule_file,
    read_schedule,
)
from lightning_gpipe.planning import MODES, Constraints, CostModel

CheckpointMode = Literal["always", "except_last", "never"]
"""``checkpoint``: re-materialization (:data:`lightning_gpipe.engine.rematerialization.CHECKPOINT_MODES`)."""

ScheduleName = Literal["gpipe", "1f1b", "zb-h1", "zb-1p", "zb-v", "v-min", "v-half", "v-zb"]
"""``schedule``: the names of :data:`lightning_gpipe.engine.schedule.SCHEDULES`."""

StartMethod = Literal["popen", "spawn"]
"""``start_method``: Lightning's subprocess-script launcher or its spawn launcher."""

StateDictType = Literal["full", "sharded"]
"""``state_dict_type``: a checkpoint as one file or as a directory of shards."""

ShardingStrategy = Literal["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]
"""``sharding_strategy``: how a stage's replicas hold its state, with the names of Lightning's ``FSDPStrategy``: whole
copies averaged by DDP, or shards by torch's FSDP2 (:mod:`lightning_gpipe.lightning.data_parallel`)."""

OffloadMode = Literal["activations"]
"""``offload``'s value besides ``None``: what a micro-batch's forward saves for its backward waits in host memory
(:mod:`lightning_gpipe.engine.offload`)."""

BalanceMode = Literal["params", "time", "memory"]
"""The modes ``balance`` takes besides a list (:data:`lightning_gpipe.planning.balance.MODES`)."""

CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "checkpoint": (get_args(CheckpointMode), f"choose one of {', '.join(get_args(CheckpointMode))}"),
    "schedule": (
        get_args(ScheduleName),
        "choose 'gpipe' (fill-drain), '1f1b' (one forward, one backward), 'zb-h1' (zero-bubble 1F1B), 'zb-1p'"
        " (zero-bubble, W placed by measured costs), 'zb-v' (zero-bubble, two model chunks per stage in a V), or"
        " 'v-min', 'v-half' or 'v-zb' (a V holding a third, a half or all of 1F1B's activation memory)",
    ),
    "start_method": (get_args(StartMethod), "choose 'popen' or 'spawn'"),
    "state_dict_type": (get_args(StateDictType), "choose 'full' or 'sharded'"),
    "sharding_strategy": (
        get_args(ShardingStrategy),
        "choose 'NO_SHARD' (each replica holds the stage's whole state, averaged by DDP), 'SHARD_GRAD_OP' or"
        " 'FULL_SHARD' (FSDP2 shards it over the replicas)",
    ),
}
"""The options that take one of a few names: option -> (allowed values, how the error names them). The one source of
the allowed names: ``GPipeStrategy``'s type hints (:data:`CheckpointMode`, :data:`ScheduleName`, ...), which the
command line of :class:`~lightning.pytorch.cli.LightningCLI` checks, are these Literals, and
``tests/unit/test_config.py`` holds them, the engine's tables and the docs to the same names."""


DEFAULTS = {"checkpoint": "except_last", "schedule": "gpipe", "virtual_stages": 1, "sharding_strategy": "NO_SHARD"}
"""The values of the options whose ``None`` stands for them (``None`` under ``plan="auto"``: the planner's choice)."""

_TIMEOUTS = (
    ("timeout", "the process group's timeout", "timedelta(minutes=30)", "torch.distributed's default"),
    ("stall_timeout", "how long a stage may wait for another", "timedelta(minutes=5)", "no limit but `timeout`"),
)
"""The options that are durations: (option, what it is, an example, what ``None`` means), for the errors."""

STALL_LIMIT_NOTE = (
    "the shorter of GPipeStrategy's stall_timeout and 90% of its timeout: raise them if a step may legitimately take"
    " that long"
)
"""Where the stall limit (:meth:`PipelineConfig.stall_limit`) comes from and how to raise it, for the watchdog's
message (:class:`~lightning_gpipe.faults.watchdog.Watchdog`)."""

Balance = BalanceMode | Sequence[int] | None
"""``balance``: ``None``, a mode of :data:`lightning_gpipe.planning.balance.MODES`, or layers per stage."""

Size = int | Literal["auto"]
"""A mesh dimension's size as the strategy takes it (``pipeline_parallel_size``, ``data_parallel_size``): a positive
integer, or ``"auto"``."""


def checked_size(size: Any, name: str) -> Size:
    """``size`` if it is a positive integer or ``"auto"``.

    Raises:
        ValueError: otherwise, naming the strategy argument ``name``.
    """
    if size == "auto" or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return size
    raise ValueError(f"GPipeStrategy({name}={size!r}): give a positive integer or 'auto'.")


@dataclass(frozen=True)
class PipelineConfig:
    """The options of :class:`~lightning_gpipe.lightning.strategy.GPipeStrategy`: what a pipeline is made of and how it
    runs.

    Args:
        balance: how many consecutive backbone layers each stage holds. A list gives them, one entry per
            device, e.g. ``[3, 5]``. A mode chooses the contiguous split whose costliest stage is cheapest
            (exactly, see :func:`~lightning_gpipe.planning.balance.solve`): ``"params"`` by parameter count,
            ``"time"`` by forward + backward time, ``"memory"`` by saved activations + parameters. ``None``
            (default) means ``"params"``. ``"time"`` and ``"memory"`` profile each layer, one at a time on
            global rank 0's device, on the first micro-batch of the module's ``example_input_array`` (the
            input of ``forward``) or else of the first training batch; the costs are kept in
            :attr:`layer_costs` and reused by later runs of the same strategy. See docs/balance.md.
        balance_memory_limit: bytes one stage may hold, counted as its layers' profiled saved activations
            and parameters for one micro-batch (see :func:`~lightning_gpipe.planning.balance.balance_by`); the
            split is the best one within it. ``None`` (default) for no limit. Profiles like ``"time"``.
        chunks: M, the number of micro-batches per mini-batch. ``None`` (default) uses ``4 * K`` for K > 1
            stages, the point from which the paper finds the bubble negligible, and 1 for a single stage (no
            bubble to hide, so micro-batches would only cost time; set ``chunks`` to trade time for
            activation memory with re-materialization on one device). A batch with fewer rows
            than ``chunks`` runs as one micro-batch per row; a batch that does not divide evenly gives
            uneven micro-batches (as :func:`torch.tensor_split`).
        checkpoint: re-materialization: ``"always"`` recomputes every micro-batch's forward in the
            drain, ``"except_last"`` all but the last micro-batch, ``"never"`` keeps all activations. ``None``
            (default): ``"except_last"``, or the planner's choice under ``plan="auto"``.
        schedule: ``"gpipe"`` is GPipe's fill-drain (``None``, the default, means it, or the planner's choice under
            ``plan="auto"``): all M forwards, then all M backwards, so a
            stage holds M micro-batches. ``"1f1b"`` is PipeDream-Flush's one-forward-one-backward schedule
            (Narayanan et al. 2021): each micro-batch's backward starts as soon as its loss exists, so stage k
            of K holds at most ``K - k`` micro-batches; same gradients, same bubble. Under ``"1f1b"`` the last
            stage runs ``training_step`` once per micro-batch on its rows of the batch, weighting each loss
            by its share of the rows (see docs/contract.md, "1F1B"). ``"zb-h1"`` is zero-bubble's ZB-H1 (Qi et al.
            2023, section 3.1): 1F1B with each backward split into the input gradient (B) and the weight gradient
            (W), stage k running each W k micro-batches after its B, where it would otherwise wait; it runs the
            user's step like ``"1f1b"``, holds at most K micro-batches on each stage (1F1B's peak, on stage 0)
            and needs the B/W split (``defer_weight_grad`` unset or ``True``). ``"zb-1p"`` is zero-bubble's automatic
            schedule at the same memory (section 3.2): like ``"zb-h1"``, but each stage's W placed from the
            backbone's profiled F, B and W times (profiled once on global rank 0, like ``balance="time"``; the
            plans are never slower than ZB-H1's on the simulator's clock, and equal them for equal costs).
            ``"zb-v"`` is zero-bubble's ZB-V (section 6): two model chunks per stage placed in a V, virtual stages
            k and 2K - 1 - k on stage k (``virtual_stages`` is 2), so the backbone's input and the user's head and
            loss are both on stage 0, with W placed by cost like ``"zb-1p"``; 1F1B's peak memory where the model chunks
            are equal. ``"v-min"``, ``"v-half"``, ``"v-zb"`` (Qi et al. 2024): ZB-V with each stage holding at most
            ``ceil(2K / 3)``, K or 2K chunk micro-batches, a third, a half or all of 1F1B's activation memory.
            A ``.csv`` path runs a schedule in torch's format
            (:mod:`~lightning_gpipe.engine.schedule_csv`, docs/planning.md). Evaluation is the same forward for all.
        virtual_stages: v, the model chunks of each stage (interleaved pipelines, Narayanan et al. 2021, section
            2.2): the backbone is split into ``K * v`` virtual stages and stage k holds virtual stages k, k + K,
            ..., so a micro-batch visits every stage v times and the bubble falls from ``(K - 1) / (M + K - 1)``
            towards ``(K - 1) / (v M + K - 1)``, at the price of v times as many transfers. ``"gpipe"`` runs the
            looped fill-drain, ``"1f1b"`` Megatron-LM's interleaved 1F1B, ``"zb-h1"`` the interleaved 1F1B order
            with ZB-H1's W delay, ``"zb-1p"`` that order with W placed by cost (see
            :mod:`lightning_gpipe.engine.schedule`), ``"zb-v"`` its V (2 only, and its default);
            a list ``balance`` gives ``K * v``
            entries. Parameter names, and so checkpoints, are those of the unsplit module: a run resumes with
            another v or K. 1 (``None``, default): one model chunk per stage; under ``plan="auto"`` the planner's
            choice. Each virtual link has a process group of its own (:mod:`lightning_gpipe.engine.channels`), since
            NCCL matches the point-to-point messages of two ranks by order, not by tag; tested on gloo (CPU) only.
        deferred_batch_norm: ``True`` makes the backbone's ``nn.BatchNorm1d/2d/3d`` layers normalise with
            micro-batch statistics but update their running statistics once per mini-batch, equal to
            single-device batch norm's (see :class:`~lightning_gpipe.engine.batchnorm.DeferredBatchNorm`); the
            plain layers are back in the module after the run. ``False`` (default) leaves batch norm as
            it is: every micro-batch, and every recompute, updates the running statistics.
        defer_weight_grad: ``True`` splits each micro-batch's backward on the stages after the first into the
            input gradient, sent to the previous stage at once, and the weight gradient, computed after the send
            (zero-bubble pipeline parallelism's B/W split, Qi et al. 2023), so the previous stage starts each
            backward one weight gradient earlier. Same gradients. Under fill-drain with ``checkpoint="never"``
            the last stage runs every weight gradient after its last input gradient (its graphs are all held
            at the fill's end anyway); elsewhere a micro-batch's graph is held no longer than without the
            split (docs/how-it-works.md). ``False`` computes both in one backward. ``None`` (default): the
            schedule's default, :data:`~lightning_gpipe.engine.schedule.DEFERRED_BY_DEFAULT`; with ``schedule``
            and ``plan`` unset too, chosen at fit start on a pipeline of several stages: the backbone's layers are
            profiled (B and W timed apart) and the split is taken where the simulator predicts fill-drain faster
            with it (:func:`~lightning_gpipe.planning.split.choose_split`), the choice printed on global rank 0.
        pipeline_parallel_size: K, the stages of each pipeline. ``"auto"`` (default): the length of a list
            ``balance``, else ``devices * num_nodes / data_parallel_size`` if that is given, else ``devices`` (one
            pipeline per node).
        data_parallel_size: D, the pipeline replicas, each training on its own shard of every batch.
            ``"auto"`` (default): ``devices * num_nodes / (K * T)``. ``K * D * T`` must equal ``devices * num_nodes``.
        tensor_parallel_size: T, the processes of each stage (innermost in rank order) over which ``configure_model``,
            run after the split, splits its layers (docs/scaling.md, "3D parallelism"). 1 (default): none.
        backbone: name of the ``nn.Sequential`` attribute to pipeline; ``None`` finds the only one.
        start_method: ``"popen"`` (default) re-runs the user's script once per extra stage, like
            ``torchrun``; ``"spawn"`` starts worker processes from the main one and loads every
            stage's trained weights back into the main process's module.
        state_dict_type: ``"full"`` (default) writes a checkpoint as one file holding every stage's weights and
            optimizer state, gathered on global rank 0; it loads into the plain LightningModule without the
            strategy. ``"sharded"`` writes a directory with torch.distributed.checkpoint, each stage its own
            part, for models too large to gather. Both resume with any number of stages and any ``balance``.
        sharding_strategy: ``"NO_SHARD"`` (``None``, the default, means it, or the planner's choice under
            ``plan="auto"``): each replica of a stage holds its whole state, DDP averages; with
            ``"SHARD_GRAD_OP"``/``"FULL_SHARD"`` FSDP2 shards it (:mod:`~lightning_gpipe.lightning.data_parallel`).
        timeout: the process group's timeout, a ``datetime.timedelta``: how long a collective or transfer may wait
            before torch.distributed gives up (30 minutes by default; ``None``: torch.distributed's default); it also
            caps ``stall_timeout``. On the command line, ``--trainer.strategy.timeout=0:30:00`` (hours:minutes:seconds).
        stall_timeout: how long a stage may wait for another (a transfer, or a collective of the package's)
            before the job ends, naming the stage that stopped progressing and where it was, e.g. "stage 1 has
            been in the forward of micro-batch 3 at step 17 for 300 s". 5 minutes by default, and at most 90% of
            ``timeout`` (so that it speaks before torch.distributed gives up); ``None`` leaves only that. Writing
            a checkpoint and profiling the backbone do not count as stalls. See docs/training.md, "Failures and
            stalls".
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        plan: ``"auto"`` plans the pipeline before the first step (see docs/planning.md): global rank 0 profiles the
            backbone's layers once, at two micro-batch sizes, and every process predicts each candidate plan
            (``chunks``, ``checkpoint``, ``schedule``, the best ``balance``) on the mesh the job was launched with,
            and runs the fastest one whose every process fits ``memory_limit`` (one tensor rank's stage, split as the
            module declares); what it chose and why is printed and kept in ``plan_report``. ``None`` (default): no
            planning. Options given (``chunks``, ``balance``, ``checkpoint``, ``schedule``, even at defaults) are kept.
        memory_limit: bytes one device may hold under ``plan="auto"``: parameters, gradients, optimizer state,
            activations and transfer buffers. ``None`` (default): the free memory CUDA reports on global rank 0's
            device; on the CPU it must be given.
        cost_model: the planner's constants for this machine
            (:class:`~lightning_gpipe.planning.CostModel`); ``None`` (default): the ones measured for the package.
        offload: ``"activations"`` moves what each micro-batch's forward saves for its backward (not parameters, nor
            tensors under 1 MiB) to pinned host memory on a side CUDA stream, and back one computing action before its
            backward (PipeOffload, Wan et al., ICML 2025; :mod:`lightning_gpipe.engine.offload`, docs/training.md);
            same values, bit for bit; on a CPU nothing moves. ``None`` (default): no offload, or under
            ``plan="auto"`` on CUDA the planner's choice (docs/planning.md).
        compile: ``True`` compiles each backbone layer of every stage with :func:`torch.compile` (its defaults), in
            place: the forward, the re-materialization's recompute and the backward (one compiled backward per
            layer) run compiled code, and parameter names stay (``backbone.7.weight``). A dict gives
            ``torch.compile``'s keyword arguments, e.g. ``{"dynamic": False}``. ``False`` (default) compiles
            nothing. Under the B/W split (``defer_weight_grad``, the zero-bubble schedules) each compiled layer's
            backward runs twice, once for B and once for W (same gradients; see
            :mod:`lightning_gpipe.engine.compilation` and docs/how-it-works.md, "torch.compile").

    Raises:
        ValueError: naming the option and the fix, for a value of the wrong type or outside :data:`CHOICES`, a
            ``balance`` that is neither a mode nor a list of integers, a ``balance_memory_limit`` that is not a
            positive integer or comes with a list ``balance``, a bad mesh size, options ``tensor_parallel_size``
            refuses (:func:`_check_tensor_parallel`), ``memory_limit`` or ``cost_model`` without ``plan="auto"``,
            ``plan="auto"`` with ``balance_memory_limit``, or ``compile`` with a sharded ``sharding_strategy``.
    """

    balance: Balance = None
    chunks: int | None = None
    checkpoint: CheckpointMode | None = None
    schedule: ScheduleName | None = None
    deferred_batch_norm: bool = False
    defer_weight_grad: bool | None = None
    virtual_stages: int | None = None
    backbone: str | None = None
    balance_memory_limit: int | None = None
    start_method: StartMethod = "popen"
    state_dict_type: StateDictType = "full"
    sharding_strategy: ShardingStrategy | None = None
    pipeline_parallel_size: Size = "auto"
    data_parallel_size: Size = "auto"
    tensor_parallel_size: int = 1
    timeout: timedelta | None = default_pg_timeout
    stall_timeout: timedelta | None = timedelta(minutes=5)
    process_group_backend: str | None = None
    plan: str | None = None
    memory_limit: int | None = None
    cost_model: CostModel | None = None
    compile: CompileOption = False
    offload: OffloadMode | None = None

    def __post_init__(self) -> None:
        self._given: frozenset[str]  # the options given (not None), set here: not a field of the dataclass
        object.__setattr__(self, "_given", frozenset(k for k in DEFAULTS if getattr(self, k) is not None))
        for option, default in DEFAULTS.items():
            object.__setattr__(self, option, default if getattr(self, option) is None else getattr(self, option))
        if self.schedule in V_SHAPED and "virtual_stages" not in self._given:  # the V's two arms, kept by the planner
            object.__setattr__(self, "virtual_stages", 2)
            object.__setattr__(self, "_given", self._given | {"virtual_stages"})
        self._table: ScheduleTable | None  # a CSV schedule's, read before any process starts
        object.__setattr__(self, "_table", _schedule_file(self))
        _check_types(self)
        for option, (allowed, fix) in CHOICES.items():
            if getattr(self, option) not in allowed and not (option == "schedule" and self._table is not None):
                raise ValueError(f"GPipeStrategy({option}={getattr(self, option)!r}): {fix}.")
        self._check_weight_split()
        self._check_virtual_stages()
        self._check_balance()
        _check_plan(self)
        _check_compile(self)  # raises ValueError for a bad value, before any process starts
        _check_timeouts(self)
        checked_size(self.pipeline_parallel_size, "pipeline_parallel_size")
        checked_size(self.data_parallel_size, "data_parallel_size")
        _check_tensor_parallel(self)
        if self.balance is not None and not isinstance(self.balance, str):
            object.__setattr__(self, "balance", list(self.balance))

    def _check_weight_split(self) -> None:
        defer = self.defer_weight_grad
        if defer is not None and not isinstance(defer, bool):
            raise ValueError(
                f"GPipeStrategy(defer_weight_grad={defer!r}): give True (the B/W split), False, or None for the"
                " schedule's default."
            )
        assert self.schedule is not None  # __post_init__ gave the default
        if defer is False and DEFERRED_BY_DEFAULT.get(self.schedule):  # the zero-bubble schedules: they need it
            raise ValueError(
                f"GPipeStrategy(schedule={self.schedule!r}, defer_weight_grad=False): a zero-bubble schedule runs each"
                " weight gradient apart from its input gradient, so it needs the B/W split; leave defer_weight_grad"
                " unset (or True), or choose schedule='1f1b'."
            )

    def _check_virtual_stages(self) -> None:
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(
                f"GPipeStrategy(virtual_stages={v!r}): give the model chunks per stage, an integer >= 1 (1: none)."
            )
        if self.schedule in V_SHAPED and v != 2:
            raise ValueError(
                f"GPipeStrategy(schedule={self.schedule!r}, virtual_stages={v}): a V schedule places two model chunks"
                " per stage in a V; leave virtual_stages unset (or 2), or choose schedule='zb-1p' for other counts."
            )

    @property
    def v_shape(self) -> bool:
        """Whether the schedule places each stage's two model chunks in a V (:data:`~lightning_gpipe.engine.schedule.
        V_SHAPED`: virtual stages k and 2K - 1 - k on stage k, the head on stage 0), or as a CSV schedule does."""
        return self.schedule in V_SHAPED or (self._table is not None and self._table.v_shape)

    @property
    def splits_backward(self) -> bool:
        """Whether the stages after the first split each backward into B and W: ``defer_weight_grad``, or if
        ``None``, the schedule's default (:data:`~lightning_gpipe.engine.schedule.DEFERRED_BY_DEFAULT`)."""
        if self.defer_weight_grad is None:
            assert self.schedule is not None  # __post_init__ gave the default
            return self._table.splits if self._table is not None else DEFERRED_BY_DEFAULT[self.schedule]
        return self.defer_weight_grad

    def _check_balance(self) -> None:
        balance, limit = self.balance, self.balance_memory_limit
        automatic = balance is None or balance in MODES
        if not automatic and (  # so balance is not None
            isinstance(balance, (str, bytes))
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in cast(Sequence, balance))
        ):
            raise ValueError(
                f"GPipeStrategy(balance={balance!r}): choose 'params', 'time' or 'memory', or give the number of"
                " backbone layers of each stage as a list of integers, e.g. balance=[3, 5]."
            )
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(
                f"GPipeStrategy(balance_memory_limit={limit!r}): give the bytes one stage may hold, an integer >= 1,"
                " or None for no limit."
            )
        if limit is not None and not automatic:
            raise ValueError(
                f"GPipeStrategy(balance={balance!r}, balance_memory_limit=...): the memory limit steers an automatic"
                " balance; use balance='time' (or 'params', 'memory') with it, or drop the limit."
            )

    def constraints(self) -> Constraints:
        """What the user fixed, for the planner: ``chunks``, ``offload``, a ``balance`` (list or mode), the mesh sizes
        that are not ``"auto"``, and ``checkpoint``, ``schedule``, ``virtual_stages`` and ``sharding_strategy`` when
        given explicitly (even at their default values; ``"NO_SHARD"`` also with ``compile``, which FSDP2 refuses)."""
        return Constraints(
            pipeline_parallel_size=None if self.pipeline_parallel_size == "auto" else self.pipeline_parallel_size,
            data_parallel_size=None if self.data_parallel_size == "auto" else self.data_parallel_size,
            micro_batches=self.chunks,
            checkpoint=self.checkpoint if "checkpoint" in self._given else None,
            schedule=self.schedule if "schedule" in self._given else None,
            balance=self.balance,
            virtual_stages=self.virtual_stages if "virtual_stages" in self._given else None,
            sharding_strategy=self.sharding_strategy
            if "sharding_strategy" in self._given or self.compile is not False
            else None,
            offload=self.offload,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def profiled(self) -> bool:
        """Whether the run needs each layer's profiled cost: to choose the balance (``"time"``, ``"memory"`` or a
        limit), or to place the actions of a schedule by cost (``"zb-1p"``, see :attr:`placed_by_cost`)."""
        return self.balance in ("time", "memory") or self.balance_memory_limit is not None or self.placed_by_cost

    @property
    def chooses_split(self) -> bool:
        """Whether the strategy chooses between whole backwards and the B/W split at fit start
        (:func:`~lightning_gpipe.planning.split.choose_split`): the user fixed neither ``schedule`` nor
        ``defer_weight_grad`` and asked for no plan."""
        return self.plan is None and "schedule" not in self._given and self.defer_weight_grad is None

    @property
    def placed_by_cost(self) -> bool:
        """Whether the schedule places its actions by the profiled B and W times
        (:data:`~lightning_gpipe.engine.schedule.PLACED_BY_COST`)."""
        return self.schedule in PLACED_BY_COST

    def micro_batches_for(self, num_stages: int) -> int:
        """M for a pipeline of ``num_stages``: ``chunks`` if given, else ``4 * K`` for K > 1 (the paper's point from
        which the bubble is negligible) and 1 for a single stage (no bubble to hide)."""
        if self.chunks is not None:
            return self.chunks
        return 4 * num_stages if num_stages > 1 else 1

    def stall_limit(self) -> float:
        """Seconds a stage may wait for another before the wait counts as a stall: ``stall_timeout``, at most 90% of
        ``timeout`` (so that the watchdog speaks before torch.distributed gives up); ``inf`` without either."""
        limits = [0.9 * self.timeout.total_seconds()] if self.timeout is not None else []
        limits += [self.stall_timeout.total_seconds()] if self.stall_timeout is not None else []
        return min(limits, default=float("inf"))


def _check_types(config: "PipelineConfig") -> None:
    """The options whose values are not checked against a table of names: their types."""
    chunks = config.chunks
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"GPipeStrategy(chunks={chunks!r}): chunks is the number of micro-batches, an integer >= 1.")
    if not isinstance(config.deferred_batch_norm, bool):
        raise ValueError(
            f"GPipeStrategy(deferred_batch_norm={config.deferred_batch_norm!r}): give True (batch norm's running"
            " statistics updated once per mini-batch) or False."
        )
    for option in ("backbone", "process_group_backend"):
        value = getattr(config, option)
        if value is not None and not isinstance(value, str):
            what = "the name of the nn.Sequential attribute" if option == "backbone" else "a backend name"
            raise ValueError(f"GPipeStrategy({option}={value!r}): give {what} as a string, or None.")
    if config.offload is not None and config.offload not in get_args(OffloadMode):
        raise ValueError(
            f"GPipeStrategy(offload={config.offload!r}): choose None (activations stay on the device) or"
            " 'activations' (moved to host memory until their backward)."
        )
    if config.cost_model is not None and not isinstance(config.cost_model, CostModel):
        raise ValueError(
            f"GPipeStrategy(cost_model={config.cost_model!r}): give a lightning_gpipe.CostModel, e.g."
            " CostModel(transfer_latency=2e-3), or None for the package's constants."
        )


def _schedule_file(config: "PipelineConfig") -> ScheduleTable | None:
    """A ``schedule`` that is the path of a CSV schedule in torch.distributed.pipelining's format (torchtitan's
    ``pipeline_parallel_schedule_csv``; :mod:`~lightning_gpipe.engine.schedule_csv`), read; ``chunks`` and
    ``virtual_stages`` become its M and v where not given; ``None`` for a schedule's name.

    Raises:
        ValueError: for a missing file, one our runtime cannot run (the row and column named), ``chunks``,
            ``virtual_stages`` or ``defer_weight_grad=False`` that the file contradicts, or ``plan="auto"``.
    """
    if not is_schedule_file(config.schedule):
        return None
    try:
        table = read_schedule(cast(str, config.schedule))
    except (OSError, ValueError) as error:
        raise ValueError(f"GPipeStrategy(schedule={config.schedule!r}): {error}") from error
    for option, value in (("chunks", table.micro_batches), ("virtual_stages", table.virtual_stages)):
        given = config.chunks is not None if option == "chunks" else option in config._given
        if given and getattr(config, option) != value:
            raise ValueError(
                f"GPipeStrategy(schedule={config.schedule!r}, {option}={getattr(config, option)!r}): the schedule is"
                f" written for {option}={value}; leave {option} unset, or write the schedule for it."
            )
        object.__setattr__(config, option, value)
    if config.defer_weight_grad is False and table.splits:
        raise ValueError(
            f"GPipeStrategy(schedule={config.schedule!r}, defer_weight_grad=False): the schedule splits backwards"
            " into I and W, which needs the B/W split; leave defer_weight_grad unset (or True)."
        )
    if config.plan is not None:
        raise ValueError(
            f"GPipeStrategy(schedule={config.schedule!r}, plan='auto'): a CSV schedule fixes K, chunks and the order"
            " of every action, which the planner would choose; drop one of them."
        )
    return table


def _check_plan(config: "PipelineConfig") -> None:
    """``plan`` and the options that steer it: ``memory_limit`` and ``cost_model`` only with ``plan="auto"``, which
    takes the place of ``balance_memory_limit``."""
    plan, limit = config.plan, config.memory_limit
    if plan not in (None, "auto"):
        raise ValueError(f"GPipeStrategy(plan={plan!r}): choose 'auto' (plan the pipeline) or None.")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(
            f"GPipeStrategy(memory_limit={limit!r}): give the bytes one device may hold, an integer >= 1, or None"
            " for what the accelerator reports."
        )
    if plan is None and (limit is not None or config.cost_model is not None):
        raise ValueError(
            "GPipeStrategy(memory_limit=..., cost_model=...) steer the planner; add plan='auto', or drop them"
            " (balance_memory_limit limits the balance alone)."
        )
    if plan == "auto" and config.balance_memory_limit is not None:
        raise ValueError(
            "GPipeStrategy(plan='auto', balance_memory_limit=...): the planner takes the whole memory of a device"
            " as memory_limit=BYTES (parameters, gradients, optimizer state, activations); drop"
            " balance_memory_limit."
        )


def _check_compile(config: "PipelineConfig") -> None:
    """``compile``'s value (:func:`~lightning_gpipe.engine.compile_options`), and not with sharding: compiled layers
    have not been run under FSDP2's hooks."""
    try:
        compile_options(config.compile)
    except ValueError as error:
        raise ValueError(
            f"GPipeStrategy(compile={config.compile!r}): {error} Give True (torch.compile with its defaults), False,"
            " or a dict of torch.compile's keyword arguments, e.g. compile={'dynamic': False, 'mode':"
            " 'max-autotune-no-cudagraphs'}."
        ) from error
    if config.sharding_strategy != "NO_SHARD" and config.compile is not False:
        raise ValueError(
            f"GPipeStrategy(sharding_strategy={config.sharding_strategy!r}, compile=...): layers compiled with"
            " torch.compile have not been run under FSDP2's gathering hooks by GPipeStrategy; set compile=False, or"
            " sharding_strategy='NO_SHARD' to keep compile."
        )


TENSOR_PARALLEL_NOT_YET = {
    "compile": "compiled layers are not checked with DTensor parameters yet; leave compile=False",
    "offload": "offloading DTensor activations is not checked yet; leave offload=None (plan='auto' never plans it"
    " with tensor_parallel_size > 1)",
}
"""Options ``tensor_parallel_size > 1`` refuses for now (when ``GPipeStrategy(...)`` is built, before any process
starts), each with why and the fix."""


def _check_tensor_parallel(config: "PipelineConfig") -> None:
    """Raise a ``ValueError`` naming the fix for a ``tensor_parallel_size`` that is not a positive integer, or with
    ``tensor_parallel_size > 1`` an option of :data:`TENSOR_PARALLEL_NOT_YET`."""
    size = config.tensor_parallel_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"GPipeStrategy(tensor_parallel_size={size!r}): give a positive integer (1: none).")
    if size == 1:
        return
    for option, why in TENSOR_PARALLEL_NOT_YET.items():
        if getattr(config, option) not in (None, False):
            raise ValueError(
                f"GPipeStrategy(tensor_parallel_size={size}, {option}={getattr(config, option)!r}): {why}."
            )


def check_tensor_parallel_replicas(config: "PipelineConfig", replicas: int) -> None:
    """Raise a ``ValueError`` naming the fix for tensor-parallel stages with several ``replicas`` kept in step by DDP
    (``sharding_strategy="NO_SHARD"``): DDP takes no ``DTensor`` parameters; FSDP2 shards them over the replicas.
    Under ``plan="auto"`` a ``sharding_strategy`` not given is the planner's, which plans FSDP2 for such stages."""
    if config.tensor_parallel_size == 1 or replicas == 1 or config.sharding_strategy != "NO_SHARD":
        return
    if config.plan == "auto" and config.constraints().sharding_strategy is None:
        return
    raise ValueError(
        f"GPipeStrategy(tensor_parallel_size={config.tensor_parallel_size}) with {replicas} data-parallel replicas"
        " and sharding_strategy='NO_SHARD': DDP does not take the tensor-parallel (DTensor) parameters. Use"
        " sharding_strategy='FULL_SHARD' or 'SHARD_GRAD_OP' (FSDP2 over the replicas, as torchtitan composes them)."
    )


def check_tensor_parallel_scaler(config: "PipelineConfig", scaler: bool) -> None:
    """Raise a ``ValueError`` naming the fix for tensor-parallel stages under a precision with a gradient ``scaler``
    (``precision="16-mixed"`` on CUDA, or a plugin given one): the scaler's unscaling of tensor-parallel (``DTensor``)
    gradients has not been run, whatever ``sharding_strategy`` and the number of replicas, so no plan avoids it. Called
    where the launcher is configured, before any process starts, and by the planner."""
    if config.tensor_parallel_size == 1 or not scaler:
        return
    raise ValueError(
        f"GPipeStrategy(tensor_parallel_size={config.tensor_parallel_size}) with precision='16-mixed': the gradient"
        " scaler's unscaling of tensor-parallel (DTensor) gradients has not been run by GPipeStrategy, with any"
        " sharding_strategy. Use precision='bf16-mixed' (no scaler) or '32-true', or tensor_parallel_size=1."
    )


def _check_timeouts(config: "PipelineConfig") -> None:
    """``timeout`` and ``stall_timeout``: positive ``timedelta``s or ``None``."""
    for option, what, example, without in _TIMEOUTS:
        value = getattr(config, option)
        if value is None or (isinstance(value, timedelta) and value > timedelta(0)):
            continue
        seconds = f" (timedelta(seconds={value}) for {value} s)" if isinstance(value, (int, float)) else ""
        raise ValueError(
            f"GPipeStrategy({option}={value!r}): give {what} as a positive `datetime.timedelta`, e.g. {example}"
            f"{seconds}, or None ({without}). On the command line: --trainer.strategy.{option}=0:30:00"
            " (hours:minutes:seconds)."
        )


def offload_note(config: PipelineConfig, device_type: str) -> str | None:
    """What ``offload`` does on a CPU, said once per run; ``None`` without offload or on an accelerator."""
    if config.offload is None or device_type != "cpu":
        return None
    return (
        "GPipeStrategy(offload='activations'): offload on the CPU moves nothing anywhere useful: activations stay in"
        " host memory, where a CPU stage's activations already are (the hooks and prefetches run, the values are"
        " the same). Offload spares an accelerator's memory."
    )


def one_stage_warning(config: PipelineConfig, num_stages: int, device_type: str) -> str | None:
    """The warning for a pipeline of one stage on a CPU that no option asked for, else ``None``.

    ``Trainer(devices="auto")``, Lightning's default, is one process on a CPU, so leaving ``devices`` out gives a
    pipeline of one stage: nothing is split. Lightning resolves ``"auto"`` before the strategy sees it, so an explicit
    ``devices=1`` looks the same here; ``pipeline_parallel_size=1`` or a one-entry ``balance`` says that one stage is
    meant, and silences the warning.

    Args:
        config: the strategy's options.
        num_stages: K, as resolved from the devices.
        device_type: the type of the stage's device (``"cpu"``, ``"cuda"``...).
    """
    meant = config.pipeline_parallel_size != "auto" or isinstance(config.balance, list)
    if num_stages > 1 or device_type != "cpu" or meant:
        return None
    return (
        "GPipeStrategy runs a pipeline of one stage: the whole backbone in one process, nothing split. On a CPU,"
        " Trainer(devices='auto'), the default, is one process; give one device per stage, e.g."
        " Trainer(accelerator='cpu', devices=2) for 2 stages. For one stage on purpose, say so with"
        " GPipeStrategy(pipeline_parallel_size=1)."
    )
