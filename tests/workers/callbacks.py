"""Distributed worker: an MLP on 2 stages with PipelineBalance, PipelineThroughput and PipelineTimeline at once.

Usage: python callbacks.py OUT_DIR
The backbone is 4 x (Linear(1024, 1024), ReLU) split unevenly, balance=[2, 6] (one Linear against three), so that
PipelineBalance has something to suggest. Logs with a CSVLogger (first, so files go to its log_dir), a
TensorBoardLogger (which takes the timeline image) and an MLflow-like logger (ArtifactLogger: MlflowClient's
``log_artifact(run_id, path, artifact_path)``, recorded). Rank 0 writes OUT_DIR/result.json (the balance report, the
throughput metrics, written files).
"""

import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import nn

import lightning_gpipe

WIDTH, ROWS, STEPS = 1024, 1024, 8


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
        self.head = nn.Linear(WIDTH, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class ArtifactLogger(Logger):
    """A logger shaped like Lightning's MLFlowLogger where the callbacks look: ``run_id`` and an ``experiment`` with
    MlflowClient's ``log_artifact(run_id, local_path, artifact_path)``; it records the calls (no log_dir)."""

    def __init__(self) -> None:
        super().__init__()
        self.artifacts: list[list] = []

    @property
    def name(self) -> str:
        return "artifacts"

    @property
    def version(self) -> int:
        return 0

    @property
    def run_id(self) -> str:
        return "run0"

    @property
    def experiment(self) -> "ArtifactLogger":
        return self

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        self.artifacts.append([run_id, local_path, artifact_path])

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def main(out: str) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS * STEPS, WIDTH, generator=generator)
    y = torch.randint(0, 10, (ROWS * STEPS,), generator=generator)  # the same rows and labels on every stage
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=ROWS)
    balance = lightning_gpipe.PipelineBalance(warmup=2, steps=5)
    throughput = lightning_gpipe.PipelineThroughput(window_size=4)
    timeline = lightning_gpipe.PipelineTimeline(steps=(3,))
    artifacts = ArtifactLogger()
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(balance=[2, 6], chunks=8, checkpoint="except_last"),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        log_every_n_steps=2,
        logger=[CSVLogger(out, name="csv", version=0), TensorBoardLogger(out, name="tb", version=0), artifacts],
        callbacks=[balance, throughput, timeline],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(MLP(), data)
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            result = {"balance": balance.report, "throughput": throughput.metrics, "written": timeline.written}
            json.dump({**result, "artifacts": artifacts.artifacts}, f)


if __name__ == "__main__":
    main(sys.argv[1])
