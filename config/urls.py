from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from quotes.ops.health import healthz
from quotes.ops.metrics import metrics_view

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("", include("quotes.urls")),
]
