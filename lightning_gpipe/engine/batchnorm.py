"""Deferred batch norm: micro-batch statistics for normalisation, mini-batch running statistics.

GPipe (Huang et al. 2019, section 2.2) computes batch norm's sufficient statistics over each
micro-batch during training and tracks the moving averages over the mini-batch; torchgpipe calls
this "deferred batch norm". Each micro-batch is normalised with its own mean and variance (the
layer cannot see the others), and its moments are merged into those of the mini-batch so far; the
last micro-batch commits one running-statistics update, the one a single device makes for the whole
mini-batch. A re-materialized micro-batch's recompute in the drain is not tracked again.

The layers learn which micro-batch is running from :func:`lightning_gpipe.engine.microbatch.current_micro_batch`;
outside a pipeline every call is a mini-batch of one micro-batch, so a deferred layer behaves exactly
like the ``nn.BatchNorm`` it replaces.
"""

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gpipe._torch import BatchNormBase
from lightning_gpipe.engine.microbatch import MicroBatch, current_micro_batch

_PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_OUTSIDE_A_PIPELINE = MicroBatch(index=0, micro_batches=1)
_TENSORS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
"""A batch norm's parameters (``None`` without ``affine``) and running statistics, by name."""


@dataclass
class _Moments:
    """Per-channel count, mean and sum of squared deviations of the micro-batches seen so far.

    Merged with Chan, Golub and LeVeque's pairwise update, which avoids the cancellation of
    ``sum_squares / n - mean ** 2`` for channels whose mean is large against their spread.
    """

    count: int
    mean: Tensor
    m2: Tensor

    @classmethod
    def of(cls, input: Tensor) -> "_Moments":
        """Moments of ``input`` (N, C, ...) over every dimension but the channel dimension 1."""
        x = input.detach().to(torch.promote_types(input.dtype, torch.float32))
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x, dims, correction=0)
        count = x.numel() // x.size(1)
        return cls(count, mean, var * count)

    def merged(self, other: "_Moments") -> "_Moments":
        """The moments of both sets of rows together."""
        count = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        m2 = self.m2 + other.m2 + delta.square() * (self.count * other.count / count)
        return _Moments(count, mean, m2)


class DeferredBatchNorm(BatchNormBase):
    """A batch norm layer that updates its running statistics once per mini-batch of micro-batches.

    In training, each micro-batch is normalised with its own statistics (biased variance, as
    ``nn.BatchNorm``); the running statistics get one update per mini-batch, when its last
    micro-batch has run: ``running_mean`` and ``running_var`` (unbiased variance) move towards the
    mean and variance of the whole mini-batch by ``momentum``, or by ``1 / num_batches_tracked`` for
    ``momentum=None`` (cumulative average), and ``num_batches_tracked`` grows by one, exactly as
    single-device ``nn.BatchNorm`` on the whole mini-batch. The forward of a re-materialized
    micro-batch, recomputed in the drain, does not update them again. In evaluation it normalises
    with the running statistics, as ``nn.BatchNorm``.

    The layer shares the parameters and buffers of the ``nn.BatchNorm`` it wraps, under the same
    names (``weight``, ``bias``, ``running_mean``, ``running_var``, ``num_batches_tracked``), so state
    dicts are interchangeable with the plain module's; :func:`revert_deferred_batch_norm` gives the
    original layer back. Forward hooks registered on the original layer do not run while it is deferred.

    Implements GPipe's batch norm (Huang et al. 2019, section 2.2), like torchgpipe's
    ``DeferredBatchNorm`` but with the unbiased running variance of ``nn.BatchNorm`` and a state dict
    free of extra buffers.

    Args:
        batch_norm: an ``nn.BatchNorm1d``, ``nn.BatchNorm2d`` or ``nn.BatchNorm3d`` that tracks running
            statistics; input shapes are its own ((N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W)).

    Raises:
        TypeError: for any other module, or a batch norm created with ``track_running_stats=False``
            (it has no running statistics to defer).
    """

    _original: BatchNormBase  # the wrapped layer, in the instance's __dict__ (see __init__)

    def __init__(self, batch_norm: nn.Module) -> None:
        if type(batch_norm) not in _PLAIN or not batch_norm.track_running_stats:
            raise TypeError(
                f"DeferredBatchNorm wraps an nn.BatchNorm1d/2d/3d with track_running_stats=True, not {batch_norm!r}."
            )
        batch_norm = cast(BatchNormBase, batch_norm)  # one of _PLAIN
        super().__init__(batch_norm.num_features, batch_norm.eps, batch_norm.momentum, device="meta")
        self.affine = batch_norm.affine
        _share_tensors(self, batch_norm)
        self.train(batch_norm.training)
        self.__dict__["_original"] = batch_norm  # not a submodule: kept out of state dicts and `.to()`
        self._pending: _Moments | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        type(self._original)._check_input_dim(self, input)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input``; in training, track its moments for the mini-batch's running statistics.

        Raises:
            ValueError: for an input of the wrong number of dimensions, or (in training) a micro-batch
                with a single value per channel, as ``nn.BatchNorm``.
        """
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        micro = current_micro_batch() or _OUTSIDE_A_PIPELINE
        if not micro.recompute:
            self._track(input, micro)
        return output

    def _track(self, input: Tensor, micro: MicroBatch) -> None:
        moments = _Moments.of(input)
        self._pending = moments if micro.index == 0 or self._pending is None else self._pending.merged(moments)
        if micro.index == micro.micro_batches - 1:
            self._commit(self._pending)
            self._pending = None

    @torch.no_grad()
    def _commit(self, moments: _Moments) -> None:
        # tracked running statistics (checked in __init__): the buffers are there
        assert self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = moments.m2 / (moments.count - 1)
        self.running_mean.mul_(1 - factor).add_(moments.mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` (or ``module`` itself) by a :class:`DeferredBatchNorm`.

    Layers are replaced in place in their parents and share the originals' parameters and buffers, so
    optimizers and state dicts see the same tensors under the same names. Only exact
    ``nn.BatchNorm1d/2d/3d`` instances that track running statistics are converted: subclasses (whose
    forward may differ), ``SyncBatchNorm`` and batch norms without running statistics are left alone.

    Args:
        module: any module, e.g. a backbone ``nn.Sequential``.

    Returns:
        ``module``, or its replacement if it is itself a batch norm.
    """
    if type(module) in _PLAIN and module.track_running_stats:
        return DeferredBatchNorm(module)
    for name, child in list(module.named_children()):
        module.add_module(name, convert_deferred_batch_norm(child))
    return module


def revert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Put back the original ``nn.BatchNorm`` of every :class:`DeferredBatchNorm` in ``module`` (the reverse
    of :func:`convert_deferred_batch_norm`).

    Each original layer gets the deferred layer's current parameters, buffers (possibly moved to another
    device or loaded from a checkpoint meanwhile) and training mode.

    Args:
        module: any module.

    Returns:
        ``module``, or the original batch norm if ``module`` is itself deferred.
    """
    if isinstance(module, DeferredBatchNorm):
        original = module._original
        _share_tensors(original, module)
        return original.train(module.training)
    for name, child in list(module.named_children()):
        module.add_module(name, revert_deferred_batch_norm(child))
    return module


def _share_tensors(target: nn.Module, source: nn.Module) -> None:
    """Make ``target``'s parameters and running statistics ``source``'s own (the same tensors, ``None`` where
    ``source`` has none)."""
    for name in _TENSORS:
        setattr(target, name, getattr(source, name))
