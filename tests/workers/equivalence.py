"""Distributed worker: pipelined training of TupleNet for the configurations tests/equivalence_grid.py gives K
stages (on 2 stages every (chunks, checkpoint)), every other fill-drain one with deferred weight gradients
(``defer_weight_grad=True``).

Usage: python equivalence.py OUT_DIR  (run with Lightning's launcher: K = --devices)
Writes OUT_DIR/M{chunks}_{checkpoint}.pt (rank 0's module after fit: the full state dict),
OUT_DIR/threads_rank{r}.txt (torch threads of each stage process) and OUT_DIR/predictions_rank{r}.pt
(what `trainer.predict` returns on each rank with the last trained module), and OUT_DIR/1f1b_{checkpoint}.pt
(``schedule="1f1b"`` on batches of 25, 25 and 2 rows, 4 micro-batches: M >= K, uneven (7, 6, 6, 6), then
M = 2 < K for K > 2), OUT_DIR/zb-h1_{always,never}.pt and OUT_DIR/zb-1p_except_last.pt (the zero-bubble
schedules on the same batches; ``"zb-1p"`` places W by the profiled costs), and OUT_DIR/v2_{schedule}_{checkpoint}.pt
(``virtual_stages=2``: the looped fill-drain as the M{chunks} runs, 3 micro-batches; interleaved 1F1B, ZB-H1 and
ZB-1p, and ZB-V's two chunks in a V, as the 1f1b runs), with and without re-materialization; with K = 2 or 4 also
OUT_DIR/v_{schedule}.pt (the V schedules V-Min, V-Half and V-ZB, 8 micro-batches of batches of 26 rows, 6 AdamW
steps: the state and every step's loss); with K = 2 also OUT_DIR/csv_torch_izb.pt (``schedule=`` the CSV torch writes of
its ScheduleInterleavedZeroBubble at M = 4, on the 1f1b runs' batches).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from equivalence_grid import V_SCHEDULES, fill_drain, interleaved, per_microbatch  # noqa: E402
from models import LossRecorder, fit, loader, trainer_kwargs  # noqa: E402
from rowwise import fit_batches  # noqa: E402
from sharded import AdamWNet  # noqa: E402

import lightning_gpipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()

for i, (chunks, checkpoint) in enumerate(fill_drain(args.devices)):
    # every other configuration defers weight gradients, so both drains meet every checkpoint mode
    strategy = lightning_gpipe.GPipeStrategy(chunks=chunks, checkpoint=checkpoint, defer_weight_grad=i % 2 == 1)
    module = fit(strategy=strategy, devices=args.devices)
    if strategy.global_rank == 0:
        torch.save(module.state_dict(), os.path.join(args.out, f"M{chunks}_{checkpoint}.pt"))
rank = strategy.global_rank
with open(os.path.join(args.out, f"threads_rank{rank}.txt"), "w") as f:
    f.write(str(torch.get_num_threads()))
trainer = L.Trainer(strategy=lightning_gpipe.GPipeStrategy(chunks=3), devices=args.devices, **trainer_kwargs())
torch.save(trainer.predict(module, loader()), os.path.join(args.out, f"predictions_rank{rank}.pt"))
for schedule, checkpoint in per_microbatch(args.devices):
    strategy = lightning_gpipe.GPipeStrategy(chunks=4, checkpoint=checkpoint, schedule=schedule)
    state = fit_batches(strategy, args.devices, batch_size=25).lightning_module.state_dict()
    if rank == 0:
        torch.save(state, os.path.join(args.out, f"{schedule}_{checkpoint}.pt"))
for schedule, checkpoint in interleaved(args.devices):
    defer = True if checkpoint == "never" else None  # the B/W split; None: the schedule's default (on for zb-h1)
    options = dict(checkpoint=checkpoint, schedule=schedule, virtual_stages=2, defer_weight_grad=defer)
    if schedule == "gpipe":
        state = fit(strategy=lightning_gpipe.GPipeStrategy(chunks=3, **options), devices=args.devices).state_dict()
    else:
        strategy = lightning_gpipe.GPipeStrategy(chunks=4, **options)
        state = fit_batches(strategy, args.devices, batch_size=25).lightning_module.state_dict()
    if rank == 0:
        torch.save(state, os.path.join(args.out, f"v2_{schedule}_{checkpoint}.pt"))
for schedule, checkpoint in V_SCHEDULES.items() if args.devices in (2, 4) else ():
    recorder = LossRecorder()
    strategy = lightning_gpipe.GPipeStrategy(chunks=8, checkpoint=checkpoint, schedule=schedule)
    trainer = fit_batches(strategy, args.devices, batch_size=26, module=AdamWNet, callbacks=[recorder])
    if rank == 0:
        result = {"state": trainer.lightning_module.state_dict(), "losses": recorder.losses}
        torch.save(result, os.path.join(args.out, f"v_{schedule}.pt"))
if args.devices == 2:  # a schedule torch wrote: ScheduleInterleavedZeroBubble's CSV (I/W split, two stages per rank)
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble
    from torch_schedules import torch_csv, torch_schedule

    path = os.path.join(args.out, f"torch_izb_rank{rank}.csv")  # each process reads its own copy as it starts
    with open(path, "w") as f:
        f.write(torch_csv(torch_schedule(ScheduleInterleavedZeroBubble, 2, 4)))
    strategy = lightning_gpipe.GPipeStrategy(schedule=path)
    state = fit_batches(strategy, args.devices, batch_size=25).lightning_module.state_dict()
    if rank == 0:
        torch.save(state, os.path.join(args.out, "csv_torch_izb.pt"))
