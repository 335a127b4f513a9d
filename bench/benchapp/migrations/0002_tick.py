from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("benchapp", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="Tick",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("job", models.CharField(max_length=200)),
                ("slot", models.BigIntegerField()),
                ("at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
    ]
