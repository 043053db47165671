"""The Lightning adapter: :class:`~lightning_gpipe.lightning.strategy.GPipeStrategy` and what it wires together.

The strategy's hooks (:mod:`~lightning_gpipe.lightning.strategy`, over the mesh of processes in
:mod:`~lightning_gpipe.lightning.mesh`), its options (:mod:`~lightning_gpipe.lightning.config`), the builder of a
process's stage (:mod:`~lightning_gpipe.lightning.build`) and its run (:mod:`~lightning_gpipe.lightning.step`), the
logging relay, checkpoints, the optimizer step, batch agreement, signals, data, the callbacks and the planner's
entry point. With :mod:`lightning_gpipe.hf`, the only part of the package that imports Lightning.
"""
