"""Migration 0019 on a database that had DRF's authtoken: each plain key
becomes a digest, the plain table is dropped, and the agent's key keeps
working as it was."""

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone
from rest_framework.test import APIClient

from runs.models import ApiToken
from runs.tokens import key_digest

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = ("runs", "0018_tenant_webhook_secret")
AFTER = ("runs", "0019_api_token_digests")
PLAIN_KEY = "3f9c2a7be01d4c55a6e8f0b1c2d3e4f5a6b7c8d9"  # DRF's shape: 40 hexadecimal characters

# DRF's authtoken_token as its migrations leave it.
CREATE_PLAIN = {
    "sqlite": 'CREATE TABLE "authtoken_token" ("key" varchar(40) NOT NULL PRIMARY KEY, "created" datetime NOT NULL, '
              '"user_id" integer NOT NULL UNIQUE REFERENCES "auth_user" ("id") DEFERRABLE INITIALLY DEFERRED)',
    "postgresql": 'CREATE TABLE "authtoken_token" ("key" varchar(40) NOT NULL PRIMARY KEY, "created" timestamp '
                  'with time zone NOT NULL, "user_id" integer NOT NULL UNIQUE REFERENCES "auth_user" ("id") '
                  'DEFERRABLE INITIALLY DEFERRED)',
}


def migrate(target) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target if isinstance(target, list) else [target])


def tables() -> list[str]:
    with connection.cursor() as cursor:
        return connection.introspection.table_names(cursor)


@pytest.fixture
def back_at_0018():
    migrate(BEFORE)
    yield
    migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())


def test_a_plain_key_keeps_working_after_the_migration_and_is_stored_nowhere(back_at_0018):
    assert "runs_apitoken" not in tables()
    agent = User.objects.create_user("agent")
    historical = MigrationExecutor(connection).loader.project_state(BEFORE).apps  # the tables as they are at 0018
    historical.get_model("runs", "Membership").objects.create(
        user_id=agent.pk, tenant=historical.get_model("runs", "Tenant").objects.create(name="acme"))
    created = timezone.now().replace(microsecond=0)
    with connection.cursor() as cursor:
        cursor.execute(CREATE_PLAIN[connection.vendor])
        cursor.execute('INSERT INTO "authtoken_token" ("key", "created", "user_id") VALUES (%s, %s, %s)',
                       [PLAIN_KEY, created, agent.pk])
        cursor.execute('INSERT INTO "django_migrations" ("app", "name", "applied") VALUES (%s, %s, %s)',
                       ["authtoken", "0001_initial", created])

    migrate(AFTER)

    assert "authtoken_token" not in tables()
    with connection.cursor() as cursor:
        cursor.execute('SELECT COUNT(*) FROM "django_migrations" WHERE "app" = %s', ["authtoken"])
        assert cursor.fetchone() == (0,)
        for table in tables():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            assert not any(PLAIN_KEY in repr(value) for row in cursor.fetchall() for value in row), table
    migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())  # the models below are today's
    token = ApiToken.objects.get()
    assert (token.user_id, token.digest, token.key_prefix) == (agent.pk, key_digest(PLAIN_KEY), PLAIN_KEY[:8])
    assert token.created_at == created and token.revoked_at is None and token.expires_at is None

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {PLAIN_KEY}")
    assert client.get("/api/v1/runs").status_code == 200
    client.credentials(HTTP_AUTHORIZATION=f"Token {PLAIN_KEY[:-1]}0")
    assert client.get("/api/v1/runs").status_code == 401


def test_a_database_that_never_had_authtoken_migrates_too(back_at_0018):
    assert "authtoken_token" not in tables()

    migrate(AFTER)

    assert "runs_apitoken" in tables() and not ApiToken.objects.exists()
