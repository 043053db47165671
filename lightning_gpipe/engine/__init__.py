"""The engine: one process's part of a training step, without Lightning.

A schedule is data (:mod:`~lightning_gpipe.engine.schedule`: each stage's ordered
:mod:`~lightning_gpipe.engine.actions`), checked and timed on one clock (:mod:`~lightning_gpipe.engine.clock`);
the :mod:`~lightning_gpipe.engine.runtime` executes a process's plan over the primitives of its model chunks
(:mod:`~lightning_gpipe.engine.model_chunk`), which move activations and gradients through
:mod:`~lightning_gpipe.engine.transfer`. The user contract at the backbone call is
:mod:`~lightning_gpipe.engine.contract`. Nothing here imports Lightning, the planner or the adapter: the engine
imports only itself and :mod:`lightning_gpipe.faults`.
"""
