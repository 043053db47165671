"""Mixtures of experts through the pipeline (lightning_gpipe.hf.moe): the per-row router statistics give
``transformers``' load-balancing loss exactly, for the whole batch or its micro-batches together, and a schedule that
computes the loss per micro-batch is refused before step 1. Every model is built from a small config."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import FAMILIES, build  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter, load_balancing_loss_func  # noqa: E402

from lightning_gpipe.hf import CausalLM, to_sequential  # noqa: E402
from lightning_gpipe.hf.decoder import causal_lm_loss  # noqa: E402
from lightning_gpipe.hf.moe import RouterLoss, router_loss_of  # noqa: E402
from lightning_gpipe.hf.packing import decoder_input  # noqa: E402


def padded_mask() -> torch.Tensor:
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[4, :3] = 0
    return mask


def test_the_row_statistics_give_the_load_balancing_loss_of_transformers_for_the_batch_and_its_micro_batches():
    """Three layers' router logits of 6 rows of 7 tokens, padding in two rows: summing each row's statistics over
    the layers, then over the rows, of the whole batch or of micro-batches of 2 rows, gives
    ``load_balancing_loss_func``'s loss over the batch (with the mask, and without one as all ones)."""
    router = RouterLoss(num_experts=5, top_k=2, coefficient=0.1, router=MixtralTopKRouter)
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(6 * 7, 5, generator=generator) for _ in range(3)]
    for mask in (padded_mask(), torch.ones(6, 7, dtype=torch.long)):
        expected = load_balancing_loss_func(tuple(logits), 5, 2, None if mask.all() else mask)
        whole = sum(router.statistics(layer, mask) for layer in logits)
        torch.testing.assert_close(router.aux_loss(whole), expected, atol=1e-6, rtol=0)
        parts = [
            sum(router.statistics(layer.view(6, 7, 5)[rows].reshape(-1, 5), mask[rows]) for layer in logits)
            for rows in (slice(0, 2), slice(2, 4), slice(4, 6))
        ]
        torch.testing.assert_close(router.aux_loss(torch.cat(parts)), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cannot attribute"):
        router.statistics(logits[0][:-1], padded_mask())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_micro_batches_of_the_backbone_give_the_models_loss_with_its_load_balancing_loss(name):
    """The backbone applied to micro-batches of 2 rows, their outputs (logits, statistics) concatenated as the last
    stage does: the unmodified model's loss with labels, load-balancing loss times its coefficient included."""
    torch.manual_seed(0)
    model = build(name)
    ids = torch.randint(3, 61, (6, 7))
    mask = padded_mask()
    labels = ids.masked_fill(mask == 0, -100)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    backbone = to_sequential(model)
    value = decoder_input(ids, mask)
    outputs = []
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part = tuple(t[rows] for t in value)
        for layer in backbone:
            part = layer(part)
        outputs.append(part)
    logits, statistics = (torch.cat(items) for items in zip(*outputs))
    router = router_loss_of(model)
    assert router.coefficient == 0.1 and statistics.shape == (6, 2 * 4 + 1)
    torch.testing.assert_close(causal_lm_loss((logits, statistics), labels, router), expected, atol=1e-6, rtol=0)
    without = causal_lm_loss(logits, labels, router)  # the load-balancing loss counts
    assert (expected - without).abs() > 1e-3


def test_without_output_router_logits_no_statistics_travel():
    model = build("mixtral", output_router_logits=False)
    assert router_loss_of(model) is None
    output = to_sequential(model)[0](decoder_input(torch.tensor([[5, 6, 7]])))
    assert len(output) == 3  # hidden, mask, positions


def test_a_load_balancing_loss_under_a_per_micro_batch_schedule_is_refused_before_step_1(tmp_path):
    """1F1B computes each micro-batch's loss apart: the product of means over the batch does not split that way."""
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_gpipe

    fields = dict(FAMILIES["mixtral"][2])
    module = CausalLM(config=fields, attn_implementation="eager")
    ids = torch.randint(3, 61, (4, 6))
    data = DataLoader([{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}], batch_size=None)
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=2, schedule="1f1b"),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"MixtralForCausalLM adds a load-balancing loss.*schedule='gpipe'"):
        trainer.fit(module, data)
    assert trainer.global_step == 0
