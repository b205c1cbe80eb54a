"""`python manage.py create_token USERNAME`: print a new API token for USERNAME."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from studio.accounts.management.users import user_named
from studio.accounts.models import ApiToken


class Command(BaseCommand):
    help = "Issue a new API token for USERNAME and print it (the only time it is shown)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="a label to recognise the token by")

    def handle(self, *args, username: str, name: str, **options) -> None:
        user = user_named(username)
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive")
        issued = ApiToken.objects.issue(user, name)
        self.stdout.write(issued.secret)
