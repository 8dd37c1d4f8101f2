"""Entry points for spawned worker processes (they must be importable by reference)."""

from __future__ import annotations

import torch


def run_model(rank: int, model, queue) -> None:
    """Run the received model on ones and report the output and whether hooks were there."""
    queue.put((rank, model(torch.ones(1, 4)).tolist(), len(model[0]._forward_hooks)))
