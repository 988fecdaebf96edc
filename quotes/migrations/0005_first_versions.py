from __future__ import annotations

from django.db import migrations

# The fields as they were when this migration was written (not imported: models change later).
GENERATION_FIELDS = (
    "system_prompt",
    "user_prompt_template",
    "default_topic",
    "backend",
    "model",
    "fallback_models",
    "lora",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def first_versions(apps, schema_editor):
    Persona = apps.get_model("quotes", "Persona")
    PersonaVersion = apps.get_model("quotes", "PersonaVersion")
    for persona in Persona.objects.all():
        if not PersonaVersion.objects.filter(persona=persona).exists():
            config = {field: getattr(persona, field) for field in GENERATION_FIELDS}
            PersonaVersion.objects.create(persona=persona, number=1, config=config, note="first version")


class Migration(migrations.Migration):
    dependencies = [("quotes", "0004_versions_and_gateway_log")]

    operations = [migrations.RunPython(first_versions, migrations.RunPython.noop)]
