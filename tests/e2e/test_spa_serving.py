"""`studio.spa` serves the built frontend: index.html for page paths, hashed assets with
long caching, and nothing outside the build; API paths keep their JSON 404s."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.test import Client


@pytest.fixture
def dist(tmp_path: Path, settings) -> Path:
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text("<!doctype html><div id=root></div>")
    (tmp_path / "assets" / "index-abc123.js").write_text("console.log(1)")
    (tmp_path / "favicon.svg").write_text("<svg/>")
    (tmp_path.parent / "secret.txt").write_text("not served")
    settings.SPA_DIST_DIR = tmp_path
    return tmp_path


@pytest.mark.parametrize("path", ["/", "/workflows", "/workflows/4b8a1b4e-0000-0000-0000-000000000000/run",
                                  "/runs/x", "/cluster"])
def test_pages_get_the_app(dist: Path, path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/html; charset=utf-8"
    assert response["Cache-Control"] == "no-cache"
    assert b'<div id=root>' in response.content
    assert "csrftoken" in response.cookies


def test_assets_are_immutable(dist: Path) -> None:
    response = Client().get("/assets/index-abc123.js")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/javascript"
    assert "immutable" in response["Cache-Control"]
    assert b"".join(response.streaming_content) == b"console.log(1)"
    favicon = Client().get("/favicon.svg")
    assert favicon.status_code == 200 and favicon["Content-Type"] == "image/svg+xml"


@pytest.mark.parametrize("path", ["/assets/missing.js", "/assets/../index.html", "/assets/%2e%2e/secret.txt",
                                  "/nope.js", "/index.html", "/a/favicon.svg"])
def test_no_file_outside_the_build_or_missing(dist: Path, path: str) -> None:
    assert Client().get(path).status_code == 404


@pytest.mark.parametrize("path", ["/api/nope/", "/ws/runs/x/", "/static/nope.css"])
def test_reserved_prefixes_are_not_the_app(dist: Path, path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"


def test_admin_stays_the_admin(dist: Path) -> None:
    response = Client().get("/admin/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_writes_are_refused(dist: Path) -> None:
    assert Client().post("/workflows").status_code == 405


def test_unbuilt_frontend_says_how_to_build(settings, tmp_path: Path) -> None:
    settings.SPA_DIST_DIR = tmp_path / "missing"
    response = Client().get("/workflows")
    assert response.status_code == 503
    assert b"scripts/frontend.sh build" in response.content
