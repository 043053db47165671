"""Peak memory of each stage process of a pipelined Hugging Face model built on the meta device, against its share.

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

Bytes do not depend on the machine's load: one run.

Usage::

    python benchmarks/hf_memory.py                      # writes the checkpoint to a temporary directory
    python benchmarks/hf_memory.py --dir /tmp/llama92m  # keeps (or reuses) it there
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
"""The validation batch: ``ROWS`` sequences of ``LENGTH`` tokens."""


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


def measure(directory: str) -> None:
    """One stage process (Lightning's launcher re-runs this for the other stage): validate and emit its figures."""
    from benchmarks._runs import _map_large_allocations, _reset_peak_rss, _status_mib

    _map_large_allocations()
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lightning_gpipe
    from lightning_gpipe.hf import CausalLM

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
            params = sum(t.numel() * t.element_size() for t in own_tensors(pl_module)) / MIB
            validation_peak = _status_mib("VmHWM")
            emit(
                trainer.global_rank,
                stage=trainer.strategy.stage_index,
                layers=len(list(pl_module.backbone.children())),
                params_mib=params,
                build_peak_mib=self.build_peak - self.base,
                kept_mib=self.kept - self.base,
                read_mib=self.read - self.base,
                activations_mib=validation_peak - self.read,
                peak_mib=max(self.build_peak, validation_peak) - self.base,
            )

    def own_tensors(module) -> list:
        """The stage's parameters and buffers, each once (the other stages' stay on the meta device)."""
        return list({id(t): t for t in [*module.parameters(), *module.buffers()] if not t.is_meta}.values())

    torch.manual_seed(0)
    ids = torch.randint(3, CONFIG["vocab_size"], (ROWS, LENGTH))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    trainer = L.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(chunks=1),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Memory()],
    )
    trainer.validate(CausalLM(pretrained=directory), DataLoader([batch], batch_size=None), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="the checkpoint directory (written if it holds no config.json)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a stage process
    args = parser.parse_args()
    if args.measure is not None:
        measure(args.measure)
        return
    temporary = tempfile.TemporaryDirectory() if args.dir is None else None
    directory = Path(args.dir or temporary.name)
    write_checkpoint(directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / MIB
    result = subprocess.run(
        [sys.executable, __file__, "--measure", str(directory)],
        capture_output=True,
        text=True,
        env=clean_env(threads=1),
    )
    records = sorted(_json_records(result.stdout), key=lambda r: r["stage"])
    if result.returncode != 0 or len(records) != 2:
        sys.exit(f"the measured run failed:\n{result.stderr[-3000:]}")
    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    print(f"Llama {fields}; {size:.0f} MiB safetensors; validate one batch of {ROWS} x {LENGTH} tokens on 2 stages")
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
    if temporary is not None:
        temporary.cleanup()


if __name__ == "__main__":
    main()
