from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('workflows', '0002_deployments_sessions'),
    ]

    operations = [
        migrations.AddField(
            model_name='deployment',
            name='cache_scope',
            field=models.CharField(choices=[('user', "each user's runs their own"), ('shared', "every user's runs of this deployment (staff only: e.g. a public system prompt)")], default='user', help_text="user: a user's runs never meet another's in a cache; shared: set by staff", max_length=8),
        ),
    ]
