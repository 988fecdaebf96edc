from __future__ import annotations

from django.urls import path

from . import chat_api, views

app_name = "quotes"

urlpatterns = [
    path("", views.index, name="index"),
    path("personas/<slug:slug>/", views.persona_page, name="persona"),
    path("q/<uuid:public_id>/", views.quote_permalink, name="permalink"),
    path("api/quotes/stream", views.stream_quote, name="stream"),
    # The persona page's form (htmx): same stream, Django's normal CSRF check.
    path("quotes/stream", views.stream_quote_form, name="stream-form"),
    path("api/quotes/<uuid:public_id>/feedback", views.quote_feedback, name="feedback"),
    path("api/quotes/<uuid:public_id>/stop", views.stop_quote, name="stop"),
    # Keeps a quote past the log's retention: the page's Permalink and Copy buttons (Django's CSRF).
    path("api/quotes/<uuid:public_id>/share", views.share_quote, name="share"),
    # OpenAI's Chat Completions: every persona as a model (quotes.chat_api).
    path("v1/chat/completions", chat_api.chat_completions, name="chat-completions"),
    path("v1/models", chat_api.list_models, name="models"),
    path("v1/models/<str:model>", chat_api.get_model, name="model"),
]
