"""The Omni-Flow studio: a Django project (settings, urls, asgi, celery) and its apps."""

# The Celery app is made current on import, so the tasks the web process sends
# (`apply_async`) use its broker (REDIS_URL) rather than Celery's default app.
from studio.celery import app as celery_app

__all__ = ["celery_app"]
