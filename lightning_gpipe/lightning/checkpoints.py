"""GPipeStrategy's checkpoint hooks: every stage's weights and optimizer state under the original names.

A checkpoint is the unsplit module's (:mod:`~lightning_gpipe.lightning.state_dict`): ``state_dict_type="full"``
gathers every stage's part on global rank 0, which writes one file Lightning's ``TorchCheckpointIO`` reads without
the strategy; ``"sharded"`` writes one directory with torch.distributed.checkpoint, each stage its part. Either
loads into any split (another number of stages or of virtual stages).
"""

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_gpipe.lightning import state_dict
from lightning_gpipe.lightning._lightning import optimizers_to_device, torch_optimizer
from lightning_gpipe.lightning.data_parallel import placed_like, placed_optimizer_states, whole_tensors

if TYPE_CHECKING:  # the class it comes ahead of, whose attributes the hooks use and whose methods they override
    from lightning_gpipe.lightning.mesh import MeshStrategy as _Strategy
else:
    _Strategy = object


class CheckpointHooks(_Strategy):
    """The checkpoint hooks of :class:`~lightning_gpipe.lightning.strategy.GPipeStrategy` (a base class ahead of
    :class:`~lightning_gpipe.lightning.mesh.MeshStrategy`, whose attributes they use: ``config``, the job, the
    pipeline's group, the module and its optimizers)."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are restored after the split, so each stage loads the entries of its own layers."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state for a checkpoint under the original names (see
        :mod:`lightning_gpipe.lightning.state_dict`): ``"full"``, the whole model's on global rank 0 and ``{}``
        elsewhere (a collective call); ``"sharded"``,
        this stage's part."""
        module = self.lightning_module
        assert module is not None  # a checkpoint is taken of an attached module
        return self._whole_or_local(module.state_dict())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, whole or this stage's, like the model's state dict."""
        module = self.lightning_module
        assert module is not None  # a checkpoint is taken of an attached module
        local = state_dict.optimizer_state(module, torch_optimizer(optimizer))
        return self._whole_or_local(local)

    def _whole_or_local(self, local: dict[str, Any]) -> dict[str, Any]:
        if self.config.state_dict_type == "sharded":
            return local
        whole = whole_tensors(local)  # a stage's shards over its replicas or tensor ranks, gathered whole
        return state_dict.whole_on_rank_zero(whole, self.pipeline_index, self.pipeline_group, self._job) or {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint: one file from global rank 0 (``"full"``), or a directory from all stages (``"sharded"``);
        either replaces an existing one only once complete. Waiting for the writers does not count as a stall."""
        with self._job.position.unbounded_phase("writing a checkpoint"):
            if self.config.state_dict_type == "sharded":
                state_dict.save_directory(checkpoint, filepath, self.global_rank, self._job)
            else:
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a full checkpoint file on every stage, or this stage's part of a checkpoint directory (the
        other stages' model entries as meta tensors, see :func:`~lightning_gpipe.lightning.state_dict.load_directory`).

        Raises:
            FileNotFoundError: for a directory that is not a sharded checkpoint (it has no ``meta.pt``).
            DamagedCheckpointError: for a damaged or truncated checkpoint file, naming it (see
                :func:`~lightning_gpipe.lightning.state_dict.reading`).
        """
        with self._job.position.unbounded_phase("reading a checkpoint"):
            if not Path(checkpoint_path).is_dir():
                with state_dict.reading(checkpoint_path):
                    return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            module = self.lightning_module
            assert module is not None  # restored after setup (restore_checkpoint_after_setup): attached
            fitting = module.trainer.state.fn == TrainerFn.FITTING
            template = state_dict.stage_template(module, self.optimizers, fitting)
            return state_dict.load_directory(checkpoint_path, template, self._job)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Check the checkpoint's model state against the whole model, every stage's entries, on every stage alike
        (see :func:`~lightning_gpipe.lightning.state_dict.check_model_state`), then load this stage's entries.

        Raises:
            RuntimeError: as ``torch.nn.Module.load_state_dict`` does without a pipeline: with ``strict``
                (``LightningModule.strict_loading``), for the keys of the model the checkpoint lacks and those of no
                stage it holds; for an entry of another shape, naming both.
        """
        module = self.lightning_module
        assert module is not None  # restored after setup (restore_checkpoint_after_setup): attached
        with self._job.position.unbounded_phase("reading a checkpoint"):  # the others may still be reading it
            shapes = state_dict.whole_model_shapes(module, self._job)
        state_dict.check_model_state(checkpoint["state_dict"], shapes, strict, type(module).__name__)
        local = state_dict.local_entries(checkpoint["state_dict"], module)
        module.load_state_dict(placed_like(local, module.state_dict()), strict=strict)  # whole tensors into shards

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this stage's entries of every optimizer's name-keyed state, whatever the split it was saved with
        (see :func:`~lightning_gpipe.lightning.state_dict.load_optimizer_states`)."""
        module = self.lightning_module
        assert module is not None  # restored after setup (restore_checkpoint_after_setup): attached
        states = placed_optimizer_states(module, self.optimizers, checkpoint["optimizer_states"])
        state_dict.load_optimizer_states(module, self.optimizers, states)
        optimizers_to_device(self.optimizers, self.root_device)
