"""A rate-limited row stands for every refusal of its client, persona and reason in one window;
a quote whose permalink was opened is known, so pruning keeps it longer."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("quotes", "0008_vote")]

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
        migrations.AddField(
            model_name="generation",
            name="shared_at",
            field=models.DateTimeField(
                blank=True,
                help_text="Shared quotes are kept longer.",
                null=True,
                verbose_name="permalink first opened",
            ),
        ),
    ]
