"""Distributed worker: pipeline x data parallelism on a mesh of --devices x --num-nodes processes.

Usage: python mesh.py OUT_DIR [--devices N] [--num-nodes N] [--configs NAME ...] [--fail-rank R]
Started by a test through Lightning's launcher (``--devices 4``), or once per process by torchrun or with the
``SLURM_*`` variables ``srun`` sets (``--devices 2 --num-nodes 2``). Every run trains ``SyncNet`` on the same
global batches of 40 rows (then 12): each replica reads ``40 / data_parallel_size`` rows per batch.
For each configuration NAME of :data:`CONFIGS`, global rank 0 writes OUT_DIR/NAME.pt: its module's whole state
after fit and the ``sync_dist=True`` training loss it saw after every batch; after "pp2_dp2", also what
``trainer.predict`` returned to it on :func:`models.loader` (OUT_DIR/pp2_dp2_predictions.pt).
``--fail-rank R`` instead runs a (2, 2) fit in which global rank R raises at step 2; rank 0 writes the error it
got to OUT_DIR/failure.txt, and
every process writes OUT_DIR/rank{r}.txt (its pid).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import GLOBAL_BATCH, LossRecorder, SyncNet, ddp_order_loader, loader, trainer_kwargs  # noqa: E402

import lightning_gpipe  # noqa: E402

# name: (pipeline_parallel_size, data_parallel_size, strategy options, Trainer options, resume from, max_steps)
CONFIGS = {
    "pp2_dp2": (2, 2, {}, {}, None, 6),
    "pp2_dp2_clip": (2, 2, {"checkpoint": "never"}, {"gradient_clip_val": 0.05}, None, 6),
    "pp2_dp2_accumulate": (2, 2, {"defer_weight_grad": True}, {"accumulate_grad_batches": 2}, None, 6),
    "pp2_dp2_1f1b": (
        2,
        2,
        {"schedule": "1f1b", "chunks": 4},
        {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
        None,
        6,
    ),
    "pp2_dp2_zb_h1": (2, 2, {"schedule": "zb-h1", "chunks": 4}, {"gradient_clip_val": 0.05}, None, 6),
    "pp2_dp2_interleaved": (
        2,
        2,
        {"schedule": "1f1b", "chunks": 4, "virtual_stages": 2, "defer_weight_grad": True},
        {"gradient_clip_val": 0.05},
        None,
        6,
    ),
    "pp1_dp4": (1, 4, {}, {}, None, 6),
    "pp2_dp2_first4": (2, 2, {}, {}, None, 4),
    "pp4_dp1_resumed": (4, 1, {}, {}, "pp2_dp2_first4", 6),
    "pp1_dp4_resumed": (1, 4, {}, {}, "pp2_dp2_first4", 6),
    "pp2_dp2_sharded_first4": (2, 2, {"state_dict_type": "sharded"}, {}, None, 4),
    "pp4_dp1_sharded_resumed": (4, 1, {}, {}, "pp2_dp2_sharded_first4", 6),
    # resumed with another K and v: 2 stages of 2 model chunks each, then 4 stages of one
    "pp2_dp2_v2_sharded_first4": (2, 2, {"state_dict_type": "sharded", "virtual_stages": 2}, {}, None, 4),
    "pp4_dp1_from_v2_resumed": (4, 1, {}, {}, "pp2_dp2_v2_sharded_first4", 6),
    # ZB-V on (2, 2), its two chunks per stage in a V, resumed on 4 stages of one chunk
    "pp2_dp2_zb_v_sharded_first4": (2, 2, {"state_dict_type": "sharded", "schedule": "zb-v", "chunks": 4}, {}, None, 4),
    "pp4_dp1_from_zb_v_resumed": (4, 1, {}, {}, "pp2_dp2_zb_v_sharded_first4", 6),
    # each stage's state sharded over its replicas by FSDP2; run only where named (the two torchrun "nodes")
    "pp2_dp2_full_shard": (2, 2, {"sharding_strategy": "FULL_SHARD"}, {}, None, 6),
}
NAMED_ONLY = ("pp2_dp2_full_shard",)
"""Configurations that run only where ``--configs`` names them (the sharded run is tested in its own launch)."""


def run(name: str, out: str, devices: int, num_nodes: int) -> None:
    pp, dp, options, overrides, resume, max_steps = CONFIGS[name]
    strategy = lightning_gpipe.GPipeStrategy(pipeline_parallel_size=pp, data_parallel_size=dp, **options)
    L.seed_everything(1, verbose=False)
    callbacks = [recorder := LossRecorder()]
    if name.endswith("first4"):  # a checkpoint after step 4, the end of epoch 2, as OUT_DIR/NAME.ckpt
        callbacks.append(ModelCheckpoint(out, name, every_n_train_steps=4, enable_version_counter=False))
        overrides = {**overrides, "enable_checkpointing": True}
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        num_nodes=num_nodes,
        max_steps=max_steps,
        **trainer_kwargs(callbacks=callbacks, **overrides),
    )
    ckpt = os.path.join(out, f"{resume}.ckpt") if resume else None
    # one pipeline keeps the user's loader; here, one in the order the data-parallel runs read
    data = loader(batch_size=GLOBAL_BATCH // dp) if dp > 1 else ddp_order_loader()
    trainer.fit(SyncNet(), data, ckpt_path=ckpt)
    if name == "pp2_dp2":  # each replica predicts its shard; rank 0 keeps replica 0's, as under DDP
        strategy = lightning_gpipe.GPipeStrategy(pipeline_parallel_size=pp, data_parallel_size=dp)
        predictor = L.Trainer(strategy=strategy, devices=devices, num_nodes=num_nodes, **trainer_kwargs())
        predictions = predictor.predict(trainer.lightning_module, loader())
        if predictor.global_rank == 0:
            torch.save(predictions, f"{out}/{name}_predictions.pt")
    if trainer.global_rank == 0:
        environment = type(strategy.cluster_environment).__name__
        state = trainer.lightning_module.state_dict()
        torch.save({"state": state, "losses": recorder.losses, "environment": environment}, f"{out}/{name}.pt")


def fail(rank: int, out: str, devices: int, num_nodes: int) -> None:
    class FailingNet(SyncNet):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2 and self.trainer.global_rank == rank:
                raise ValueError(f"boom on rank {rank}")
            return super().training_step(batch, batch_idx)

    strategy = lightning_gpipe.GPipeStrategy(pipeline_parallel_size=2, data_parallel_size=2)
    trainer = L.Trainer(strategy=strategy, devices=devices, num_nodes=num_nodes, max_steps=6, **trainer_kwargs())
    try:
        trainer.fit(FailingNet(), loader(batch_size=GLOBAL_BATCH // 2))
    except BaseException as error:
        if trainer.global_rank == 0:
            with open(os.path.join(out, "failure.txt"), "w") as f:
                f.write(f"{type(error).__name__}: {error}")
        raise


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=[name for name in CONFIGS if name not in NAMED_ONLY])
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()
    if args.fail_rank is not None:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", 0))))
        with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as f:
            f.write(str(os.getpid()))
        fail(args.fail_rank, args.out, args.devices, args.num_nodes)
    for config in args.configs:
        run(config, args.out, args.devices, args.num_nodes)
