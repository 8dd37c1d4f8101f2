"""Entry points for spawned worker processes (they must be importable by reference)."""

from __future__ import annotations

import os
import sys

import torch


def run_model(rank: int, model, queue) -> None:
    """Run the received model on ones and report the output and whether hooks were there."""
    queue.put((rank, model(torch.ones(1, 4)).tolist(), len(model[0]._forward_hooks)))


def run_rank(rank: int, fn, *args) -> None:
    """Run ``fn(rank, *args)`` in a spawned rank, then leave without finalising the interpreter.

    On torch 2.13 one of two gloo ranks aborts at exit in about one run in four ("terminate called without an
    active exception", SIGABRT), with or without picklehooks: a gloo worker thread still holds a
    finished collective's work object, whose tensors' Python objects it releases only after the
    interpreter has begun to finalise; taking the GIL then ends the thread inside a C++ destructor
    (core dump: ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``;
    pytorch/pytorch#179291). ``destroy_process_group`` does not join those threads. So a rank that
    finished (its results written and closed) ends with ``os._exit(0)``; one that raised still
    raises, and ``mp.spawn`` reports its traceback.
    """
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
