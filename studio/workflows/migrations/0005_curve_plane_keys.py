from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('workflows', '0004_lease_run_lease'),
    ]

    operations = [
        migrations.AddField(
            model_name='deployment',
            name='plane_public',
            field=models.CharField(blank=True, help_text="the CURVE public key of the deployment's worker plane", max_length=40),
        ),
        migrations.AddField(
            model_name='deployment',
            name='plane_secret',
            field=models.CharField(blank=True, help_text='its secret key: only the workers and the processes dispatching to them hold it; cleared when the deployment ends', max_length=40),
        ),
    ]
