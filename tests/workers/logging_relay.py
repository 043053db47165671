"""Distributed worker: LoggedNet on 2 stages with a CSV logger, ModelCheckpoint and EarlyStopping.

Usage: python logging_relay.py OUT_DIR
Writes OUT_DIR/callback_rank{r}.json (each rank's callback_metrics and best checkpoint score).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from models import logged_fit  # noqa: E402

import lightning_gpipe  # noqa: E402, F401

out = sys.argv[1]
trainer = logged_fit(out, strategy="gpipe", devices=2)
metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
best = trainer.checkpoint_callback.best_model_score
with open(os.path.join(out, f"callback_rank{trainer.global_rank}.json"), "w") as f:
    json.dump({"callback_metrics": metrics, "best_score": float(best), "stopped": trainer.should_stop}, f)
