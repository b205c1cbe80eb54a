"""`python manage.py create_token USERNAME`: print a new API token for USERNAME."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from studio.accounts.models import ApiToken


class Command(BaseCommand):
    help = "Issue a new API token for USERNAME and print it (the only time it is shown)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="a label to recognise the token by")

    def handle(self, *args, username: str, name: str, **options) -> None:
        User = get_user_model()
        try:
            user = User.objects.get(**{User.USERNAME_FIELD: username})
        except User.DoesNotExist:
            raise CommandError(f"no user {username!r}") from None
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive")
        issued = ApiToken.objects.issue(user, name)
        self.stdout.write(issued.secret)
