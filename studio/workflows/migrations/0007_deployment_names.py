"""A live deployment's name is unique for its owner: it is the OpenAI model id its clients use.
Live deployments made before without a name (or sharing one) take their workflow's name,
numbered `-2`, `-3` ... as new deployments do."""

from typing import Any

from django.db import migrations, models

LIVE = ["pending", "running", "starting", "stopping"]


def name_live_deployments(apps: Any, schema_editor: Any) -> None:
    Deployment = apps.get_model("workflows", "Deployment")
    taken: dict[int, set[str]] = {}
    for deployment in (Deployment.objects.filter(status__in=LIVE).select_related("version__workflow")
                       .order_by("created_at")):
        names = taken.setdefault(deployment.owner_id, set())
        base = deployment.name or deployment.version.workflow.name[:96]
        name, number = base, 1
        while name in names:
            number += 1
            name = f"{base}-{number}"
        names.add(name)
        if name != deployment.name:
            deployment.name = name
            deployment.save(update_fields=["name"])


class Migration(migrations.Migration):
    dependencies = [
        ("workflows", "0006_placement"),
    ]

    operations = [
        migrations.AlterField(
            model_name="deployment",
            name="name",
            field=models.CharField(blank=True, max_length=100,
                                   help_text="the OpenAI model id of a chat deployment; unique among the owner's"
                                             " live ones"),
        ),
        migrations.RunPython(name_live_deployments, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="deployment",
            constraint=models.UniqueConstraint(condition=models.Q(status__in=LIVE), fields=("owner", "name"),
                                               name="deployment_name_unique_live"),
        ),
    ]
