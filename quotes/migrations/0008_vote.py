"""One vote per client per quote (issue 13): the Vote table. A quote's existing single vote
becomes one Vote from a client no one can be again ("legacy"), so the next visitor's vote adds
to it instead of replacing it."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models


def keep_existing_votes(apps, schema_editor):
    Generation = apps.get_model("quotes", "Generation")
    Vote = apps.get_model("quotes", "Vote")
    rows = Generation.objects.filter(feedback__isnull=False).values_list("pk", "feedback")
    batch = []
    for pk, value in rows.iterator():
        batch.append(Vote(generation_id=pk, client_key="legacy", value=value))
        if len(batch) >= 1000:
            Vote.objects.bulk_create(batch)
            batch = []
    Vote.objects.bulk_create(batch)


class Migration(migrations.Migration):
    dependencies = [("quotes", "0007_generation_public_id")]

    operations = [
        migrations.AlterField(
            model_name="generation",
            name="feedback",
            field=models.SmallIntegerField(
                blank=True,
                choices=[(1, "👍"), (-1, "👎")],
                help_text="The visitors' verdict: the sign of the sum of their votes (one per visitor), "
                "empty when there are none or they cancel out.",
                null=True,
            ),
        ),
        migrations.CreateModel(
            name="Vote",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("client_key", models.CharField(max_length=64)),
                ("value", models.SmallIntegerField(choices=[(1, "👍"), (-1, "👎")])),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "generation",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="votes",
                        to="quotes.generation",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("generation", "client_key"), name="one_vote_per_client_per_quote"
                    )
                ],
            },
        ),
        migrations.RunPython(keep_existing_votes, migrations.RunPython.noop),
    ]
