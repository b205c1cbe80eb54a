from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workflows", "0005_curve_plane_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="placement",
            field=models.JSONField(blank=True, default=dict,
                                   help_text="distributed mode: the node of each replica, the replicas that moved"),
        ),
    ]
