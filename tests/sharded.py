"""The sharded data-parallel runs (``sharding_strategy``, FSDP2 over each stage's replicas) and their one-device
references, for tests/workers/sharding.py and tests/distributed/test_sharding.py.

Every run is a (2 stages x 2 replicas) mesh training with AdamW on global batches of 40 rows (each replica reads 20);
its reference is single-device Lightning reading the same global batches in Lightning's ``DistributedSampler`` order.
The Hugging Face runs (:data:`HF_RUNS`) read 6 rows a step, and their reference is the unmodified model on one device.
"""

import functools
import importlib.util
import os

import lightning as L
import torch
import torch.nn.functional as F
from conftest import hf_one_device_optimizer, hf_train_one_device, hf_worker
from grid import suite
from models import GLOBAL_BATCH, LossRecorder, SyncNet, loader, trainer_kwargs
from nonchain import TiedNet, token_loader
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STEPS = 6
"""AdamW steps of every run (two epochs of 40 + 12 rows, and one more)."""


class AdamWNet(SyncNet):
    """:class:`models.SyncNet` (a tuple-activation backbone, a head on the last stage) trained with AdamW."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class TiedAdamWNet(TiedNet):
    """:class:`nonchain.TiedNet` (an embedding tied to the head, one Linear at two positions) trained with AdamW,
    logging its loss averaged over the replicas."""

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.head(self.backbone(tokens)), targets)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


RUNS = {
    # name: (module class, strategy options, Trainer options)
    "full_gpipe": (AdamWNet, dict(sharding_strategy="FULL_SHARD"), {}),
    "full_gpipe_clip_never": (
        AdamWNet,
        dict(sharding_strategy="FULL_SHARD", checkpoint="never"),
        {"gradient_clip_val": 0.05},
    ),
    "grad_op_gpipe_accumulate_split": (
        AdamWNet,
        dict(sharding_strategy="SHARD_GRAD_OP", defer_weight_grad=True, checkpoint="always"),
        {"accumulate_grad_batches": 2},
    ),
    "full_1f1b_clip_accumulate": (
        AdamWNet,
        dict(sharding_strategy="FULL_SHARD", schedule="1f1b", chunks=4),
        {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    ),
    "grad_op_1f1b": (AdamWNet, dict(sharding_strategy="SHARD_GRAD_OP", schedule="1f1b", chunks=4), {}),
    "full_zb_h1_clip": (
        AdamWNet,
        dict(sharding_strategy="FULL_SHARD", schedule="zb-h1", chunks=4),
        {"gradient_clip_val": 0.05},
    ),
    "full_interleaved_split": (
        AdamWNet,
        dict(sharding_strategy="FULL_SHARD", schedule="1f1b", chunks=4, virtual_stages=2, defer_weight_grad=True),
        {},
    ),
    "full_zb_1p_always": (
        AdamWNet,
        dict(sharding_strategy="FULL_SHARD", schedule="zb-1p", chunks=4, checkpoint="always"),
        {},
    ),
    "grad_op_zb_v": (AdamWNet, dict(sharding_strategy="SHARD_GRAD_OP", schedule="zb-v", chunks=4), {}),
    "full_v_min": (AdamWNet, dict(sharding_strategy="FULL_SHARD", schedule="v-min", chunks=4), {}),
    "tied_full_gpipe_clip": (
        TiedAdamWNet,
        dict(sharding_strategy="FULL_SHARD", balance=[3, 4]),
        {"gradient_clip_val": 0.05},
    ),
    "tied_full_1f1b": (
        TiedAdamWNet,
        dict(sharding_strategy="FULL_SHARD", balance=[3, 4], schedule="1f1b", chunks=4),
        {},
    ),
}

"""The sharded runs that must train like one device: each sharding strategy with every schedule kind, clipping,
accumulation, re-materialization and the B/W split, and tied parameters. The suite runs one of each kind
(:mod:`grid`)."""
RUNS = suite(
    RUNS,
    "full_gpipe",
    "grad_op_1f1b",
    "full_1f1b_clip_accumulate",
    "full_interleaved_split",
    "grad_op_zb_v",
    "tied_full_gpipe_clip",
)


MIXED = {
    "bf16_ddp_1f1b": (
        AdamWNet,
        dict(sharding_strategy="NO_SHARD", schedule="1f1b", chunks=4),
        {"precision": "bf16-mixed"},
    ),
    "bf16_full_shard_1f1b": (
        AdamWNet,
        dict(sharding_strategy="FULL_SHARD", schedule="1f1b", chunks=4),
        {"precision": "bf16-mixed"},
    ),
}
"""``precision="bf16-mixed"`` (Lightning's autocast) on the same mesh, without and with sharding: they must agree with
each other (one device's fp32 is another arithmetic)."""

CHECKPOINTED = {
    # name: (pipeline_parallel_size, data_parallel_size, sharding_strategy, state_dict_type, resumed from, max_steps);
    # a run of 4 steps writes NAME.ckpt (a file, or a directory when sharded) after its last step, the end of epoch 2
    "sharded_ckpt_of_full_shard_first4": (2, 2, "FULL_SHARD", "sharded", None, 4),
    "pp4_dp1_from_sharded_ckpt_of_full_shard": (4, 1, "NO_SHARD", "full", "sharded_ckpt_of_full_shard_first4", 6),
    "ddp_from_sharded_ckpt_of_full_shard": (2, 2, "NO_SHARD", "full", "sharded_ckpt_of_full_shard_first4", 6),
    "full_ckpt_of_full_shard_first4": (2, 2, "FULL_SHARD", "full", None, 4),
    "grad_op_from_full_ckpt_of_full_shard": (2, 2, "SHARD_GRAD_OP", "full", "full_ckpt_of_full_shard_first4", 6),
    "sharded_ckpt_of_ddp_first4": (2, 2, "NO_SHARD", "sharded", None, 4),
    "full_shard_from_sharded_ckpt_of_ddp": (2, 2, "FULL_SHARD", "full", "sharded_ckpt_of_ddp_first4", 6),
}
"""Checkpoints of sharded runs resumed on other meshes, with and without sharding, and the reverse (AdamWNet). The
suite resumes a sharded checkpoint on 4 stages and a full one under another sharding."""
CHECKPOINTED = suite(
    CHECKPOINTED,
    "sharded_ckpt_of_full_shard_first4",
    "pp4_dp1_from_sharded_ckpt_of_full_shard",
    "full_ckpt_of_full_shard_first4",
    "grad_op_from_full_ckpt_of_full_shard",
)

HF_RUNS = {
    name: lora
    for name, lora in {"hf_llama_full_shard": False, "hf_llama_lora_full_shard": True}.items()
    if importlib.util.find_spec("transformers") and (not lora or importlib.util.find_spec("peft"))
}
"""The tiny Hugging Face Llama of tests/hf_families.py (``lightning_gpipe.hf.CausalLM``, tests/workers/
transformers_hf.py's starting model, AdamW and schedule) under FULL_SHARD on 2 stages x 2 replicas, 3 micro-batches:
name -> fine-tuning LoRA adapters (``lora=True``: the worker's starting adapter) instead of every weight. Only those
whose packages (``transformers``, ``peft``) are installed. The suite runs LoRA's (frozen weights beside sharded
adapters; the whole model is sharded in :data:`RUNS`)."""
HF_RUNS = suite(HF_RUNS, *(name for name in HF_RUNS if "lora" in name))

HF_ROWS, HF_STEPS = 24, 4
"""The HF runs' rows, every one of 12 real tokens (no padding, so that each replica's mean over its labelled tokens
averages to the batch's mean: the mean DDP and FSDP take over the replicas), and their steps: 6 rows per step."""

VALIDATED = ("full_gpipe", "grad_op_1f1b")
"""The runs that validate after every epoch (on :func:`models.loader`'s other rows): sharded evaluation steps between
training steps."""


def dataset_of(module_class: type) -> Dataset:
    """The 52 rows a run of ``module_class`` trains on."""
    return (token_loader() if module_class is TiedAdamWNet else loader()).dataset


def reference_loader(dataset: Dataset) -> DataLoader:
    """``dataset`` in global batches of 40 rows, in the order Lightning's ``DistributedSampler`` gives the replicas
    together (as :func:`models.ddp_order_loader`)."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return DataLoader(dataset, GLOBAL_BATCH, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed))


def one_device(name: str, steps: int = STEPS) -> tuple[dict, list[float]]:
    """The state dict and the per-step losses single-device Lightning trains in ``steps`` steps for run ``name``'s
    reference (a run of :data:`CHECKPOINTED`: plain AdamWNet)."""
    module_class, _, overrides = RUNS[name] if name in RUNS else (AdamWNet, {}, {})
    L.seed_everything(1, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, max_steps=steps, **trainer_kwargs(callbacks=[recorder], **overrides))
    trainer.fit(module_class(), reference_loader(dataset_of(module_class)))
    return trainer.lightning_module.state_dict(), recorder.losses


class ReplicaLosses(L.Callback):
    """Keeps the loss of every training step of this process's pipeline replica (as its last stage returns it)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, *_) -> None:
        if outputs is not None:
            self.losses.append(float(outputs["loss"]))


class ShardsHeld(L.Callback):
    """At the end of training: how many of the stage's (not meta) trainable parameters are ``DTensor`` shards, of
    how many."""

    def on_train_end(self, trainer, pl_module) -> None:
        trained = [p for p in pl_module.parameters() if p.requires_grad and not p.is_meta]
        self.sharded = (sum(isinstance(p, DTensor) for p in trained), len(trained))


def hf_starting_module(name: str, out: str, lora: bool):
    """``lightning_gpipe.hf.CausalLM`` over the worker's starting tiny Llama (and with ``lora``, its starting
    adapters), saved by this rank under OUT_DIR for run ``name`` and loaded from there, as a user's pretrained
    directory is (eager attention, the worker's optimization)."""
    import lightning_gpipe.hf as hf

    worker, rank = hf_worker(), int(os.environ.get("LOCAL_RANK", 0))
    init, extra = os.path.join(out, f"{name}_init_rank{rank}"), {}
    initial = worker.initial_model("llama")
    initial.should_save_on_this_rank = lambda is_main_process: True  # every rank its own copy (a group exists)
    initial.save_pretrained(init)
    if lora:
        extra["lora"] = os.path.join(out, f"{name}_adapter_rank{rank}")
        worker.initial_lora("llama").save_pretrained(extra["lora"])
    return hf.CausalLM(pretrained=init, attn_implementation="eager", **extra, **worker.OPTIMIZATION)


@functools.cache
def hf_in_float64(lora: bool) -> dict:
    """:func:`hf_one_device` in float64 (made once per case): what fp32 rounding is measured against."""
    return hf_one_device(lora, torch.float64)[0]


def hf_rows() -> list[dict[str, torch.Tensor]]:
    """:data:`HF_ROWS` rows of 12 tokens of the tiny vocabulary, every token real and its own next-token label."""
    from hf_families import VOCAB

    ids = torch.randint(4, VOCAB, (HF_ROWS, 12), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def hf_global_batches() -> list[dict[str, torch.Tensor]]:
    """:func:`hf_rows` in global batches of 6, in the order Lightning's ``DistributedSampler`` gives the 2 replicas
    together (shuffled with the workers' seed, 1): step ``b`` of replica ``r`` reads 3 of the 6 rows of batch ``b``."""
    rows = hf_rows()
    order = list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=1))
    return [{k: torch.stack([rows[j][k] for j in order[i : i + 6]]) for k in rows[0]} for i in range(0, HF_ROWS, 6)]


def hf_one_device(lora: bool, dtype: torch.dtype = torch.float32, steps: int = HF_STEPS) -> tuple[dict, list[float]]:
    """The unmodified tiny Llama (with the worker's LoRA adapters if ``lora``) trained on one device in ``dtype`` on
    the first ``steps`` of :func:`hf_global_batches`, with ``CausalLM.configure_optimizers``' AdamW (decay on
    tensors of >= 2 dimensions, over the trainable parameters) and learning-rate schedule: the base model's state
    dict and the per-step losses."""
    worker = hf_worker()
    model = (worker.initial_lora if lora else worker.initial_model)("llama").to(dtype)
    base = model.get_base_model() if lora else model
    base.config._attn_implementation = "eager"
    optimizer, schedule = hf_one_device_optimizer(model, worker.OPTIMIZATION, HF_STEPS)
    model.train()
    losses = hf_train_one_device(model, optimizer, schedule, hf_global_batches()[:steps])
    return base.state_dict(), losses
