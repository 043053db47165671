"""Tiny models of the timm families ``lightning_gpipe.timm`` cuts (built without downloads), the data they train on,
and their one-device references: for tests/unit/test_timm.py, tests/workers/timm_models.py and
tests/distributed/test_timm.py.

``FAMILIES`` maps a test name to how to build it: a timm model name with ``timm.create_model``'s small-size
arguments, or a timm class with its arguments (ResNet, EfficientNet, RegNet and MLP-Mixer have no registered name
whose arguments shrink them). Every model takes 32 x 32 images, has 10 classes, between 2,000 and 19,000
parameters, and no dropout, so that a pipelined run and one device draw nothing at random.
"""

import copy

import torch
import torch.nn.functional as F
from torchvision_cpu import make_importable

make_importable()  # timm imports torchvision: see tests/torchvision_cpu.py

# ruff: noqa: E402 - timm is imported once torchvision imports
import timm
from timm.models import efficientnet, mlp_mixer, regnet, resnet
from timm.models._efficientnet_builder import decode_arch_def
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

PATCHES = dict(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2)
"""The transformers': 16 patches of 8 x 8 pixels, width 16, 2 blocks of 2 heads."""

FAMILIES = {
    "vit": ("vit_tiny_patch16_224", PATCHES),
    "deit": ("deit_tiny_distilled_patch16_224", PATCHES),
    "beit": ("beit_base_patch16_224", PATCHES),
    "eva": ("eva02_tiny_patch14_224", PATCHES),  # EVA-02: a rotary embedding in every block
    "swin": (
        "swin_tiny_patch4_window7_224",
        dict(
            img_size=32, patch_size=4, embed_dim=8, depths=(1, 1), num_heads=(1, 2), window_size=4, drop_path_rate=0.0
        ),
    ),
    "convnext": ("convnext_atto", dict(depths=(1, 1, 1, 1), dims=(4, 8, 8, 16))),
    "resnet": (resnet.ResNet, dict(block=resnet.BasicBlock, layers=(1, 1, 1, 1), channels=(4, 4, 8, 8), stem_width=4)),
    "resnext": (
        resnet.ResNet,
        dict(block=resnet.Bottleneck, layers=(1, 1, 1, 1), channels=(4, 4, 8, 8), stem_width=4, cardinality=2),
    ),
    "efficientnet": (
        efficientnet.EfficientNet,
        dict(
            block_args=decode_arch_def([["ds_r1_k3_s1_e1_c8"], ["ir_r1_k3_s2_e2_c16_se0.25"]]),
            stem_size=8,
            num_features=32,
        ),
    ),
    "regnet": (regnet.RegNet, dict(cfg=regnet.RegNetCfg(depth=4, w0=8, wa=12, wm=1.5, group_size=4, stem_width=8))),
    "mixer": (mlp_mixer.MlpMixer, dict(img_size=32, patch_size=8, embed_dim=16, num_blocks=2, mlp_ratio=(0.5, 2.0))),
}

BATCH, STEPS, CHUNKS = 8, 3, 2
"""Rows of a batch, optimizer steps of a run, micro-batches of a pipelined step."""

OPTIMIZERS = {
    "sgd": dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=0.0),
    "adamw": dict(optimizer="adamw", lr=0.01, weight_decay=0.01),
}
"""The ``ImageClassifier`` options of each optimizer the runs use."""


def build(family: str, **kwargs):
    """The tiny model of ``family``, seeded alike on every call."""
    name, arguments = FAMILIES[family]
    arguments = copy.deepcopy(arguments)  # EfficientNet's builder consumes its block arguments
    torch.manual_seed(0)
    if isinstance(name, str):
        return timm.create_model(name, pretrained=False, num_classes=10, **arguments, **kwargs)
    return name(num_classes=10, **arguments, **kwargs)


def data() -> TensorDataset:
    """``STEPS`` batches of ``BATCH`` random 32 x 32 images and their labels."""
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(STEPS * BATCH, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (STEPS * BATCH,), generator=generator)
    return TensorDataset(images, labels)


def classifier(family: str, optimizer: str):
    """``lightning_gpipe.timm.ImageClassifier`` of the tiny ``family`` model, trained with ``optimizer``."""
    from lightning_gpipe.timm import ImageClassifier

    return ImageClassifier(build(family), num_classes=None, **OPTIMIZERS[optimizer])


def one_device(
    family: str, optimizer: str, dtype: torch.dtype = torch.float32, replicated: bool = False
) -> dict[str, torch.Tensor]:
    """The parameters of :func:`classifier` after ``STEPS`` steps on one device, each step's loss the mean over the
    batch's rows computed in ``CHUNKS`` micro-batches (batch norm normalises each with its own statistics, as in the
    pipeline), in ``dtype``. ``replicated``: the rows in the order Lightning's ``DistributedSampler`` gives
    data-parallel replicas together (shuffled with seed 0, that of the runs' ``seed_everything``)."""
    module = classifier(family, optimizer).to(dtype)
    optimizer_ = module.configure_optimizers()
    dataset = data()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0) if replicated else None
    for images, labels in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
        chunks = zip(images.to(dtype).chunk(CHUNKS), labels.chunk(CHUNKS))
        loss = sum(F.cross_entropy(module.backbone(x), y) * len(y) / len(labels) for x, y in chunks)
        loss.backward()
        optimizer_.step()
        optimizer_.zero_grad()
    return {name: p.detach().clone() for name, p in module.named_parameters()}
