"""How the engine's processes wait between torch's parallel regions: passively, unless told otherwise.

torch's CPU kernels run on an OpenMP team. Left to its default, an idle team thread spins at the end
of each parallel region, waiting for the next one. A decode step of a small model runs a few hundred
short regions, and on a machine whose cores are shared (several worker processes, other programs) a
spinning thread holds the core its team mates, or the other process's, need to finish the region.
Measured on this code's 2-core machine under a load of about 5, a SmolLM2-135M batch-1 float32 decode
step took 158-617 ms on average with spinning threads and 25-64 ms with passive ones
(`OMP_WAIT_POLICY=PASSIVE`: an idle thread sleeps at once).

The policy is for processes that share their host's cores with siblings: role workers (the
launcher's, and `omniflow worker` as a node agent starts it) and TP followers. A process that has
the machine to itself does better with OpenMP's default (spin a while, then sleep): on the same
machine idle, `omniflow bench decode --model smollm2-135m` gave float32 batch-1 66.8 tok/s and
batch-16 539 with the default against 39.0 and 381 passive. So the command line's own process (a
bench, `omniflow generate`, an in-process `run`) keeps the default.

OpenMP reads the policy once, when its runtime loads (with torch), so the setting goes into the
environment of a process before it imports torch: `thread_environment` for the processes the engine
starts, `wait_passively` for `omniflow worker`. A policy already in the environment (an operator's
choice) is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

__all__ = ["DEFAULT_WAIT_POLICY", "WAIT_POLICY_ENV", "thread_environment", "wait_passively"]

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"


def thread_environment(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` for a process the engine starts: `OMP_WAIT_POLICY=PASSIVE` unless `env`
    names a policy already."""
    return {WAIT_POLICY_ENV: DEFAULT_WAIT_POLICY, **env}


def wait_passively() -> bool:
    """Set `OMP_WAIT_POLICY=PASSIVE` in this process's environment unless it names a policy already.

    Returns whether the policy can still take effect: False once torch is imported (its OpenMP
    runtime has read the environment), as in a test that calls the command line's `main`; the
    environment is then left as it is."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)
    return True
