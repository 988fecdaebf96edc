from __future__ import annotations

from django.contrib import admin

from .models import Generation, Persona


@admin.register(Persona)
class PersonaAdmin(admin.ModelAdmin[Persona]):
    list_display = ("name", "slug", "model", "is_active", "display_order")
    list_editable = ("is_active", "display_order")
    list_filter = ("is_active", "model")
    search_fields = ("name", "slug", "system_prompt")
    prepopulated_fields = {"slug": ("name",)}


@admin.register(Generation)
class GenerationAdmin(admin.ModelAdmin[Generation]):
    list_display = ("created_at", "persona", "status", "backend", "model", "ttft_ms", "completion_tokens")
    list_filter = ("status", "backend", "model", "persona")
    search_fields = ("text", "topic")
    date_hierarchy = "created_at"

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False
