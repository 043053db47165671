"""Every private Lightning and torch API the package touches (docs/how-it-works.md, "Private Lightning and torch APIs
we touch") still exists with the shape the package uses: an upgrade that removes or renames one fails here, by name,
instead of somewhere inside a pipelined run."""

import inspect

import lightning as L
import torch
from torch import nn


def test_the_private_lightning_names_the_package_imports_exist():
    from lightning.fabric.utilities.distributed import (  # noqa: F401
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
    )
    from lightning.fabric.utilities.optimizer import _optimizers_to_device  # noqa: F401
    from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher  # noqa: F401
    from lightning.pytorch.utilities.data import _update_dataloader

    assert set(_collect_rng_states()) >= {"torch", "python"}
    _set_rng_states(_collect_rng_states())
    assert "_configure_launcher" in vars(ParallelStrategy) or hasattr(ParallelStrategy, "_configure_launcher")
    assert list(inspect.signature(_update_dataloader).parameters)[:2] == ["dataloader", "sampler"]


def test_the_trainer_attributes_the_package_reads_exist():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    connector = trainer._signal_connector
    assert connector.received_sigterm is False and isinstance(connector._original_handlers, dict)
    assert callable(connector._slurm_sigusr_handler_fn)
    assert isinstance(trainer._accelerator_connector.use_distributed_sampler, bool)
    assert isinstance(L.Trainer._evaluation_loop, property)  # the running validation or test loop
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        assert hasattr(loop, "max_batches")
    assert hasattr(trainer.fit_loop, "_data_source") and hasattr(trainer.fit_loop.epoch_loop, "batch_idx")
    assert "_results" in dir(trainer)


def test_the_private_torch_names_the_package_uses_exist():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert LightningOptimizer(optimizer)._optimizer is optimizer
    scaler = torch.amp.GradScaler("cpu")
    assert hasattr(scaler, "_per_optimizer_states") and hasattr(scaler, "_device")
    assert callable(torch.distributed.distributed_c10d._get_default_store)
    assert hasattr(torch._C._distributed_c10d.Reducer, "prepare_for_backward")
    assert "recurse" in inspect.signature(nn.Module._apply).parameters
    module = nn.Linear(2, 2)
    assert {"weight", "bias"} <= set(module._parameters) and isinstance(module._modules, dict)
    assert issubclass(nn.BatchNorm1d, nn.modules.batchnorm._BatchNorm)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # noqa: F401
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    assert "no_dist" in inspect.signature(_load_state_dict).parameters


def test_the_torch_compile_setting_the_package_changes_exists():
    """``compilation.compile_layer`` turns AOTAutograd's donated buffers off on stages that split their backwards."""
    assert isinstance(torch._functorch.config.donated_buffer, bool)


def test_the_step_relay_and_agreement_find_what_they_use_in_lightning():
    """The fields of a logged value the step relay rebuilds, the closure result the optimizer step's output fix-up
    replaces, and the per-step SIGTERM broadcast the agreement stands for."""
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultCollection

    from lightning_gpipe.lightning.relay import SCALAR_FIELDS, TENSOR_FIELDS

    results = _ResultCollection(training=True)
    results.batch_idx = 0
    results.log("training_step", "loss", torch.tensor(1.0), on_step=True, on_epoch=True, batch_size=4)
    (value,) = results.values()
    assert isinstance(value.meta, _Metadata) and value.is_tensor
    assert set(TENSOR_FIELDS) <= set(vars(value)) and set(SCALAR_FIELDS) <= set(vars(value))
    result = ClosureResult(torch.tensor(2.0), extra={"a": 1})
    assert {"loss", "extra"} <= set(vars(result)) and "_result" in vars(Closure(lambda: result))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert callable(trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor)
