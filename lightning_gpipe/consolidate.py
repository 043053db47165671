"""``python -m lightning_gpipe.consolidate DIR OUT.ckpt``: a sharded checkpoint directory as one full checkpoint file
(the command-line entry of :mod:`lightning_gpipe.lightning.consolidate`)."""

import sys

from lightning_gpipe.lightning.consolidate import consolidate, consolidated_checkpoint, load_from_checkpoint, main

__all__ = ["consolidate", "consolidated_checkpoint", "load_from_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
