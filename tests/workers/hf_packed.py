"""Distributed worker: packed rows (several documents per row) through a tiny `transformers` Llama on GPipeStrategy.

Usage: python hf_packed.py OUT_DIR --devices K [--schedule S] [--lora]
Each rank writes the starting checkpoint (``save_pretrained`` of the seeded untied Llama of tests/hf_families.py;
with ``--lora`` the tied one and a starting adapter with random ``A`` and ``B``, as tests/workers/transformers_hf.py's)
to OUT_DIR/init_rank{r}; ``CausalLM`` then fits ``STEPS`` AdamW steps of :func:`batches` (documents of 1 to 15
tokens packed into rows of 16, 3 micro-batches of uneven real tokens) on K stages under schedule ``S`` (default
fill-drain), writing OUT_DIR/grads_rank{r}.pt (every trainable parameter's gradient of the first step, by the model's
names, before the optimizer steps), OUT_DIR/state_rank{r}.pt (the rank's parameters after fit) and OUT_DIR/losses.pt
(the per-step losses, last stage). tests/distributed/test_hf_packed.py compares them with the documents run one by
one through the unmodified model on one device.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_families import build  # noqa: E402
from transformers_hf import OPTIMIZATION, with_lora  # noqa: E402

STEPS = 2
ROW = 16
"""Tokens per packed row."""


def documents(step: int) -> list[list[int]]:
    """Step ``step``'s documents: 18 of 1 to 15 tokens (seeded)."""
    generator = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(1, 16, (18,), generator=generator).tolist()
    return [torch.randint(4, 61, (n,), generator=generator).tolist() for n in lengths]


def batches() -> list[dict]:
    """``STEPS`` packed batches (:func:`lightning_gpipe.hf.packed_batch` of each step's documents in rows of
    ``ROW``)."""
    from lightning_gpipe.hf import pack_documents, packed_batch

    return [packed_batch(pack_documents(documents(step), ROW), pad_token_id=0) for step in range(STEPS)]


def initial_model(lora: bool):
    """The seeded starting model: the untied Llama (its gradients are each one stage's), or with LoRA the tied one
    (its embedding frozen)."""
    torch.manual_seed(0)
    return build("llama", tie_word_embeddings=lora)


def initial_lora():
    """The seeded starting LoRA model of :func:`initial_model` (:func:`transformers_hf.with_lora`)."""
    return with_lora(initial_model(True))


if __name__ == "__main__":
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    import lightning_gpipe
    import lightning_gpipe.hf as hf
    from lightning_gpipe.hf.layer import hf_name

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    class Record(Callback):
        """The first step's gradients (before the optimizer) and every step's loss."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.grads: dict[str, torch.Tensor] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == 0:
                for name, parameter in pl_module.backbone.named_parameters():
                    if parameter.grad is not None and not parameter.is_meta:
                        self.grads[hf_name(name)] = parameter.grad.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if outputs is not None:
                self.losses.append(float(outputs["loss"]))

    L.seed_everything(0, verbose=False)
    init = os.path.join(args.out, f"init_rank{rank}")
    initial = initial_model(args.lora)
    initial.should_save_on_this_rank = lambda is_main_process: True  # every rank its own copy (see transformers_hf)
    initial.save_pretrained(init)
    extra = {}
    if args.lora:
        extra["lora"] = os.path.join(args.out, f"adapter_rank{rank}")
        initial_lora().save_pretrained(extra["lora"])
    module = hf.CausalLM(pretrained=init, attn_implementation="eager", **extra, **OPTIMIZATION)
    record = Record()
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=3, schedule=args.schedule),
        accelerator="cpu",
        devices=args.devices,
        max_steps=STEPS,
        default_root_dir=args.out,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    own = {hf_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
    torch.save(own, os.path.join(args.out, f"state_rank{rank}.pt"))
    torch.save(record.grads, os.path.join(args.out, f"grads_rank{rank}.pt"))
    if record.losses and rank == args.devices - 1:
        torch.save(record.losses, os.path.join(args.out, "losses.pt"))
