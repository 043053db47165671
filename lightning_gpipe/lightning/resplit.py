"""The split checked against the running pipeline, and moved in place when another is predicted faster.

``balance="time"`` chooses the split once, from a profile of each layer run alone, before training. After the first
optimizer steps (:class:`Resplit`: ``warmup`` steps, then ``steps`` measured ones), every stage sends its mean busy time
per step (forwards, recomputes, backwards and deferred weight gradients; the time source :attr:`Resplit.busy` is
replaceable) and the names of its layers to every other stage, in one collective call, so every stage decides from the
same numbers (:func:`choose_resplit`): each stage's measured over predicted time (:func:`stage_ratios`; the prediction
:func:`profiled_busy`, B and W apart where the run splits its backwards) is how much slower or faster than profiled that
stage runs, a layer costs on each stage its profiled time times that stage's ratio, the balance solver (under
``balance_memory_limit``) picks the split of those costs (:func:`measured_split`), and the simulator predicts both
steps. One line says what the check found (:func:`check_line`): each stage's busy time the profile predicted against
the measured one, with the profile's error, and the split kept or re-split. Where the new split's step is at least
``gain`` (5%) shorter, the stages move the layers that change hands (:func:`move_layers`): their parameters, buffers
and optimizer state go over the run's process group to their new stage, exactly, the stages' pipelines are rebuilt
through the same door as at setup (:func:`~lightning_gpipe.lightning.build.build_stage`), and the optimizer (the same
object, so schedulers keep working) gets the new parameters in their groups. A ``balance`` given as a list is never
changed. Runs with several replicas, tensor-parallel stages, virtual stages, tied parameters across stages,
``compile`` or ``deferred_batch_norm`` keep their split (one line says why). The new pipeline's links are new process
groups, made as at setup. See docs/balance.md.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_gpipe._torch import children
from lightning_gpipe.engine import WORK, Span, recomputed_share
from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning._lightning import optimizers_to_device, torch_optimizer
from lightning_gpipe.lightning.build import Process, build_stage, stage_spec
from lightning_gpipe.lightning.step import StageRun
from lightning_gpipe.planning import (
    CostModel,
    LayerCost,
    StageCost,
    layer_memory,
    modelled_stage_costs,
    simulate,
    solve_by_stage,
)

if TYPE_CHECKING:  # the class it comes ahead of, whose attributes it uses and whose methods it overrides
    from lightning_gpipe.lightning.config import PipelineConfig
    from lightning_gpipe.lightning.mesh import MeshStrategy as _Strategy
else:
    _Strategy = object

_BUSY = tuple(kind for kind in WORK if kind not in ("loss", "optimizer"))

_AS_PROFILED = CostModel(micro_batch_overhead=0.0, compute_scale=1.0, copy_bandwidth=math.inf)
"""The planner's stage costs (:func:`~lightning_gpipe.planning.predict.modelled_stage_costs`) with the layers' times as
profiled: nothing added per micro-batch or per byte moved (a stage's busy spans hold neither)."""


def work_seconds(run: StageRun, spans: Sequence[Span]) -> float:
    """The default :attr:`Resplit.busy`: seconds of the step's forward, recompute, backward and weight spans
    (``spans``: those the stage recorded in the step; the head's and the optimizer's are left out, as the profile
    leaves them out)."""
    return sum(span.end - span.start for span in spans if span.kind in _BUSY)


BusyTime = Callable[[StageRun, Sequence[Span]], float]
"""A stage's busy seconds in one training step: ``busy(run, spans)``, ``run`` the stage's
:class:`~lightning_gpipe.lightning.step.StageRun`, ``spans`` what its recorder kept of the step."""


class ResplitDecision(NamedTuple):
    """What :func:`choose_resplit` found.

    Attributes:
        balance: the current split.
        best: the split of the measured costs (the current one when no other is faster).
        step: the current split's predicted step, seconds, from the measured costs.
        best_step: ``best``'s.
        taken: whether ``best`` is predicted at least the asked share faster.
        profiled: each stage's busy seconds per step the profile predicted for ``balance`` (:func:`profiled_busy`).
    """

    balance: list[int]
    best: list[int]
    step: float
    best_step: float
    taken: bool
    profiled: list[float]


def profiled_busy(
    costs: Sequence[LayerCost], balance: Sequence[int], micro_batches: int, checkpoint: str, split: bool = False
) -> list[float]:
    """Each stage's busy seconds per step as the profile predicts them: ``micro_batches`` times its layers' forwards
    (and the recomputed share of them under ``checkpoint``) and backwards; with ``split`` (the run splits its
    backwards into B and W), a stage after the first runs each layer's profiled B and W where they were measured, the
    first stage whole backwards, as the engine runs them (a stage's busy time: :func:`work_seconds`)."""
    share = recomputed_share(checkpoint, micro_batches)
    stages = modelled_stage_costs(costs, balance, _AS_PROFILED, split)
    return [micro_batches * (stage.forward * (1 + share) + stage.backward) for stage in stages]


def profile_errors(profiled: Sequence[float], measured: Sequence[float]) -> list[float]:
    """Each stage's profile error: its profiled busy time less its measured one, over the measured one (0.1: the
    profile predicted 10% more than the run took; 0 where nothing was measured)."""
    return [(p - m) / m if m > 0 else 0.0 for p, m in zip(profiled, measured)]


def profile_line(profiled: Sequence[float], measured: Sequence[float]) -> str:
    """The profile's busy time per stage against the measured one, in words: ``profiled 8.0, 4.0 ms per step against
    11.0, 4.0 ms measured, error -27%, +0%``."""
    errors = ", ".join(f"{100 * e:+.0f}%" for e in profile_errors(profiled, measured))
    return (
        f"profiled {', '.join(f'{1e3 * s:.1f}' for s in profiled)} ms per step against"
        f" {', '.join(f'{1e3 * s:.1f}' for s in measured)} ms measured, error {errors}"
    )


def stage_ratios(
    costs: Sequence[LayerCost],
    balance: Sequence[int],
    measured: Sequence[float],
    micro_batches: int,
    checkpoint: str,
    split: bool = False,
) -> list[float]:
    """Each stage's measured busy seconds per step over the profile's prediction of them (:func:`profiled_busy`,
    ``split`` as there): how much slower (above 1) or faster than profiled the stage runs whatever layers it holds.
    A stage predicted to take no time gets 1."""
    profiled = profiled_busy(costs, balance, micro_batches, checkpoint, split)
    return [seconds / predicted if predicted > 0 else 1.0 for seconds, predicted in zip(measured, profiled)]


def measured_stages(
    costs: Sequence[LayerCost], balance: Sequence[int], ratios: Sequence[float], split: bool = False
) -> list[StageCost]:
    """The simulator's costs of the stages of ``balance``: their layers' profiled times (B and W apart on the stages
    after the first where ``split``) scaled by each stage's ``ratios`` (:func:`stage_ratios`)."""
    stages = modelled_stage_costs(costs, balance, _AS_PROFILED, split)
    return [
        replace(
            stage,
            forward=stage.forward * ratio,
            backward=stage.backward * ratio,
            recompute=(stage.forward if stage.recompute is None else stage.recompute) * ratio,
            weight=stage.weight * ratio,
        )
        for stage, ratio in zip(stages, ratios)
    ]


def measured_split(
    costs: Sequence[LayerCost],
    ratios: Sequence[float],
    micro_batches: int,
    checkpoint: str,
    split: bool = False,
    memory_limit: int | None = None,
) -> list[int]:
    """The split whose busiest stage is least busy when each stage runs at its measured ``ratios`` (a layer costs on
    stage ``k`` its profiled time, B and W apart after the first stage where ``split``, times ``ratios[k]``), each
    stage within ``memory_limit`` (bytes, as :func:`~lightning_gpipe.planning.balance.balance_by` counts them)."""
    share = recomputed_share(checkpoint, micro_batches)

    def busy(halves: bool) -> list[float]:
        layers = modelled_stage_costs(costs, [1] * len(costs), _AS_PROFILED, halves)
        return [layer.forward * (1 + share) + layer.backward for layer in layers]

    whole = busy(False)
    halves = busy(True) if split else whole
    rows = [[ratio * t for t in (whole if k == 0 else halves)] for k, ratio in enumerate(ratios)]
    if memory_limit is None:
        return solve_by_stage(rows)
    return solve_by_stage(rows, memory=layer_memory(costs), memory_limit=memory_limit)


def choose_resplit(
    costs: Sequence[LayerCost],
    balance: Sequence[int],
    measured: Sequence[float],
    config: "PipelineConfig",
    micro_batches: int,
    gain: float = 0.05,
) -> ResplitDecision:
    """The split the measured stage times ask for, taken where the simulator predicts its step at least ``gain``
    shorter than the current ``balance``'s.

    The error the check corrects is the stage's: each stage's measured busy time over the profile's prediction
    (:func:`stage_ratios`) is taken as how much slower or faster that stage runs whatever layers it holds (its
    process's share of the machine, its B/W split, its caches), and a layer moved to another stage costs its
    profiled time times its new stage's ratio. The candidate is :func:`measured_split` (under
    ``config.balance_memory_limit``); both steps come from the same costs (:func:`measured_stages`) under ``config``'s
    schedule, checkpoint mode and B/W split.

    Args:
        costs: the profiled cost of each backbone layer for one micro-batch.
        balance: the current split.
        measured: each stage's busy seconds per step.
        config: the run's options.
        micro_batches: M.
        gain: the least share of the current step the new split must save (default 5%).
    """
    checkpoint, schedule, split_backward = config.checkpoint, config.schedule, config.splits_backward
    assert checkpoint is not None and schedule is not None  # PipelineConfig gave the defaults
    ratios = stage_ratios(costs, balance, measured, micro_batches, checkpoint, split_backward)

    def step(split: Sequence[int]) -> float:
        stages = measured_stages(costs, split, ratios, split_backward)
        return simulate(
            stages, micro_batches, checkpoint, schedule=schedule, defer_weight_grad=split_backward
        ).step_time

    limit = config.balance_memory_limit
    best = measured_split(costs, ratios, micro_batches, checkpoint, split_backward, limit)
    current, best_step = step(balance), step(best)
    taken = list(best) != list(balance) and best_step <= (1 - gain) * current
    profiled = profiled_busy(costs, balance, micro_batches, checkpoint, split_backward)
    return ResplitDecision(list(balance), best if taken else list(balance), current, best_step, taken, profiled)


@dataclass
class Resplit:
    """When the split of ``balance="time"`` is checked against the run (``GPipeStrategy.resplit``; set it to ``None``
    to keep the profiled split).

    Args:
        warmup: optimizer steps not measured, at the start of each fit (default 3: the first ones set up connections
            and caches).
        steps: optimizer steps measured after them; their mean busy time per stage decides (default 3).
        gain: the least share of the predicted step a new split must save to be taken (default 0.05).
        busy: the time source, a :data:`BusyTime` (default :func:`work_seconds`, the stage's recorded spans).

    Attributes:
        record: what the last fit's check found (``None`` before one): ``balance``, ``measured_s`` (per stage),
            ``resplit`` (the new balance or ``None``) and, where the run keeps its split whatever is found, ``refused``
            (why); else ``profiled_s`` (each stage's busy seconds per step the profile predicted,
            :func:`profiled_busy`), ``profile_error`` (per stage, :func:`profile_errors`), ``split_backward`` (whether
            the run splits its backwards into B and W), ``best_balance``, ``predicted_step_s`` and ``best_step_s``.

    Raises:
        ValueError: for ``warmup < 0``, ``steps < 1`` or a ``gain`` outside ``[0, 1)``.
    """

    warmup: int = 3
    steps: int = 3
    gain: float = 0.05
    busy: BusyTime = work_seconds
    record: dict[str, Any] | None = field(default=None, init=False)
    _seen: list[float] = field(default_factory=list, init=False, repr=False)
    _count: int = field(default=0, init=False, repr=False)
    _done: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.steps < 1 or not 0 <= self.gain < 1:
            raise ValueError(
                f"Resplit(warmup={self.warmup}, steps={self.steps}, gain={self.gain}): give warmup >= 0 unmeasured"
                " steps, steps >= 1 measured ones and a gain in [0, 1) (0.05: a split predicted 5% faster)."
            )

    def restart(self) -> None:
        """Forget the measured steps, so that the next fit checks its split again (its :attr:`record` stays)."""
        self._seen, self._count, self._done = [], 0, False

    def measuring(self) -> bool:
        """Whether the next optimizer step is measured."""
        return not self._done and self.warmup <= self._count < self.warmup + self.steps

    def stepped(self, busy: float | None) -> bool:
        """Count an optimizer step (``busy``: its busy seconds, when measured); whether the check is due now (once
        per fit)."""
        self._count += 1
        if busy is not None:
            self._seen.append(busy)
        due = not self._done and len(self._seen) == self.steps
        self._done = self._done or due
        return due

    @property
    def mean_busy(self) -> float:
        """The mean busy seconds of the measured steps."""
        return sum(self._seen) / len(self._seen)


class ResplitHooks(_Strategy):
    """The re-split of :class:`~lightning_gpipe.lightning.strategy.GPipeStrategy` (a base class ahead of
    :class:`~lightning_gpipe.lightning.mesh.MeshStrategy`): measures the steps :attr:`resplit` asks for around
    Lightning's optimizer step, then checks the split (see the module docstring)."""

    _run: StageRun | None
    _requested: "PipelineConfig"
    layer_costs: list[LayerCost] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resplit: Resplit | None = Resplit()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any | None = None, **kwargs) -> Any:
        """Lightning's optimizer step, measured where :attr:`resplit` asks; after the last measured step, the check."""
        check, run = self.resplit, self._run
        if check is None or run is None or not self._checks_split():
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if not check.measuring():
            check.stepped(None)
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        events, mark = run.events, len(run.events.spans)
        was, events.enabled = events.enabled, True
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        events.enabled = was
        busy = check.busy(run, run.events.spans[mark:])
        if not was:
            del events.spans[mark:]  # recorded for the check only
        if check.stepped(busy):
            self._check_split(check, run)
        return result

    @override
    def teardown(self) -> None:
        """Forget this fit's measured steps (:meth:`Resplit.restart`), then tear down as before."""
        if self.resplit is not None:
            self.resplit.restart()
        super().teardown()

    def _checks_split(self) -> bool:
        """Whether this fit's split came from the profile (``balance="time"``; a list given is never changed)."""
        return self._requested.balance == "time" and self.layer_costs is not None and self.topology.num_stages > 1

    def _check_split(self, check: Resplit, run: StageRun) -> None:
        """Gather every stage's busy time and layers (one collective call), decide alike everywhere, say so, and
        move the layers where the decision says."""
        mine = (check.mean_busy, list(children(run.partition)), run.ties.held)
        parts = waiting.all_gather_object(self._job, mine)
        parts = [parts[self.topology.rank_of(k, 0)] for k in range(self.topology.num_stages)]  # the first pipeline's
        balance, measured = [len(names) for _, names, _ in parts], [busy for busy, _, _ in parts]
        check.record = {"balance": balance, "measured_s": measured, "resplit": None}
        refused = self._refusal(any(tied for _, _, tied in parts))
        if refused is not None:
            check.record["refused"] = refused
            rank_zero_info(f"GPipeStrategy keeps balance={balance} whatever its stages' measured times: {refused}.")
            return
        assert self.layer_costs is not None  # _checks_split
        micro_batches = self.config.micro_batches_for(self.topology.num_stages)
        decision = choose_resplit(self.layer_costs, balance, measured, self.config, micro_batches, check.gain)
        check.record |= check_record(decision, measured, self.config.splits_backward)
        if decision.taken:
            process = Process(self.topology, self.global_rank, self.root_device, self._job, self._control_group)
            move_layers(self, run, process, decision.best)
        rank_zero_info(check_line(decision, measured, check.gain))

    def _refusal(self, tied: bool) -> str | None:
        """Why this run keeps its split whatever the times say (the same on every process), or ``None``."""
        topology, config = self.topology, self.config
        reasons = {
            "data parallelism moves no layers yet": topology.data_parallel_size > 1,
            "tensor-parallel stages move no layers yet (a moved layer's shards and their optimizer state would go to"
            " the same tensor rank of its new stage, to be split again there)": topology.tensor_parallel_size > 1,
            "virtual stages move no layers yet": topology.virtual_stages > 1,
            "tied parameters across stages move no layers yet": tied,
            "compiled stages are not re-split": config.compile is not False,
            "deferred batch norm is not re-split": config.deferred_batch_norm,
        }
        return next((reason for reason, holds in reasons.items() if holds), None)


def check_record(decision: ResplitDecision, measured: Sequence[float], split: bool) -> dict[str, Any]:
    """What :attr:`Resplit.record` holds of a check's ``decision`` beside the split and the ``measured`` busy
    seconds per stage (``split``: whether the run splits its backwards)."""
    return {
        "profiled_s": decision.profiled,
        "profile_error": profile_errors(decision.profiled, measured),
        "split_backward": split,
        "best_balance": decision.best,
        "predicted_step_s": decision.step,
        "best_step_s": decision.best_step,
        "resplit": decision.best if decision.taken else None,
    }


def check_line(decision: ResplitDecision, measured: Sequence[float], gain: float) -> str:
    """The one line a check prints: the split re-split or kept (``gain``: the least share a new split must save), the
    stages' busy times per step, profiled against measured (:func:`profile_line`), and the steps the measured times
    predict."""
    busy = f"the stages' busy times ({profile_line(decision.profiled, measured)})"
    best, now = f"{1e3 * decision.best_step:.1f} ms", f"{1e3 * decision.step:.1f} ms"
    if decision.taken:
        return (
            f"GPipeStrategy re-split the backbone from balance={decision.balance} to {decision.best}: {busy} predict a"
            f" step of {best} instead of {now}."
        )
    return (
        f"GPipeStrategy keeps balance={decision.balance}: {busy} predict no split {gain:.0%} faster (the best split's"
        f" step {best}, this one's {now})."
    )


def move_layers(strategy: Any, run: StageRun, process: Process, balance: list[int]) -> None:
    """Re-split the running pipeline into ``balance`` in place (a collective call of every stage, all with the same
    ``balance``): the layers that change stage go, with their parameters, buffers and optimizer state, over the run's
    process group to their new stage, bit for bit; each stage's pipeline is rebuilt on the new split, and ``run``
    takes it (its recorder's spans and state too), so callbacks and the strategy keep their run.

    Args:
        strategy: the ``GPipeStrategy`` of the run (its module, optimizers, options, mesh and job).
        run: its :class:`~lightning_gpipe.lightning.step.StageRun`.
        process: where this process sits in the job.
        balance: the new layers per stage.
    """
    module, split = strategy.lightning_module, run.pipeline.split
    optimizers = [torch_optimizer(optimizer) for optimizer in strategy.optimizers]
    names = list(children(split.sequential))
    owner = dict(zip(names, (stage for stage, count in enumerate(balance) for _ in range(count))))
    stage = run.pipeline.stage
    leaving = {name: layer for name, layer in run.partition.named_children() if owner[name] != stage}
    where = _places(optimizers)
    outgoing = {
        name: (_tensors(layer), _optimizer_entries(layer, optimizers, where)) for name, layer in leaving.items()
    }
    parts = waiting.all_gather_object(strategy.job, outgoing)
    arriving = {name: part[name] for part in parts for name in part if owner[name] == stage}
    _forget(optimizers, [p for layer in leaving.values() for p in layer.parameters()])
    events = run.pipeline.events
    run.backbone_call.end_kept()
    # the backbone whole again (this stage's layers real, the others' on the meta device); every process has finished
    # its steps (the gather above), so no process uses the old pipeline's links and ties, and their groups are released
    run.pipeline.close(None, release_groups=True)
    device = strategy.root_device
    for name, (tensors, entries) in arriving.items():
        _install(children(split.sequential)[name], tensors, device)
        _adopt(children(split.sequential)[name], entries, optimizers)
    config = replace(strategy.config, balance=balance, balance_memory_limit=None)
    spec = stage_spec(module, split.backbone, config, process, strategy.layer_costs)
    fresh = build_stage(
        module, split.backbone, spec, strategy.job, run.randomness, run.share, (run.relay, run.step_relay)
    )
    fresh.pipeline.events.spans, fresh.pipeline.events.enabled = events.spans, events.enabled
    fresh.pipeline.events.memory = events.memory
    run.pipeline, run.backbone_call = fresh.pipeline, fresh.backbone_call
    _in_module_order(module, optimizers)
    optimizers_to_device(optimizers, device)


def _tensors(layer: nn.Module) -> dict[str, Tensor]:
    """A layer's parameters and buffers (non-persistent ones too) by name, detached."""
    return {name: tensor.detach() for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]}


def _places(optimizers: list[torch.optim.Optimizer]) -> dict[int, tuple[int, int]]:
    """Each parameter's optimizer and param group, by the parameter's ``id``."""
    return {
        id(p): (o, g)
        for o, optimizer in enumerate(optimizers)
        for g, group in enumerate(optimizer.param_groups)
        for p in group["params"]
    }


def _optimizer_entries(
    layer: nn.Module, optimizers: list[torch.optim.Optimizer], where: dict[int, tuple[int, int]]
) -> dict[str, tuple[int, int, dict]]:
    """Where each of ``layer``'s parameters sits in ``optimizers`` (optimizer, param group: ``where``, see
    :func:`_places`) and its state, by name."""
    entries = {}
    for name, parameter in layer.named_parameters():
        if id(parameter) in where:
            o, g = where[id(parameter)]
            entries[name] = (o, g, dict(optimizers[o].state.get(parameter, {})))
    return entries


def _forget(optimizers: list[torch.optim.Optimizer], parameters: list[nn.Parameter]) -> None:
    """Take ``parameters`` (those of the layers leaving the stage) and their state out of ``optimizers``."""
    leaving = {id(p) for p in parameters}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in leaving]
        for parameter in parameters:
            optimizer.state.pop(parameter, None)


def _install(layer: nn.Module, tensors: dict[str, Tensor], device: torch.device) -> None:
    """Give a layer (on the meta device here) the tensors another stage sent: parameters stay parameters (their
    ``requires_grad`` the layer's), buffers buffers (persistent or not, as in the layer)."""
    for name, tensor in tensors.items():
        path, _, leaf = name.rpartition(".")
        holder = layer.get_submodule(path)
        old = getattr(holder, leaf)
        value = tensor.to(device)
        setattr(
            holder,
            leaf,
            nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value,
        )


def _adopt(
    layer: nn.Module, entries: dict[str, tuple[int, int, dict]], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Put a layer's arrived parameters into the param groups their state came from, with that state."""
    for name, (o, g, state) in entries.items():
        parameter = layer.get_parameter(name)
        optimizers[o].param_groups[g]["params"].append(parameter)
        if state:
            optimizers[o].state[parameter] = state


def _in_module_order(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Each param group's parameters in the module's order, as ``configure_optimizers`` would give them."""
    order = {id(p): i for i, p in enumerate(module.parameters())}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"].sort(key=lambda p: order.get(id(p), len(order)))
