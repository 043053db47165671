"""torch.distributed.pipelining's schedules in one process, without a process group or a stage that runs: the order
torch plans for every rank, as its CSV (``_dump_csv``), and torch's own reader of a CSV (``_load_csv``), for the tests
of :mod:`lightning_gpipe.engine.schedule_csv`. Torch builds ``pipeline_order`` from the stages' indices, counts and
``n_microbatches`` alone, so stand-in stages (their index, the pipeline's stage count and size) are enough."""

import csv
import io
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import schedules


def _stages(num_stages: int, virtual_stages: int, v_shape: bool) -> list[SimpleNamespace]:
    """Rank 0's stand-in stages: virtual stages 0, K, ... (looped) or 0 and 2K - 1 (a V)."""
    total = num_stages * virtual_stages
    indices = [0, total - 1] if v_shape else list(range(0, total, num_stages))
    return [
        SimpleNamespace(
            stage_index=s,
            num_stages=total,
            group_rank=0,
            group_size=num_stages,
            is_first=s == 0,
            is_last=s == total - 1,
            submod=torch.nn.Identity(),
            has_backward=True,
        )
        for s in indices
    ]


def torch_schedule(cls: type, num_stages: int, micro_batches: int, virtual_stages: int = 2, v_shape: bool = False):
    """Torch's schedule ``cls`` (e.g. ``schedules.ScheduleInterleaved1F1B``) for K = ``num_stages`` ranks, as rank 0
    builds it: its ``pipeline_order`` (compute only) and ``pipeline_order_with_comms`` hold every rank's."""
    stages = _stages(num_stages, virtual_stages, v_shape)
    return cls(stages, micro_batches, loss_fn=lambda output, target: output.sum())


def torch_csv(schedule, comms: bool = False) -> str:
    """What torch's ``_dump_csv`` writes of ``schedule``: its compute-only order, or with ``comms`` its order with the
    transfers torch adds (the "compute_comms" format)."""
    order = schedule.pipeline_order_with_comms if comms else schedule.pipeline_order
    output = io.StringIO()
    writer = csv.writer(output)
    for rank in order:
        writer.writerow(order[rank])
    return output.getvalue()


def torch_reads(path: Path, num_stages: int, micro_batches: int, virtual_stages: int, v_shape: bool) -> dict:
    """Load the CSV at ``path`` with torch's ``_PipelineScheduleRuntime._load_csv`` ("compute_only", torchtitan's
    ``pipeline_parallel_schedule_csv``): it validates the schedule and lowers it to one with transfers, raising if it
    cannot; returns every rank's lowered order."""
    runtime = torch_schedule(schedules._PipelineScheduleRuntime, num_stages, micro_batches, virtual_stages, v_shape)
    runtime._load_csv(str(path))
    return runtime.pipeline_order_with_comms
