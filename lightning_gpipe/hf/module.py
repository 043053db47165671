"""LightningModules that fine-tune a Hugging Face model whose backbone is :func:`~lightning_gpipe.hf.to_sequential`'s.

:class:`CausalLM` (any decoder of the standard layout, GPT-2), :class:`Seq2SeqLM` (encoder-decoders: T5, BART, Marian,
M2M100...), :class:`MaskedLM` and :class:`SequenceClassifier` (BERT-style encoders) check the model's class in
``__init__`` (the self-check, before any stage process starts) and build the model in ``configure_model`` on the meta
device: under ``GPipeStrategy`` (whose ``model_sharded_context`` is the meta device) each stage then allocates only its
own layers and reads only their tensors from the checkpoint's safetensors files
(:class:`~lightning_gpipe.hf.weights.SafetensorsWeights`); under any other strategy, or in ``load_from_checkpoint``, the
whole model is materialised at once the same way. With ``lora``, ``peft`` wraps the model first
(:mod:`lightning_gpipe.hf.lora`): the base weights are frozen on every stage, only the adapters train, and the
checkpoints and ``save_pretrained`` hold the adapters. :class:`SavePretrained` writes a ``from_pretrained`` directory
after fit, each stage writing its own shard.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gpipe.engine import Partition, materialize
from lightning_gpipe.faults import Job, waiting
from lightning_gpipe.hf import lora as peft_lora
from lightning_gpipe.hf.adapter import Family, check_class, family_of, to_sequential
from lightning_gpipe.hf.composite import unused_inputs
from lightning_gpipe.hf.decoder import causal_lm_loss, shifts_labels
from lightning_gpipe.hf.encoder import encoder_input
from lightning_gpipe.hf.kv_cache import clear_kv_caches, decoding, positions_from_mask
from lightning_gpipe.hf.layer import UnsupportedModelError, hf_name
from lightning_gpipe.hf.masks import unpackable_layer_types
from lightning_gpipe.hf.moe import RouterLoss, router_loss_of
from lightning_gpipe.hf.packing import decoder_input
from lightning_gpipe.hf.seq2seq import seq2seq_input, seq2seq_loss
from lightning_gpipe.hf.seq2seq_generate import generation_setting, seq2seq_beam_search, seq2seq_greedy_generate
from lightning_gpipe.hf.tensor_plan import split_stage, stage_targets
from lightning_gpipe.hf.weights import SafetensorsWeights, save_stage_shards
from lightning_gpipe.lightning import attached_trainer, forward_and_share, whole_tensors

try:
    from huggingface_hub import snapshot_download
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
        PretrainedConfig,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error

if TYPE_CHECKING:
    from lightning_gpipe.lightning import GPipeStrategy


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
        lora: fine-tune LoRA adapters with ``peft`` instead of every weight: ``True`` (``LoraConfig(r=8,
            lora_alpha=16, target_modules="all-linear")``), a dict of ``peft.LoraConfig`` fields, a ``LoraConfig``,
            or the ``save_pretrained`` directory of an adapter to go on training; ``None`` (default) trains every
            weight. The base weights are frozen on every stage (no gradient, no optimizer state); see
            :mod:`lightning_gpipe.hf.lora`. A ``LoraConfig`` object is not kept in the hyperparameters: give a dict
            for checkpoints that ``load_from_checkpoint`` should rebuild.
        checkpoint_frozen: with ``lora``, whether Lightning checkpoints also hold the frozen base weights. Default
            ``False``: only the trainable tensors (the adapters); loading one takes the base from ``pretrained``.
        self_check: prove the adapter's cut on the model's class before anything is built (default; see
            :mod:`lightning_gpipe.hf.selfcheck`). ``False`` skips it: only for a class you have verified yourself.

    Attributes:
        backbone: the ``nn.Sequential`` of :func:`~lightning_gpipe.hf.to_sequential`, after ``configure_model``.
        hf_model: the ``transformers`` model (not a submodule: its modules are the backbone's).
        peft_model: the ``peft`` model around it, with ``lora``; else ``None``.

    Raises:
        ValueError: for ``decay`` other than the three names, no ``pretrained`` and no ``config``, or a ``lora``
            whose initialisation needs the base weights (see :func:`~lightning_gpipe.hf.lora.lora_config`).
        SelfCheckError: if the adapter does not cut the model's class as its own forward computes (naming the class
            and the first backbone layer that differs), before any process starts.
        UnsupportedModelError: if no family takes the model's class.
        ImportError: for ``lora`` without ``peft``.
    """

    auto_class: Any = None
    """The ``transformers`` auto class that builds the model from a config."""

    also_built_by: tuple[Any, ...] = ()
    """Auto classes building a model from a config :attr:`auto_class` does not (of this kind: :meth:`_check_family`)."""

    trains_encoder: bool = False
    """Whether the module trains an encoder (its backbone takes ``(input_ids, attention_mask, token_type_ids)``)."""

    trains_seq2seq: bool = False
    """Whether the module trains an encoder-decoder (:mod:`lightning_gpipe.hf.seq2seq`)."""

    tensor_targets = stage_targets
    """``tensor_targets(size)``: per backbone layer, the modules transformers' plan splits, with their styles."""

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict | PretrainedConfig | None = None,
        overrides: dict | None = None,
        attn_implementation: str = "sdpa",
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        decay: str = "cosine",
        min_lr_ratio: float = 0.1,
        lora: bool | str | dict | None = None,
        checkpoint_frozen: bool = False,
        self_check: bool = True,
    ) -> None:
        super().__init__()
        if decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"decay={decay!r}: choose 'cosine', 'linear' or 'constant'.")
        if pretrained is None and config is None:
            raise ValueError("Give `pretrained` (a checkpoint directory or Hub name) or a `config` to build from.")
        ignored = [name for name, value in (("config", config), ("lora", lora)) if _is_object(value)]
        self.save_hyperparameters(ignore=ignored or None)
        self.pretrained, self.model_config, self.attn_implementation = pretrained, config, attn_implementation
        self.overrides = dict(overrides or {})
        self.lr, self.weight_decay, self.betas = lr, weight_decay, cast("tuple[float, float]", tuple(betas))
        self.warmup_steps, self.decay, self.min_lr_ratio = warmup_steps, decay, min_lr_ratio
        self.lora, self.checkpoint_frozen, self.self_check = lora or None, checkpoint_frozen, self_check
        if self.lora is not None:
            peft_lora.lora_config(self.lora)  # a bad LoRA configuration fails here, before any process starts
        if self_check:  # configure_model then builds from the same config: no second check
            config = self.model_config_for_build()
            model_class = self._model_class(config)
            self._check_family(model_class.__name__, check_class(model_class, config))

    def _auto_class(self, config: PretrainedConfig) -> Any:
        """:func:`_builder` of :attr:`auto_class` and :attr:`also_built_by` for ``config``."""
        return _builder((self.auto_class, *self.also_built_by), config, type(self).__name__)

    def _model_class(self, config: PretrainedConfig) -> type:
        """The class :meth:`_auto_class` builds for ``config``."""
        return self._auto_class(config)._model_mapping[type(config)]

    def _check_family(self, name: str, family: Family) -> None:
        """Refuse a model its family cuts into another kind of backbone than this module feeds (e.g. BERT's causal-LM
        head without ``is_decoder=True``, an encoder, under :class:`CausalLM`)."""
        kind = _kind(family.encoder, family.seq2seq)
        other = _kind(self.trains_encoder, self.trains_seq2seq)
        if kind != other:
            raise UnsupportedModelError(
                f"{type(self).__name__} trains {other}, but {name} is cut as {kind} (the {family.name} family, whose"
                f" backbone takes {family.inputs}): {_fix_for(kind, other)}."
            )

    @property
    def hf_model(self) -> Any:
        """The ``transformers`` model whose modules the backbone holds (``None`` before ``configure_model``)."""
        return self.__dict__.get("_hf_model")

    @property
    def peft_model(self) -> Any:
        """The ``peft`` model around :attr:`hf_model` with ``lora``, else ``None``."""
        return self.__dict__.get("_peft_model")

    @property
    def router_loss(self) -> RouterLoss | None:
        """The model's load-balancing loss when it adds one (a mixture of experts with ``output_router_logits``),
        else ``None`` (see :mod:`lightning_gpipe.hf.moe`)."""
        return None if self.hf_model is None else router_loss_of(self.hf_model)

    def hf_config(self) -> PretrainedConfig:
        """The model's configuration, from ``pretrained`` or ``config``, with ``overrides`` (no weights read)."""
        config = self.model_config
        if self.pretrained is not None:
            return AutoConfig.from_pretrained(_local(self.pretrained), **self.overrides)
        if isinstance(config, PretrainedConfig):
            for key, value in self.overrides.items():
                setattr(config, key, value)
            return config
        fields = {**dict(cast(dict, config)), **self.overrides}  # a dict: __init__ took pretrained or config
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def model_config_for_build(self) -> PretrainedConfig:
        """:meth:`hf_config` as the model is built: with the attention implementation (:func:`_attention`), no cache."""
        config = self.hf_config()
        config._attn_implementation = _attention(self._model_class(config), self.attn_implementation)
        config.use_cache = False
        return config

    def configure_model(self) -> None:
        """Build the model on the meta device and its backbone; outside ``GPipeStrategy`` also materialise it.

        Under ``GPipeStrategy`` this runs in its meta-device context: the strategy splits the backbone and each
        stage materialises only its layers, which read their tensors from ``pretrained``'s safetensors files (or
        initialise as the model does). Elsewhere (one device, ``load_from_checkpoint``) the whole backbone is
        materialised here, on the current default device, the same way. Once built, it only splits the stage's layers
        over its tensor ranks (:func:`~lightning_gpipe.hf.tensor_plan.split_stage`, raising its errors), if any.
        """
        if self.hf_model is not None:
            split_stage(self)
            return
        config = self.model_config_for_build()
        with torch.device("meta"):
            model = self._auto_class(config).from_config(config, attn_implementation=config._attn_implementation)
        model.train()
        weights: SafetensorsWeights | peft_lora.PeftWeights | None = None  # the checkpoint's, then with adapters
        if self.pretrained is not None:
            weights = SafetensorsWeights(
                _local(self.pretrained), model.all_tied_weights_keys, model.base_model_prefix, model
            )
        self.__dict__["_hf_model"] = model
        if self.lora is not None:
            with torch.device("meta"):
                wrapped = self.__dict__["_peft_model"] = peft_lora.wrap(model, self.lora)
            adapters = self.lora if isinstance(self.lora, (str, os.PathLike)) else None
            if weights is not None or adapters is not None:
                weights = peft_lora.PeftWeights(wrapped, cast("SafetensorsWeights | None", weights), adapters)
        self._check_family(type(model).__name__, family_of(model))
        self.backbone = to_sequential(self.peft_model or model, weights, check=False)  # checked in __init__
        device = torch.empty(()).device
        if device.type != "meta":  # not under GPipeStrategy's sharded context: this process holds everything
            materialize(self.backbone, device)  # tied parameters stay one

    # ----------------------------------------------------------------------------------------------- checkpoints

    def _frozen_names(self) -> set[str]:
        """The names of the parameters that train no more (LoRA's base weights), when checkpoints leave them out."""
        if self.peft_model is None or self.checkpoint_frozen:
            return set()
        names = {name for name, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return names | {name for name, _ in self.named_buffers(remove_duplicate=False)}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # every overload
        """The module's state; with ``lora`` (and ``checkpoint_frozen=False``) only its trainable tensors, the
        adapters: what Lightning checkpoints hold (every stage its own, see ``GPipeStrategy(state_dict_type=...)``)."""
        state = super().state_dict(*args, **kwargs)
        frozen = self._frozen_names()
        if frozen:
            prefix = kwargs.get("prefix", "")
            for key in [k for k in state if k.startswith(prefix) and k[len(prefix) :] in frozen]:
                del state[key]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load ``state_dict``; with ``lora`` (and ``checkpoint_frozen=False``) the frozen tensors it lacks keep
        their values (read from ``pretrained``), so an adapters-only checkpoint loads with ``strict=True``."""
        frozen = self._frozen_names()
        if frozen:
            current = super().state_dict(keep_vars=True)
            state_dict = {**{k: v for k, v in current.items() if k in frozen}, **state_dict}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

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
        """AdamW over this stage's trainable parameters (no decay for tensors of fewer than 2 dimensions), stepped
        every optimizer step by :func:`lr_factor`. A stage with nothing to train (with ``lora``, one that holds only
        frozen layers, e.g. the final norm and the head) gets one empty group: it steps nothing, as the pipeline's
        other stages step."""
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]] or groups[1:]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        total = self.trainer.estimated_stepping_batches if attached_trainer(self) is not None else 1
        factor = lambda step: lr_factor(step, self.warmup_steps, int(total), self.decay, self.min_lr_ratio)  # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------------------- saving

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write a directory that ``from_pretrained`` loads (config and safetensors).

        Without a pipeline it is the model's ``save_pretrained``. Inside a pipelined run (the module split into
        stages, e.g. from ``on_train_end``, see :class:`SavePretrained`) it must be called on every process: each
        stage of the first pipeline (replica 0, tensor rank 0) writes its own parameters as one shard, and global
        rank 0 the index and the config, so no process gathers the model.

        With ``lora`` it writes the adapter directory instead (``adapter_model.safetensors`` and
        ``adapter_config.json``, as ``PeftModel.save_pretrained``; ``PeftModel.from_pretrained(base, directory)``
        loads it): every stage sends its adapters, small next to the model, to global rank 0, which writes them.

        Returns:
            The directory.
        """
        directory = Path(directory)
        model = self.hf_model
        if self.peft_model is not None:
            return self._save_adapters(directory)
        if not isinstance(self.backbone, Partition):
            model.save_pretrained(directory)
            return directory
        _save_stage_shards(self, cast("GPipeStrategy", self.trainer.strategy), directory)  # split: a pipelined run
        return directory

    def _save_adapters(self, directory: Path) -> Path:
        """:meth:`save_pretrained` with ``lora``: the trainable tensors of every stage, written by global rank 0."""
        if not isinstance(self.backbone, Partition):
            self.peft_model.save_pretrained(str(directory))
            return directory
        _save_stage_adapters(self, cast("GPipeStrategy", self.trainer.strategy), directory)
        return directory


def _save_stage_shards(module: HFModule, strategy: GPipeStrategy, directory: Path) -> None:
    """:meth:`HFModule.save_pretrained` of a split model: each stage of the first pipeline (replica 0, tensor rank 0)
    writes its shard, global rank 0 the index (of every shard's sizes, gathered) and the config."""
    model = module.hf_model
    state = {hf_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
    state = whole_tensors(state)  # a sharded or split stage's DTensors gathered whole: a collective call
    stages = strategy.topology.num_stages
    gather = functools.partial(_gather_over_world, strategy.job) if stages > 1 else None  # of the shards' sizes
    if getattr(strategy, "pipeline_index", 0) == 0:  # replica 0's, tensor rank 0's stages write
        save_stage_shards(
            directory,
            state,
            strategy.stage_index,
            stages,
            model.config,
            skip=model.all_tied_weights_keys,
            gather=gather,
            write_index=strategy.global_rank == 0,
            model=model,
        )
    elif gather is not None:
        gather(None)
    strategy.barrier("save_pretrained")


def _save_stage_adapters(module: HFModule, strategy: GPipeStrategy, directory: Path) -> None:
    """Every stage's trainable tensors (whole: a sharded stage's gathered over its replicas, a collective call) sent to
    global rank 0, which writes the adapter directory."""
    state = module.backbone.state_dict(keep_vars=True)
    local = {hf_name(k): v.detach() for k, v in state.items() if v.requires_grad and not v.is_meta}
    local = {k: v.cpu() for k, v in whole_tensors(local).items()}
    everything = _gather_over_world(strategy.job, local if getattr(strategy, "pipeline_index", 0) == 0 else None)
    if strategy.global_rank == 0:
        peft_lora.save_adapters(module.peft_model, directory, {k: v for part in everything for k, v in part.items()})
    strategy.barrier("save_pretrained")


def _builder(auto_classes: tuple[Any, ...], config: PretrainedConfig, module: str) -> Any:
    """The first of ``auto_classes`` that builds a model from ``config``.

    Raises:
        UnsupportedModelError: if none does (a config of another kind of model), naming the first and ``module``.
    """
    for auto in auto_classes:
        if type(config) in auto._model_mapping:
            return auto
    raise UnsupportedModelError(
        f"{auto_classes[0].__name__} builds no model from a {type(config).__name__} ({config.model_type!r}):"
        f" {module} cannot train it."
    )


def _attention(model_class: type, requested: str) -> str:
    """``requested``, but ``"eager"`` for ``"sdpa"`` where ``model_class`` has no SDPA attention (Mamba has no attention
    at all), as ``transformers`` falls back when none is asked for."""
    return "eager" if requested == "sdpa" and not getattr(model_class, "_supports_sdpa", False) else requested


def _kind(encoder: bool, seq2seq: bool) -> str:
    """What a backbone is, for messages: an encoder, a decoder or an encoder-decoder."""
    return "an encoder-decoder" if seq2seq else "an encoder" if encoder else "a decoder"


def _fix_for(kind: str, trained: str) -> str:
    """What to do with a model cut as ``kind`` under a module that trains ``trained`` (:func:`_kind`'s words): choose
    the module for ``kind``; for an encoder under a decoder's module also set ``is_decoder=True``, with which
    ``transformers`` runs the causal-LM heads of BERT-style encoders as decoders (the encoder family takes no model
    with it, :mod:`lightning_gpipe.hf.causal_encoder` takes them)."""
    fix = f"choose the module for {kind}"
    if (kind, trained) == ("an encoder", "a decoder"):
        return (
            "to train it as a causal LM set `is_decoder=True` in its config (overrides={'is_decoder': True}), as"
            f" transformers asks of a BERT-style causal-LM head used as a standalone decoder; or {fix}"
        )
    return fix


def _is_object(value: Any) -> bool:
    """Whether ``value`` is an object that ``save_hyperparameters`` should not record (a config object)."""
    return value is not None and not isinstance(value, (bool, int, float, str, dict, list, tuple, os.PathLike))


def _gather_over_world(job: Job, obj: Any) -> list[Any]:
    """Every process's ``obj`` (``None`` from processes that write nothing), skipping the ``None``s (a collective
    call whose wait a failed or stalled stage ends, :func:`~lightning_gpipe.faults.waiting.all_gather_object`)."""
    return [o for o in waiting.all_gather_object(job, obj) if o is not None]


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
    """Causal language-model fine-tuning of a decoder (a declared plan, the standard layout, GPT-2, the GPT-2-like
    layout with its recurrent and hybrid families: Mamba, Jamba...), pipelined by ``GPipeStrategy``.

    Batches are dicts of ``(N, S)`` long tensors: ``input_ids``, ``attention_mask`` (1 real, 0 padding) and
    ``labels`` (the ids, ``-100`` where no loss is wanted, e.g. padding); the loss is the model's own
    (``ForCausalLMLoss``: next-token cross-entropy, mean over the labelled tokens of the whole batch; plus the
    load-balancing loss of a mixture of experts whose config has ``output_router_logits=True``, times its
    ``router_aux_loss_coef``; for a class whose forward scores unshifted labels, BART's causal LMs, its cross-entropy
    of each position against its own label: give it labels shifted left,
    :func:`~lightning_gpipe.hf.decoder.shifts_labels`). Positions are ``0 .. S-1``, as the model's forward numbers a
    training batch.
    ``predict`` decodes greedily through the pipeline.

    Packed rows (several documents back to back in a row, no padding between them) are batches with ``position_ids``
    too, each document numbered from 0 (:func:`~lightning_gpipe.hf.packed_batch` makes them): attention stays inside
    each document (a block-diagonal causal mask) and the positions restart. A batch may carry two ints of the whole
    batch, ``num_targets`` (its labelled targets) and ``num_rows`` (its rows; both from ``packed_batch``), which make
    the loss the mean over the batch's targets under every schedule, 1F1B's per-micro-batch losses included
    (:meth:`loss`).

    A mixture of experts with the load-balancing loss needs the batch's loss at once: under a schedule that runs
    the loss per micro-batch (``schedule="1f1b"`` and the other non-fill-drain schedules) :meth:`on_fit_start`
    refuses it (see :mod:`lightning_gpipe.hf.moe`).

    Args:
        *args: see :class:`HFModule`.
        max_new_tokens: tokens ``predict_step`` adds at most. Default 32.
        kv_cache: ``predict_step`` decodes with each stage's key/value caches, one new token per step (default),
            or re-runs the whole sequence every step (see :func:`greedy_generate`).
        **kwargs: see :class:`HFModule`.
    """

    auto_class = AutoModelForCausalLM
    also_built_by = (AutoModelForSeq2SeqLM,)  # speech-to-text language models (Voxtral, Qwen2-Audio...) listed there

    def __init__(self, *args: Any, max_new_tokens: int = 32, kv_cache: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_new_tokens, self.kv_cache = max_new_tokens, kv_cache
        self._labels_checked = False
        self._shift: bool | None = None  # shifts_labels of the model's class, read once (the loss asks per micro-batch)

    def backbone_input(self, batch: dict[str, Any]) -> tuple[Tensor, ...]:
        """``(input_ids, attention_mask, position_ids)``, or for packed rows (a batch with ``position_ids``)
        ``(input_ids, attention_mask, position_ids, documents)`` (:func:`~lightning_gpipe.hf.packing.decoder_input`).

        Raises:
            ValueError: for packed rows of a model with recurrent layers (``linear_attention``...), whose state would
                run from one document into the next; for a batch carrying what the model's forward takes and the
                backbone would drop (:meth:`_refuse_unused`).
        """
        self._refuse_unused(batch)
        self._refuse_copied_labels(batch)
        positions = batch.get("position_ids")
        if positions is not None:
            recurrent = unpackable_layer_types(self.hf_model.config)
            if recurrent:
                raise ValueError(
                    f"{type(self.hf_model).__name__} has {recurrent} layers, whose state runs across a packed row's"
                    " documents: give it unpacked batches (no position_ids)."
                )
        return decoder_input(batch["input_ids"], batch.get("attention_mask"), positions)

    def _refuse_unused(self, batch: dict[str, Any]) -> None:
        """Refuse a batch carrying inputs the model's forward takes and the backbone does not run
        (:func:`~lightning_gpipe.hf.composite.unused_inputs`): a composite model's images or audio, rather than
        train on the text alone without a word.

        Raises:
            ValueError: naming them.
        """
        unused = unused_inputs(self.hf_model, batch)
        if unused:
            raise ValueError(
                f"The batch carries {unused}, which {type(self.hf_model).__name__}'s forward takes but CausalLM's"
                " backbone does not run: it trains on the text (input_ids, attention_mask, position_ids, labels),"
                " not on a composite model's image or audio towers (docs/transformers.md, 'Composite models')."
                " Leave them out of the batch to train the language model on the text."
            )

    def _refuse_copied_labels(self, batch: dict[str, Any]) -> None:
        """Refuse, on the first batch, labels equal to the input ids (``-100`` aside) for a class whose forward scores
        each position against its own label (:func:`~lightning_gpipe.hf.decoder.shifts_labels` false: BART's causal
        LMs): they would train the model to copy its input, silently. Reads the batch on the host once.

        Raises:
            ValueError: naming the class and the labels to give.
        """
        labels = batch.get("labels")
        if self._labels_checked or labels is None or self.hf_model is None:
            return
        self._labels_checked = True
        if self._shifts_labels():
            return
        scored = labels != -100
        if bool(scored.any()) and bool((labels[scored] == batch["input_ids"][scored]).all()):
            raise ValueError(
                f"{type(self.hf_model).__name__}'s loss scores each position against its own label (unshifted), and"
                " this batch's labels equal its input_ids: it would learn to copy its input. Give labels shifted"
                " left: labels[:, i] = input_ids[:, i + 1], -100 at the end (docs/transformers.md, 'One decoder"
                " stack')."
            )

    def _shifts_labels(self) -> bool:
        """Whether the model's class shifts its labels (:func:`~lightning_gpipe.hf.decoder.shifts_labels`; ``True``
        before the model is built), read once per module."""
        if self._shift is None and self.hf_model is not None:
            self._shift = shifts_labels(type(self.hf_model))
        return self._shift is not False

    def loss(self, output: Tensor | tuple[Tensor, Tensor], batch: dict[str, Any]) -> Tensor:
        """The model's loss with ``batch["labels"]`` (:func:`~lightning_gpipe.hf.decoder.causal_lm_loss`): next-token
        cross-entropy over the labelled tokens (unshifted where the model's forward does not shift them), plus the
        load-balancing loss of a mixture of experts.

        With ``batch["num_targets"]`` and ``batch["num_rows"]`` (ints of the whole batch: its labelled targets and
        its rows; see the class), the cross-entropy is the sum over these rows' targets over ``num_targets``, times
        ``num_rows`` over these rows: the engine weighs a micro-batch's loss by its share of the rows, so the step's
        loss and gradients are the mean over the whole batch's targets under every schedule.
        """
        labels = batch["labels"]
        loss = causal_lm_loss(output, labels, self.router_loss, batch.get("num_targets"), self._shifts_labels())
        if "num_rows" in batch:
            loss = loss * (batch["num_rows"] / labels.shape[0])
        return loss

    def on_fit_start(self) -> None:
        """Refuse a load-balancing loss under a schedule that runs the loss per micro-batch, before step 1.

        Raises:
            ValueError: for a mixture of experts with ``output_router_logits=True`` under such a schedule: the loss
                is a product of two means over the whole batch, which the micro-batches' losses do not add up to.
        """
        run = getattr(self.trainer.strategy, "run", None)
        if self.router_loss is not None and run is not None and run.pipeline.loss_per_micro_batch:
            raise ValueError(
                f"{type(self.hf_model).__name__} adds a load-balancing loss (output_router_logits=True) that is a"
                " product of two means over the whole batch's tokens, but this schedule computes the loss per"
                " micro-batch, which would train another loss. Use the fill-drain schedule (GPipeStrategy(schedule="
                "'gpipe'), the default), or train without it (overrides={'output_router_logits': False})."
            )

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Greedy continuations of the batch's left-padded prompts (``input_ids``, ``attention_mask``): ``(N, S +
        T)`` ids, at most :attr:`max_new_tokens` new ones, stopping at the model's ``eos_token_id``."""
        self._refuse_unused(batch)
        eos = self.hf_model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        return self.generate(ids, mask, self.max_new_tokens, eos, kv_cache=self.kv_cache)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 20,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        kv_cache: bool = True,
    ) -> Tensor:
        """Greedy decoding through the pipeline (see :func:`greedy_generate`); call it on every stage."""
        return greedy_generate(
            self.backbone, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, kv_cache
        )


class Seq2SeqLM(HFModule):
    """Fine-tuning of an encoder-decoder (T5, mT5, umT5, BART, mBART, Marian, M2M100/NLLB, Pegasus...; see
    :mod:`lightning_gpipe.hf.seq2seq`), pipelined by ``GPipeStrategy``: the encoder's blocks, then the decoder's, the
    encoder's output and the source mask carried to every decoder stage.

    Batches are dicts of long tensors: ``input_ids`` and ``attention_mask`` ``(N, S)`` (the source), ``labels`` ``(N,
    T)`` (the target ids, ``-100`` where no loss is wanted, e.g. padding), and optionally ``decoder_input_ids`` and
    ``decoder_attention_mask`` ``(N, T)`` (else the labels shifted right, as the model's forward makes them:
    :func:`~lightning_gpipe.hf.seq2seq.seq2seq_input`). The loss is the model's own (cross-entropy over the labelled
    tokens, their mean over the batch), with ``label_smoothing``; a batch may carry ``num_targets`` and ``num_rows``
    (ints of the whole batch, as :class:`CausalLM`'s) to make it the mean over the whole batch's targets under every
    schedule. ``predict`` generates through the pipeline, greedily or with beam search, each stage keeping its
    decoder blocks' caches (:meth:`generate`).

    Args:
        *args: see :class:`HFModule`.
        label_smoothing: the label smoothing of the cross-entropy (``torch.nn.functional.cross_entropy``'s), in
            [0, 1). Default 0.0: the model's own loss.
        max_new_tokens: tokens ``predict_step`` generates at most. Default 32.
        num_beams: the beams of ``predict_step`` (1: greedy); ``None`` (default): the generation config's.
        **kwargs: see :class:`HFModule`.

    Raises:
        ValueError: for ``label_smoothing`` outside [0, 1).
    """

    auto_class = AutoModelForSeq2SeqLM
    trains_seq2seq = True

    def __init__(
        self,
        *args: Any,
        label_smoothing: float = 0.0,
        max_new_tokens: int = 32,
        num_beams: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing}: give a value in [0, 1).")
        super().__init__(*args, **kwargs)
        self.label_smoothing, self.max_new_tokens, self.num_beams = label_smoothing, max_new_tokens, num_beams

    def backbone_input(self, batch: dict[str, Any]) -> tuple[Tensor, ...]:
        """``(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)``
        (:func:`~lightning_gpipe.hf.seq2seq.seq2seq_input`)."""
        return seq2seq_input(
            self.hf_model,
            batch["input_ids"],
            batch.get("attention_mask"),
            batch.get("decoder_input_ids"),
            batch.get("decoder_attention_mask"),
            batch.get("labels"),
            self.training,
        )

    def loss(self, logits: Tensor, batch: dict[str, Any]) -> Tensor:
        """Cross-entropy of the logits with ``batch["labels"]`` (:func:`~lightning_gpipe.hf.seq2seq.seq2seq_loss`);
        with ``num_targets`` and ``num_rows``, weighted as :meth:`CausalLM.loss` weighs it."""
        labels = batch["labels"]
        loss = seq2seq_loss(logits, labels, self.label_smoothing, batch.get("num_targets"))
        if "num_rows" in batch:
            loss = loss * (batch["num_rows"] / labels.shape[0])
        return loss

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Outputs for the batch's sources (``input_ids``, ``attention_mask``): ``(N, 1 + T)`` decoder ids, at most
        :attr:`max_new_tokens` new ones, with :attr:`num_beams` (see :meth:`generate`)."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        return self.generate(ids, mask, self.max_new_tokens, num_beams=self.num_beams)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 20,
        num_beams: int | None = None,
        length_penalty: float | None = None,
        early_stopping: bool | str | None = None,
        kv_cache: bool = True,
    ) -> Tensor:
        """Decoding through the pipeline with the model's generation config (its decoder start, forced first and
        last tokens, end and padding ids, and what is not given here: ``num_beams``, ``length_penalty``,
        ``early_stopping``, resolved as :func:`~lightning_gpipe.hf.seq2seq_generate.generation_setting` says); call
        it on every stage. Greedy with one beam (:func:`~lightning_gpipe.hf.seq2seq_generate.seq2seq_greedy_generate`,
        with the decoder blocks' caches unless ``kv_cache=False``), else beam search
        (:func:`~lightning_gpipe.hf.seq2seq_generate.seq2seq_beam_search`, always with the caches).

        Returns:
            ``(N, 1 + T)`` long decoder ids, as ``model.generate`` with the same settings.

        Raises:
            ValueError: if the generation config names no decoder start token (nor a ``bos_token_id``), or from
                :func:`~lightning_gpipe.hf.seq2seq_generate.seq2seq_beam_search`.
        """
        generation = self.hf_model.generation_config
        start = generation.decoder_start_token_id
        start = generation.bos_token_id if start is None else start
        if start is None:
            raise ValueError("The model's generation config has no decoder_start_token_id (nor bos_token_id).")
        num_beams = generation_setting(generation, "num_beams", num_beams)
        ids = (self.backbone, input_ids, attention_mask, start)
        ends = (generation.eos_token_id, generation.pad_token_id)
        forced = (generation.forced_bos_token_id, generation.forced_eos_token_id)
        if num_beams == 1:
            return seq2seq_greedy_generate(*ids, max_new_tokens, *ends, *forced, kv_cache=kv_cache)
        return seq2seq_beam_search(
            *ids,
            num_beams,
            max_new_tokens,
            *ends,
            *forced,
            generation_setting(generation, "length_penalty", length_penalty),
            generation_setting(generation, "early_stopping", early_stopping),
        )


class MaskedLM(HFModule):
    """Masked language-model fine-tuning of a BERT-style encoder (BERT, RoBERTa, XLM-RoBERTa...). Batches:
    ``input_ids``, ``attention_mask``, optional ``token_type_ids``, and ``labels`` (the original ids at masked
    positions, ``-100`` elsewhere; masking is the data's job, e.g. ``transformers.DataCollatorForLanguageModeling``).
    Arguments: see :class:`HFModule`."""

    auto_class = AutoModelForMaskedLM
    trains_encoder = True

    def backbone_input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``."""
        return encoder_input(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))

    def loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Cross-entropy over the masked positions."""
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))


class SequenceClassifier(HFModule):
    """Sequence classification with a BERT-style encoder (BERT's pooled first token, RoBERTa's head on it). Batches:
    ``input_ids``, ``attention_mask``, optional ``token_type_ids``, and ``labels`` ``(N,)`` long class ids. Logs
    ``val_acc`` besides the loss. Arguments: see :class:`HFModule` (``config={"num_labels": C}`` sets the classes of a
    checkpoint's head)."""

    auto_class = AutoModelForSequenceClassification
    trains_encoder = True

    def backbone_input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``."""
        return encoder_input(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))

    def loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Cross-entropy of the class logits."""
        return nn.functional.cross_entropy(logits.float(), batch["labels"])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Log ``val_loss`` and ``val_acc``."""
        logits = self.backbone(self.backbone_input(batch))
        n = batch["input_ids"].shape[0]
        self.log("val_loss", self.loss(logits, batch), prog_bar=True, batch_size=n)
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean(), prog_bar=True, batch_size=n)


@torch.no_grad()
@decoding()  # generate's positions, with or without caches
def greedy_generate(
    backbone: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    max_new_tokens: int = 20,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    kv_cache: bool = True,
) -> Tensor:
    """Greedy decoding of a causal LM backbone, through the pipeline (every stage calls it alike).

    Each step is one backbone call through :func:`lightning_gpipe.forward_and_share`: the last stage picks each
    row's most likely next token and every stage receives the ids, so all stages go round the loop together.
    With ``kv_cache`` (default) the first step runs the whole prompts and every later step only the new token of
    each row: each decoder block keeps the keys and values (a recurrent layer's states: Mamba...) of its rows in its
    own ``transformers.DynamicCache`` (:class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`), so between stages
    only the new token's hidden state ``(n, 1, H)``, the ``(n, S + t)`` padding mask, its position and the rows
    travel. Without it every step runs the whole sequence so far. Without a pipeline it runs on one device.

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


def _next_tokens(output: Tensor | tuple[Tensor, Tensor]) -> Tensor:
    """Each row's most likely next token of ``(N, S, V)`` logits (or ``(logits, router statistics)``), ``(N,)`` long
    on the CPU."""
    logits = output[0] if isinstance(output, tuple) else output
    return logits[:, -1].float().argmax(-1).cpu()


class SavePretrained(pl.Callback):
    """Write the model as a ``from_pretrained`` directory at the end of training (every stage writes its shard).

    Args:
        dirpath: the directory.
        tokenizer: a tokenizer to save with it (anything with ``save_pretrained``), or ``None``.
    """

    def __init__(self, dirpath: str | os.PathLike, tokenizer: Any = None) -> None:
        self.dirpath, self.tokenizer = Path(dirpath), tokenizer

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Call ``pl_module.save_pretrained(dirpath)`` on every process; global rank 0 saves the tokenizer (the
        one given, else the data module's ``tokenizer`` attribute if it has one)."""
        cast(HFModule, pl_module).save_pretrained(self.dirpath)  # an HFModule, or a module with its save_pretrained
        # trainer.datamodule: set by Lightning, not declared on Trainer
        tokenizer = self.tokenizer or getattr(trainer.datamodule, "tokenizer", None)  # type: ignore[attr-defined]
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained") and trainer.global_rank == 0:
            tokenizer.save_pretrained(self.dirpath)
