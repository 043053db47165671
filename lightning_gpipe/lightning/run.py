"""One run's pipeline on this process: the split module, the stage, its runtime and what goes with them.

:func:`split_into_stage` builds it at the strategy's setup from the module, the options and the mesh: it chooses
the balance, checks the skip connections, splits the backbone (:class:`~lightning_gpipe.engine.partition.Split`), links
the stage to its neighbours and to the stages its skips reach, and installs the backbone call. A
:class:`PipelineRun` holds what the strategy's hooks hand work to; :meth:`PipelineRun.close` undoes the split at
teardown.
"""

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.lightning import state_dict
from lightning_gpipe.planning.balance import LayerCost, resolve_balance
from lightning_gpipe.engine.batchnorm import convert_deferred_batch_norm, revert_deferred_batch_norm
from lightning_gpipe.engine.compilation import compile_layers, compile_options, uncompile_layers
from lightning_gpipe.engine.channels import LinkKey, link_groups
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.engine.contract import BackboneCall
from lightning_gpipe.lightning.data_parallel import GradientSync
from lightning_gpipe.engine.events import Recorder, TrackingRecorder
from lightning_gpipe.engine.gradients import StepGradients
from lightning_gpipe.faults.job import Job
from lightning_gpipe.engine.partition import Partition, Split, materialize
from lightning_gpipe.planning.costs import CostModel
from lightning_gpipe.planning.predict import stage_costs
from lightning_gpipe.lightning.randomness import StageRandomness
from lightning_gpipe.lightning.relay import LogRelay, share_step_output
from lightning_gpipe.engine.runtime import Runtime
from lightning_gpipe.planning.simulator import action_costs
from lightning_gpipe.engine.skip import SkipLayout
from lightning_gpipe.engine.skip.links import SkipLinks
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.engine.ties import TiedParameters, find_ties
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.engine.transfer import Link, Turn


@dataclass
class PipelineRun:
    """This process's part of one run (see the module docstring).

    Args:
        split: the module split into this stage's partition.
        stages: the stage's primitives, one :class:`~lightning_gpipe.engine.stage.Stage` per model chunk (one without
            virtual stages).
        runtime: executes the stage's plans.
        backbone_call: the call the partition goes through (installed as ``partition.pipeline``).
        relay: copies the last stage's logged values to every stage.
        ties: the parameters this stage shares with others.
        randomness: the stage's random streams (see :mod:`lightning_gpipe.lightning.randomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (failure board, position, watchdog, waits).
        gradient_sync: DDP over the stage's replicas, with several of them (set by :meth:`sync_gradients`).
        step_gradients: a 1F1B step's gradients, kept apart until Lightning's ``backward``.
        collector: what the pipeline callbacks (:mod:`lightning_gpipe.lightning.callbacks`) record of this run's steps, shared
            by all of them; the first one that needs it sets it.
    """

    split: Split
    stages: list[Stage]
    runtime: Runtime
    backbone_call: BackboneCall
    relay: LogRelay
    ties: TiedParameters
    randomness: StageRandomness
    share: Callable[[Any], Any]
    job: Job
    gradient_sync: Optional[GradientSync] = None
    step_gradients: StepGradients = field(default_factory=StepGradients)
    collector: Any = None

    @property
    def partition(self) -> Partition:
        """Every backbone layer this stage holds, under its original names (all its model chunks')."""
        return self.split.partition

    @property
    def events(self) -> Recorder:
        """The stage's recorder, which every model chunk's spans go to (marked with their chunk)."""
        return self.stages[0].events

    @property
    def stage(self) -> Stage:
        """The stage's last model chunk (its only one without virtual stages): on the last stage, the one whose
        output the user's step receives."""
        return self.stages[-1]

    def sync_gradients(self, module: "pl.LightningModule", group: Any, device: torch.device) -> None:
        """Let DDP average this stage's gradients over its data-parallel ``group`` (several replicas only; see
        :mod:`lightning_gpipe.lightning.data_parallel`): what the stage trains is its partition, and on the last stage also
        the modules after the backbone. The step's last backward on the stage is its first chunk's (every plan
        ends with it); the other chunks' parameters are complete by then, and DDP reduces them with the first
        bucket."""
        trained = module if self.stage.is_last else self.split.partition
        if not GradientSync.trains(trained):
            return
        self.gradient_sync = GradientSync(trained, group, device)
        if GradientSync.trains(self.split.partition):
            self.stages[0].before_last_backward = self.gradient_sync.prepare

    def start(self, module: "pl.LightningModule", device: torch.device) -> None:
        """Initialise the stage's layers on ``device`` if ``module`` was created on the meta device (see
        :func:`~lightning_gpipe.engine.partition.materialize`), with the stage's random stream, and relay what the module's
        epoch-end hooks log. Once the run exists, so that :meth:`close` undoes the split if this fails.

        Raises:
            ValueError: if a layer created on the meta device cannot be initialised.
        """
        with self.randomness.stage():  # each stage initialises its own layers
            materialize(module, device)
        self.relay.relay_after_epoch_end_hooks(module)

    @contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """Within a gradient-accumulation window, accumulate without averaging over the replicas (Lightning's loop
        enters this for every batch of the window but the last). Under a schedule with a loss per micro-batch (1F1B)
        every batch's gradients are averaged: they are computed apart from the window's earlier ones (see
        :class:`~lightning_gpipe.engine.gradients.StepGradients`), and the average of a sum is the sum of the averages."""
        sync = self.gradient_sync
        with nullcontext() if sync is None or self.runtime.per_micro_batch_loss else sync.disabled():
            yield

    def announce_loss_backward(self, loss: Tensor) -> None:
        """On the last stage, announce the step's last backward to the gradient sync when it is the loss's: the
        partition trains nothing, or a one-stage pipeline runs the step unsplit (nothing left to drain)."""
        sync = self.gradient_sync
        first = self.stages[0]
        if sync is not None and (first.before_last_backward is None or not first.draining):
            sync.prepare([loss])

    def training_step(self, module: "pl.LightningModule", precision: Any, args: tuple, kwargs: dict) -> Any:
        """The plan up to its cut (fill-drain: the fill; 1F1B: the whole step, see :meth:`micro_batch_steps`).
        Every stage returns the last stage's output, the user's loss or the dict holding it, so that callbacks see
        the step's loss on every rank (see :func:`~lightning_gpipe.lightning.relay.share_step_output`). ``precision``: the
        precision plugin.

        Raises:
            TypeError, ValueError: under 1F1B, for a batch or backbone input that cannot be split by rows.
            RuntimeError: if the user's step does not call the backbone exactly once, or returns no
                loss on the last stage.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self.runtime.per_micro_batch_loss:
            self.job.position.begin_step(f"step {module.trainer.global_step}")
            with precision.train_step_context(), self.job.board.reporting():
                output = self.micro_batch_steps(module, args, kwargs, precision)
        else:
            output = self.user_step(module, "training_step", precision.train_step_context, args, kwargs)
        if self.stage.is_last and output is None:
            raise RuntimeError(
                "`training_step` returned None on the last stage; under GPipeStrategy every step must return its"
                " loss, since all stages take part in the drain."
            )
        return share_step_output(output, self.stage.is_last, self.share, self.stage.link.device)

    def backward(self, module: "pl.LightningModule", precision: Any, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """The plan after its cut, between the precision plugin's ``pre_backward`` and ``post_backward``. Fill-drain:
        the last stage backpropagates ``loss`` to its boundary through the precision plugin (``args``: the
        optimizer and what follows it in ``Precision.backward``), so loss scaling applies to the whole pipeline,
        then every stage drains its micro-batches. 1F1B: the step's gradients, computed in
        :meth:`training_step`, are added to ``.grad``.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self.runtime.per_micro_batch_loss:
            self.step_gradients.hand_over()
            return
        if self.stage.is_last:
            self.announce_loss_backward(loss)
            with self.randomness.stage():
                precision.backward(loss, module, *args, **kwargs)
        with precision.train_step_context(), self.job.board.reporting(), self.randomness.stage():
            self.runtime.backward()  # recomputes as the fill did, with the stage's random stream

    def evaluation_step(
        self, module: "pl.LightningModule", hook: str, context: Callable, args: tuple, kwargs: dict
    ) -> Any:
        """A pipelined forward of the user's ``hook`` (``"validation_step"``, ``"test_step"`` or ``"predict_step"``)
        within the precision plugin's ``context``. Returns the user's output on the last stage (``None`` elsewhere),
        or for predict the last stage's prediction on every stage; then relays the last stage's logged values.

        Raises:
            RuntimeError: if the user's step does not call the backbone exactly once (plainly or through
                :func:`~lightning_gpipe.forward_and_share`).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        output = self.user_step(module, hook, context, args, kwargs)
        if hook == "predict_step":
            return self.share(output)
        self.relay(module.trainer)
        return output

    def user_step(self, module: "pl.LightningModule", hook: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        """One call of the user's ``hook`` with ``args`` and ``kwargs`` within ``context``, ending at the backbone
        call on all stages but the last (see :meth:`~lightning_gpipe.engine.contract.BackboneCall.user_step`)."""
        step = getattr(module, hook)
        self.job.position.begin_step(f"step {module.trainer.global_step}")
        with context(), self.job.board.reporting():
            return self.backbone_call.user_step(hook, lambda: step(*args, **kwargs))

    def micro_batch_steps(self, module: "pl.LightningModule", args: tuple, kwargs: dict, precision: Any) -> Any:
        """The whole step of a schedule with a loss per micro-batch (1F1B, see
        :meth:`~lightning_gpipe.engine.contract.BackboneCall.micro_batch_steps`); its gradients are kept apart until
        Lightning's ``backward`` (which zeroes the previous step's in between, on the first batch of an
        accumulation window: those are freed at once). ``precision``: the precision plugin."""
        trainer = module.trainer
        zeroed = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0  # as Lightning's loop
        backward = partial(self._backward_micro_batch, module, precision)
        with self.step_gradients.computing(list(module.parameters()), zeroed_after=zeroed):
            return self.backbone_call.micro_batch_steps(module, "training_step", args, kwargs, backward)

    def _backward_micro_batch(self, module: "pl.LightningModule", precision: Any, loss: Tensor, last: bool) -> None:
        """Backpropagate one micro-batch's weighted loss as Lightning's backward does a step's: divided by
        ``accumulate_grad_batches``, scaled by the precision plugin's gradient scaler if it has one, through
        ``LightningModule.backward``; without the step's ``on_before_backward`` hooks, which Lightning's ``backward``
        runs. ``last``: whether it is the step's last micro-batch."""
        if last:
            self.announce_loss_backward(loss)
        loss = loss / module.trainer.accumulate_grad_batches
        scaler = getattr(precision, "scaler", None)
        precision.backward(scaler.scale(loss) if scaler is not None else loss, module, None)

    def whole_state(self, module: "pl.LightningModule", replica: int, group: Any) -> Optional[dict]:
        """Every stage's part of ``module``'s state on the process of pipeline replica ``replica`` that gets the
        whole model back (see :func:`~lightning_gpipe.lightning.state_dict.whole_on_rank_zero`; ``None`` elsewhere): a
        collective call over the pipeline's ``group``."""
        return state_dict.whole_on_rank_zero(module.state_dict(), replica, group, self.job)

    def close(self, module: "pl.LightningModule", whole: Optional[dict[str, Any]]) -> None:
        """Undo the split (see :meth:`~lightning_gpipe.engine.partition.Split.undo`; ``whole``: every stage's state, on the
        process that gets the whole model back), the relay's hooks, and put back the plain batch norm layers."""
        LogRelay.unwrap_epoch_end_hooks(module)
        uncompile_layers(self.split.partition)
        self.split.undo(whole)
        revert_deferred_batch_norm(self.split.sequential)


def split_into_stage(
    module: "pl.LightningModule",
    name: str,
    config: PipelineConfig,
    topology: Topology,
    rank: int,
    device: torch.device,
    costs: Optional[list[LayerCost]],
    randomness: StageRandomness,
    share: Callable[[Any], Any],
    relay: LogRelay,
    job: Job,
) -> PipelineRun:
    """Split ``module``'s backbone ``name`` and build this process's stage of the pipeline (then call
    :meth:`PipelineRun.start`).

    Args:
        module: the LightningModule, whole (or created on the meta device).
        name: the attribute of its ``nn.Sequential`` backbone.
        config: the strategy's options.
        topology: the mesh; ``rank`` is this process's global rank in it.
        device: the stage's device.
        costs: the backbone layers' profiled costs, where the balance needs them.
        randomness: the stage's random streams (see :mod:`lightning_gpipe.lightning.randomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        relay: the logging relay of this process's pipeline.
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (the links' waits, the ties' collectives, the position).

    Raises:
        ValueError: if ``balance`` does not fit the backbone, or the skip connections do not pair up or join two
            chunks of one stage.
    """
    layers, stage_index, num_stages = getattr(module, name), topology.stage_of(rank), topology.num_stages
    balance = resolve_balance(
        config.balance, layers, topology.num_virtual, costs, config.balance_memory_limit, topology.virtual_stages
    )
    skips = SkipLayout(layers, balance)  # checks the stash/pop pairs on every stage alike, before any step
    if config.deferred_batch_norm:
        convert_deferred_batch_norm(layers)  # the whole backbone, so that `Split.undo` puts it back
    ties = find_ties(module, name, balance, num_stages, topology.v_shape)  # before the split: one object per name
    split = Split(module, name, balance, stage_index, num_stages, topology.virtual_of(stage_index))
    compile_layers(split.partition, compile_options(config.compile), config.splits_backward)
    recorder, chunks = TrackingRecorder(job.position), config.chunks_for(num_stages)
    groups = link_groups(topology, skips, rank)  # a collective call: every process creates every link's group
    held = topology.virtual_of(stage_index)
    routes = [("link", s, s + 1) for s in held] + [("skip", r.src, r.dst) for r in skips.routes]
    turns = {route: Turn() for route in routes if route[1] in held and route[2] in held}  # within this process
    stages = []
    for chunk, (virtual, partition) in enumerate(zip(held, split.chunks)):
        events = recorder.for_chunk(chunk)
        link, skip_links = _links(topology, rank, virtual, skips, device, job, events, groups, turns)
        defer, mode = config.splits_backward, config.checkpoint
        stages.append(Stage(partition, link, virtual, topology.num_virtual, chunks, mode, defer, skip_links))
    placed = action_costs(stage_costs(costs, balance, CostModel(), split=True)) if config.placed_by_cost else None
    runtime = Runtime(stages, config.schedule, num_stages, position=job.position, costs=placed)
    backbone_call = BackboneCall(runtime, runtime.is_last, share=share, randomness=randomness, position=job.position)
    split.partition.pipeline = backbone_call
    tied = TiedParameters(ties, module, topology, rank, job)
    return PipelineRun(split, stages, runtime, backbone_call, relay, tied, randomness, share, job)


def _links(
    topology: Topology,
    rank: int,
    virtual: int,
    skips: SkipLayout,
    device: torch.device,
    job: Job,
    events: Recorder,
    groups: dict[LinkKey, dist.ProcessGroup],
    turns: dict[tuple[str, int, int], Turn],
) -> tuple[Link, SkipLinks]:
    """The link of virtual stage ``virtual`` on ``rank`` to its neighbours in its pipeline, and to the virtual
    stages its skips reach (``events``: the chunk's recorder; ``groups``: the links' own process groups, see
    :mod:`lightning_gpipe.engine.channels`; ``turns``: the links between two model chunks of this process, by
    ``("link" | "skip", sending virtual stage, receiving virtual stage)``)."""
    replica, last = topology.replica_of(rank), topology.num_virtual - 1
    place = partial(topology.rank_of_virtual, replica=replica)
    link = Link(
        prev_rank=place(virtual - 1) if virtual > 0 else None,
        next_rank=place(virtual + 1) if virtual < last else None,
        device=device,
        events=events,
        tag=(topology.link_tag(virtual - 1), topology.link_tag(virtual)),
        job=job,
        groups=(groups.get((replica, virtual - 1, virtual)), groups.get((replica, virtual, virtual + 1))),
        turns=(turns.get(("link", virtual - 1, virtual)), turns.get(("link", virtual, virtual + 1))),
    )
    outgoing, incoming = skips.outgoing(virtual), skips.incoming(virtual)
    peers = {
        "outgoing": {(place(t), topology.skip_tag(virtual, t)): keys for t, keys in outgoing.items()},
        "incoming": {(place(s), topology.skip_tag(s, virtual)): keys for s, keys in incoming.items()},
    }
    own = {(place(t), topology.skip_tag(virtual, t)): groups.get((replica, virtual, t)) for t in outgoing}
    own.update({(place(s), topology.skip_tag(s, virtual)): groups.get((replica, s, virtual)) for s in incoming})
    routes = {(place(t), topology.skip_tag(virtual, t)): ("skip", virtual, t) for t in outgoing}
    routes.update({(place(s), topology.skip_tag(s, virtual)): ("skip", s, virtual) for s in incoming})
    local = {peer: turns[route] for peer, route in routes.items() if route in turns}
    return link, SkipLinks(**peers, device=device, events=events, job=job, groups=own, turns=local)
