"""timm's vision models in the pipeline (``lightning_gpipe.timm``).

:func:`to_sequential` turns a timm model (ViT, DeiT, BEiT, EVA, Swin, ConvNeXt, ResNet/ResNeXt, EfficientNet, RegNet,
MLP-Mixer) into the backbone contract without copying weights: the embedding (with its class token and position
embedding) as the first layer, one layer per block, the final norm, pooling and classifier as the last, proved equal
to the model's own forward before it is used (the self-check). :class:`ImageClassifier` fine-tunes one with
``GPipeStrategy``. Needs ``timm`` 1.0.20 or newer (``pip install 'lightning-gpipe[timm]'``).

Importing it without ``timm``, or with a ``torchvision`` that does not import, raises ``ImportError`` naming the
``pip`` command that fixes it: timm imports torchvision, and PyPI's torchvision wheel for Linux is built for CUDA,
which fails to import beside the CPU build of torch ("operator torchvision::nms does not exist").
"""

from lightning_utilities.core.imports import RequirementCache

_TIMM = RequirementCache("timm>=1.0.20")
if not _TIMM:
    raise ImportError(
        f"lightning_gpipe.timm needs timm 1.0.20 or newer: {_TIMM.message}. Install it with"
        " pip install 'lightning-gpipe[timm]'"
    )
try:
    import timm  # noqa: F401
except (ImportError, RuntimeError, OSError) as error:
    if "torchvision" not in str(error):
        raise
    raise ImportError(
        f"lightning_gpipe.timm needs timm, which imports torchvision, and importing torchvision failed ({error}). On"
        " a machine with the CPU build of torch, PyPI's torchvision wheel (built for CUDA) does not import: install"
        " the CPU build, pip install torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu"
    ) from error

# ruff: noqa: E402 - the package's modules are imported only once the requirement holds
from lightning_gpipe.timm.classifier import ImageClassifier
from lightning_gpipe.timm.families import FAMILIES, Family, family_of
from lightning_gpipe.timm.layer import TimmLayer, UnsupportedModelError
from lightning_gpipe.timm.selfcheck import SelfCheckError
from lightning_gpipe.timm.sequential import to_sequential

__all__ = [
    "FAMILIES",
    "Family",
    "ImageClassifier",
    "SelfCheckError",
    "TimmLayer",
    "UnsupportedModelError",
    "family_of",
    "to_sequential",
]
