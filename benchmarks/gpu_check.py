"""The GPU check: lightning-gpipe on one accelerator, as a user with one GPU runs it, in a few minutes.

NCCL refuses two ranks on one GPU, so every pipeline here has one stage (``devices=1``): the engine's whole step (the
plan, re-materialization, the B/W split, the relay and the agreement's bookkeeping) runs on the device. Parts:

- ``equal``: a one-stage ``GPipeStrategy(chunks=4)`` against plain Lightning, 5 SGD steps of an MLP, for every
  schedule a stage can run alone (``gpipe``, ``1f1b``, ``zb-h1``, ``zb-1p``) and every checkpoint mode; the largest
  parameter difference must be below 1e-5;
- ``dropout``: with dropout, re-materialized micro-batches (``checkpoint="always"``) train exactly as kept ones
  (``"never"``): the recompute replays the first forward's masks (the device's random state restored);
- ``bf16``: ``precision="bf16-mixed"`` trains to finite weights near fp32's;
- ``compile``: ``compile=True`` on the installed torch equals the uncompiled step (to 1e-4);
- ``hf``: a small Llama from ``lightning_gpipe.hf`` learns a token rule in bf16 (its loss falls by half); skipped,
  with the reason, where ``transformers`` is missing or older than 5.24;
- ``plan``: ``plan="auto"`` plans and trains (on the CPU with ``memory_limit`` given; on CUDA from the free memory);
- ``syncs``: steady-state steps of a one-stage pipeline under ``torch.cuda.set_sync_debug_mode("error")``: a host
  synchronisation in a step raises (CUDA only); a schedule that fails is run again under ``"warn"`` to print how
  many synchronisations a step makes and where (the innermost frame of this package on the stack);
- ``packed``: a small Llama from ``lightning_gpipe.hf`` on packed rows of documents (``pack_documents``,
  ``packed_batch``: no padding but at a row's end, positions restarting per document), the batch's shape changing
  every step, under ``gpipe``, ``1f1b`` and ``zb-1p``: on CUDA its steady-state steps run under
  ``set_sync_debug_mode("error")`` (0 host synchronisations per step, as ``syncs``; else where they are); on the CPU
  (a dry run) fill-drain's steps train, the synchronisations unchecked;
- ``speed``: 8 x Linear(4096), batch 8192, bf16-mixed, median milliseconds per step (the device synchronised at each
  step's end): a plain PyTorch loop with M micro-batches (gradient accumulation) against ``GPipeStrategy(chunks=M)``,
  M = 1, 4, 8, ``--repeats`` interleaved repeats (default 3), the ratio and each repeat's; ``host`` is ours' time
  per step until the host has queued the step's work; plain Lightning (``lightning``) once, for reference.

Usage::

    python benchmarks/gpu_check.py                   # every part, on CUDA if there is a GPU
    python benchmarks/gpu_check.py --parts equal speed
    python benchmarks/gpu_check.py --dry-run         # on the CPU, small sizes, CUDA-only parts skipped (the test suite)

Each part prints ``PASS``, ``FAIL`` or ``SKIP`` with its figures; the exit status is 1 if any part failed. Under a
minute of work per part on an H100; the script is the project's, the check of issue 36 (docs/benchmarks.md).
"""

import argparse
import collections
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_gpipe  # noqa: E402
from lightning_gpipe import GPipeStrategy  # noqa: E402

PARTS = ("equal", "dropout", "bf16", "compile", "hf", "plan", "syncs", "packed", "speed")


class Check:
    """Where the parts run: the device, the sizes (small in a dry run), the repeats of `speed`, the results."""

    def __init__(self, dry_run: bool, repeats: int = 1) -> None:
        self.repeats = repeats
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.accelerator = "gpu" if self.cuda else "cpu"
        self.dry_run = dry_run
        self.failed: list[str] = []
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def report(self, part: str, verdict: str, **figures: Any) -> None:
        """Print one part's verdict and figures."""
        shown = " ".join(f"{key}={value}" for key, value in figures.items())
        print(f"{verdict} {part} {shown}", flush=True)
        if verdict == "FAIL":
            self.failed.append(part)

    def trainer(self, strategy: Any | None = None, **kwargs: Any) -> L.Trainer:
        """A quiet single-device Trainer."""
        base = dict(accelerator=self.accelerator, devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
        return L.Trainer(**{**base, **({"strategy": strategy} if strategy is not None else {}), **kwargs})


class Net(L.LightningModule):
    """An MLP classifier: ``depth`` x (Linear, Tanh[, Dropout]) as the backbone, a Linear head, SGD."""

    def __init__(self, width: int = 128, depth: int = 4, p: float = 0.0, lr: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()] + ([nn.Dropout(p)] if p else [])
        self.backbone, self.head, self.lr = nn.Sequential(*layers), nn.Linear(width, 10), lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data(rows: int = 256, width: int = 128, batch: int = 32) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, width, generator=generator), torch.randint(0, 10, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _state(check: Check, strategy: Any | None, steps: int = 5, p: float = 0.0, **kwargs: Any) -> dict:
    L.seed_everything(0, verbose=False)
    trainer = check.trainer(strategy, max_steps=steps, **kwargs)
    trainer.fit(Net(p=p), _data())
    return {key: value.detach().float().cpu() for key, value in trainer.lightning_module.state_dict().items()}


def _largest(a: dict, b: dict) -> float:
    return max((a[key] - b[key]).abs().max().item() for key in a)


def part_equal(check: Check) -> None:
    plain, worst = _state(check, None), {}
    for schedule in ("gpipe", "1f1b", "zb-h1", "zb-1p"):
        for mode in ("always", "except_last", "never"):
            strategy = GPipeStrategy(chunks=4, schedule=schedule, checkpoint=mode)
            worst[f"{schedule}/{mode}"] = _largest(plain, _state(check, strategy))
    largest = max(worst.values())
    check.report("equal", "PASS" if largest < 1e-5 else "FAIL", cases=len(worst), largest=f"{largest:.2e}",
                 worst=max(worst, key=worst.get))  # fmt: skip


def part_dropout(check: Check) -> None:
    kept = _state(check, GPipeStrategy(chunks=4, checkpoint="never"), p=0.2)
    recomputed = _state(check, GPipeStrategy(chunks=4, checkpoint="always"), p=0.2)
    difference = _largest(kept, recomputed)
    check.report("dropout", "PASS" if difference == 0.0 else "FAIL", always_vs_never=f"{difference:.2e}")


def part_bf16(check: Check) -> None:
    fp32 = _state(check, GPipeStrategy(chunks=4))
    bf16 = _state(check, GPipeStrategy(chunks=4), precision="bf16-mixed")
    finite = all(torch.isfinite(value).all().item() for value in bf16.values())
    difference = _largest(fp32, bf16)
    check.report("bf16", "PASS" if finite and difference < 0.05 else "FAIL", finite=finite, vs_fp32=f"{difference:.2e}")


def part_compile(check: Check) -> None:
    from lightning_gpipe.engine.compilation import ISOLATES

    plain = _state(check, GPipeStrategy(chunks=4), steps=3)
    compiled = _state(check, GPipeStrategy(chunks=4, compile=True), steps=3)
    difference = _largest(plain, compiled)
    verdict = "PASS" if difference < 1e-4 else "FAIL"
    check.report("compile", verdict, torch=torch.__version__, isolate_recompiles=ISOLATES, vs_eager=f"{difference:.2e}")


class _Tokens(Dataset):
    """Sequences whose next token is ``(t * 7 + 3) % vocab``: a rule a small LM learns in a few dozen steps."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, vocab, (rows, 1), generator=generator)]
        for _ in range(length - 1):
            ids.append((ids[-1] * 7 + 3) % vocab)
        self.ids = torch.cat(ids, 1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def part_hf(check: Check) -> None:
    try:
        from lightning_gpipe.hf import CausalLM
    except ImportError as error:  # no transformers, or one older than lightning_gpipe.hf needs
        check.report("hf", "SKIP", why=str(error).replace(" ", "_"))
        return
    from transformers import LlamaConfig

    width, steps = (64, 30) if check.dry_run else (256, 120)
    config = LlamaConfig(vocab_size=128, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    L.seed_everything(0, verbose=False)
    losses = _Losses()
    precision = "bf16-mixed" if check.cuda else "32-true"
    trainer = check.trainer(GPipeStrategy(chunks=4), max_steps=steps, callbacks=[losses], precision=precision)
    trainer.fit(CausalLM(config=config, lr=3e-3), DataLoader(_Tokens(512, 32, 128), batch_size=16, shuffle=True))
    first, last = statistics.fmean(losses.losses[:3]), statistics.fmean(losses.losses[-3:])
    check.report("hf", "PASS" if last < first / 2 else "FAIL", precision=precision, first=f"{first:.3f}",
                 last=f"{last:.3f}")  # fmt: skip


def part_plan(check: Check) -> None:
    limit = None if check.cuda else 2**30  # on the CPU the planner needs the memory one process may hold
    strategy = GPipeStrategy(plan="auto", memory_limit=limit)
    _state(check, strategy, steps=3)
    chosen = strategy.plan_report.chosen.plan
    check.report("plan", "PASS", chunks=chosen.micro_batches, checkpoint=chosen.checkpoint, schedule=chosen.schedule)


class _SyncsForbidden(L.Callback):
    """Steady-state training steps (from step ``start``) under ``torch.cuda.set_sync_debug_mode("error")``."""

    def __init__(self, start: int) -> None:
        self.start, self.steps = start, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx >= self.start:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self.steps += batch_idx >= self.start


class _SyncSites(_SyncsForbidden):
    """Steady-state steps under ``set_sync_debug_mode("warn")``, counting where each host synchronisation comes from.

    A site is the innermost frame of this package (else of Lightning, else outside torch) on the Python stack when
    torch warns; a synchronisation in a backward is reported at the frame that called it.
    """

    def __init__(self, start: int) -> None:
        super().__init__(start)
        self.sites: collections.Counter = collections.Counter()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx >= self.start:
            torch.cuda.set_sync_debug_mode("warn")

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        """A ``warnings.showwarning`` that counts synchronisation warnings by site."""
        if "synchroniz" not in str(message):
            return
        outside = ("/torch/", "warnings.py", __file__)
        frames = [f for f in traceback.extract_stack() if not any(part in f.filename for part in outside)]
        for marker in ("lightning_gpipe", "lightning", ""):
            found = [f for f in frames if marker in f.filename]
            if found:
                self.sites[f"{Path(found[-1].filename).name}:{found[-1].lineno}"] += 1
                return


def _sync_sites(check: Check, schedule: str) -> str:
    """Where a one-stage pipeline's steady-state steps synchronise: ``N/step`` and the four commonest sites."""
    sites = _SyncSites(start=3)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = sites.record
        _state(check, GPipeStrategy(chunks=4, schedule=schedule), steps=8, callbacks=[sites])
    per_step = sum(sites.sites.values()) / max(sites.steps, 1)
    return f"{per_step:.1f}/step@" + ",".join(f"{site}x{n}" for site, n in sites.sites.most_common(4))


def part_syncs(check: Check) -> None:
    if not check.cuda:
        check.report("syncs", "SKIP", why="no CUDA device")
        return
    results = {}
    for schedule in ("gpipe", "1f1b", "zb-1p"):
        forbidden = _SyncsForbidden(start=3)
        try:
            _state(check, GPipeStrategy(chunks=4, schedule=schedule), steps=10, callbacks=[forbidden])
            results[schedule] = f"{forbidden.steps}_steps_0_syncs"
        except RuntimeError:
            torch.cuda.set_sync_debug_mode("default")
            results[schedule] = _sync_sites(check, schedule)
    passed = all(result.endswith("0_syncs") for result in results.values())
    check.report("syncs", "PASS" if passed else "FAIL", **results)


def _packed_batches(count: int, vocab: int, generator: torch.Generator) -> list[dict]:
    """``count`` batches of 4 rows packed from documents of 4 to 24 random tokens, batch ``i``'s rows at most
    ``40 + 3 * i`` tokens long: each batch of another shape."""
    from lightning_gpipe.hf import pack_documents, packed_batch

    batches = []
    for i in range(count):
        lengths = torch.randint(4, 25, (24,), generator=generator).tolist()
        documents = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
        batches.append(packed_batch(pack_documents(documents, row_length=40 + 3 * i)[:4], pad_token_id=0))
    return batches


def part_packed(check: Check) -> None:
    try:
        from lightning_gpipe.hf import CausalLM
    except ImportError as error:  # no transformers, or one older than lightning_gpipe.hf needs
        check.report("packed", "SKIP", why=str(error).replace(" ", "_"))
        return
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    batches = _packed_batches(10, config.vocab_size, torch.Generator().manual_seed(0))
    results = {}
    for schedule in ("gpipe", "1f1b", "zb-1p") if check.cuda else ("gpipe",):
        L.seed_everything(0, verbose=False)
        forbidden = _SyncsForbidden(start=3)
        trainer = check.trainer(GPipeStrategy(chunks=4, schedule=schedule), max_steps=len(batches),
                                callbacks=[forbidden] if check.cuda else [])  # fmt: skip
        try:
            trainer.fit(CausalLM(config=config, lr=1e-3), DataLoader(batches, batch_size=None))
            results[schedule] = f"{forbidden.steps}_steps_0_syncs" if check.cuda else f"{len(batches)}_steps"
        except RuntimeError as error:  # a host synchronisation under "error" (or another failure: named)
            if check.cuda:
                torch.cuda.set_sync_debug_mode("default")
            results[schedule] = repr(error)[:120].replace(" ", "_")
    lengths = sorted({batch["input_ids"].shape[1] for batch in batches})
    passed = all(result.endswith("_syncs" if check.cuda else "_steps") for result in results.values())
    check.report("packed", "PASS" if passed else "FAIL", lengths=",".join(map(str, lengths)), **results)


class _Repeat(Dataset):
    def __init__(self, batch: tuple, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple:
        return self.batch


class _Clock(L.Callback):
    """Seconds per step after ``warmup`` steps (the device synchronised at each step's end) and the host's share:
    from the last step's end until the host has queued this step's work (on CUDA, its wait for the device excluded)."""

    def __init__(self, warmup: int, cuda: bool) -> None:
        self.warmup, self.cuda, self.times, self.host, self.started = warmup, cuda, [], [], None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        queued = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if batch_idx >= self.warmup and self.started is not None:
            self.times.append(now - self.started)
            self.host.append(queued - self.started)
        self.started = now


def _torch_loop(check: Check, batch: tuple, chunks: int, width: int, depth: int, steps: int) -> float:
    """Median seconds per step of the plain PyTorch loop with ``chunks`` micro-batches."""
    model = nn.Sequential(Net(width=width, depth=depth).backbone, nn.Linear(width, 10)).to(check.device)
    optimizer, times = torch.optim.SGD(model.parameters(), lr=1e-3), []
    x, y = batch
    for step in range(steps):
        started = time.perf_counter()
        with torch.autocast(check.device.type, dtype=torch.bfloat16):
            for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
                (F.cross_entropy(model(xc), yc) * len(yc) / len(y)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if check.cuda:
            torch.cuda.synchronize()
        if step >= 5:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _lightning(check: Check, batch: tuple, chunks: int | None, width: int, depth: int, steps: int) -> tuple:
    """Median seconds per step, and of the host's share, of a one-stage ``GPipeStrategy(chunks=chunks)`` through
    Lightning, or of plain Lightning where ``chunks`` is None."""
    L.seed_everything(0, verbose=False)
    clock = _Clock(warmup=5, cuda=check.cuda)
    strategy = None if chunks is None else GPipeStrategy(chunks=chunks, checkpoint="never")
    trainer = check.trainer(strategy, max_steps=steps, callbacks=[clock], precision="bf16-mixed")
    trainer.fit(Net(width=width, depth=depth, lr=1e-3), DataLoader(_Repeat(batch, steps), batch_size=None))
    return statistics.median(clock.times), statistics.median(clock.host)


def _speed_at(check: Check, batch: tuple, sizes: tuple, chunks: int) -> str:
    """``loop/ours ms = ratio`` at ``chunks`` micro-batches: medians over ``check.repeats`` interleaved repeats, the
    ratio the median of the repeats' ratios (each repeat's), and ours' median host share per step."""
    loops, ours, hosts = [], [], []
    for _ in range(check.repeats):
        loops.append(_torch_loop(check, batch, chunks, *sizes))
        step, host = _lightning(check, batch, chunks, *sizes)
        ours.append(step)
        hosts.append(host)
    ratios = [step / loop for step, loop in zip(ours, loops)]
    each = ",".join(f"{ratio:.2f}" for ratio in ratios)
    return (f"{1e3 * statistics.median(loops):.2f}/{1e3 * statistics.median(ours):.2f}ms"
            f"={statistics.median(ratios):.2f}x({each};host_{1e3 * statistics.median(hosts):.2f}ms)")  # fmt: skip


def part_speed(check: Check) -> None:
    width, depth, rows, steps = (64, 4, 64, 12) if check.dry_run else (4096, 8, 8192, 25)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, width, generator=generator), torch.randint(0, 10, (rows,), generator=generator)
    batch, sizes = (x.to(check.device), y.to(check.device)), (width, depth, steps)
    figures = {f"M{chunks}": _speed_at(check, batch, sizes, chunks) for chunks in (1, 4, 8)}
    plain, host = _lightning(check, batch, None, *sizes)
    name = {"name": torch.cuda.get_device_name()} if check.cuda else {}
    check.report("speed", "PASS", **figures, lightning=f"{1e3 * plain:.2f}ms(host_{1e3 * host:.2f}ms)",
                 device=check.device.type, **name)  # fmt: skip


RUNS: dict[str, Callable[[Check], None]] = {
    "equal": part_equal, "dropout": part_dropout, "bf16": part_bf16, "compile": part_compile, "hf": part_hf,
    "plan": part_plan, "syncs": part_syncs, "packed": part_packed, "speed": part_speed,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts; 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, small sizes, CUDA-only parts skipped")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each timing in `speed`")
    args = parser.parse_args(argv)
    check = Check(args.dry_run, args.repeats)
    print(f"torch {torch.__version__}, lightning {L.__version__}, lightning_gpipe {lightning_gpipe.__version__},"
          f" device {check.device}", flush=True)  # fmt: skip
    for part in args.parts:
        started = time.perf_counter()
        try:
            RUNS[part](check)
        except Exception as error:  # noqa: BLE001 - a part that raises fails, the next one runs
            check.report(part, "FAIL", error=repr(error)[:300].replace(" ", "_"))
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
