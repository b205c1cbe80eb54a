"""The workflows app's migrations 0001..0011 in one: the schema they built, made again from the models.

A database that applied 0001..0011 records this one as applied without running it; a new database runs
only this one. 0007's data step (naming the live deployments made before names were unique) is left out:
this migration creates the deployments table, so when it runs there is no deployment to name."""

import uuid

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

import studio.workflows.models


class Migration(migrations.Migration):

    initial = True

    replaces = [
        ('workflows', '0001_initial'),
        ('workflows', '0002_deployments_sessions'),
        ('workflows', '0003_tenant_cache_scope'),
        ('workflows', '0004_lease_run_lease'),
        ('workflows', '0005_curve_plane_keys'),
        ('workflows', '0006_placement'),
        ('workflows', '0007_deployment_names'),
        ('workflows', '0008_node_files'),
        ('workflows', '0009_worker_failed_error'),
        ('workflows', '0010_worker_gpus'),
        ('workflows', '0011_run_folder_removal'),
    ]

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='Deployment',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(blank=True, help_text="the OpenAI model id of a chat deployment; unique among the owner's live ones", max_length=100)),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('starting', 'Starting'), ('running', 'Running'), ('stopping', 'Stopping'), ('stopped', 'Stopped'), ('failed', 'Failed')], default='pending', max_length=16)),
                ('replicas', models.JSONField(blank=True, default=dict, help_text='role name -> replica count')),
                ('node', models.CharField(blank=True, help_text='node whose Celery worker starts the role workers; blank: the studio process', max_length=63)),
                ('placement', models.JSONField(blank=True, default=dict, help_text='distributed mode: the node of each replica, the replicas that moved')),
                ('namespace', models.CharField(blank=True, help_text='worker registry namespace', max_length=100)),
                ('cache_scope', models.CharField(choices=[('user', "each user's runs their own"), ('shared', "every user's runs of this deployment (staff only: e.g. a public system prompt)")], default='user', help_text="user: a user's runs never meet another's in a cache; shared: set by staff", max_length=8)),
                ('plane_public', models.CharField(blank=True, help_text="the CURVE public key of the deployment's worker plane", max_length=40)),
                ('plane_secret', models.CharField(blank=True, help_text='its secret key: only the workers and the processes dispatching to them hold it; cleared when the deployment ends', max_length=40)),
                ('error', models.TextField(blank=True)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='deployments', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['-created_at'],
            },
        ),
        migrations.CreateModel(
            name='Run',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('running', 'Running'), ('done', 'Done'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], db_index=True, default='pending', max_length=16)),
                ('inputs', models.JSONField(blank=True, default=dict)),
                ('outputs', models.JSONField(blank=True, default=dict)),
                ('error', models.TextField(blank=True)),
                ('failed_node', models.CharField(blank=True, max_length=64)),
                ('timeout_s', models.FloatField(blank=True, null=True)),
                ('created_at', models.DateTimeField(auto_now_add=True, db_index=True)),
                ('started_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('duration_ms', models.FloatField(blank=True, null=True)),
                ('last_seq', models.IntegerField(default=-1)),
                ('node_params', models.JSONField(blank=True, default=dict, help_text="node id -> params laid over the spec's for this run (chat turns)")),
                ('lease_owner', models.CharField(blank=True, help_text="the executor holding the run's lease", max_length=200)),
                ('lease_expires_at', models.DateTimeField(blank=True, help_text='when the lease lapses unless renewed', null=True)),
                ('attempts', models.PositiveIntegerField(default=0, help_text="executions begun (a stopped executor's run restarts)")),
                ('cancel_requested', models.BooleanField(default=False, help_text='the lease holder is asked to cancel the run')),
                ('executed_on', models.JSONField(blank=True, default=list, help_text='the nodes (OMNIFLOW_NODE) of the processes that claimed it')),
                ('deployment', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='runs', to='workflows.deployment')),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='runs', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['-created_at'],
            },
        ),
        migrations.CreateModel(
            name='RunFile',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('role', models.CharField(choices=[('input', 'Input'), ('output', 'Output'), ('node', 'Node')], max_length=8)),
                ('name', models.CharField(help_text='the input or output it belongs to', max_length=64)),
                ('filename', models.CharField(max_length=255)),
                ('content_type', models.CharField(default='application/octet-stream', max_length=100)),
                ('size', models.PositiveBigIntegerField()),
                ('sha256', models.CharField(max_length=64)),
                ('file', models.FileField(max_length=255, upload_to=studio.workflows.models._run_file_path)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='run_files', to=settings.AUTH_USER_MODEL)),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='files', to='workflows.run')),
            ],
            options={
                'ordering': ['created_at'],
            },
        ),
        migrations.CreateModel(
            name='RunFolderRemoval',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('node', models.CharField(max_length=63)),
                ('run_id', models.UUIDField()),
                ('owner_id', models.BigIntegerField(help_text="the run's owner: its folder is <users root>/<owner id>/")),
                ('folders', models.JSONField(default=list, help_text="the run's output folder names, relative to the owner's folder")),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'ordering': ['created_at'],
                'constraints': [models.UniqueConstraint(fields=('node', 'run_id'), name='runfolderremoval_unique')],
            },
        ),
        migrations.CreateModel(
            name='Session',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('title', models.CharField(blank=True, max_length=200)),
                ('messages', models.JSONField(blank=True, default=list, help_text='[{role, content, ...}] in order')),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
                ('closed', models.BooleanField(default=False)),
                ('deployment', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='sessions', to='workflows.deployment')),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='chat_sessions', to=settings.AUTH_USER_MODEL)),
                ('turn', models.ForeignKey(blank=True, help_text='the run of the turn in flight, if any', null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='workflows.run')),
            ],
            options={
                'ordering': ['-updated_at'],
            },
        ),
        migrations.CreateModel(
            name='Worker',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('role', models.CharField(max_length=64)),
                ('worker_id', models.CharField(help_text='id in the worker registry', max_length=128, unique=True)),
                ('host', models.CharField(blank=True, max_length=255)),
                ('address', models.CharField(blank=True, max_length=255)),
                ('device', models.CharField(blank=True, max_length=64)),
                ('gpus', models.JSONField(blank=True, default=list, help_text="the host's GPU indices this process holds (nvidia-smi's numbering); empty: none")),
                ('pid', models.PositiveIntegerField(blank=True, null=True)),
                ('status', models.CharField(choices=[('starting', 'Starting'), ('ready', 'Ready'), ('busy', 'Busy'), ('draining', 'Draining'), ('stopped', 'Stopped'), ('lost', 'Lost'), ('failed', 'Failed')], default='starting', max_length=16)),
                ('error', models.TextField(blank=True, help_text='why it did not come up (status failed)')),
                ('started_at', models.DateTimeField(auto_now_add=True)),
                ('last_seen_at', models.DateTimeField(blank=True, null=True)),
                ('deployment', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='workers', to='workflows.deployment')),
            ],
            options={
                'ordering': ['deployment', 'role', 'worker_id'],
            },
        ),
        migrations.CreateModel(
            name='Workflow',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=100)),
                ('description', models.TextField(blank=True)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='workflows', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['-updated_at'],
            },
        ),
        migrations.AddField(
            model_name='run',
            name='workflow',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='runs', to='workflows.workflow'),
        ),
        migrations.CreateModel(
            name='WorkflowVersion',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('number', models.PositiveIntegerField()),
                ('spec', models.JSONField(help_text='the GraphSpec document (canonical form)')),
                ('spec_hash', models.CharField(help_text='SHA-256 of the canonical GraphSpec bytes', max_length=64)),
                ('layout', models.JSONField(blank=True, default=dict, help_text='editor layout: node positions, viewport')),
                ('message', models.TextField(blank=True)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('valid', models.BooleanField(help_text='whether the spec passed validation when saved')),
                ('issues', models.JSONField(blank=True, default=list, help_text='validation issues (empty when valid)')),
                ('author', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                ('workflow', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='versions', to='workflows.workflow')),
            ],
            options={
                'ordering': ['workflow', '-number'],
            },
        ),
        migrations.AddField(
            model_name='run',
            name='version',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='runs', to='workflows.workflowversion'),
        ),
        migrations.AddField(
            model_name='deployment',
            name='version',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='deployments', to='workflows.workflowversion'),
        ),
        migrations.CreateModel(
            name='NodeRun',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('node', models.CharField(max_length=64)),
                ('kind', models.CharField(max_length=64)),
                ('state', models.CharField(choices=[('pending', 'Pending'), ('queued', 'Queued'), ('running', 'Running'), ('done', 'Done'), ('failed', 'Failed'), ('skipped', 'Skipped'), ('cancelled', 'Cancelled')], default='pending', max_length=16)),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('iterations', models.PositiveIntegerField(default=0)),
                ('started_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('duration_ms', models.FloatField(blank=True, null=True)),
                ('error', models.TextField(blank=True)),
                ('progress', models.FloatField(blank=True, null=True)),
                ('message', models.CharField(blank=True, max_length=500)),
                ('outputs', models.JSONField(blank=True, default=dict, help_text='port -> preview of the latest value')),
                ('frames', models.PositiveIntegerField(default=0, help_text='stream frames emitted')),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='nodes', to='workflows.run')),
            ],
            options={
                'ordering': ['run', 'id'],
                'constraints': [models.UniqueConstraint(fields=('run', 'node'), name='noderun_unique_node')],
            },
        ),
        migrations.CreateModel(
            name='RunEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('seq', models.PositiveIntegerField()),
                ('type', models.CharField(max_length=32)),
                ('data', models.JSONField()),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='events', to='workflows.run')),
            ],
            options={
                'ordering': ['run', 'seq'],
                'constraints': [models.UniqueConstraint(fields=('run', 'seq'), name='runevent_unique_seq')],
            },
        ),
        migrations.AddConstraint(
            model_name='workflow',
            constraint=models.UniqueConstraint(fields=('owner', 'name'), name='workflow_unique_name_per_owner'),
        ),
        migrations.AddIndex(
            model_name='workflowversion',
            index=models.Index(fields=['workflow', 'spec_hash'], name='workflows_w_workflo_ed3b0a_idx'),
        ),
        migrations.AddConstraint(
            model_name='workflowversion',
            constraint=models.UniqueConstraint(fields=('workflow', 'number'), name='version_unique_number'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['owner', '-created_at'], name='workflows_r_owner_i_2f6317_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['workflow', '-created_at'], name='workflows_r_workflo_ffbb31_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['status', 'lease_expires_at'], name='run_lease_expiry'),
        ),
        migrations.AddConstraint(
            model_name='deployment',
            constraint=models.UniqueConstraint(condition=models.Q(('status__in', ['pending', 'running', 'starting', 'stopping'])), fields=('owner', 'name'), name='deployment_name_unique_live'),
        ),
    ]
