"""Deferred batch norm: micro-batch normalisation, running statistics equal to single-device batch norm's.

In-process checks drive a one-stage pipeline (fill and drain, with re-materialization); the check on 2 stage
processes is tests/distributed/test_batchnorm.py.
"""

import copy

import pytest
import torch
from conftest import one_stage_pipeline
from torch import nn

from lightning_gpipe.engine.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm, revert_deferred_batch_norm
from lightning_gpipe.engine.pipeline import Runtime

SHAPES = {nn.BatchNorm1d: (4,), nn.BatchNorm2d: (4, 3, 3), nn.BatchNorm3d: (4, 2, 2, 2)}
STATS = ("running_mean", "running_var", "num_batches_tracked")


def _pipeline(layers: nn.Sequential, chunks: int, checkpoint: str) -> tuple[nn.Module, Runtime]:
    """``layers`` as the backbone of a one-stage pipeline; calling the returned backbone runs the fill."""
    module = nn.Module()
    module.backbone = layers
    schedule = one_stage_pipeline(module, chunks, checkpoint)
    return module.backbone, schedule


def _batches(kind, sizes=(20, 20, 12), seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [3.0 + 2.0 * torch.randn(n, *SHAPES[kind], generator=generator) for n in sizes]


def _train(norm: nn.Module, batches, chunks: int, checkpoint: str) -> list[torch.Tensor]:
    """Fill and drain every batch through a pipeline of ``[norm]``; returns the outputs."""
    backbone, stage = _pipeline(nn.Sequential(norm), chunks, checkpoint)
    outputs = []
    for x in batches:
        y = backbone(x)
        y.pow(2).sum().backward()
        stage.backward()
        outputs.append(y.detach())
    return outputs


def _assert_stats_equal(got: nn.Module, expected: nn.Module) -> None:
    for name in STATS:
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "kind, momentum, chunks, checkpoint",
    [
        (nn.BatchNorm1d, 0.1, 4, "except_last"),
        (nn.BatchNorm2d, None, 3, "always"),
        (nn.BatchNorm2d, 0.1, 4, "always"),
        (nn.BatchNorm3d, 0.1, 5, "never"),
        (nn.BatchNorm1d, None, 5, "except_last"),
    ],
)
def test_running_statistics_equal_batch_norm_on_the_whole_mini_batch(kind, momentum, chunks, checkpoint):
    # mini-batches of 20, 20 and 12 rows; 3 and 5 chunks give uneven micro-batches (7, 7, 6 and 3, 3, 2, 2, 2)
    torch.manual_seed(0)
    plain = kind(4, momentum=momentum)
    deferred = DeferredBatchNorm(copy.deepcopy(plain))
    batches = _batches(kind)
    outputs = _train(deferred, batches, chunks, checkpoint)
    for x in batches:
        plain(x)
    _assert_stats_equal(deferred, plain)
    assert int(deferred.num_batches_tracked) == len(batches)
    for x, y in zip(batches, outputs):  # each micro-batch normalised with its own statistics
        expected = torch.cat(
            [
                nn.functional.batch_norm(m, None, None, plain.weight, plain.bias, True)
                for m in torch.tensor_split(x, min(chunks, len(x)))
            ]
        )
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_plain_batch_norm_in_a_pipeline_differs(checkpoint):
    """The control: without deferral, every micro-batch and every recompute moves the running statistics."""
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(4)
    piped = copy.deepcopy(plain)
    batches = _batches(nn.BatchNorm2d)
    _train(piped, batches, 4, checkpoint)
    for x in batches:
        plain(x)
    assert int(piped.num_batches_tracked) > len(batches)
    assert not torch.allclose(piped.running_mean, plain.running_mean, rtol=0, atol=1e-3)


def test_recompute_in_the_drain_does_not_track_again():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(4)
    deferred = DeferredBatchNorm(copy.deepcopy(plain))
    backbone, stage = _pipeline(nn.Sequential(deferred), 4, "always")
    x = _batches(nn.BatchNorm2d, sizes=(10,))[0]  # micro-batches of 3, 3, 2 and 2 rows
    backbone(x).sum().backward()
    plain(x)
    _assert_stats_equal(deferred, plain)  # committed by the fill's last micro-batch
    stage.backward()  # recomputes all 4 micro-batches
    _assert_stats_equal(deferred, plain)


def test_fewer_rows_than_chunks_commit_once():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(4, momentum=None)
    deferred = DeferredBatchNorm(copy.deepcopy(plain))
    batches = _batches(nn.BatchNorm2d, sizes=(3, 2))  # 8 chunks: micro-batches of one row each
    _train(deferred, batches, 8, "except_last")
    for x in batches:
        plain(x)
    _assert_stats_equal(deferred, plain)


def test_outside_a_pipeline_it_is_batch_norm():
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(4, momentum=0.3)
    deferred = DeferredBatchNorm(copy.deepcopy(plain))
    for x in _batches(nn.BatchNorm1d):
        torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=1e-6)
    _assert_stats_equal(deferred, plain)
    deferred.eval(), plain.eval()
    x = _batches(nn.BatchNorm1d, sizes=(5,), seed=1)[0]
    torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        deferred(torch.zeros(2, 4, 3, 3))


def test_state_dict_is_batch_norms_and_conversion_round_trips():
    torch.manual_seed(0)
    inner = nn.BatchNorm2d(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(inner, nn.ReLU()), nn.BatchNorm1d(2, affine=False))
    expected = copy.deepcopy(model).state_dict()
    parameters = list(model.parameters())
    assert convert_deferred_batch_norm(model) is model
    assert isinstance(model[1][0], DeferredBatchNorm) and isinstance(model[2], DeferredBatchNorm)
    assert list(model.parameters()) == parameters  # shared, so optimizers keep working
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    model.double()  # buffers replaced while deferred
    model[1][0].running_mean.fill_(7.0)
    model.eval()
    assert revert_deferred_batch_norm(model) is model
    assert model[1][0] is inner and type(model[2]) is nn.BatchNorm1d
    assert inner.running_mean.dtype == torch.float64 and bool((inner.running_mean == 7.0).all())
    assert not inner.training
    assert list(model.state_dict()) == list(expected)


def test_only_plain_batch_norms_with_running_statistics_are_converted():
    class Custom(nn.BatchNorm2d):
        pass

    untracked, custom = nn.BatchNorm2d(4, track_running_stats=False), Custom(4)
    model = nn.Sequential(untracked, custom, nn.GroupNorm(2, 4))
    convert_deferred_batch_norm(model)
    assert model[0] is untracked and model[1] is custom
    assert isinstance(convert_deferred_batch_norm(nn.BatchNorm3d(2)), DeferredBatchNorm)
    with pytest.raises(TypeError, match="track_running_stats=True"):
        DeferredBatchNorm(untracked)
