"""timm models as backbones (lightning_gpipe.timm), in one process: ``to_sequential``'s layers of the tiny model of
every family (tests/timm_families.py) compute exactly the model's forward and hold its own parameters under its
names; the cut's layout; the self-check proves the cut and names the first layer that differs, leaving the model as
it was; refusals name what is supported; ``ImageClassifier`` builds by name or from a model; a torchvision that does
not import is met with the ``pip`` line that fixes it; the AmoebaNet example's ``train_timm.py`` builds one. Distributed
training: tests/distributed/test_timm.py."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from timm_families import FAMILIES, PATCHES, build
from torch import nn

from lightning_gpipe.timm import (
    ImageClassifier,
    SelfCheckError,
    UnsupportedModelError,
    family_of,
    to_sequential,
)

IMAGES = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_layers_compute_exactly_the_models_forward_with_its_own_parameters_under_its_names(family):
    model = build(family).eval()
    backbone = to_sequential(model)
    with torch.no_grad():
        torch.testing.assert_close(backbone(IMAGES), model(IMAGES), atol=0, rtol=0)
    ours = {name.split(".", 1)[1]: p for name, p in backbone.named_parameters(remove_duplicate=False)}
    theirs = dict(model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(ours[name] is theirs[name] for name in theirs)  # the same objects: nothing copied


def test_the_cut_opens_stages_into_blocks_and_joins_a_downsample_without_tensors_to_the_next_block():
    labels = [layer.label for layer in to_sequential(build("convnext"))]
    assert labels == [
        "embedding",
        "stages.0.downsample, stages.0.blocks.0",  # an nn.Identity
        *[part for stage in (1, 2, 3) for part in (f"stages.{stage}.downsample", f"stages.{stage}.blocks.0")],
        "head",
    ]
    assert [layer.label for layer in to_sequential(build("efficientnet"))] == [
        "embedding",
        "blocks.0.0",
        "blocks.1.0",
        "head",
    ]


def test_a_vit_with_dropout_and_stochastic_depth_is_proved_in_training_mode_too():
    model = build("vit", drop_rate=0.2, drop_path_rate=0.2, pos_drop_rate=0.2).train()
    backbone = to_sequential(model)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        theirs = model(IMAGES)
        torch.manual_seed(3)
        ours = backbone(IMAGES)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_the_self_check_leaves_the_model_as_it_was():
    model = build("resnet").train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    state = torch.random.get_rng_state()
    to_sequential(model)
    assert model.training
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())  # running statistics
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_model_whose_forward_does_more_than_its_family_cuts_is_refused_naming_the_first_layer_that_differs():
    from timm.models.vision_transformer import VisionTransformer

    class Doubled(VisionTransformer):
        def forward_features(self, x, **kwargs):
            return self.norm(2 * self.blocks(self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))))

    torch.manual_seed(0)
    model = Doubled(num_classes=10, **PATCHES)
    with pytest.raises(SelfCheckError, match=r"Doubled \(ViT/DeiT\).*layer 2 \(blocks\.1\) differs"):
        to_sequential(model)
    to_sequential(model, check=False)  # skipped on request


def test_a_model_of_no_supported_family_is_refused_naming_the_families():
    with pytest.raises(UnsupportedModelError, match=r"cannot cut Sequential: .*ViT/DeiT.*ResNet/ResNeXt \(ResNet\)"):
        to_sequential(nn.Sequential(nn.Conv2d(3, 4, 3)))


def test_an_option_the_cut_does_not_follow_is_refused_naming_it():
    model = build("beit", use_shared_rel_pos_bias=True, use_rel_pos_bias=False)
    with pytest.raises(UnsupportedModelError, match=r"Beit \(BEiT\): .*use_shared_rel_pos_bias=True"):
        to_sequential(model)


def test_a_subclass_of_a_timm_class_is_cut_as_its_family():
    from timm.models.convnext import ConvNeXt

    class Mine(ConvNeXt):
        pass

    assert family_of(Mine(depths=(1, 1, 1, 1), dims=(4, 8, 8, 16))).name == "ConvNeXt"


def test_the_image_classifier_builds_by_name_or_from_a_model_and_keeps_the_model_out_of_its_submodules():
    by_name = ImageClassifier("vit_tiny_patch16_224", num_classes=10, model_kwargs=PATCHES)
    assert [layer.label for layer in by_name.backbone] == ["embedding", "blocks.0", "blocks.1", "head"]
    assert all(name.startswith("backbone.") for name in by_name.state_dict())
    retargeted = ImageClassifier(build("convnext"), num_classes=5, optimizer="adamw")
    assert retargeted.backbone(IMAGES).shape == (3, 5)
    assert isinstance(retargeted.configure_optimizers(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="optimizer='adam'"):
        ImageClassifier(build("resnet"), optimizer="adam")


def test_a_torchvision_that_does_not_import_is_met_with_the_pip_line_of_its_cpu_build(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] in ("timm", "torchvision") or "lightning_gpipe.timm" in m]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` fails
    with pytest.raises(ImportError, match=r"pip install torchvision==0.28.0 --index-url .*/whl/cpu"):
        importlib.import_module("lightning_gpipe.timm")


def test_the_amoebanet_example_fine_tunes_a_timm_model_by_name_on_its_cifar_data(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from amoebanet import train_timm
    from amoebanet.data import CIFAR10DataModule

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_timm.py"])  # the CLI reads `args` only
    cli = train_timm.main(["--model.model=convnext_atto", "--model.optimizer=adamw"], run=False)
    assert isinstance(cli.model, ImageClassifier) and isinstance(cli.datamodule, CIFAR10DataModule)
    assert type(cli.model.timm_model).__name__ == "ConvNeXt" and cli.model.timm_model.num_classes == 10
    assert cli.trainer.strategy.__class__.__name__ == "GPipeStrategy" and cli.trainer.logger.name == "timm"
