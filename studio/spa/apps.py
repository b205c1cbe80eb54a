from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class SpaConfig(AppConfig):
    name = "studio.spa"
    label = "spa"
    verbose_name = "Studio frontend"

    def ready(self) -> None:
        checks.register(frontend_built_check)


def frontend_built_check(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """Warn (not fail) when the frontend is not built: the API works without it."""
    from studio.spa.views import dist_dir

    if (dist_dir() / "index.html").is_file():
        return []
    return [checks.Warning(
        f"the studio frontend is not built ({dist_dir() / 'index.html'} is missing); pages answer 503",
        hint="run `bash scripts/frontend.sh build` (npm ci && npm run build in frontend/)",
        id="spa.W001",
    )]
