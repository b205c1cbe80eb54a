"""`python manage.py setup_demo`: the `demo` user, the example workflows, and its login.

Creates the user (or resets its password), loads `workflows/*.py` for it and prints the
username, password and (with --token) a new API token. The password is random unless
given with --password; only its hash is stored, so each call that does not give one sets
and prints a new one.
"""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from studio.accounts.models import ApiToken


class Command(BaseCommand):
    help = "Create (or reset) the demo user, load the example workflows for it and print its login."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default=None, help="default: a new random password")
        parser.add_argument("--admin", action="store_true", help="make the user staff and superuser")
        parser.add_argument("--token", action="store_true", help="also issue and print an API token")
        parser.add_argument("--no-examples", action="store_true")

    def handle(self, *args, username: str, password: str | None, admin: bool, token: bool,
               no_examples: bool, **options) -> None:
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
