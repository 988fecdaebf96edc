from __future__ import annotations

from django.urls import path

from . import views

app_name = "quotes"

urlpatterns = [
    path("", views.index, name="index"),
    path("personas/<slug:slug>/", views.persona_page, name="persona"),
    path("api/quotes/stream", views.stream_quote, name="stream"),
]
