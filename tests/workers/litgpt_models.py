"""Distributed worker: litgpt's ``GPT`` (a tiny Pythia and a tiny Llama config) trained and decoded through
GPipeStrategy by ``lightning_gpipe.litgpt.CausalLM``, several cases in one process group.

Usage: python litgpt_models.py OUT_DIR --devices K
Each rank writes the starting checkpoint of each config (``torch.save`` of a seeded ``GPT``'s state dict, litgpt's
``lit_model.pth`` format) to OUT_DIR/init_{config}_rank{r}.pth; every case builds ``CausalLM`` on the meta device,
each stage reading only its own tensors of it. With K = 2, each case of :data:`CASES` is fitted for ``STEPS`` steps
on 2 stages, writing OUT_DIR/state_{case}_rank{r}.pt (the rank's parameters after fit, by litgpt's names), and each
config's starting model decodes :func:`prompts` greedily through the 2 stages with ``trainer.predict``
(OUT_DIR/generated_{config}.pt, rank 0). With K = 4, the case :data:`SHARDED` runs on 2 stages x 2 replicas with
``sharding_strategy="FULL_SHARD"``, each replica reading half of every batch's rows. tests/distributed/test_litgpt.py
compares all of it with the unmodified ``GPT`` trained and decoding (litgpt's ``generate``) on one device; it imports
this file for the configs, the batches and the prompts.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchvision_cpu import make_importable  # noqa: E402

make_importable()  # lightning imports torchmetrics, which imports torchvision

import torch  # noqa: E402
from litgpt.config import Config  # noqa: E402
from litgpt.model import GPT  # noqa: E402

CONFIGS = {
    # GPT-NeoX style: parallel residual, LayerNorm, a quarter of each head rotary, GELU MLP
    "pythia": dict(
        name="pythia-tiny", block_size=32, n_layer=3, n_embd=32, n_head=4, vocab_size=100, padding_multiple=4,
        rotary_percentage=0.25, parallel_residual=True, bias=True,
    ),
    # Llama style: sequential residual, RMSNorm, SwiGLU MLP, grouped queries, every head dimension rotary
    "llama": dict(
        name="llama-tiny", block_size=32, n_layer=3, n_embd=32, n_head=4, n_query_groups=2, vocab_size=100,
        padding_multiple=4, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=48,
    ),
}  # fmt: skip
"""The two tiny configs (a few thousand parameters each)."""

STEPS = 3
ROWS = 8
OPTIMIZERS = {"sgd": dict(lr=1e-5), "adamw": dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))}
"""Each optimizer's settings: SGD's steps equal one device's to 1e-5, AdamW's within fp32 rounding."""
CASES = {
    f"{config}-{schedule}-{optimizer}": (config, schedule, optimizer)
    for config in CONFIGS
    for schedule, optimizer in (("gpipe", "sgd"), ("1f1b", "adamw"))
}
"""The 2-stage cases: ``name: (config, schedule, optimizer)``."""
SHARDED = ("llama", "gpipe", "adamw")
"""The pp=2 x dp=2 case (``sharding_strategy="FULL_SHARD"``)."""
MAX_NEW_TOKENS = 6


def batches() -> list[torch.Tensor]:
    """``STEPS`` batches of ``ROWS`` rows of 12 token ids."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (ROWS, 12), generator=generator) for _ in range(STEPS)]


def prompts() -> torch.Tensor:
    """Two prompts of 5 tokens."""
    return torch.tensor([[5, 6, 7, 8, 9], [40, 41, 42, 43, 44]])


def initial_model(config: str, dtype: torch.dtype = torch.float32) -> GPT:
    """The seeded starting ``GPT`` of ``config``."""
    torch.manual_seed(0)
    return GPT(Config(**CONFIGS[config])).to(dtype)


if __name__ == "__main__":
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_gpipe
    import lightning_gpipe.litgpt as lg

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    class SGDCausalLM(lg.CausalLM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=OPTIMIZERS["sgd"]["lr"])

    def init_file(config: str) -> str:
        path = os.path.join(args.out, f"init_{config}_rank{rank}.pth")
        if not os.path.exists(path):
            torch.save(initial_model(config).state_dict(), path)
        return path

    def trainer(strategy) -> L.Trainer:
        return L.Trainer(
            strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    def fit(name: str, config: str, schedule: str, optimizer: str, dp: int = 1) -> None:
        module_class = SGDCausalLM if optimizer == "sgd" else lg.CausalLM
        settings = {} if optimizer == "sgd" else OPTIMIZERS["adamw"]
        module = module_class(CONFIGS[config], checkpoint=init_file(config), **settings)
        mesh = dict(pipeline_parallel_size=2, data_parallel_size=dp, sharding_strategy="FULL_SHARD") if dp > 1 else {}
        strategy = lightning_gpipe.GPipeStrategy(chunks=2, schedule=schedule, **mesh)
        data = DataLoader(batches(), batch_size=None)
        if dp > 1:  # rows: Lightning's distributed sampler gives each replica ROWS / dp of them per step
            data = DataLoader([row for batch in batches() for row in batch], batch_size=ROWS // dp)
        trainer(strategy).fit(module, data)
        own = {lg.lit_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
        torch.save(lightning_gpipe.lightning.whole_tensors(own), os.path.join(args.out, f"state_{name}_rank{rank}.pt"))

    if args.devices == 2:
        for name, case in CASES.items():
            fit(name, *case)
        for config in CONFIGS:
            module = lg.CausalLM(CONFIGS[config], checkpoint=init_file(config), max_new_tokens=MAX_NEW_TOKENS)
            generated = trainer(lightning_gpipe.GPipeStrategy(chunks=2)).predict(
                module, DataLoader([prompts()], batch_size=None)
            )
            if rank == 0:
                torch.save(generated[0], os.path.join(args.out, f"generated_{config}.pt"))
    else:
        L.seed_everything(
            0, verbose=False
        )  # the distributed sampler's shuffle (an earlier script may have set another)
        fit("sharded", *SHARDED, dp=2)
