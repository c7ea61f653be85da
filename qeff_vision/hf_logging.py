"""Quiet transformers: our stages print their own progress (torch-free until called)."""

from __future__ import annotations


def quiet_transformers() -> None:
    """Silence transformers' progress bars and info logs (our stages print their own progress)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
