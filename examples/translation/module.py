"""LightningModule training the multilingual Transformer: label-smoothed loss, inverse-sqrt schedule, beam search.

Written for the GPipe strategy (Huang et al. 2019, arXiv:1811.06965): the
whole encoder-decoder is the single ``nn.Sequential`` attribute ``backbone``
(see ``model.py``). Code before the backbone call only picks tensors out of
the batch; the loss and metrics only read the logits. Decoding (``decoding.py``:
beam search or greedy, with the decoder's key/value cache) calls the backbone
once per generated token through ``lightning_gpipe.forward_and_share``, which
runs the pipelined forward and hands the chosen tokens to every stage, so all
stages loop in lockstep.
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

from translation.decoding import beam_search, greedy
from translation.model import transformer
from translation.scoring import Translator
from translation.vocabulary import load_tokenizer


def inverse_sqrt(warmup_steps: int):
    """Learning-rate factor of step s: linear warmup to 1 at ``warmup_steps``, then ``sqrt(warmup_steps / s)``.

    The schedule of Vaswani et al. 2017, section 5.3, normalised to peak at 1.

    Args:
        warmup_steps: steps of linear warmup (at least 1).
    """

    def factor(step: int) -> float:
        step = step + 1
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))

    return factor


def cooldown(factor, cooldown_steps: int, last_step: Callable[[], int]):
    """``factor`` of step s times a linear decay to 0 over the ``cooldown_steps`` steps that end at ``last_step()``.

    The cool-down of a warmup-stable-decay schedule (Hägele et al. 2024, "Scaling Laws and Compute-Optimal
    Training Beyond Fixed Training Durations", section 3): the learning rate follows ``factor`` until
    ``last_step - cooldown_steps``, then falls linearly to 0 at ``last_step``.

    Args:
        factor: the schedule before the cool-down, a function of the step (from 0).
        cooldown_steps: steps of the decay (at least 1).
        last_step: the step count at which the learning rate reaches 0, asked at every step (the module's is
            ``Trainer(max_steps)``, which :class:`~time_budget.TimeBudget` may move during the run).
    """

    def cooled(step: int) -> float:
        return factor(step) * min(1.0, max(last_step() - step, 0) / cooldown_steps)

    return cooled


DECODING = ("decode", "max_new_tokens", "beam_size", "length_penalty", "kv_cache")
"""The arguments of :class:`TranslationModule` that choose how it decodes: attributes of the module of the same
names, left out of its saved hyperparameters (a checkpoint does not fix them)."""


class TranslationModule(Translator):
    """One encoder-decoder Transformer for every translation direction, selected by a ``<2xx>`` source token.

    Args:
        tokenizer_file: the shared vocabulary (``tokenizer.json``). Default: the shipped one.
        d_model: model width. Default 256.
        nhead: attention heads. Default 4.
        num_encoder_layers: encoder layers. Default 3.
        num_decoder_layers: decoder layers. Default 3.
        dim_feedforward: feed-forward hidden width. Default 1024.
        dropout: dropout probability. Default 0.1.
        label_smoothing: label smoothing of the training loss (Szegedy et al. 2016). Default 0.1.
        lr: peak learning rate of AdamW. Default 1e-3.
        warmup_steps: linear warmup steps, then inverse square root decay. Default 500.
        cooldown_steps: the last steps before ``Trainer(max_steps)``, over which the learning rate also falls
            linearly to 0 (see :func:`cooldown`); 0 (default) keeps the inverse square root decay to the end.
        betas: AdamW betas. Default (0.9, 0.98).
        weight_decay: AdamW (decoupled) weight decay. Default 0.
        decode: translate the validation batches and log SacreBLEU per direction. Default True.
        max_new_tokens: decoding stops after ``S + max_new_tokens`` tokens for sources of S tokens. Default 16.
        tie_embeddings: one table for source and target embeddings and the output projection (Press & Wolf
            2017; see ``model.transformer``). Default False.
        beam_size: hypotheses beam search keeps per sentence in validation and ``predict``; 1 decodes greedily.
            Default 4 (Vaswani et al. 2017).
        length_penalty: exponent alpha of beam search's length normalisation ``((5 + length) / 6) ** alpha``
            (Wu et al. 2016, GNMT); 0 ranks by log-probability alone. Default 0.6 (Vaswani et al. 2017).
        kv_cache: decode with the decoder layers' key/value cache, one new token per step (``True``), or re-run
            the encoder and decoder on the whole prefix every step (``False``, the same tokens, slower).
            Default True.

    Raises:
        ValueError: when ``d_model`` is odd or not divisible by ``nhead`` (see ``model.transformer``), or
            ``beam_size < 1`` or ``cooldown_steps < 0``; from ``configure_optimizers``, when ``cooldown_steps`` is
            set without ``Trainer(max_steps)`` or exceeds it.

    The decoding arguments (:data:`DECODING`) are attributes of the same names, not saved hyperparameters.
    Training batches are those of ``TranslationDataModule``; ``predict`` batches need only ``src``.
    Logged: ``train_loss`` (label-smoothed, per target token), ``val_loss`` (cross-entropy per target
    token), ``val_ppl``, ``val_bleu_<src>_<tgt>`` (SacreBLEU, 0-100, 13a tokenization), ``lr``.
    """

    def __init__(
        self,
        tokenizer_file: str | None = None,
        d_model: int = 256,
        nhead: int = 4,
        num_encoder_layers: int = 3,
        num_decoder_layers: int = 3,
        dim_feedforward: int = 1024,
        dropout: float = 0.1,
        label_smoothing: float = 0.1,
        lr: float = 1e-3,
        warmup_steps: int = 500,
        cooldown_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.98),
        weight_decay: float = 0.0,
        decode: bool = True,
        max_new_tokens: int = 16,
        tie_embeddings: bool = False,
        beam_size: int = 4,
        length_penalty: float = 0.6,
        kv_cache: bool = True,
    ) -> None:
        super().__init__()
        if beam_size < 1:
            raise ValueError(f"beam_size={beam_size} must be at least 1 (1 decodes greedily)")
        if cooldown_steps < 0:
            raise ValueError(f"cooldown_steps={cooldown_steps} must be 0 (no cool-down) or positive")
        # Decoding settings are chosen when evaluating, so they are attributes, not saved hyperparameters: with
        # `train.py validate/predict --ckpt_path`, LightningCLI (2.6) would apply a checkpoint's hyperparameters
        # over the command line's (Lightning-AI/pytorch-lightning#21455).
        self.save_hyperparameters(ignore=list(DECODING))
        self.decode, self.max_new_tokens, self.kv_cache = decode, max_new_tokens, kv_cache
        self.beam_size, self.length_penalty = beam_size, length_penalty
        self.tokenizer = load_tokenizer(tokenizer_file)
        self.pad_id = self.tokenizer.pad_token_id
        self.backbone = transformer(
            len(self.tokenizer),
            self.pad_id,
            d_model=d_model,
            nhead=nhead,
            num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            tie_embeddings=tie_embeddings,
        )
        self.add_metrics()

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Run the backbone on source and shifted target; log and return the label-smoothed loss per token."""
        loss = self.cross_entropy(self.target_logits(batch), batch["tgt_out"], self.hparams.label_smoothing)
        self.log("train_loss", loss, prog_bar=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def target_logits(self, batch: dict) -> Tensor:
        """The backbone's ``(N, T, vocab)`` logits of ``(batch["src"], batch["tgt_in"])``."""
        return self.backbone((batch["src"], batch["tgt_in"]))

    def translate_batch(self, batch: dict) -> list[str]:
        """:meth:`translate` ``batch["src"]`` (each row's target language is its first token)."""
        return self.translate(batch["src"])

    @torch.no_grad()
    def translate(self, src: Tensor, beam_size: int | None = None, kv_cache: bool | None = None) -> list[str]:
        """Translate a batch of sources by beam search (``beam_size > 1``) or greedily; one backbone call per step.

        Args:
            src: ``(N, S)`` long source ids, target-language token first, padded with the padding id.
            beam_size: overrides the module's ``beam_size`` (1: greedy).
            kv_cache: overrides the module's ``kv_cache``.

        Returns:
            N detokenized translations (special tokens dropped).
        """
        beam_size = self.beam_size if beam_size is None else beam_size
        cache = self.kv_cache if kv_cache is None else kv_cache
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        if beam_size == 1:
            ids = greedy(self.backbone, src, bos, eos, self.max_new_tokens, cache)
        else:
            ids = beam_search(self.backbone, src, bos, eos, self.max_new_tokens, beam_size, self.length_penalty, cache)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def configure_optimizers(self) -> dict:
        """AdamW over this stage's parameters with warmup then inverse-square-root decay (and the cool-down, if
        ``cooldown_steps``), stepped every step."""
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=hp.lr, betas=tuple(hp.betas), eps=1e-9, weight_decay=hp.weight_decay
        )
        factor = inverse_sqrt(hp.warmup_steps)
        if hp.cooldown_steps:
            max_steps = self.trainer.max_steps
            if not 0 < hp.cooldown_steps <= max_steps:
                raise ValueError(
                    f"cooldown_steps={hp.cooldown_steps} needs Trainer(max_steps) of at least as many steps (it is"
                    f" {max_steps}): the learning rate reaches 0 at max_steps; set --trainer.max_steps"
                )
            factor = cooldown(factor, hp.cooldown_steps, lambda: self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
