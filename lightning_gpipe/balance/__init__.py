"""Choosing ``balance``: how many consecutive backbone layers each stage holds."""

from lightning_gpipe.balance.solver import solve

__all__ = ["solve"]
