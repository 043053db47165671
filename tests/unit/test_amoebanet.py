"""Tests for the AmoebaNet-D example (examples/amoebanet): sizes, layer contract, data, the CLI's logger (its run on
2 stage processes: tests/distributed/test_amoebanet.py).

Parameter counts are checked against GPipe (Huang et al. 2019,
arXiv:1811.06965) Table 1, building the ImageNet models on the meta device.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from amoebanet.data import CIFAR10DataModule
from amoebanet.model import amoebanetd

TABLE_1_PARAMETERS = {(18, 208): 82e6, (18, 416): 318e6, (18, 544): 542e6}
"""GPipe Table 1: AmoebaNet-D (L, D) parameter counts for ImageNet."""


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model``."""
    return sum(parameter.numel() for parameter in model.parameters())


def is_tensor_or_tuple_of_tensors(value: object) -> bool:
    """True for a Tensor or a non-empty tuple of Tensors."""
    if isinstance(value, Tensor):
        return True
    return isinstance(value, tuple) and len(value) > 0 and all(isinstance(item, Tensor) for item in value)


@pytest.mark.parametrize(("num_layers", "num_filters"), list(TABLE_1_PARAMETERS))
def test_imagenet_parameter_counts_match_gpipe_table_1(num_layers: int, num_filters: int) -> None:
    """The ImageNet models are within 5% of the sizes GPipe reports."""
    with torch.device("meta"):
        model = amoebanetd(num_classes=1000, num_layers=num_layers, num_filters=num_filters, image_size=224)
    expected = TABLE_1_PARAMETERS[(num_layers, num_filters)]
    assert count_parameters(model) == pytest.approx(expected, rel=0.05)


def test_layers_pass_tensors_or_tuples_and_return_logits() -> None:
    """Layer by layer, a real CIFAR batch flows as Tensors/tuples and ends as (N, 10) logits."""
    torch.manual_seed(0)
    model = amoebanetd(num_classes=10, num_layers=6, num_filters=16, image_size=32)
    datamodule = CIFAR10DataModule(batch_size=4)
    datamodule.setup("fit")
    images, labels = next(iter(datamodule.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (4,) and labels.dtype == torch.long
    activation = images
    for name, layer in model.named_children():
        activation = layer(activation)
        assert is_tensor_or_tuple_of_tensors(activation), name
        items = activation if isinstance(activation, tuple) else (activation,)
        assert all(item.shape[0] == 4 for item in items), name
    assert isinstance(activation, Tensor) and activation.shape == (4, 10)
    assert torch.isfinite(activation).all()


def test_imagenet_stem_reaches_seven_by_seven() -> None:
    """At 224x224 the ImageNet stem (32x overall with the two reductions) leaves 7x7 maps."""
    with torch.device("meta"):
        model = amoebanetd(num_classes=1000, num_layers=3, num_filters=16, image_size=224)
        _, last = model[:-1](torch.empty(2, 3, 224, 224))
        logits = model(torch.empty(2, 3, 224, 224))
    assert last.shape == (2, 4 * 4 * 16, 7, 7)
    assert logits.shape == (2, 1000)


def test_num_layers_must_be_a_multiple_of_three() -> None:
    """L is split evenly over three stacks of normal cells."""
    with pytest.raises(ValueError, match="multiple of 3"):
        amoebanetd(num_layers=4)


@pytest.mark.parametrize(
    ("args", "save_dir"),
    [
        ([], "{cwd}/lightning_logs"),
        (["--trainer.default_root_dir={root}"], "{root}/lightning_logs"),
        (["--config={configs}/cpu.yaml", "--trainer.default_root_dir={root}"], "{root}/lightning_logs"),
        (["--trainer.default_root_dir={root}", "--trainer.logger.save_dir=mine"], "mine"),
        (["--trainer.default_root_dir={root}", "--trainer.logger=TensorBoardLogger"], "{root}/lightning_logs"),
    ],
)
def test_example_logger_follows_default_root_dir_unless_given_a_save_dir(args, save_dir, tmp_path, monkeypatch):
    """The CLI resolves ``<default_root_dir>`` in the logger's ``save_dir``; a ``save_dir`` of the user's is kept."""
    from amoebanet import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads `args` only
    paths = {"cwd": tmp_path, "root": tmp_path / "runs", "configs": Path(train.__file__).parent / "configs"}
    cli = train.main([arg.format(**paths) for arg in args], run=False)
    assert cli.trainer.logger.save_dir == save_dir.format(**paths)
    assert cli.trainer.logger.name == "amoebanet"


@pytest.mark.parametrize(
    ("speedup", "fallback", "trained"),
    [(0.2, "true", "32-true"), (1.5, "true", "bf16-mixed"), (0.2, "false", "bf16-mixed")],
)
def test_the_cpu_recipe_trains_in_fp32_where_this_cpu_runs_bf16_slower(
    speedup, fallback, trained, monkeypatch, tmp_path
):
    """``precision_fallback`` (the 20-minute recipe's) replaces bf16-mixed by 32-true where bf16 measures slower
    (the measurement injected), leaves the choice to the stage processes in the environment, and a stage process
    takes it from there without measuring."""
    import cpu_precision
    from amoebanet import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setenv(cpu_precision.CHOICE, "")  # restored (unset) after the test
    monkeypatch.delenv(cpu_precision.CHOICE)
    monkeypatch.setattr(cpu_precision, "bf16_speedup", lambda: speedup)
    recipe = Path(train.__file__).parent / "configs" / "cifar10_20min.yaml"
    args = [f"--config={recipe}", f"--precision_fallback={fallback}", "--data.data_dir=cifar10"]
    assert train.main(args, run=False).trainer.precision == trained
    assert os.environ.get(cpu_precision.CHOICE) == (trained if fallback == "true" else None)

    def not_again() -> float:
        raise AssertionError("a stage process measured again")

    monkeypatch.setattr(cpu_precision, "bf16_speedup", not_again)  # a stage process: the choice is in its environment
    assert train.main(args, run=False).trainer.precision == trained


def test_decoding_once_gives_the_images_of_decoding_every_time() -> None:
    """``decode_once`` keeps decoded uint8 images: the same test tensors and labels as decoding on every access,
    and augmented training images of the same shape (random crops and flips of the same pictures)."""
    every_time, once = CIFAR10DataModule(), CIFAR10DataModule(decode_once=True)
    every_time.setup("fit")
    once.setup("fit")
    assert len(once.val_set) == len(every_time.val_set) == 500
    for index in (0, 123, 499):
        image, label = once.val_set[index]
        expected_image, expected_label = every_time.val_set[index]
        assert label == expected_label and torch.equal(image, expected_image)
    image, label = once.train_set[7]
    assert image.shape == (3, 32, 32) and label == every_time.train_set[7][1]


def test_recipe_options_one_cycle_label_smoothing_channels_last() -> None:
    """The 20-minute config builds: channels-last weights, a one-cycle learning rate over ``max_steps`` peaking at
    ``lr`` that follows ``max_steps`` when it moves (as the config's TimeBudget moves it), and a time budget."""
    from amoebanet import train
    from time_budget import TimeBudget

    config = Path(train.__file__).parent / "configs" / "cifar10_20min.yaml"
    cli = train.main([f"--config={config}", "--data.data_dir=null"], run=False)
    module, trainer = cli.model, cli.trainer
    assert module.hparams.one_cycle and module.hparams.label_smoothing > 0 and module.hparams.channels_last
    assert cli.datamodule.hparams.decode_once
    (budget,) = [callback for callback in trainer.callbacks if isinstance(callback, TimeBudget)]
    assert budget.minutes == 20
    stem_conv = next(m for m in module.backbone.modules() if isinstance(m, nn.Conv2d))
    assert stem_conv.weight.is_contiguous(memory_format=torch.channels_last)
    module.trainer = trainer
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    for last_step in (trainer.max_steps, 2 * trainer.max_steps):  # the plan, then a plan twice as long
        trainer.fit_loop.epoch_loop.max_steps = last_step
        factor = scheduler.lr_lambdas[0]
        rates = [module.hparams.lr * factor(step) for step in range(last_step + 1)]
        assert rates[0] == pytest.approx(module.hparams.lr / 25)
        assert max(rates) == pytest.approx(module.hparams.lr, rel=1e-4)
        assert rates[-1] == pytest.approx(module.hparams.lr / 25e4)
        assert rates.index(max(rates)) == pytest.approx(module.hparams.warmup_fraction * last_step, abs=1)


def test_class_subset_is_seeded_and_prepare_writes_what_the_data_module_selects(tmp_path) -> None:
    """``class_subset`` keeps the first N rows of each class in a seeded order and leaves a subset as it is;
    ``prepare.py`` writes that subset, which ``--data.data_dir`` then reads (before ``dataset_name``) unchanged;
    a missing directory stops with the flag and the prepare command."""
    from amoebanet.data import DEFAULT_DATA_DIR, class_subset
    from amoebanet.prepare import prepare
    from example_data import DataUnavailableError

    shipped = CIFAR10DataModule()
    shipped.setup("fit")
    split = shipped.train_set.split
    subset = class_subset(split, 20)
    labels = subset["label"]
    assert len(subset) == 200 and all(labels.count(k) == 20 for k in range(10))
    assert labels == class_subset(split, 20)["label"] and labels != class_subset(split, 20, seed=1)["label"]
    assert class_subset(subset, 20) is subset
    assert prepare(tmp_path / "out", str(DEFAULT_DATA_DIR), train_per_class=20) == {"train": 200, "test": 500}
    prepared = CIFAR10DataModule(data_dir=str(tmp_path / "out"), dataset_name="uoft-cs/cifar10", train_per_class=20)
    prepared.check_data("fit")
    prepared.setup("fit")
    assert prepared.train_set.split["label"] == labels
    with pytest.raises(DataUnavailableError, match=r"--data.data_dir=.*does not exist(.|\n)*amoebanet/prepare.py DIR"):
        CIFAR10DataModule(data_dir=str(tmp_path / "missing")).check_data("fit")


def test_flip_test_averages_the_logits_of_each_image_and_its_mirror_image() -> None:
    """``flip_test`` validates on the mean logits of the batch and its flip, from one backbone call."""
    from amoebanet.module import AmoebaNetClassifier
    from torchmetrics.classification import MulticlassAccuracy

    torch.manual_seed(0)
    module = AmoebaNetClassifier(num_layers=3, num_filters=8, flip_test=True).eval()
    module.log = lambda *args, **kwargs: None  # no Trainer to log to
    images, labels = torch.randn(6, 3, 32, 32), torch.arange(6) % 10
    with torch.no_grad():
        module.validation_step((images, labels), 0)
        expected = (module.backbone(images) + module.backbone(images.flip(-1))) / 2
    assert module.val_acc.compute() == MulticlassAccuracy(10)(expected, labels)
    assert module.val_loss.compute() == pytest.approx(F.cross_entropy(expected, labels).item(), rel=1e-5)
