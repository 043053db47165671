"""Make ``import torchvision`` (and so ``import timm``) work in the processes that use timm, on a machine that has
only PyPI's CUDA-built torchvision beside the CPU torch, as the test machines do.

PyPI's torchvision 0.28 wheel for Linux is built for CUDA: its C++ extension does not load beside the CPU build of
torch 2.13, and the import then fails in ``torchvision._meta_registrations`` with "operator torchvision::nms does not
exist", because it registers fake kernels for the extension's operators. Installed in site-packages it would break
``import lightning`` in every process (torchmetrics imports torchvision when it finds it). A user installs the CPU
build instead (``pip install torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu``,
docs/models.md); the test machines reach only PyPI, so the test command installs PyPI's wheel into
:data:`TORCHVISION_DIR`, outside site-packages, and only a process that calls :func:`make_importable` sees it. When
its extension does not load, :func:`make_importable` declares the extension's operator schemas (names and
signatures, no kernels) and imports torchvision again: its Python code (the layers and transforms timm uses) is the
real one; calling one of the detection operators (``nms``, ``roi_align``, ...) would raise "no kernel", and no model
of the tests calls them.
"""

import importlib.util
import sys
from pathlib import Path

import torch

TORCHVISION_DIR = Path(__file__).resolve().parents[1] / ".torchvision"
"""Where the test command installs PyPI's torchvision (``pip install --no-deps --target .torchvision ...``,
README.md), outside site-packages."""

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels,"
    " SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width)"
    " -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width)"
    " -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height,"
    " SymInt width) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " int sampling_ratio, bool aligned) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h,"
    " SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups,"
    " SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias,"
    " SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w,"
    " SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
"""The operators torchvision 0.28's ``_meta_registrations`` registers fake kernels for, as its extension declares
them."""

_LIBRARY: list[torch.library.Library] = []  # the declared schemas live as long as this library object


def make_importable() -> None:
    """Import torchvision (from site-packages, else from :data:`TORCHVISION_DIR`), declaring its extension's operator
    schemas first if (and only if) the extension does not load; nothing when neither holds torchvision."""
    if "torchvision" in sys.modules:
        return
    if importlib.util.find_spec("torchvision") is None:
        if not (TORCHVISION_DIR / "torchvision").is_dir():
            return
        sys.path.append(str(TORCHVISION_DIR))
    try:
        import torchvision  # noqa: F401
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            library.define(schema)
        _LIBRARY.append(library)
        import torchvision  # noqa: F401,F811
