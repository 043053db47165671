"""The engine: one process's part of a training step, without Lightning.

Its front door is :class:`StagePipeline`, built by :func:`build_pipeline` from a :class:`StageSpec`: ``forward``,
``backward``, ``evaluate`` and named events (see :mod:`lightning_gpipe.engine.pipeline`). The names below are
everything the layers above use of the engine: the adapters (Lightning's, Hugging Face's) the door and what a step
takes and leaves, the planner the plans (which it simulates on the engine's own dependency rules) and what measures
a layer as a stage runs it; its modules are its internals.

Inside, a schedule is data (:mod:`~lightning_gpipe.engine.schedule`: each stage's ordered
:mod:`~lightning_gpipe.engine.actions`), checked and timed on one clock (:mod:`~lightning_gpipe.engine.clock`); the
:class:`~lightning_gpipe.engine.pipeline.Runtime` executes a process's plan over the primitives of its model chunks
(:mod:`~lightning_gpipe.engine.model_chunk`), which move activations and gradients through
:mod:`~lightning_gpipe.engine.transfer`. The engine imports only itself, :mod:`lightning_gpipe.faults` and
:mod:`lightning_gpipe._torch` (torch's private API); it knows tensors, plans and process groups, never a
LightningModule.
"""

from lightning_gpipe.engine.actions import COMPUTE, Action, ActionCost, Kind, Plan, virtual_stage
from lightning_gpipe.engine.clock import Clock
from lightning_gpipe.engine.compilation import CompileOption, compile_options
from lightning_gpipe.engine.events import TRANSFER, WORK, PeakBytes, Recorder, SavedBytes, Span
from lightning_gpipe.engine.gradients import StepGradients
from lightning_gpipe.engine.microbatch import Partition, Value, batch_size, leaves, scatter, tensors
from lightning_gpipe.engine.module_paths import attach
from lightning_gpipe.engine.offload import placement as offload_placement
from lightning_gpipe.engine.partition import is_whole, materialize
from lightning_gpipe.engine.pipeline import StagePipeline, StageSpec, build_pipeline
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES, checkpointed, recomputed_share
from lightning_gpipe.engine.schedule import DEFERRED_BY_DEFAULT, PLACED_BY_COST, SCHEDULES, V_SHAPED, check, plans
from lightning_gpipe.engine.schedule_csv import (
    ScheduleTable,
    export_schedule,
    is_schedule_file,
    plans_from_csv,
    plans_to_csv,
    read_schedule,
)
from lightning_gpipe.engine.skip.tracker import SkipTracker, tracking
from lightning_gpipe.engine.ties import TiedParameters
from lightning_gpipe.engine.topology import Topology, groups, replicas_mesh
from lightning_gpipe.engine.trace import StageTrace, StepTrace
from lightning_gpipe.engine.weightgrad import backward_input

__all__ = [
    # the front door
    "StagePipeline",
    "StageSpec",
    "build_pipeline",
    # the mesh
    "Topology",
    "groups",
    "replicas_mesh",
    # the backbone and its values
    "Partition",
    "Value",
    "batch_size",
    "is_whole",
    "materialize",
    "attach",
    "scatter",
    # options
    "CompileOption",
    "DEFERRED_BY_DEFAULT",
    "PLACED_BY_COST",
    "V_SHAPED",
    "compile_options",
    # schedules other tools write: torch.distributed.pipelining's CSV format
    "ScheduleTable",
    "export_schedule",
    "is_schedule_file",
    "plans_from_csv",
    "plans_to_csv",
    "read_schedule",
    # what a step leaves behind: gradients kept apart, tied parameters, timed spans
    "Recorder",
    "StageTrace",
    "StepGradients",
    "StepTrace",
    "TRANSFER",
    "TiedParameters",
    "WORK",
    "recomputed_share",
    # plans, for the planner: the schedules' actions, their costs, the clock that times them, re-materialization
    "Action",
    "ActionCost",
    "CHECKPOINT_MODES",
    "COMPUTE",
    "Clock",
    "Kind",
    "Plan",
    "SCHEDULES",
    "Span",
    "check",
    "checkpointed",
    "offload_placement",
    "plans",
    "virtual_stage",
    # measuring a layer as a stage runs it, for the planner's profile: memory counted, values, skips, the B/W split
    "PeakBytes",
    "SavedBytes",
    "SkipTracker",
    "backward_input",
    "leaves",
    "tensors",
    "tracking",
]
