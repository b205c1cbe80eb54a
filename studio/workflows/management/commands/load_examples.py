"""`python manage.py load_examples --owner USERNAME [--dir workflows]`: import the example
workflows (DSL modules) as Workflows owned by USERNAME. Idempotent: an unchanged example
adds no version; a changed one adds a version."""

from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from engine.client.graphs import GraphValidationError, WorkflowLoadError, load_workflow
from studio.accounts.management.users import user_named
from studio.workflows.models import Workflow
from studio.workflows.operations import check_spec_for_studio, create_workflow, save_version


class Command(BaseCommand):
    help = "Import workflows/*.py (trusted files on this machine) as workflows owned by a user."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--owner", required=True, help="username of the owner")
        parser.add_argument("--dir", default=str(settings.ROOT_DIR / "workflows"), help="folder of DSL modules")

    def handle(self, *args, owner: str, dir: str, **options) -> None:
        user = user_named(owner)
        folder = Path(dir)
        paths = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
        if not paths:
            raise CommandError(f"no workflow modules in {folder}")
        failures = 0
        touched: list[uuid.UUID] = []
        for path in paths:
            try:
                spec = load_workflow(path)
            except (WorkflowLoadError, GraphValidationError) as exc:
                self.stderr.write(f"{path.name}: {exc}")
                failures += 1
                continue
            checked = check_spec_for_studio(spec)
            workflow = Workflow.objects.filter(owner=user, name=spec.name).first()
            if workflow is None:
                touched.append(create_workflow(user, name=spec.name, description=spec.description, checked=checked,
                                               message=f"imported from {path.name}").pk)
                outcome = "created"
            else:
                saved = save_version(workflow, checked, message=f"updated from {path.name}", author=user)
                outcome = f"version {saved.version.number}" + ("" if saved.created else " (unchanged)")
                if saved.created:
                    touched.append(workflow.pk)
            note = "" if checked.valid else f" — {len(checked.issues)} validation issue(s)"
            self.stdout.write(f"{spec.name}: {outcome}{note}")
        # Loaded together, updated together: one instant, so the workflows list (newest first, then by
        # name) shows the examples in name order, not in the order this loop happened to save them.
        Workflow.objects.filter(pk__in=touched).update(updated_at=timezone.now())
        if failures:
            raise CommandError(f"{failures} example(s) could not be loaded")
