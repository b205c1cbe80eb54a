"""OpenMP's wait policy for the engine's processes (`engine.compute.threads`)."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.compute.threads import thread_environment, wait_passively

PROBE = ("from engine.compute.threads import wait_passively; import os; took = wait_passively(); import torch; "
         "print(took, os.environ['OMP_WAIT_POLICY'])")


def test_a_started_process_waits_passively_unless_its_environment_names_a_policy():
    assert thread_environment({"PATH": "/bin"}) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}


def _probe(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    return done.stdout.strip()


def test_the_command_line_process_sets_the_policy_before_torch_loads_and_keeps_an_operators():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _probe(env) == "True PASSIVE"
    assert _probe({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "True ACTIVE"


def test_once_torch_is_loaded_the_environment_is_left_alone(monkeypatch):
    import torch  # noqa: F401  (loaded, as in any test process)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert wait_passively() is False
    assert "OMP_WAIT_POLICY" not in os.environ


CLI_PROBE = ("import os, sys; from engine.cli import main\n"
             "try:\n    main([sys.argv[1], '--help'])\nexcept SystemExit:\n    pass\n"
             "print(os.environ.get('OMP_WAIT_POLICY', 'unset'))")


def test_only_a_role_worker_started_from_the_command_line_waits_passively():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def policy(command: str) -> str:
        done = subprocess.run([sys.executable, "-c", CLI_PROBE, command], env=env, capture_output=True, text=True,
                              timeout=120, check=True)
        return done.stdout.strip().splitlines()[-1]

    assert policy("worker") == "PASSIVE"  # shares its host's cores with the other workers
    assert policy("bench") == "unset"  # a process with the machine to itself keeps OpenMP's default
