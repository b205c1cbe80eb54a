"""Process titles of role workers and the fork server (`ps` shows role, id and address).

setproctitle grows a title over the environ block unless SPT_NOENV is set before its first
call; /proc/PID/environ (where operators and the GPU checks read a worker's
CUDA_VISIBLE_DEVICES) would then read as the title. With SPT_NOENV a title is at most as long
as the command line, which is the better trade."""

from __future__ import annotations

import os

import setproctitle


def set_title(title: str) -> None:
    os.environ.setdefault("SPT_NOENV", "1")  # before setproctitle's first call; children inherit it
    setproctitle.setproctitle(title)
