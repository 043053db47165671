"""Skip connections across stages, with torchgpipe's API: ``@skippable``, ``stash``, ``pop`` and namespaces.

A layer of the backbone decorated with :func:`skippable` hands a tensor to a later layer by name: its
``forward`` is a generator that does ``yield stash("name", tensor)``, and the later layer's does
``tensor = yield pop("name")``. Without a pipeline the stashed tensor waits in the thread's tracker
(:mod:`lightning_gpipe.engine.skip.tracker`) until it is popped, so the backbone runs unchanged on one device. Under
:class:`~lightning_gpipe.GPipeStrategy` it goes point-to-point from the stashing stage to the popping stage,
per micro-batch, and its gradient comes back the same way (:mod:`lightning_gpipe.engine.skip.links`); the stages in
between never see it. :func:`verify_skippables` checks the pairs before any step.

Source: torchgpipe (Kim et al. 2020, arXiv:2004.09910, section 3.3 "Skip connections"), whose public names
(``skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``, ``isolate``) these are.
"""

from lightning_gpipe.engine.skip.layout import SkipLayout, verify_skippables
from lightning_gpipe.engine.skip.skippable import Namespace, pop, skippable, stash

__all__ = ["Namespace", "SkipLayout", "pop", "skippable", "stash", "verify_skippables"]
