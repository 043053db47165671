"""Packed rows against pad-to-longest batches: real tokens per second of ``lightning_gpipe.hf.CausalLM`` on 2 stages at
the same token budget (issue 47).

The causal-LM example's model (``examples/causal_lm``: a Llama of hidden 256, 4 blocks, 8,000-token vocabulary) and
data (the shipped Multi30k sentences in en, de, fr, cs, one document each, ``<s> sentence </s>``, with the shipped
tokenizer), documents cut at ``--max-length`` tokens (34 by default, where the mean document, 17.2 tokens, is half the
longest), ``--max-tokens`` tokens a batch either way:

- ``padded``: as many documents (in a seeded random order) as keep ``rows * longest <= max_tokens``, each batch padded
  to its longest (``TextDataModule(max_tokens=...)``);
- ``packed``: documents packed into rows of ``max_length`` tokens, ``max_tokens // max_length`` rows a batch, positions
  restarting and attention kept inside each document (``TextDataModule(packing=True, max_tokens=...)``).

Each measurement is a fresh ``trainer.fit`` of ``--warmup + --steps`` steps under ``GPipeStrategy`` (fill-drain,
``--chunks`` micro-batches) on 2 CPU stage processes; the figure is the real (non-padding) tokens of the measured
steps over their wall time on global rank 0. The two kinds run interleaved (padded, packed, padded, packed...),
``--repeats`` times each; the medians are compared. The machine is shared: quote the whole output.

Usage (from the repository root)::

    python benchmarks/hf_packing.py                       # 3 repeats of 20 measured steps each
    python benchmarks/hf_packing.py --repeats 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository: lightning_gpipe, benchmarks
sys.path.insert(0, str(ROOT / "examples"))  # causal_lm, example_cli

from benchmarks._harness import CONTENDED, StepClock, _json_records, clean_env, emit  # noqa: E402

KINDS = ("padded", "packed")


def measure(args: argparse.Namespace) -> None:
    """One fit (a measured process and the stage process Lightning starts); global rank 0 prints the JSON line."""
    import lightning as L
    from causal_lm.data import TextDataModule
    from causal_lm.train import MODEL_DEFAULTS

    import lightning_gpipe
    from lightning_gpipe.hf import CausalLM

    clock, tokens = StepClock(args.warmup), []

    class Measure(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            clock.mark()
            tokens.append((int(batch["attention_mask"].sum()), batch["input_ids"].numel()))

    L.seed_everything(0, verbose=False)
    data = TextDataModule(max_length=args.max_length, max_tokens=args.max_tokens, packing=args.kind == "packed")
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=args.chunks),
        accelerator="cpu",
        devices=2,
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Measure()],
    )
    trainer.fit(CausalLM(**MODEL_DEFAULTS), data)
    measured = tokens[args.warmup :]
    elapsed = clock.ends[-1] - clock.ends[args.warmup - 1]
    real, padded = sum(t for t, _ in measured), sum(n for _, n in measured)
    summary = clock.summary()
    emit(trainer.global_rank, tokens_per_s=real / elapsed, real_share=real / padded, real_per_step=real / len(measured),
         median_s=summary["median_s"], runq_wait=summary["runq_wait"], cpu_s=summary["cpu_s"])  # fmt: skip


def run(kind: str, args: argparse.Namespace) -> dict:
    """One measurement of ``kind`` in fresh processes: global rank 0's record (the other rank's wait for a CPU
    folded in as ``waits``)."""
    command = [sys.executable, __file__, "--measure", kind, *_common(args)]
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=1800)
    records = sorted(_json_records(done.stdout), key=lambda r: r["rank"])
    if done.returncode != 0 or not records:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"measurement failed (exit {done.returncode}): {' '.join(command)}")
    busiest = max(r["cpu_s"] for r in records)  # CPU s a step of the busiest process: less sensitive to other load
    return {
        **records[0],
        "waits": [r["runq_wait"] for r in records],
        "tokens_per_cpu_s": records[0]["real_per_step"] / busiest,
    }


def _line(record: dict) -> str:
    """One measurement, for the log."""
    waits = "/".join(f"{100 * w:.0f}%" for w in record["waits"])
    flag = "  [contended]" if max(record["waits"]) > CONTENDED else ""
    return (
        f"{record['tokens_per_s']:8.0f} real tokens/s  ({record['real_per_step']:.0f} real tokens a step,"
        f" {100 * record['real_share']:.0f}% of the batch; {record['median_s']:.3f} s/step; waited for a CPU"
        f" {waits}){flag}"
    )


def _compare(results: dict[str, list[dict]], figure: str) -> dict[str, float]:
    """Print the medians of ``figure`` and their ratio (also over the uncontended repeats, where some were not);
    return the medians and the ratio."""
    medians = {kind: statistics.median(r[figure] for r in results[kind]) for kind in KINDS}
    pairs = ", ".join(f"{b[figure] / a[figure]:.2f}" for a, b in zip(*results.values()))
    name = {"tokens_per_s": "real tokens/s", "tokens_per_cpu_s": "real tokens per CPU s of the busiest process"}[figure]
    ratio = medians["packed"] / medians["padded"]
    print(f"\n{name}, median: padded {medians['padded']:.0f}, packed {medians['packed']:.0f}")
    print(f"packed / padded = {ratio:.2f}x  (per repeat: {pairs})")
    calm = {kind: [r[figure] for r in results[kind] if max(r["waits"]) <= CONTENDED] for kind in KINDS}
    if all(calm.values()) and sum(map(len, calm.values())) < 2 * len(results["padded"]):
        calm_ratio = statistics.median(calm["packed"]) / statistics.median(calm["padded"])
        print(f"    uncontended runs only: {calm_ratio:.2f}x")
    return {**medians, "ratio": ratio}


def _common(args: argparse.Namespace) -> list[str]:
    names = ("max_length", "max_tokens", "chunks", "steps", "warmup")
    return [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--max-length", type=int, default=34, help="tokens per document at most, and per packed row")
    parser.add_argument("--max-tokens", type=int, default=1088, help="the token budget of a batch (default 32 rows)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per run (default 3)")
    args = parser.parse_args()
    if args.measure:
        args.kind = args.measure
        measure(args)
        return
    started = time.perf_counter()
    print("command:  " + " ".join([sys.executable, *sys.argv]))
    print(f"settings: {' '.join(_common(args))}; 2 stages, fill-drain; host {os.cpu_count()} CPUs", flush=True)
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for repeat in range(args.repeats):
        for kind in KINDS:
            record = run(kind, args)
            results[kind].append(record)
            print(f"repeat {repeat + 1}  {kind:<7} {_line(record)}", flush=True)
    summary = {figure: _compare(results, figure) for figure in ("tokens_per_s", "tokens_per_cpu_s")}
    print(json.dumps(summary))
    print(f"wall time {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
