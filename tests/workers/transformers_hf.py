"""Distributed worker: a tiny `transformers` model (any family of tests/hf_families.py) trained and decoded through
GPipeStrategy.

Usage: python transformers_hf.py OUT_DIR --devices K [--family F] [--schedule S] [--balance time|memory|A,B,...]
       [--resume RUN]
       [--data-parallel D] [--precision P] [--fit-only | --quick] [--lora]
Each rank writes the starting checkpoint (``save_pretrained`` of a seeded model of family ``F``, see ``FAMILIES``)
to OUT_DIR/init_rank{r}; then the family's ``lightning_gpipe.hf`` module (``CausalLM``, ``Seq2SeqLM``, ``MaskedLM``
or ``SequenceClassifier``) built on the meta device, each stage loading only its own tensors from it, is fitted for
``STEPS`` AdamW steps on K stages (schedule ``S``, default fill-drain; ``--balance time`` profiles the layers,
``--balance 7,4`` gives each stage that many layers),
writing OUT_DIR/full.ckpt (a full Lightning checkpoint, at the last step), OUT_DIR/saved (``SavePretrained``: every
stage its shard), OUT_DIR/state_rank{r}.pt (the rank's own parameters after fit, by the model's names) and
OUT_DIR/losses.pt (the per-step training losses on the last stage). Decoders then decode ``prompts()`` greedily
through the pipeline with ``trainer.predict``, with the stages' key/value caches (OUT_DIR/generated.pt, rank 0) and
without (``kv_cache=False``: OUT_DIR/generated_no_cache.pt); encoder-decoders generate from them as sources, greedily
(OUT_DIR/generated.pt) and with beam search (``BEAMS`` beams: OUT_DIR/generated_beam.pt).

``--precision P`` is the Trainer's (default ``32-true``). Every run writes OUT_DIR/run_rank{r}.json: the stage's
backbone layers (by their index), Lightning's precision plugin, the dtypes of the first local layer's outputs in the
training steps, and the strategy's profiled ``layer_costs`` (``--balance time|memory``) with the balance
``lightning_gpipe.balance_by`` gives for them. ``--fit-only`` writes no checkpoint, no saved directory and decodes
nothing; ``--quick`` writes no checkpoint and no saved directory, and decodes with the key/value caches only.

``--lora`` fine-tunes LoRA adapters (``peft``) instead: each rank also writes the starting adapter (``save_pretrained``
of ``initial_lora(F)``) to OUT_DIR/adapter_rank{r}, the module goes on training it (``lora=DIR``), OUT_DIR/saved is
the adapter directory ``SavePretrained`` writes, and nothing is decoded.

``--data-parallel D`` runs D replicas of a ``K / D``-stage pipeline over the batches' rows, ``6 / D`` per replica
and step, in the order of Lightning's distributed sampler (shuffled with seed 0); no losses.pt (each last stage sees
its replica's rows). ``--resume RUN`` instead resumes the full checkpoint of the run named RUN (a sibling directory
of OUT_DIR, e.g. written on another number of stages) and trains to ``STEPS + RESUMED_STEPS`` steps; only
state_rank{r}.pt and losses.pt are written. tests/distributed/test_transformers.py compares all of it with the
unmodified model trained and decoding on one device; it imports this file for ``FAMILIES``, ``batches`` and ``prompts``.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hf_families import FAMILIES, SEQ2SEQ, VOCAB, build, is_decoder  # noqa: E402

CONFIG = FAMILIES["llama"][2]
"""The tiny Llama's config."""

STEPS = 4
RESUMED_STEPS = 2
OPTIMIZATION = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
MAX_NEW_TOKENS = 8
BEAMS = 4
"""The beams of the encoder-decoders' beam search."""
MASK_ID = 3
"""BERT's masked positions get this id (and their original ids as labels)."""
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
"""The LoRA adapters of ``--lora``: rank 4 on every linear layer of the blocks, both matrices drawn at random (so
that both get a gradient from the first step)."""
LORA_TARGETS = {"mamba": ["in_proj", "x_proj"]}
"""The families whose adapters go on named linear layers instead: Mamba's (peft refuses adapters on its mixers'
``out_proj``, which its fused kernels read directly)."""


def batches(family: str = "llama") -> list[dict[str, torch.Tensor]]:
    """``STEPS`` batches of 6 rows of 12 tokens, two rows right-padded: next-token labels (decoders), the original
    ids of every third real token, masked (masked LMs), a class per row (sequence classifiers), or target ids ``(6,
    8)``, two rows' tails unlabelled (encoder-decoders, :data:`hf_families.SEQ2SEQ`)."""
    generator = torch.Generator().manual_seed(1)
    result = []
    for _ in range(STEPS):
        ids = torch.randint(4, VOCAB, (6, 12), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        mask[4, 5:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        if FAMILIES.get(family, ("", ""))[1] == "MaskedLM":
            chosen = (torch.arange(12) % 3 == 1).expand(6, -1) & (mask == 1)
            labels = ids.masked_fill(~chosen, -100)
            ids = ids.masked_fill(chosen, MASK_ID)
        elif FAMILIES.get(family, ("", ""))[1] == "SequenceClassifier":
            labels = torch.randint(0, 3, (6,), generator=generator)
        elif family in SEQ2SEQ:
            labels = torch.randint(4, VOCAB, (6, 8), generator=generator)
            labels[1, 6:] = labels[4, 3:] = -100
        result.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return result


def prompts() -> dict[str, torch.Tensor]:
    """Three left-padded prompts."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 15, 16]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def initial_model(family: str = "llama"):
    """The seeded starting model of ``family``."""
    torch.manual_seed(0)
    return build(family)


def with_lora(model, family: str = "llama"):
    """``model`` (of ``family``) with seeded LoRA adapters (``peft.get_peft_model`` with :data:`LORA`, on the layers
    of :data:`LORA_TARGETS` where it names the family; drawn after seed 1)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    targets = {"target_modules": LORA_TARGETS[family]} if family in LORA_TARGETS else {}
    return get_peft_model(model, LoraConfig(**{**LORA, **targets}))


def initial_lora(family: str = "llama"):
    """The seeded starting LoRA model of ``family``: :func:`with_lora` of :func:`initial_model`."""
    return with_lora(initial_model(family), family)


if __name__ == "__main__":
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    import lightning_gpipe
    import lightning_gpipe.hf as hf
    from lightning_gpipe.hf.layer import hf_name

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--family", choices=[*FAMILIES, *SEQ2SEQ], default="llama")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--balance", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--fit-only", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    class Losses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if outputs is not None:
                self.losses.append(float(outputs["loss"]))

    class Recorder(Callback):
        """The stage's backbone layers, and the dtypes of the outputs of each one's ``nn.Linear`` modules while it
        trains (a decoder block's own output is its fp32 residual stream even under autocast)."""

        def __init__(self) -> None:
            self.layers: list[int] = []
            self.dtypes: dict[int, set[str]] = {}

        def on_train_start(self, trainer, pl_module) -> None:
            self.layers = [int(name) for name in pl_module.backbone._modules]
            self.hooks = [
                linear.register_forward_hook(self._hook(i))
                for i in self.layers
                for linear in pl_module.backbone._modules[str(i)].modules()
                if isinstance(linear, torch.nn.Linear)
            ]

        def _hook(self, i: int):
            def record(module, inputs, output) -> None:
                self.dtypes.setdefault(i, set()).add(str(output.dtype).removeprefix("torch."))

            return record

        def on_train_end(self, trainer, pl_module) -> None:
            for hook in self.hooks:
                hook.remove()

    L.seed_everything(0, verbose=False)  # the distributed sampler's shuffle (an earlier script may have set another)
    init = os.path.join(args.out, f"init_rank{rank}")
    initial = initial_model(args.family)
    # transformers writes on global rank 0 only once a process group exists (an earlier script of a shared launch
    # made one): every rank writes its own copy here
    initial.should_save_on_this_rank = lambda is_main_process: True
    initial.save_pretrained(init)
    module_class = getattr(hf, {**FAMILIES, **SEQ2SEQ}[args.family][1])
    extra = {"max_new_tokens": MAX_NEW_TOKENS} if is_decoder(args.family) or args.family in SEQ2SEQ else {}
    if args.lora:
        extra["lora"] = os.path.join(args.out, f"adapter_rank{rank}")
        initial_lora(args.family).save_pretrained(extra["lora"])
    module = module_class(pretrained=init, attn_implementation="eager", **extra, **OPTIMIZATION)
    resumed = args.resume is not None
    callbacks = [losses := Losses(), recorder := Recorder()]
    if not resumed and not args.fit_only and not args.quick:
        callbacks += [
            ModelCheckpoint(dirpath=args.out, filename="full", every_n_train_steps=STEPS, save_top_k=-1),
            hf.SavePretrained(os.path.join(args.out, "saved")),
        ]
    dp = args.data_parallel
    mesh = {"pipeline_parallel_size": args.devices // dp, "data_parallel_size": dp} if dp > 1 else {}
    counts = args.balance is not None and args.balance[0].isdigit()
    balance = [int(count) for count in args.balance.split(",")] if counts else args.balance
    strategy = lightning_gpipe.GPipeStrategy(chunks=3, schedule=args.schedule, balance=balance, **mesh)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        precision=args.precision,
        max_steps=STEPS + RESUMED_STEPS if resumed else STEPS,
        default_root_dir=args.out,
        enable_checkpointing=not resumed and not args.fit_only and not args.quick,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    ckpt = os.path.join(os.path.dirname(args.out), args.resume, "full.ckpt") if resumed else None
    data = DataLoader(batches(args.family), batch_size=None)
    if dp > 1:  # rows: Lightning's distributed sampler gives each replica 6 / dp of them per step
        data = DataLoader([{k: v[i] for k, v in b.items()} for b in batches(args.family) for i in range(6)], 6 // dp)
    trainer.fit(module, data, ckpt_path=ckpt)
    own = {hf_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
    torch.save(own, os.path.join(args.out, f"state_rank{rank}.pt"))
    if losses.losses and rank == args.devices - 1 and dp == 1:
        torch.save(losses.losses, os.path.join(args.out, "losses.pt"))
    costs = strategy.layer_costs if args.balance is not None and not counts else None  # "zb-1p" profiles without one
    record = {
        "layers": recorder.layers,
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "dtypes": {i: sorted(dtypes) for i, dtypes in recorder.dtypes.items()},
        "layer_costs": None if costs is None else [dataclasses.asdict(cost) for cost in costs],
        "balance_by": None if costs is None else lightning_gpipe.balance_by(args.balance, costs, args.devices // dp),
    }
    with open(os.path.join(args.out, f"run_rank{rank}.json"), "w") as f:
        json.dump(record, f)

    decodes = is_decoder(args.family) or args.family in SEQ2SEQ  # an encoder-decoder's prompts are its sources
    if decodes and not resumed and not args.fit_only and not args.lora:
        predictor = L.Trainer(
            strategy=lightning_gpipe.GPipeStrategy(chunks=2, balance=balance if counts else None),
            accelerator="cpu",
            devices=args.devices,
            default_root_dir=args.out,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        settings = [("generated", {"kv_cache": True}), ("generated_no_cache", {"kv_cache": False})]
        settings = settings[: 1 if args.quick else 2]
        if args.family in SEQ2SEQ:  # greedy, then beam search: each stage its decoder blocks' caches
            settings = [("generated", {"num_beams": 1}), ("generated_beam", {"num_beams": BEAMS})]
        for name, setting in settings:
            for field, value in setting.items():
                setattr(module, field, value)
            generated = predictor.predict(module, DataLoader([prompts()], batch_size=None))
            if rank == 0:
                torch.save(generated[0], os.path.join(args.out, f"{name}.pt"))
