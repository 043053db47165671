"""Distributed worker: a tiny Llama (tied embeddings) from `transformers` trained and decoded through GPipeStrategy.

Usage: python transformers_hf.py OUT_DIR --devices K
Each rank writes the starting checkpoint (``save_pretrained`` of a seeded model) to OUT_DIR/init_rank{r}; then a
``lightning_gpipe.hf.CausalLM`` built on the meta device, each stage loading only its own tensors from it, is fitted
for ``STEPS`` AdamW steps on K stages, writing OUT_DIR/full.ckpt (a full Lightning checkpoint, at the last step),
OUT_DIR/saved (``SavePretrained``: every stage its shard) and OUT_DIR/state_rank{r}.pt (the rank's own parameters
after fit, by the model's names); then ``trainer.predict`` decodes ``prompts()`` greedily through the pipeline
(OUT_DIR/generated.pt, rank 0). tests/test_transformers.py compares all of it with the unmodified model trained
and decoding on one device; it imports this file for ``CONFIG``, ``batches`` and ``prompts``.
"""

import argparse
import os
import sys

import torch

CONFIG = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""The tiny Llama (6 backbone layers: embeddings, 3 blocks, norm, head)."""

STEPS = 4
OPTIMIZATION = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
MAX_NEW_TOKENS = 8


def batches() -> list[dict[str, torch.Tensor]]:
    """``STEPS`` batches of 6 rows of 12 tokens, two rows right-padded."""
    generator = torch.Generator().manual_seed(1)
    result = []
    for _ in range(STEPS):
        ids = torch.randint(3, CONFIG["vocab_size"], (6, 12), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        mask[4, 5:] = 0
        ids = ids.masked_fill(mask == 0, CONFIG["pad_token_id"])
        result.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return result


def prompts() -> dict[str, torch.Tensor]:
    """Three left-padded prompts."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 15, 16]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def initial_model():
    """The seeded starting model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    import lightning_gpipe
    from lightning_gpipe.hf.adapter import hf_name
    from lightning_gpipe.hf.module import CausalLM, SavePretrained

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    init = os.path.join(args.out, f"init_rank{rank}")
    initial = initial_model()
    # transformers writes on global rank 0 only once a process group exists (an earlier script of a shared launch
    # made one): every rank writes its own copy here
    initial.should_save_on_this_rank = lambda is_main_process: True
    initial.save_pretrained(init)
    module = CausalLM(pretrained=init, attn_implementation="eager", max_new_tokens=MAX_NEW_TOKENS, **OPTIMIZATION)
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=3, checkpoint="except_last"),
        accelerator="cpu",
        devices=args.devices,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=args.out, filename="full", every_n_train_steps=STEPS, save_top_k=-1),
            SavePretrained(os.path.join(args.out, "saved")),
        ],
    )
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    own = {hf_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
    torch.save(own, os.path.join(args.out, f"state_rank{rank}.pt"))

    predictor = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=2),
        accelerator="cpu",
        devices=args.devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    generated = predictor.predict(module, DataLoader([prompts()], batch_size=None))
    if rank == 0:
        torch.save(generated[0], os.path.join(args.out, "generated.pt"))
