"""`python manage.py setup_demo`: the `demo` user, the example workflows, its login, and a chat model.

Creates the user (or resets its password), loads `workflows/*.py` for it and prints the
username, password and (with --token) a new API token. The password is random unless
given with --password; only its hash is stored, so each call that does not give one sets
and prints a new one.

Unless --no-chat, it also deploys the demo user's `chat` workflow (`workflows/chat.py`: the
real model `smollm2-135m`) as the OpenAI model `chat`, issues an API token for it (revoking the
one the previous call issued) and prints how to reach it. `make run` runs this before the
server starts, so the deployment is only recorded here, pending: in the embedded mode the
studio's web process starts the deployments it hosts as it starts (`resume_embedded`, on its
first request), and a chat request for a model still starting waits for it. A later call (a
restart of `make run`) keeps the deployment when it runs the workflow's latest version, and
replaces it when the workflow changed; either way the next server start deploys it again.
The printed OpenAI base URL is `--url`'s (default `make run`'s address, `http://127.0.0.1:8000`).
"""

from __future__ import annotations

import json
import secrets
from typing import Any
from urllib.parse import urlsplit

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from studio.accounts.models import ApiToken
from studio.config import Dispatch
from studio.workflows.apps import engine
from studio.workflows.deployments import records
from studio.workflows.deployments.service import create_deployment
from studio.workflows.models import ACTIVE_DEPLOYMENT_STATUSES, Deployment, DeploymentStatus, Workflow

CHAT_WORKFLOW = "chat"
CHAT_MODEL = "chat"
"""The deployment's name: what `model=` names in an OpenAI request."""
CHAT_TOKEN_NAME = "setup_demo chat"
DEFAULT_URL = "http://127.0.0.1:8000"
"""Where `make run` serves the studio."""


CHAT_SNIPPET_HEAD = "chat from Python (pip install openai), once the server is up; paste these lines into python:"


def chat_snippet(origin: str, secret: str) -> str:
    """Python that asks the model `chat` of the studio at `origin` with the token `secret` and
    prints its reply, as pasted (into `python` or a file): it imports what it uses, and no line is
    indented (an indented line pasted into the interpreter is an IndentationError)."""
    return "\n".join([
        "from openai import OpenAI",
        f"client = OpenAI(base_url={json.dumps(origin + '/v1')}, api_key={json.dumps(secret)})",
        f"reply = client.chat.completions.create(model={json.dumps(CHAT_MODEL)},"
        ' messages=[{"role": "user", "content": "Hello!"}])',
        "print(reply.choices[0].message.content)",
    ])


def studio_url(text: str) -> str:
    """`text` as the studio's origin (no trailing `/`): an http(s) URL with a host, else a CommandError."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CommandError(f"--url {text!r}: give the studio's address as http(s)://host[:port]")
    return text.strip().rstrip("/")


class Command(BaseCommand):
    help = ("Create (or reset) the demo user, load the example workflows for it, deploy its chat workflow as"
            " the model 'chat' and print its login and an API token.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default=None, help="default: a new random password")
        parser.add_argument("--admin", action="store_true", help="make the user staff and superuser")
        parser.add_argument("--token", action="store_true", help="also issue and print an API token")
        parser.add_argument("--no-examples", action="store_true")
        parser.add_argument("--no-chat", action="store_true",
                            help="do not deploy the chat workflow as the model 'chat' (nor issue its token)")
        parser.add_argument("--url", default=DEFAULT_URL,
                            help=f"the address the studio is served on, for the printed snippet (default {DEFAULT_URL})")

    def handle(self, *args, username: str, password: str | None, admin: bool, token: bool,
               no_examples: bool, no_chat: bool, url: str, **options) -> None:
        origin = studio_url(url)
        User = get_user_model()
        user, created = User.objects.get_or_create(**{User.USERNAME_FIELD: username})
        password = password or secrets.token_urlsafe(12)
        user.set_password(password)
        if admin:
            user.is_staff = user.is_superuser = True
        user.save()
        if not no_examples:
            call_command("load_examples", owner=username, stdout=self.stdout, stderr=self.stderr)
        self.stdout.write(f"{'created' if created else 'updated'} user {username!r}")
        self.stdout.write(f"login: {username} / {password}")
        if token:
            self.stdout.write(f"token: {ApiToken.objects.issue(user, 'demo').secret}")
        if not no_chat:
            self._chat(user, origin)

    def _chat(self, user: Any, origin: str) -> None:
        workflow = Workflow.objects.filter(owner=user, name=CHAT_WORKFLOW).first()
        version = workflow.versions.order_by("-number").first() if workflow is not None else None
        if version is None:
            self.stderr.write(f"no workflow {CHAT_WORKFLOW!r} for {user}: load the examples to chat (no --no-examples)")
            return
        with transaction.atomic():
            live = None
            for row in Deployment.objects.select_for_update().filter(owner=user, name=CHAT_MODEL,
                                                                     status__in=ACTIVE_DEPLOYMENT_STATUSES):
                if live is None and row.version_id == version.pk and row.status != DeploymentStatus.STOPPING:
                    live = row
                    continue
                # The workflow changed (a new example), or it was being stopped: it gives way. This runs
                # before the server starts (`make run`), so no workers of it run now.
                row.status = DeploymentStatus.STOPPED
                row.error = f"replaced by version {version.number} of {CHAT_WORKFLOW!r} (manage.py setup_demo)"
                row.save(update_fields=["status", "error", "updated_at"])
                records.stop_all_workers(row.pk)
            if live is None:
                embedded = engine().config.dispatch is Dispatch.LOCAL
                live = create_deployment(user, version, name=CHAT_MODEL, start_workers=not embedded)
                outcome = "deployed"
            else:
                outcome = "kept"
            ApiToken.objects.filter(user=user, name=CHAT_TOKEN_NAME, revoked=False).update(revoked=True)
            secret = ApiToken.objects.issue(user, CHAT_TOKEN_NAME).secret
        self.stdout.write(f"chat: {outcome} workflow {CHAT_WORKFLOW!r} version {version.number} as the model"
                          f" {CHAT_MODEL!r} (deployment {live.pk}); the server starts it")
        self.stdout.write(f"chat token: {secret}")
        self.stdout.write(CHAT_SNIPPET_HEAD)
        self.stdout.write(chat_snippet(origin, secret))
