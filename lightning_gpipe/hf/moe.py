"""The load-balancing loss of a mixture-of-experts decoder, through the pipeline.

``transformers``' ``load_balancing_loss_func`` (Switch Transformer, Fedus et al. 2021, eqs. 4-6, as Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE... use it) is not a sum of per-layer terms: over the batch's real tokens ``t`` and the
MoE layers ``l`` together,

    aux = E * sum_e (C_e / T) * (P_e / T),

where ``C_e`` counts how often expert ``e`` is among a token's top-k experts, ``P_e`` sums the router's softmax
probability of ``e``, and ``T`` counts (token, layer) pairs, padding left out. So a stage cannot add its layers' share
of the loss; instead each row of the batch carries its sufficient statistics through the pipeline, one ``(N, 2E + 1)``
float32 tensor ``[C (E), P (E), T (1)]`` summed over the row's real tokens and the MoE layers so far. Each MoE block
adds its router's statistics (gradients flow back through ``P`` to every stage's routers); the last stage sums the
rows and computes ``aux`` (:meth:`RouterLoss.aux_loss`), which the model adds to the loss with its
``router_aux_loss_coef``. Summing rows of micro-batches is summing rows of the batch, so fill-drain equals one device.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_gpipe.hf.layer import UnsupportedModelError


@dataclass(frozen=True)
class RouterLoss:
    """How a mixture-of-experts model's router logits make its auxiliary load-balancing loss.

    Attributes:
        num_experts: ``E``, the experts per MoE layer.
        top_k: the experts each token is routed to.
        coefficient: the loss's weight (the model's ``router_aux_loss_coef``).
        router: the module class whose output holds the router logits (the model's ``router_logits`` recorder).
        index: where in that module's output tuple the ``(tokens, E)`` logits are.
        layer_name: a path fragment the router module's path must contain, or ``None``.
    """

    num_experts: int
    top_k: int
    coefficient: float
    router: type[nn.Module]
    index: int = 0
    layer_name: str | None = None

    @property
    def width(self) -> int:
        """The statistics' width per row: ``2E + 1``."""
        return 2 * self.num_experts + 1

    def routers(self, block: nn.Module, path: str) -> list[nn.Module]:
        """The router modules inside ``block`` (at ``path`` in the model), as the model's recorder finds them."""
        found: list[nn.Module] = []
        for name, module in block.named_modules(prefix=path):
            fragment = None if self.layer_name is None else "." + self.layer_name.strip(".") + "."
            if isinstance(module, self.router) and (fragment is None or fragment in name + "."):
                found.append(module)
        return found

    @contextmanager
    def recording(self, routers: list[nn.Module]) -> Iterator[list[Tensor]]:
        """Collect the router logits of ``routers``' forward calls inside the block (a list, filled in order)."""
        captured: list[Tensor] = []

        def record(module: nn.Module, inputs: Any, output: Any) -> None:
            captured.append(output[self.index] if isinstance(output, (tuple, list)) else output)

        handles = [router.register_forward_hook(record) for router in routers]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def statistics(self, logits: Tensor, token_mask: Tensor) -> Tensor:
        """One router call's statistics per row: ``(N, 2E + 1)`` float32 from its ``(N * S, E)`` logits and the
        ``(N, S)`` mask of the tokens it routed (1 real, 0 padding), as ``load_balancing_loss_func`` counts them.

        Raises:
            ValueError: if the logits are not one row per token of the mask.
        """
        rows, length = token_mask.shape
        if logits.shape[0] != rows * length:
            raise ValueError(
                f"The router gave {logits.shape[0]} rows of logits for {rows} x {length} tokens: cannot attribute its"
                " load-balancing statistics to the batch's rows."
            )
        weights = nn.functional.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        counts = nn.functional.one_hot(selected, self.num_experts).sum(-2).float()
        real = token_mask.reshape(-1, 1).float()
        per_token = torch.cat([counts * real, weights.float() * real, real], dim=-1)
        return per_token.view(rows, length, self.width).sum(1)

    def aux_loss(self, statistics: Tensor) -> Tensor:
        """The load-balancing loss of a batch from its rows' ``(N, 2E + 1)`` statistics (a scalar)."""
        total = statistics.sum(0)
        counts, probabilities, tokens = total[: self.num_experts], total[self.num_experts : -1], total[-1]
        return (counts / tokens * (probabilities / tokens)).sum() * self.num_experts


def adds_load_balancing_loss(model_class: type) -> bool:
    """Whether ``model_class``'s forward adds ``transformers``' load-balancing loss: some ``forward`` of its classes
    (subclasses first, decorators unwrapped) calls ``load_balancing_loss_func``, as the mixtures of experts whose loss
    takes ``router_aux_loss_coef`` do (Mixtral, Qwen2/3-MoE, OLMoE...); others return router logits and add nothing
    (DeepSeek-V3, GLM-4-MoE...). The self-check compares the loss, so a class this reads wrongly is refused."""
    for cls in model_class.__mro__:
        forward = cls.__dict__.get("forward")
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
        if code is not None and "load_balancing_loss_func" in code.co_names:
            return True
    return False


_NOTED: set[str] = set()
"""The classes whose ignored ``output_router_logits`` this process has noted already (one note per class)."""


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The :class:`RouterLoss` a ``transformers`` causal LM adds to its loss, or ``None``.

    A model adds it when its config has ``output_router_logits=True`` (as ``transformers`` does: off by default),
    its forward adds the load-balancing loss (:func:`adds_load_balancing_loss`; a class that only returns its router
    logits adds none, so the flag is ignored with a one-line note) and it records ``router_logits`` from a router
    module (``_can_record_outputs``), with ``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef`` on
    the model (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE...).

    Raises:
        UnsupportedModelError: if the model adds the loss but its recorder or counts are not of that form (naming
            the way out: ``output_router_logits=False``).
    """
    if not getattr(model.config, "output_router_logits", False):
        return None
    name = type(model).__name__
    if not adds_load_balancing_loss(type(model)):
        if name not in _NOTED:
            _NOTED.add(name)
            rank_zero_info(f"{name} adds no load-balancing loss: lightning_gpipe.hf ignores output_router_logits=True.")
        return None
    recorder: Any = getattr(model, "_can_record_outputs", {}).get("router_logits")
    fields = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if getattr(recorder, "target_class", None) is None or not all(hasattr(model, f) for f in fields):
        raise UnsupportedModelError(
            f"{name} adds a load-balancing loss (output_router_logits=True) but records its router logits from no"
            f" module class, or has no {', '.join(fields)}: lightning_gpipe.hf cannot carry that loss through the"
            " pipeline. Train without it: output_router_logits=False (overrides={'output_router_logits': False})."
        )
    moe = cast(Any, model)  # a transformers MoE model: these are its attributes, which nn.Module does not declare
    return RouterLoss(
        num_experts=moe.num_experts,
        top_k=moe.num_experts_per_tok,
        coefficient=moe.router_aux_loss_coef,
        router=recorder.target_class,
        index=recorder.index,
        layer_name=recorder.layer_name,
    )
