"""LightningModules that fine-tune a Hugging Face model whose backbone is :func:`~lightning_gpipe.hf.to_sequential`'s.

:class:`CausalLM` (Llama family, GPT-2), :class:`MaskedLM` and :class:`SequenceClassifier` (BERT) build the model in
``configure_model`` on the meta device: under ``GPipeStrategy`` (whose ``model_sharded_context`` is the meta device)
each stage then allocates only its own layers and reads only their tensors from the checkpoint's safetensors files
(:class:`~lightning_gpipe.hf.weights.SafetensorsWeights`); under any other strategy, or in ``load_from_checkpoint``,
the whole model is materialised at once the same way. :class:`SavePretrained` writes a ``from_pretrained``
directory after fit, each stage writing its own shard.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine.contract import forward_and_share
from lightning_gpipe.hf.adapter import clear_kv_caches, hf_name, positions_from_mask, to_sequential
from lightning_gpipe.hf.weights import SafetensorsWeights, save_stage_shards
from lightning_gpipe.engine.partition import Partition, materialize

try:
    from huggingface_hub import snapshot_download
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        PretrainedConfig,
    )
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("lightning_gpipe.hf needs `transformers` 5 or newer: pip install 'transformers>=5'") from error


class HFModule(pl.LightningModule):
    """The common part: build the model (meta device, then each stage's own weights), AdamW with warmup and decay.

    Args:
        pretrained: a local checkpoint directory (``save_pretrained``'s), or a Hub name (downloaded with
            ``huggingface_hub.snapshot_download`` on the machine that runs it: the safetensors and JSON files);
            ``None`` to build a new model from ``config``.
        config: the configuration of a new model, used when ``pretrained`` is ``None`` (ignored otherwise, so one
            flag switches a config file to a checkpoint): a ``PretrainedConfig`` or a dict with a ``model_type`` key
            (``{"model_type": "llama", "hidden_size": 256, ...}``).
        overrides: fields set on either configuration (``{"attention_dropout": 0.1}``). Default none.
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``, as ``from_pretrained``'s argument.
        lr: the peak learning rate of AdamW. Default 3e-4.
        weight_decay: AdamW's decoupled weight decay of the matrices (biases, norms and 1-D tensors get none).
            Default 0.0.
        betas: AdamW's betas. Default (0.9, 0.95).
        warmup_steps: optimizer steps of linear warmup from 0. Default 0.
        decay: ``"cosine"`` (default), ``"linear"`` or ``"constant"`` after warmup, down to ``min_lr_ratio * lr`` at
            the run's last step (``trainer.estimated_stepping_batches``).
        min_lr_ratio: the final learning rate over the peak. Default 0.1.

    Attributes:
        backbone: the ``nn.Sequential`` of :func:`~lightning_gpipe.hf.to_sequential`, after ``configure_model``.
        hf_model: the ``transformers`` model (not a submodule: its modules are the backbone's).

    Raises:
        ValueError: for ``decay`` other than the three names, or no ``pretrained`` and no ``config``.
    """

    auto_class: Any = None
    """The ``transformers`` auto class that builds the model from a config."""

    def __init__(
        self,
        pretrained: Optional[str] = None,
        config: Optional[Union[dict, PretrainedConfig]] = None,
        overrides: Optional[dict] = None,
        attn_implementation: str = "sdpa",
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        decay: str = "cosine",
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"decay={decay!r}: choose 'cosine', 'linear' or 'constant'.")
        if pretrained is None and config is None:
            raise ValueError("Give `pretrained` (a checkpoint directory or Hub name) or a `config` to build from.")
        self.save_hyperparameters(ignore=["config"] if isinstance(config, PretrainedConfig) else None)
        self.pretrained, self.model_config, self.attn_implementation = pretrained, config, attn_implementation
        self.overrides = dict(overrides or {})
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.decay, self.min_lr_ratio = warmup_steps, decay, min_lr_ratio

    @property
    def hf_model(self) -> Any:
        """The ``transformers`` model whose modules the backbone holds (``None`` before ``configure_model``)."""
        return self.__dict__.get("_hf_model")

    def hf_config(self) -> PretrainedConfig:
        """The model's configuration, from ``pretrained`` or ``config``, with ``overrides`` (no weights read)."""
        config = self.model_config
        if self.pretrained is not None:
            return AutoConfig.from_pretrained(_local(self.pretrained), **self.overrides)
        if isinstance(config, PretrainedConfig):
            for key, value in self.overrides.items():
                setattr(config, key, value)
            return config
        fields = {**dict(config), **self.overrides}
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def configure_model(self) -> None:
        """Build the model on the meta device and its backbone; outside ``GPipeStrategy`` also materialise it.

        Under ``GPipeStrategy`` this runs in its meta-device context: the strategy splits the backbone and each
        stage materialises only its layers, which read their tensors from ``pretrained``'s safetensors files (or
        initialise as the model does). Elsewhere (one device, ``load_from_checkpoint``) the whole backbone is
        materialised here, on the current default device, the same way. Does nothing once built.
        """
        if self.hf_model is not None:
            return
        config = self.hf_config()
        config._attn_implementation = self.attn_implementation
        config.use_cache = False
        with torch.device("meta"):
            model = self.auto_class.from_config(config, attn_implementation=self.attn_implementation)
        model.train()
        weights = None
        if self.pretrained is not None:
            weights = SafetensorsWeights(_local(self.pretrained), model.all_tied_weights_keys, model.base_model_prefix)
        self.__dict__["_hf_model"] = model
        self.backbone = to_sequential(model, weights)
        device = torch.empty(()).device
        if device.type != "meta":  # not under GPipeStrategy's sharded context: this process holds everything
            materialize(self.backbone, device)  # tied parameters stay one

    # ----------------------------------------------------------------------------------------------- training

    def loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """The loss of the backbone's output ``logits`` on ``batch`` (the subclass's)."""
        raise NotImplementedError

    def backbone_input(self, batch: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """What the backbone takes from ``batch`` (data preparation only: no parameters)."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """One step: the backbone on the batch, the loss, logged as ``train_loss``."""
        loss = self.loss(self.backbone(self.backbone_input(batch)), batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Log ``val_loss`` (the mean over the epoch's batches)."""
        loss = self.loss(self.backbone(self.backbone_input(batch)), batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])

    def configure_optimizers(self) -> Any:
        """AdamW over this stage's parameters (no decay for tensors of fewer than 2 dimensions), stepped every
        optimizer step by :func:`lr_factor`."""
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=self.betas)
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1
        factor = lambda step: lr_factor(step, self.warmup_steps, int(total), self.decay, self.min_lr_ratio)  # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------------------- saving

    def save_pretrained(self, directory: Union[str, os.PathLike]) -> Path:
        """Write a directory that ``from_pretrained`` loads (config and safetensors).

        Without a pipeline it is the model's ``save_pretrained``. Inside a pipelined run (the module split into
        stages, e.g. from ``on_train_end``, see :class:`SavePretrained`) it must be called on every process: each
        stage of the first pipeline replica writes its own parameters as one shard, and global rank 0 the index
        and the config, so no process gathers the model.

        Returns:
            The directory.
        """
        directory = Path(directory)
        model = self.hf_model
        if not isinstance(self.backbone, Partition):
            model.save_pretrained(directory)
            return directory
        strategy = self.trainer.strategy
        writes = getattr(strategy, "replica_index", 0) == 0
        state = {hf_name(k): v for k, v in self.backbone.state_dict().items() if not v.is_meta}
        if writes:
            save_stage_shards(
                directory,
                state,
                strategy.stage_index,
                strategy.topology.num_stages,
                model.config,
                skip=model.all_tied_weights_keys,
                gather=_gather_over_world if strategy.topology.num_stages > 1 else None,
                write_index=strategy.global_rank == 0,
            )
        else:
            _gather_over_world(None)
        strategy.barrier("save_pretrained")
        return directory


def _gather_over_world(obj: Any) -> list[Any]:
    """Every process's ``obj`` (``None`` from processes that write nothing), skipping the ``None``s."""
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, obj)
    return [o for o in everything if o is not None]


def _local(pretrained: str) -> str:
    """A local directory for ``pretrained``: itself if it is one, else the Hub snapshot of its config, safetensors
    and tokenizer files (downloaded once into the Hugging Face cache)."""
    if os.path.isdir(pretrained):
        return pretrained
    return snapshot_download(pretrained, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str, min_ratio: float) -> float:
    """The learning rate at optimizer step ``step`` over the peak: linear warmup over ``warmup_steps`` (from
    ``1 / warmup_steps``), then ``decay`` (``"cosine"``, ``"linear"`` or ``"constant"``) down to ``min_ratio`` at
    ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


class CausalLM(HFModule):
    """Causal language-model fine-tuning of a Llama-family or GPT-2 model, pipelined by ``GPipeStrategy``.

    Batches are dicts of ``(N, S)`` long tensors: ``input_ids``, ``attention_mask`` (1 real, 0 padding) and
    ``labels`` (the ids, ``-100`` where no loss is wanted, e.g. padding); the loss is the model's own
    (``ForCausalLMLoss``: next-token cross-entropy, mean over the labelled tokens of the whole batch). Positions
    are ``0 .. S-1``, as the model's forward numbers a training batch. ``predict`` decodes greedily through the
    pipeline.

    Args:
        *args: see :class:`HFModule`.
        max_new_tokens: tokens ``predict_step`` adds at most. Default 32.
        kv_cache: ``predict_step`` decodes with each stage's key/value caches, one new token per step (default),
            or re-runs the whole sequence every step (see :func:`greedy_generate`).
        **kwargs: see :class:`HFModule`.
    """

    auto_class = AutoModelForCausalLM

    def __init__(self, *args: Any, max_new_tokens: int = 32, kv_cache: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_new_tokens, self.kv_cache = max_new_tokens, kv_cache

    def backbone_input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, attention_mask, position_ids)``."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).contiguous()
        return ids, mask, positions

    def loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Next-token cross-entropy over the labelled tokens (the model's ``ForCausalLMLoss``)."""
        return ForCausalLMLoss(logits, batch["labels"], vocab_size=logits.shape[-1])

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Greedy continuations of the batch's left-padded prompts (``input_ids``, ``attention_mask``): ``(N, S +
        T)`` ids, at most :attr:`max_new_tokens` new ones, stopping at the model's ``eos_token_id``."""
        eos = self.hf_model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        return self.generate(ids, mask, self.max_new_tokens, eos, kv_cache=self.kv_cache)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        max_new_tokens: int = 20,
        eos_token_id: Optional[int] = None,
        pad_token_id: Optional[int] = None,
        kv_cache: bool = True,
    ) -> Tensor:
        """Greedy decoding through the pipeline (see :func:`greedy_generate`); call it on every stage."""
        return greedy_generate(
            self.backbone, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, kv_cache
        )


class MaskedLM(HFModule):
    """Masked language-model fine-tuning of a BERT model. Batches: ``input_ids``, ``attention_mask``, optional
    ``token_type_ids``, and ``labels`` (the original ids at masked positions, ``-100`` elsewhere; masking is the
    data's job, e.g. ``transformers.DataCollatorForLanguageModeling``). Arguments: see :class:`HFModule`."""

    auto_class = AutoModelForMaskedLM

    def backbone_input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``."""
        return _encoder_input(batch)

    def loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Cross-entropy over the masked positions."""
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))


class SequenceClassifier(HFModule):
    """Sequence classification with a BERT model (pooled first token). Batches: ``input_ids``, ``attention_mask``,
    optional ``token_type_ids``, and ``labels`` ``(N,)`` long class ids. Logs ``val_acc`` besides the loss.
    Arguments: see :class:`HFModule` (``config={"num_labels": C}`` sets the classes of a checkpoint's head)."""

    auto_class = AutoModelForSequenceClassification

    def backbone_input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``."""
        return _encoder_input(batch)

    def loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Cross-entropy of the class logits."""
        return nn.functional.cross_entropy(logits.float(), batch["labels"])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Log ``val_loss`` and ``val_acc``."""
        logits = self.backbone(self.backbone_input(batch))
        n = batch["input_ids"].shape[0]
        self.log("val_loss", self.loss(logits, batch), prog_bar=True, batch_size=n)
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean(), prog_bar=True, batch_size=n)


def _encoder_input(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    types = batch.get("token_type_ids")
    return ids, torch.ones_like(ids) if mask is None else mask, torch.zeros_like(ids) if types is None else types


@torch.no_grad()
def greedy_generate(
    backbone: nn.Module,
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    max_new_tokens: int = 20,
    eos_token_id: Optional[int] = None,
    pad_token_id: Optional[int] = None,
    kv_cache: bool = True,
) -> Tensor:
    """Greedy decoding of a causal LM backbone, through the pipeline (every stage calls it alike).

    Each step is one backbone call through :func:`lightning_gpipe.forward_and_share`: the last stage picks each
    row's most likely next token and every stage receives the ids, so all stages go round the loop together.
    With ``kv_cache`` (default) the first step runs the whole prompts and every later step only the new token of
    each row: each decoder block keeps the keys and values of its rows in its own ``transformers.DynamicCache``
    (see :class:`~lightning_gpipe.hf.adapter.CachedDecoderBlock`), so between stages only the new token's hidden
    state ``(n, 1, H)``, the ``(n, S + t)`` padding mask, its position and the rows travel. Without it every step
    runs the whole sequence so far. Without a pipeline it runs on one device.

    Equals ``model.generate(input_ids, attention_mask=..., do_sample=False, max_new_tokens=...)``: prompts
    left-padded, positions counted from each row's first real token, a row that produced ``eos_token_id`` gets
    ``pad_token_id`` afterwards, and decoding stops once every row has.

    Args:
        backbone: the causal LM's backbone (``module.backbone``).
        input_ids: ``(N, S)`` long prompts, left-padded.
        attention_mask: ``(N, S)``, 1 for real tokens; ``None``: all real.
        max_new_tokens: tokens to add at most. Default 20.
        eos_token_id: the end-of-sequence id, or ``None`` (default) to always add ``max_new_tokens``.
        pad_token_id: what finished rows get; defaults to ``eos_token_id``.
        kv_cache: decode with the blocks' key/value caches, one new token per step (default), or re-run the whole
            sequence every step (``False``).

    Returns:
        ``(N, S + T)`` long: the prompts and the ``T <= max_new_tokens`` new tokens.
    """
    ids = input_ids
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.dtype)
    pad = eos_token_id if pad_token_id is None else pad_token_id
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    rows = torch.arange(ids.shape[0], device=ids.device)
    value: tuple[Tensor, ...] = (ids, mask, positions_from_mask(mask), *([rows] if kv_cache else []))
    clear_kv_caches(backbone)
    try:
        for _ in range(max_new_tokens):
            chosen = forward_and_share(backbone, value, _next_tokens).to(ids.device)
            if eos_token_id is not None:
                chosen = chosen.masked_fill(finished, pad)
                finished |= chosen == eos_token_id
            ids = torch.cat([ids, chosen[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if eos_token_id is not None and finished.all():
                break
            if kv_cache:
                value = (chosen[:, None], mask, positions_from_mask(mask)[:, -1:], rows)
            else:
                value = (ids, mask, positions_from_mask(mask))
    finally:
        clear_kv_caches(backbone)
    return ids


def _next_tokens(logits: Tensor) -> Tensor:
    """Each row's most likely next token of ``(N, S, V)`` logits, ``(N,)`` long on the CPU."""
    return logits[:, -1].float().argmax(-1).cpu()


class SavePretrained(pl.Callback):
    """Write the model as a ``from_pretrained`` directory at the end of training (every stage writes its shard).

    Args:
        dirpath: the directory.
        tokenizer: a tokenizer to save with it (anything with ``save_pretrained``), or ``None``.
    """

    def __init__(self, dirpath: Union[str, os.PathLike], tokenizer: Any = None) -> None:
        self.dirpath, self.tokenizer = Path(dirpath), tokenizer

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Call ``pl_module.save_pretrained(dirpath)`` on every process; global rank 0 saves the tokenizer (the
        one given, else the data module's ``tokenizer`` attribute if it has one)."""
        pl_module.save_pretrained(self.dirpath)
        tokenizer = self.tokenizer or getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained") and trainer.global_rank == 0:
            tokenizer.save_pretrained(self.dirpath)
