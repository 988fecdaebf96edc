"""The app's URLs, and the naive proxy at /bench/naive (bench.common.NAIVE_PATH)."""

from __future__ import annotations

from django.urls import path

from config.urls import urlpatterns as app_urlpatterns

from .views import proxy

urlpatterns = [path("bench/naive", proxy), *app_urlpatterns]
