"""The "Persona editors" group: may add, change and view personas, and nothing else in the admin."""

from __future__ import annotations

from django.contrib.auth.management import create_permissions
from django.db import migrations

GROUP = "Persona editors"
PERMISSIONS = ("add_persona", "change_persona", "view_persona")


def create_group(apps, schema_editor):
    # Permissions are normally made after all migrations (post_migrate); on a fresh database they
    # do not exist yet, so make this app's now.
    app_config = apps.get_app_config("quotes")
    app_config.models_module = True
    create_permissions(app_config, apps=apps, verbosity=0)
    app_config.models_module = None

    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    group, _ = Group.objects.get_or_create(name=GROUP)
    group.permissions.set(
        Permission.objects.filter(content_type__app_label="quotes", codename__in=PERMISSIONS)
    )


def delete_group(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name=GROUP).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("quotes", "0005_first_versions"),
    ]

    operations = [migrations.RunPython(create_group, delete_group)]
