"""The Omni-Flow studio: a Django project (settings, urls, asgi, celery) and its apps."""
