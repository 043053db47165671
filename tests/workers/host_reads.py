"""Distributed worker: the package's own reads of tensor values on the host in steady-state training steps.

Usage: python host_reads.py OUT_DIR
On 2 stages, an MLP of 8 x Linear(64) trains 8 steps with M = 4 and M = 8 under each of ``"gpipe"``, ``"1f1b"`` and
``"zb-1p"`` (``checkpoint="never"``, a progress bar off and no logger: what the user's own code reads is theirs), and
under ``"gpipe"`` with its head's weight tied to its first layer's (``"tied"``: one parameter on both stages); and a
tiny Llama of ``lightning_gpipe.hf.CausalLM`` on packed rows of documents whose shape changes every step, between two
shapes (``"packed"``, fill-drain: ``pack_documents``, ``packed_batch``).
From the fourth step to the end of the last, every call of a ``Tensor`` method that reads its values on the host
(``item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``) made directly by a
module of ``lightning_gpipe``, in any thread, is counted. Each rank writes OUT_DIR/reads_rank{r}.json: per run
(``"gpipe-M4"``...), the reads per step and where they were made (``file:line`` -> count).
"""

import json
import os
import sys
import threading
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_gpipe  # noqa: E402

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
PACKAGE = os.path.dirname(lightning_gpipe.__file__)
STEPS, FROM = 8, 3


class Reads:
    """Counts the package's reads while :attr:`counting`, from every thread."""

    def __init__(self) -> None:
        self.counting, self.where, self.lock = False, Counter(), threading.Lock()
        self.originals = {name: getattr(torch.Tensor, name) for name in READS}
        for name in READS:
            self._wrap(name)

    def restore(self) -> None:
        """Put torch's own methods back (the next script of the shared launch runs without the counting)."""
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name: str) -> None:
        original = self.originals[name]

        def counted(tensor, *args, **kwargs):
            if self.counting:
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(PACKAGE):
                    line = sys._getframe(1).f_lineno
                    with self.lock:
                        self.where[f"{os.path.relpath(caller, PACKAGE)}:{line} {name}"] += 1
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


class Steady(L.Callback):
    """Counts from the start of step :data:`FROM` to the end of the last step (the epoch's end is not a step)."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == FROM:
            self.reads.where.clear()
            self.reads.counting = True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == STEPS - 1:
            self.reads.counting = False


class MLP(L.LightningModule):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.ReLU())])
        self.head = nn.Linear(64, 64 if tied else 10)
        if tied:
            self.head.weight = self.backbone[0].weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def packed() -> tuple[L.LightningModule, list[dict]]:
    """A tiny Llama's ``CausalLM`` and ``STEPS`` batches of 8 rows packed from documents of 3 to 12 tokens and one of
    the row's length: rows of 16 tokens in even steps, 20 in odd ones, so that the shape changes every step and each
    shape has been seen before the counted steps (a step's shapes are then announced ahead, not sent per
    micro-batch)."""
    from transformers import LlamaConfig

    from lightning_gpipe.hf import CausalLM, pack_documents, packed_batch

    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    generator, batches = torch.Generator().manual_seed(0), []
    for step in range(STEPS):
        row = 16 + 4 * (step % 2)
        lengths = [row, *torch.randint(3, 13, (23,), generator=generator).tolist()]
        documents = [torch.randint(3, 61, (n,), generator=generator).tolist() for n in lengths]
        batches.append(packed_batch(pack_documents(documents, row_length=row)[:8], pad_token_id=0))
    return CausalLM(config=config, lr=1e-3), batches


def run(reads: Reads, schedule: str, chunks: int, tied: bool = False) -> tuple[int, float, dict]:
    """This process's global rank, its reads per steady step of one fit, and where they were made."""
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * STEPS, 64, generator=generator), torch.randint(0, 10, (64 * STEPS,)))
    module, loader = MLP(tied), DataLoader(data, batch_size=64)
    if schedule == "packed":
        module, batches = packed()
        schedule, loader = "gpipe", DataLoader(batches, batch_size=None)
    strategy = lightning_gpipe.GPipeStrategy(chunks=chunks, checkpoint="never", schedule=schedule)
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=STEPS, callbacks=[Steady(reads)], **trainer_kwargs())
    trainer.fit(module, loader)
    return trainer.global_rank, sum(reads.where.values()) / (STEPS - FROM), dict(reads.where)


if __name__ == "__main__":
    out, reads, found = sys.argv[1], Reads(), {}
    try:
        for schedule in ("gpipe", "1f1b", "zb-1p", "tied", "packed"):
            for chunks in (4, 8):
                rank, per_step, where = run(reads, schedule.replace("tied", "gpipe"), chunks, schedule == "tied")
                found[f"{schedule}-M{chunks}"] = {"per_step": per_step, "where": where}
    finally:
        reads.restore()
    with open(os.path.join(out, f"reads_rank{rank}.json"), "w") as f:
        json.dump(found, f, indent=1)
