"""Django settings, derived from `studio.config.StudioConfig` (the only reader of the environment)."""

from __future__ import annotations

import os

from studio.config import BASE_DIR, load_config

OMNIFLOW = load_config(os.environ)
"""The typed configuration; code that needs it reads `settings.OMNIFLOW`."""

DEBUG = OMNIFLOW.debug
SECRET_KEY = OMNIFLOW.secret_key
ALLOWED_HOSTS = list(OMNIFLOW.allowed_hosts)
CSRF_TRUSTED_ORIGINS = list(OMNIFLOW.csrf_trusted_origins)

INSTALLED_APPS = [
    "daphne",  # `manage.py runserver` serves ASGI (HTTP and WebSockets)
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "studio.accounts",
    "studio.workflows",
    "studio.spa",
]

MIDDLEWARE = [
    "studio.errors.UploadLimitMiddleware",
    "studio.errors.NulQueryMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "studio.urls"
ASGI_APPLICATION = "studio.asgi.application"
CSRF_FAILURE_VIEW = "studio.errors.csrf_failure"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": OMNIFLOW.database}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "/admin/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
SPA_DIST_DIR = BASE_DIR / "frontend" / "dist"
"""The built frontend that `studio.spa` serves (`npm run build` in frontend/)."""
STATIC_ROOT = OMNIFLOW.data_dir / "static"
MEDIA_ROOT = OMNIFLOW.media_root
MEDIA_URL = None  # files are served by the API, to their owner only

# Bodies above the limit are refused with 413 before they are read (UploadLimitMiddleware);
# Django's own limits are set to the same figure so nothing slips past.
DATA_UPLOAD_MAX_MEMORY_SIZE = OMNIFLOW.max_upload_bytes
FILE_UPLOAD_MAX_MEMORY_SIZE = min(OMNIFLOW.max_upload_bytes, 2_621_440)
FILE_UPLOAD_HANDLERS = [
    "studio.errors.LimitedUploadHandler",
    "django.core.files.uploadhandler.MemoryFileUploadHandler",
    "django.core.files.uploadhandler.TemporaryFileUploadHandler",
]

if OMNIFLOW.redis_url:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [OMNIFLOW.redis_url], "prefix": OMNIFLOW.redis_prefix, "capacity": 1000},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Throttle counts (studio.throttles): shared by every web process where there is a Redis.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "throttle": ({"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": OMNIFLOW.redis_url,
                  "KEY_PREFIX": f"{OMNIFLOW.redis_prefix}:throttle"} if OMNIFLOW.redis_url
                 else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "throttle"}),
}

CELERY_BROKER_URL = OMNIFLOW.redis_url or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "omniflow"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # First, so an unauthenticated request gets 401 with `WWW-Authenticate: Bearer`.
        "studio.accounts.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "studio.jsonbody.LimitedJSONParser",  # depth and size limits (studio.jsonbody)
        "rest_framework.parsers.MultiPartParser",
        "rest_framework.parsers.FormParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "studio.errors.api_exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    "URL_FORMAT_OVERRIDE": None,  # `?format=` belongs to the export endpoint
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Omni-Flow Studio API",
    "DESCRIPTION": "Workflows, versions, the node-kind catalogue, runs, deployments, workers and chat sessions"
                   " of Omni-Flow (the OpenAI-compatible /v1/ endpoints follow OpenAI's own reference).",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "studio.workflows.models.RunStatus",
        "DeploymentStatusEnum": "studio.workflows.models.DeploymentStatus",
        "WorkerStatusEnum": "studio.workflows.models.WorkerStatus",
        "NodeStateEnum": "studio.workflows.models.NodeState",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "studio": {"level": OMNIFLOW.log_level},
        "django.request": {"level": "ERROR"},
    },
}

ROOT_DIR = BASE_DIR
