"""A rate-limited row stands for every refusal of its client, persona and reason in one window."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("quotes", "0007_generation_public_id")]

    operations = [
        migrations.AddField(
            model_name="generation",
            name="request_count",
            field=models.PositiveIntegerField(
                default=1,
                help_text="How many requests this row stands for (refusals are counted per window).",
                verbose_name="requests",
            ),
        ),
    ]
