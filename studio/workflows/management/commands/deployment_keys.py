"""`python manage.py deployment_keys DEPLOYMENT_ID DIR`: write a running deployment's worker
plane keys into DIR (0700, files 0600), for a worker started by hand on another machine to
join it (`omniflow worker --namespace NAMESPACE --registry URL --keys DIR ...`). Whoever
runs this reads the database, so is trusted with every deployment already."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from engine.client.keys import PlaneKeyError
from studio.workflows.models import Deployment


class Command(BaseCommand):
    help = "Write a deployment's worker-plane CURVE keys for a worker started by hand."

    def add_arguments(self, parser) -> None:
        parser.add_argument("deployment", help="the deployment's id")
        parser.add_argument("directory", metavar="DIR", help="where to write them (made 0700)")

    def handle(self, *args, deployment: str, directory: str, **options) -> None:
        try:
            row = Deployment.objects.filter(pk=deployment).first()
        except ValidationError:
            raise CommandError(f"{deployment!r} is not a deployment id") from None
        if row is None:
            raise CommandError(f"no deployment {deployment}")
        keys = row.plane_keys()
        if keys is None:
            raise CommandError(f"deployment {deployment} has ended: it has no keys")
        try:
            keys.write(directory)
        except PlaneKeyError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"wrote the keys of deployment {deployment} (namespace {row.namespace}) to {directory}")
