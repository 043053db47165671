"""What the 1F1B tests train, in the test process (one device) and in tests/workers/one_f_one_b.py (K stages)."""

import functools

import lightning as L
import torch.nn.functional as F
from models import LossRecorder, TupleNet, loader, trainer_kwargs


class WatchedNet(TupleNet):
    """TupleNet that logs row means and the row count, returns its logits, and records what its hooks see.

    Every other step also returns a ``wide`` tensor of 80 KB or more, too large for the relay's region in the step's
    agreement, so the step's output reaches the other stages by the relay's broadcast in those steps and inside the
    region in the others. ``seen`` gets one dict per training step, on the stage holding the head (one device: the
    only one): the loss ``on_before_backward`` receives, whether the head's weight had a gradient then, the
    gradient's norm ``on_after_backward``, the rows of the returned logits and, on every stage,
    ``trainer.callback_metrics`` and the sum of the returned ``wide`` tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.backbone((x, x > -1.0)))
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log_dict({"x_mean": x.mean(), "rows": float(len(x))})
        output = {"loss": loss, "logits": logits}
        if batch_idx % 2:
            output["wide"] = logits.detach().repeat(1, 1024)
        return output

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append({})

    def on_before_backward(self, loss):
        weight = getattr(self.head, "weight", None)
        if weight is not None:
            self.seen[-1].update(loss=loss.item(), grad_before=weight.grad is not None)

    def on_after_backward(self):
        weight = getattr(self.head, "weight", None)
        if weight is not None:
            self.seen[-1]["grad_after"] = weight.grad.norm().item()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if "logits" in outputs:
            self.seen[-1]["logits_rows"] = outputs["logits"].shape[0]
        self.seen[-1]["metrics"] = {k: v.item() for k, v in self.trainer.callback_metrics.items()}
        if "wide" in outputs:
            self.seen[-1]["wide"] = outputs["wide"].sum().item()


def fit_batches(strategy="auto", devices=1, batch_size=20, module=TupleNet, ckpt_path=None, **overrides) -> L.Trainer:
    """Train a freshly seeded ``module()`` (a TupleNet) for 6 steps on 52 rows in batches of ``batch_size``."""
    L.seed_everything(1, verbose=False)
    module = module()
    overrides.setdefault("max_steps", 6)
    trainer = L.Trainer(strategy=strategy, devices=devices, **trainer_kwargs(**overrides))
    trainer.fit(module, loader(batch_size=batch_size), loader(seed=1), ckpt_path=ckpt_path)
    return trainer


@functools.cache
def adamw_reference() -> dict:
    """Single-device AdamWNet (tests/sharded.py) for 6 steps on batches of 26 rows: its state and every step's loss
    (the reference of the V schedules' runs and of the re-split's)."""
    from sharded import AdamWNet

    recorder = LossRecorder()
    trainer = fit_batches(batch_size=26, module=AdamWNet, callbacks=[recorder])
    return {"state": trainer.lightning_module.state_dict(), "losses": recorder.losses}
