"""What one backbone layer costs, as measured by profiling or given by the user."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """Cost of one backbone layer for one micro-batch.

    Args:
        forward: forward time in seconds.
        backward: backward time in seconds (without the forward a re-materialized micro-batch recomputes).
        activation_bytes: bytes autograd saves for the backward of this layer (what re-materialization frees).
        output_bytes: bytes of the layer's output (what a stage boundary here would send and keep).
        parameter_bytes: bytes of the layer's parameters and buffers.
        input_saved_bytes: of ``activation_bytes``, the bytes of the layer's input that autograd saves (shared with
            the previous layer's output, and with a stage's kept input).
        output_saved_bytes: of ``activation_bytes``, the bytes of the layer's output that autograd saves (shared
            with the next layer's input).
        transient_bytes: bytes the layer's forward or backward holds for a moment beyond what it keeps: the larger of
            the forward's peak over its end and the backward's peak over both its start and its end (the gradients
            of a cell's internal tensors, intermediates no operation saves), in tensors the operators create.
        input_grad: seconds of the backward's B half when it is split into B and W (zero-bubble's input gradient,
            :mod:`lightning_gpipe.engine.weightgrad`); 0 (default) when not measured, or the layer's input has no
            gradient.
        weight_grad: seconds of the W half of that split (the parameters' gradients); 0 (default) when not
            measured. The two together cost more than ``backward``: W runs the parameters' side of the layer's
            autograd nodes again.
        kept_grad_bytes: bytes the B half keeps until the W half runs (the gradients arriving where the layer's
            parameters branch off, :mod:`lightning_gpipe.engine.weightgrad`); 0 (default) when not measured.
    """

    forward: float
    backward: float
    activation_bytes: int = 0
    output_bytes: int = 0
    parameter_bytes: int = 0
    input_saved_bytes: int = 0
    output_saved_bytes: int = 0
    transient_bytes: int = 0
    input_grad: float = 0.0
    weight_grad: float = 0.0
    kept_grad_bytes: int = 0
