"""Peak memory of each stage process of a pipelined Hugging Face model built on the meta device, against its share;
and of fine-tuning it with LoRA adapters against fine-tuning every weight (``--fit``).

A Llama from a config (hidden 768, 6 blocks, untied 32,000-token vocabulary: 92M parameters, 366 MB of fp32) is
written once with ``save_pretrained`` (one ``model.safetensors``); then ``lightning_gpipe.hf.CausalLM(pretrained=DIR)``
runs ``trainer.validate`` on one batch under ``GPipeStrategy`` with 2 stage processes, each building the model on the
meta device and reading only its own layers' tensors (:class:`~lightning_gpipe.hf.SafetensorsWeights`). Validation
holds no gradients and no optimizer state: what a stage should hold is its parameters and the activations of the
step, nothing else.

What is measured, in every stage process, with Linux's resident set (``VmRSS``, ``VmHWM`` of ``/proc/self/status``;
the peak reset through ``/proc/self/clear_refs``), every allocation of 64 KiB or more given its own mapping so the
resident set follows the live tensors rather than the allocator's cache (``_runs._map_large_allocations``):

- ``base``: the resident set when the module is about to be built (Lightning's ``setup`` hook, before
  ``configure_model``), after Python, torch, Lightning and transformers are imported; everything below is over it.
- ``params``: the bytes of the stage's own parameters and buffers (each tensor once), counted from the tensors.
- ``build peak``: the peak from ``base`` until validation starts (the meta-device build, the split, reading the
  stage's tensors from safetensors). A whole-model allocation, a second copy of a layer or a state-dict copy would
  show here; ``build / params`` is the first ratio printed.
- ``kept``: the resident set when validation starts, over ``base`` (what the build left behind).
- ``activations``: the peak during validation over ``kept`` (the step's activations, logits and loss temporaries,
  and the transfer buffers).
- ``peak / (params + activations)``: the process's peak over ``base`` for the whole run, over that stage's
  parameters plus its measured activations: how far the stage is from holding exactly its share.

``--fit`` instead trains the same model for :data:`FIT_STEPS` AdamW steps on that batch, twice on 2 stages: every
weight (``CausalLM(pretrained=DIR)``), then LoRA adapters (``lora=True``: rank 8 on every linear layer of the
blocks, the base frozen). Each stage reports its parameters, the trainable ones, the largest gradients held before an
optimizer step (counted from the tensors), AdamW's state after the run, and its peak resident set over ``base``; the
table gives each figure for both runs and the LoRA run's peak over the full run's.

Bytes do not depend on the machine's load: one run.

Usage::

    python benchmarks/hf_memory.py                      # writes the checkpoint to a temporary directory
    python benchmarks/hf_memory.py --dir /tmp/llama92m  # keeps (or reuses) it there
    python benchmarks/hf_memory.py --fit                # LoRA against full fine-tuning
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: lightning_gpipe, benchmarks

from benchmarks._harness import _json_records, clean_env, emit  # noqa: E402

MIB = 2**20
CONFIG = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
"""The model: 91.6M parameters (two 24.6M embeddings, six blocks of 7.1M)."""

ROWS, LENGTH = 2, 128
"""The batch: ``ROWS`` sequences of ``LENGTH`` tokens."""

FIT_STEPS = 3
"""The optimizer steps of ``--fit``."""


def write_checkpoint(directory: Path) -> None:
    """``save_pretrained`` of the seeded model into ``directory`` (skipped if it holds a ``config.json``)."""
    if (directory / "config.json").is_file():
        return
    import torch
    import transformers

    fields = dict(CONFIG)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def own_tensors(module) -> list:
    """The stage's parameters and buffers, each once (the other stages' stay on the meta device)."""
    return list({id(t): t for t in [*module.parameters(), *module.buffers()] if not t.is_meta}.values())


def mib(tensors) -> float:
    """The bytes of ``tensors`` in MiB."""
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def run_stages(directory: str, callback, fit: bool, lora: bool) -> None:
    """``trainer.validate`` (or, with ``fit``, ``trainer.fit`` for :data:`FIT_STEPS` steps) of ``CausalLM`` on one
    batch under ``GPipeStrategy`` on 2 stage processes, with ``callback``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_gpipe
    from lightning_gpipe.hf import CausalLM

    torch.manual_seed(0)
    ids = torch.randint(3, CONFIG["vocab_size"], (ROWS, LENGTH))
    data = DataLoader([{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}], batch_size=None)
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=1),
        accelerator="cpu",
        devices=2,
        max_steps=FIT_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    module = CausalLM(pretrained=directory, lora=lora or None)
    if fit:
        trainer.fit(module, data)
    else:
        trainer.validate(module, data, verbose=False)


def measure(directory: str) -> None:
    """One stage process of the validation (Lightning's launcher re-runs this for the other stage)."""
    from benchmarks._runs import _map_large_allocations, _reset_peak_rss, _status_mib

    _map_large_allocations()
    import lightning as L
    import torch

    class Memory(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:  # before configure_model: nothing built yet
            self.base = _reset_peak_rss()

        def on_validation_start(self, trainer, pl_module) -> None:
            self.build_peak, self.kept = _status_mib("VmHWM"), _status_mib("VmRSS")
            with torch.no_grad():  # read every tensor once: its file pages become resident (see the docstring)
                for tensor in own_tensors(pl_module):
                    tensor.sum()
            self.read = _reset_peak_rss()

        def on_validation_end(self, trainer, pl_module) -> None:
            validation_peak = _status_mib("VmHWM")
            emit(
                trainer.global_rank,
                stage=trainer.strategy.stage_index,
                layers=len(list(pl_module.backbone.children())),
                params_mib=mib(own_tensors(pl_module)),
                build_peak_mib=self.build_peak - self.base,
                kept_mib=self.kept - self.base,
                read_mib=self.read - self.base,
                activations_mib=validation_peak - self.read,
                peak_mib=max(self.build_peak, validation_peak) - self.base,
            )

    run_stages(directory, Memory(), fit=False, lora=False)


def measure_fit(directory: str, lora: bool) -> None:
    """One stage process of ``--fit``: train every weight, or LoRA adapters, and emit the stage's figures."""
    from benchmarks._runs import _map_large_allocations, _reset_peak_rss, _status_mib

    _map_large_allocations()
    import lightning as L
    import torch

    class Memory(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:  # before configure_model: nothing built yet
            self.base, self.grads = _reset_peak_rss(), 0.0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.grads = max(self.grads, mib(grads))

        def on_train_end(self, trainer, pl_module) -> None:
            states = trainer.optimizers[0].state.values()
            emit(
                trainer.global_rank,
                stage=trainer.strategy.stage_index,
                params_mib=mib(own_tensors(pl_module)),
                trainable_mib=mib(p for p in pl_module.parameters() if p.requires_grad and not p.is_meta),
                grads_mib=self.grads,
                optimizer_mib=mib(t for state in states for t in state.values() if torch.is_tensor(t)),
                peak_mib=_status_mib("VmHWM") - self.base,
            )

    run_stages(directory, Memory(), fit=True, lora=lora)


def _records(directory: Path, *flags: str) -> list[dict]:
    """The stages' records of one measured run (``--measure`` and ``flags``), by stage; exits if it failed."""
    result = subprocess.run(
        [sys.executable, __file__, "--measure", str(directory), *flags],
        capture_output=True,
        text=True,
        env=clean_env(threads=1),
    )
    records = sorted(_json_records(result.stdout), key=lambda r: r["stage"])
    if result.returncode != 0 or len(records) != 2:
        sys.exit(f"the measured run failed:\n{result.stderr[-3000:]}")
    return records


def print_validation(directory: Path) -> None:
    """Measure the validation and print its table."""
    records = _records(directory)
    print(f"validate one batch of {ROWS} x {LENGTH} tokens on 2 stages")
    print("MiB over the resident set before the build (Python, torch, Lightning, transformers imported)")
    header = ("stage", "layers", "params", "build peak", "kept", "read", "read/params", "activations", "peak",
              "peak/(params+act)")  # fmt: skip
    print(" | ".join(header))
    for r in records:
        share = r["params_mib"] + r["activations_mib"]
        print(
            f"{r['stage']} | {r['layers']} | {r['params_mib']:.0f} | {r['build_peak_mib']:.0f} | {r['kept_mib']:.0f}"
            f" | {r['read_mib']:.0f} | {r['read_mib'] / r['params_mib']:.3f} | {r['activations_mib']:.0f}"
            f" | {r['peak_mib']:.0f} | {r['peak_mib'] / share:.3f}"
        )


def print_fit(directory: Path) -> None:
    """Measure full and LoRA fine-tuning and print the table: each figure for both, and the peaks' ratio."""
    full, lora = _records(directory, "--fit"), _records(directory, "--fit", "--lora")
    print(f"fit {FIT_STEPS} AdamW steps on one batch of {ROWS} x {LENGTH} tokens on 2 stages: full | LoRA (r=8)")
    print("MiB; peak over the resident set before the build (Python, torch, Lightning, transformers imported)")
    print("stage | params | trainable | gradients | AdamW state | peak | LoRA peak / full peak")
    for f, r in zip(full, lora):
        pairs = [(f[k], r[k]) for k in ("params_mib", "trainable_mib", "grads_mib", "optimizer_mib", "peak_mib")]
        cells = " | ".join(f"{a:.1f} / {b:.1f}" for a, b in pairs)
        print(f"{f['stage']} | {cells} | {r['peak_mib'] / f['peak_mib']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="the checkpoint directory (written if it holds no config.json)")
    parser.add_argument("--fit", action="store_true", help="LoRA against full fine-tuning instead of validation")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a stage process
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)  # a stage process of --fit
    args = parser.parse_args()
    if args.measure is not None and args.fit:
        measure_fit(args.measure, args.lora)
        return
    if args.measure is not None:
        measure(args.measure)
        return
    temporary = tempfile.TemporaryDirectory() if args.dir is None else None
    directory = Path(args.dir or temporary.name)
    write_checkpoint(directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / MIB
    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    print(f"Llama {fields}; {size:.0f} MiB safetensors")
    if args.fit:
        print_fit(directory)
    else:
        print_validation(directory)
    if temporary is not None:
        temporary.cleanup()


if __name__ == "__main__":
    main()
