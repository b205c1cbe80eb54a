"""The `join` hint of a deployment (GET /api/deployments/<id>/) is a worker command that follows
the studio's rules: the worker's own argument parser reads it as one that takes the deployment's
keys, binds the joining machine's address rather than every interface, and refuses
`module:function` ops unless the studio allows them."""

from __future__ import annotations

import argparse
import shlex
import uuid

import pytest

from engine.worker.options import add_worker_arguments
from studio.workflows.api.deployments import DeploymentDetailSerializer
from studio.workflows.models import Deployment
from tests.studio.limits import configured

PLACEHOLDERS = {"<the workflow file>": "workflows/chat.py", "<ROLE>": "llm", "<REDIS_URL>": "redis://r:6379/0",
                "<DIR>": "/home/me/keys", "<this machine's private address>": "10.1.2.3"}


def parsed(command: str) -> argparse.Namespace:
    """`command` as `omniflow worker` reads it, its placeholders filled in."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    argv = shlex.split(command)
    assert argv[:2] == ["omniflow", "worker"], command
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(argv[2:])


def hints(deployment: Deployment) -> tuple[str, str]:
    body = DeploymentDetailSerializer()
    return body.get_join(deployment), body.get_join_keys(deployment)


@pytest.mark.parametrize("allowed", [False, True])
def test_the_join_command_takes_the_keys_binds_no_wildcard_and_follows_the_op_rule(allowed: bool) -> None:
    deployment = Deployment(id=uuid.uuid4(), namespace="omniflow-dep-1234")
    with configured(allow_module_ops=allowed):
        join, keys = hints(deployment)
    args = parsed(join)
    assert args.module_ops is allowed  # --no-module-ops unless the studio allows module ops
    assert args.keys == "/home/me/keys" and not args.plaintext  # without --keys the worker does not start
    assert args.listen == "tcp://10.1.2.3:0" and "0.0.0.0" not in join
    assert (args.namespace, args.registry) == ("omniflow-dep-1234", "redis://r:6379/0")
    assert keys == f"python manage.py deployment_keys {deployment.pk} <DIR>"  # where --keys DIR comes from
