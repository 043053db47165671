"""Tensor parallelism inside the stages (``tensor_parallel_size``), for tests/workers/tensor_parallel.py and
tests/distributed/test_tensor_parallel.py: an MLP whose blocks ``configure_model`` splits column- then row-wise
(Megatron-LM's MLP), as a user of Lightning's ``ModelParallelStrategy`` writes it, and its one-device reference.

Every run trains :class:`SplitMLP` (those of :data:`TIED`: :class:`TiedSplitLM`, its embedding tied to its head, both
split) with AdamW on global batches of 40 rows (each of D replicas reads 40 / D) on 4 processes; its reference is the
same module trained by plain Lightning on one device on the same global batches, in the order Lightning's
``DistributedSampler`` gives the replicas together (:func:`sharded.reference_loader`), where ``configure_model`` splits
nothing.
"""

import importlib.util

import lightning as L
import torch
import torch.nn.functional as F
from grid import suite
from models import CLASSES, FEATURES, GLOBAL_BATCH, LossRecorder, loader, trainer_kwargs
from sharded import reference_loader
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, TensorDataset

STEPS = 6
"""AdamW steps of every run (three epochs of 40 + 12 rows)."""

WIDTH = FEATURES
"""The blocks' width (the data's features); their hidden layer is 4x wider, split over the tensor ranks."""

BLOCK_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
"""A block's first Linear split by output columns, its second by input rows (one all-reduce per block)."""

PLAN = {f"*.{name}": style for name, style in BLOCK_PLAN.items()}
""":data:`BLOCK_PLAN` for every block of the backbone (the blocks a stage holds, after the split)."""

RUNS = {
    # name: (strategy options, Trainer options); 4 processes: K = 4 / (T * D)
    "pp2_tp2_gpipe": (dict(tensor_parallel_size=2, chunks=4), {}),
    "pp2_tp2_1f1b_clip_accumulate": (
        dict(tensor_parallel_size=2, chunks=4, schedule="1f1b"),
        {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    ),
    "pp2_tp2_zb_h1": (dict(tensor_parallel_size=2, chunks=4, schedule="zb-h1"), {}),
    "pp2_tp2_v_half_clip": (dict(tensor_parallel_size=2, chunks=4, schedule="v-half"), {"gradient_clip_val": 0.05}),
    "pp1_dp2_tp2_full_shard_clip": (
        dict(tensor_parallel_size=2, pipeline_parallel_size=1, chunks=2, sharding_strategy="FULL_SHARD"),
        {"gradient_clip_val": 0.05},
    ),
}
"""The runs that must train like one device, on every schedule kind: fill-drain, 1F1B, the B/W split, a V; with
global clipping over DTensor gradients; FSDP2 over the replicas of tensor-parallel stages (2-D DTensors). The suite
runs 1F1B, the V (its B/W split) and FSDP2 (:mod:`grid`)."""
RUNS = suite(RUNS, "pp2_tp2_1f1b_clip_accumulate", "pp2_tp2_v_half_clip", "pp1_dp2_tp2_full_shard_clip")

MIXED = {"pp2_tp2_bf16": (dict(tensor_parallel_size=2, chunks=4), {"precision": "bf16-mixed"})}
"""``precision="bf16-mixed"`` (Lightning's CPU autocast) on 2 stages x 2 tensor ranks, against one device's
``bf16-mixed`` run."""

CHECKPOINTED = {
    # name: (strategy options, resumed from); a run without one writes NAME.ckpt after 4 steps, a resumed one ends at 6
    "pp2_tp2_first4": (dict(tensor_parallel_size=2, chunks=4), None),
    "pp2_dp2_from_pp2_tp2": (dict(pipeline_parallel_size=2, chunks=2), "pp2_tp2_first4"),
    "pp1_dp2_tp2_from_pp2_tp2": (
        dict(tensor_parallel_size=2, pipeline_parallel_size=1, chunks=2, sharding_strategy="FULL_SHARD"),
        "pp2_tp2_first4",
    ),
    "pp2_tp2_first4_sharded": (dict(tensor_parallel_size=2, chunks=4, state_dict_type="sharded"), None),
    "pp2_dp2_from_pp2_tp2_sharded": (dict(pipeline_parallel_size=2, chunks=2), "pp2_tp2_first4_sharded"),
}
"""A full checkpoint of a (2 stages x 2 tensor ranks) run resumed without tensor parallelism, and on one stage of 2
tensor ranks (with 2 replicas: FSDP2); a sharded one (torch.distributed.checkpoint, each process its part) resumed
without tensor parallelism. The suite resumes the full one on one stage and the sharded one without tensor
parallelism."""
CHECKPOINTED = suite(
    CHECKPOINTED, "pp2_tp2_first4", "pp1_dp2_tp2_from_pp2_tp2", "pp2_tp2_first4_sharded", "pp2_dp2_from_pp2_tp2_sharded"
)

TIED = {
    "pp2_tp2_tied_1f1b_clip": (dict(tensor_parallel_size=2, chunks=4, schedule="1f1b"), {"gradient_clip_val": 0.05})
}
""":class:`TiedSplitLM` (its embedding on stage 0 tied to its head on stage 1, both split by rows of the shared weight)
on 2 stages x 2 tensor ranks, 1F1B with global clipping (the tie's copy on stage 1 counted once)."""

HF_RUNS = {
    name: lora
    for name, lora in {"hf_llama_pp2_tp2": False, "hf_llama_lora_pp2_tp2": True}.items()
    if importlib.util.find_spec("transformers") and (not lora or importlib.util.find_spec("peft"))
}
"""The tiny Hugging Face Llama of tests/hf_families.py (``lightning_gpipe.hf.CausalLM``) split by its declared tensor
plan on 2 stages x 2 tensor ranks, 3 micro-batches, on :func:`sharded.hf_global_batches`: name -> fine-tuning LoRA
adapters instead of every weight. Only those whose packages are installed; the suite runs the whole model's."""
HF_RUNS = suite(HF_RUNS, *(name for name in HF_RUNS if "lora" not in name))


class SplitMLP(L.LightningModule):
    """Four MLP blocks (``Linear(16, 64) -> ReLU -> Linear(64, 16)``) as the backbone, a classifier head;
    ``configure_model`` splits every block over ``self.device_mesh["tensor_parallel"]`` where there is one."""

    def __init__(self) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(4)]
        self.backbone = nn.Sequential(*blocks)
        self.head = nn.Linear(WIDTH, CLASSES)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        parallelize_module(self.backbone, mesh["tensor_parallel"], PLAN)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    @staticmethod
    def dataset() -> Dataset:
        """The 52 rows it trains on: :func:`models.loader`'s."""
        return loader().dataset


VOCAB = 8
""":class:`TiedSplitLM`'s vocabulary: its embedding's rows and its head's outputs, split over the tensor ranks."""

TIED_PLAN = {
    "0": RowwiseParallel(input_layouts=Replicate()),
    "[123].0": ColwiseParallel(),
    "[123].2": RowwiseParallel(),
}
""":class:`TiedSplitLM`'s backbone plan: the embedding split by rows (each rank its part of the vocabulary, its lookups
all-reduced; torchtitan's), the blocks as :data:`PLAN`."""


class TiedSplitLM(SplitMLP):
    """Token ids -> an embedding (backbone layer 0) -> 3 MLP blocks -> a head whose weight is the embedding's (Press &
    Wolf 2017). ``configure_model`` splits the embedding by rows and the head by output columns (gathered): on each
    stage the shared weight's first dimension, so the tie's two copies (stage 0's, the last stage's) are split alike."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *list(self.backbone)[1:])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.backbone[0].weight

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        parallelize_module(self.backbone, mesh["tensor_parallel"], TIED_PLAN)
        if isinstance(self.head, nn.Linear):  # on the last stage only (elsewhere, a stand-in)
            parallelize_module(self.head, mesh["tensor_parallel"], ColwiseParallel(output_layouts=Replicate()))

    @staticmethod
    def dataset() -> Dataset:
        """52 rows: a token and the token to predict."""
        generator = torch.Generator().manual_seed(0)
        tokens, targets = (torch.randint(0, VOCAB, (52,), generator=generator) for _ in range(2))
        return TensorDataset(tokens, targets)


def replicas_loader(replicas: int, module_class: type[SplitMLP] = SplitMLP) -> DataLoader:
    """The 52 rows of ``module_class.dataset()`` for a run of ``replicas`` data-parallel replicas: global batches of 40
    in ``DistributedSampler`` order (one replica), else 40 / D rows per replica (Lightning adds the sampler)."""
    dataset = module_class.dataset()
    return reference_loader(dataset) if replicas == 1 else DataLoader(dataset, batch_size=GLOBAL_BATCH // replicas)


def one_device(steps: int = STEPS, module_class: type[SplitMLP] = SplitMLP, **overrides) -> tuple[dict, list[float]]:
    """The state dict and per-step losses of ``module_class`` trained by single-device Lightning for ``steps`` steps
    on the global batches (``overrides``: Trainer options, e.g. ``precision="64-true"`` for the exact reference)."""
    L.seed_everything(1, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, max_steps=steps, **trainer_kwargs(callbacks=[recorder], **overrides))
    trainer.fit(module_class(), replicas_loader(1, module_class))
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}, recorder.losses


def in_float64(overrides: dict, steps: int = STEPS, module_class: type[SplitMLP] = SplitMLP) -> dict:
    """The float64 reference's state after ``steps`` steps (what fp32 rounding is measured against;
    :func:`conftest.assert_within_fp32_rounding`)."""
    return {k: v.double() for k, v in one_device(steps, module_class, precision="64-true", **overrides)[0].items()}
