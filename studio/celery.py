"""The Celery app of the distributed mode: `celery -A studio worker -Q omniflow`.

Broker: REDIS_URL (settings.CELERY_BROKER_URL). Tasks take ids, are idempotent and
retry only on transient errors (see studio.workflows.tasks).
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "studio.settings")

app = Celery("omniflow")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
