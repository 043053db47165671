"""Skip connections across stages, with torchgpipe's API (the public path of :mod:`lightning_gpipe.engine.skip`).

``from lightning_gpipe.skip import Namespace, pop, skippable, stash``: see :mod:`lightning_gpipe.engine.skip`.
"""

from lightning_gpipe.engine.skip import Namespace, pop, skippable, stash, verify_skippables

__all__ = ["Namespace", "pop", "skippable", "stash", "verify_skippables"]
