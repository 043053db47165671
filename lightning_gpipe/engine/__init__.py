"""The engine: one process's part of a training step, without Lightning.

Its front door is :class:`StagePipeline`, built by :func:`build_pipeline` from a :class:`StageSpec`: ``forward``,
``backward``, ``evaluate`` and named events (see :mod:`lightning_gpipe.engine.pipeline`). The names below are
everything the layers above (the Lightning adapter, the Hugging Face adapter) use of the engine; its modules are
its internals.

Inside, a schedule is data (:mod:`~lightning_gpipe.engine.schedule`: each stage's ordered
:mod:`~lightning_gpipe.engine.actions`), checked and timed on one clock (:mod:`~lightning_gpipe.engine.clock`); the
:class:`~lightning_gpipe.engine.pipeline.Runtime` executes a process's plan over the primitives of its model chunks
(:mod:`~lightning_gpipe.engine.model_chunk`), which move activations and gradients through
:mod:`~lightning_gpipe.engine.transfer`. The engine imports only itself and :mod:`lightning_gpipe.faults`; it knows
tensors, plans and process groups, never a LightningModule.
"""

from lightning_gpipe.engine.compilation import CompileOption, compile_options
from lightning_gpipe.engine.events import TRANSFER, WORK, Recorder
from lightning_gpipe.engine.gradients import StepGradients
from lightning_gpipe.engine.microbatch import Partition, Value, batch_size, scatter
from lightning_gpipe.engine.partition import find_backbone, is_whole, materialize
from lightning_gpipe.engine.pipeline import StagePipeline, StageSpec, build_pipeline
from lightning_gpipe.engine.rematerialization import recomputed_share
from lightning_gpipe.engine.schedule import DEFERRED_BY_DEFAULT, PLACED_BY_COST, V_SHAPED
from lightning_gpipe.engine.ties import TiedParameters
from lightning_gpipe.engine.topology import Size, Topology, checked_size, groups, resolve_topology
from lightning_gpipe.engine.trace import StageTrace, StepTrace

__all__ = [
    # the front door
    "StagePipeline",
    "StageSpec",
    "build_pipeline",
    # the mesh
    "Size",
    "Topology",
    "checked_size",
    "groups",
    "resolve_topology",
    # the backbone and its values
    "Partition",
    "Value",
    "batch_size",
    "find_backbone",
    "is_whole",
    "materialize",
    "scatter",
    # options
    "CompileOption",
    "DEFERRED_BY_DEFAULT",
    "PLACED_BY_COST",
    "V_SHAPED",
    "compile_options",
    # what a step leaves behind: gradients kept apart, tied parameters, timed spans
    "Recorder",
    "StageTrace",
    "StepGradients",
    "StepTrace",
    "TRANSFER",
    "TiedParameters",
    "WORK",
    "recomputed_share",
]
