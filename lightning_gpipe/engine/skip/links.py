"""Skip tensors between the stage that stashes them and the stage that pops them, point-to-point.

One :class:`~lightning_gpipe.engine.transfer.Link` per pair of stages a skip crosses, on its own tag
(:meth:`Topology.skip_tag <lightning_gpipe.engine.topology.Topology.skip_tag>`) and process group
(:mod:`lightning_gpipe.engine.channels`) so that it never mixes with the neighbour link's messages. Per micro-batch,
the stashing stage sends a tuple of that pair's skip tensors (each headed by its signature: a skip link sends no
step message) as soon as the
micro-batch's forward has run; the popping stage receives it before running the micro-batch and, after the micro-batch's
backward, sends back the gradients of the floating-point ones, which the stashing stage backpropagates with
its output's. The stages in between take no part. A gradient's receive is posted ahead, as the schedule posts its
output gradient's.

A stashing stage does not wait for its skip sends in the middle of a step: under 1F1B the popping stage may
be several micro-batches behind. It waits for those of micro-batch ``j`` once ``j``'s gradient is back
(:meth:`SkipLinks.backward`), by which time the popping stage has long received them.
"""

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.events import Recorder
from lightning_gpipe.engine.transfer import Link, Turn

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job

Keys = list[Any]


class SkipLinks:
    """The skip connections of one stage: links to the later stages it stashes for and the earlier ones it pops from.

    Args:
        outgoing: ``(global rank, tag)`` of each later stage -> the keys it pops from this stage, in the order both
            send.
        incoming: ``(global rank, tag)`` of each earlier stage -> the keys this stage pops from it, in that order.
        device: this stage's device.
        events: the stage's recorder (skip transfers are ``send``/``recv`` spans like the neighbour link's).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, for the links' waits.
        groups: ``(global rank, tag)`` of a peer -> the process group of the link with it
            (:mod:`lightning_gpipe.engine.channels`); the default group for a peer not in it (default: every peer).
        turns: ``(global rank, tag)`` of a peer that is another model chunk of this process -> the
            :class:`~lightning_gpipe.engine.transfer.Turn` both model chunks share, which that link goes through
            (default: none).
        control: the CPU (gloo) process group of the links' control messages (see
            :class:`~lightning_gpipe.engine.transfer.Link`); ``None`` (default): each link's own group.
    """

    def __init__(
        self,
        outgoing: dict[tuple[int, int], Keys],
        incoming: dict[tuple[int, int], Keys],
        device: torch.device,
        events: Recorder,
        job: "Job",
        groups: dict[tuple[int, int], dist.ProcessGroup | None] | None = None,
        turns: dict[tuple[int, int], Turn] | None = None,
        control: dist.ProcessGroup | None = None,
    ) -> None:
        out, into, groups, turns = sorted(outgoing.items()), sorted(incoming.items()), groups or {}, turns or {}

        def link(prev_rank: int | None, next_rank: int | None, peer: tuple[int, int]) -> Link:
            group, turn = groups.get(peer), turns.get(peer)
            sides = (turn, None) if prev_rank is not None else (None, turn)
            return Link(
                prev_rank, next_rank, device, events, tag=peer[1], job=job, groups=(group, group), turns=sides,
                control=control, stepped=False,
            )  # fmt: skip

        self._out = [(keys, link(None, peer[0], peer)) for peer, keys in out]
        self._in = [(keys, link(peer[0], None, peer)) for peer, keys in into]

    @property
    def pops(self) -> bool:
        """Whether the stage pops skip tensors from earlier stages (they arrive with each micro-batch)."""
        return bool(self._in)

    def receive(self, training: bool) -> dict[Any, Tensor]:
        """The skip tensors of the next micro-batch from every earlier stage, by key (new leaves in training).

        Raises:
            PipelineFailure: if a stashing stage failed while this one waited for it.
        """
        received: dict[Any, Tensor] = {}
        for keys, link in self._in:
            value = link.recv_activation()
            received.update(zip(keys, microbatch.leaves(value) if training else value))
        return received

    def send(self, stashed: dict[Any, Tensor], index: int) -> None:
        """Send micro-batch ``index``'s stashed tensors to the stages that pop them, asynchronously."""
        for keys, link in self._out:
            link.send_activation(tuple(stashed[key] for key in keys), index)

    def outputs(self, stashed: dict[Any, Tensor]) -> list[Tensor]:
        """The floating-point tensors sent from ``stashed``, in the order their gradients come back."""
        return [t for keys, _ in self._out for t in microbatch.floats(tuple(stashed[key] for key in keys))]

    def expect_grads(self, stashed: dict[Any, Tensor]) -> None:
        """Post the receives of the gradients of one micro-batch's sent tensors ``stashed``, in micro-batch order."""
        for keys, link in self._out:
            link.post_grads([(t.shape, t.dtype) for t in microbatch.floats(tuple(stashed[key] for key in keys))])

    def backward(self, index: int) -> list[Tensor]:
        """Wait for micro-batch ``index``'s gradients from the popping stages (as :meth:`outputs`); the sends of
        micro-batches up to ``index`` are then received, and freed.

        Raises:
            PipelineFailure: if a popping stage failed while this one waited for it.
        """
        grads = [grad for _, link in self._out for grad in link.recv_grads(index)]
        for _, link in self._out:
            link.flush(through=index)
        return grads

    def send_grads(self, received: dict[Any, Tensor], index: int) -> None:
        """Send the gradients of micro-batch ``index``'s received leaves back to the stashing stages (zeros for a
        leaf that got none)."""
        for keys, link in self._in:
            leaves = microbatch.floats(tuple(received[key] for key in keys))
            link.send_grads([t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves], index)

    def flush(self, sent: bool) -> None:
        """Wait for the gradient sends to the stashing stages, and, if ``sent``, for the skip sends too.

        Raises:
            PipelineFailure: if a neighbour failed while this one waited for it.
        """
        for _, link in self._in + (self._out if sent else []):
            link.flush()
