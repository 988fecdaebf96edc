from __future__ import annotations

import uuid

from django.db import migrations, models


def fill_public_ids(apps, schema_editor):
    Generation = apps.get_model("quotes", "Generation")
    for row in Generation.objects.filter(public_id__isnull=True).only("pk").iterator():
        Generation.objects.filter(pk=row.pk).update(public_id=uuid.uuid4())


class Migration(migrations.Migration):
    dependencies = [("quotes", "0006_persona_editors_group")]

    operations = [
        migrations.AddField(
            model_name="generation", name="public_id", field=models.UUIDField(null=True, editable=False)
        ),
        migrations.RunPython(fill_public_ids, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="generation",
            name="public_id",
            field=models.UUIDField(default=uuid.uuid4, editable=False, unique=True),
        ),
    ]
