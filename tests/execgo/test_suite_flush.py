"""The suite's own flush (tests/backends): after a transactional test that
changed the seeded policy, the content types and the permissions, the next
test starts on the rows the migrations wrote, ids included. The tests of
this module run in their order in one process."""

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection

from policy.models import PolicyRule, PolicyVersion
from tests.backends import PREFIX

pytestmark = pytest.mark.django_db(transaction=True)

KEPT = ("runs_policyrule", "runs_policyversion", "django_content_type", "auth_permission")


def same_rows(table: str) -> bool:
    """The table holds exactly the rows of its kept copy (compared by the
    database: SQLite's copy has no declared types to convert values by)."""
    table, copy = connection.ops.quote_name(table), connection.ops.quote_name(PREFIX + table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT (SELECT COUNT(*) FROM {table}), (SELECT COUNT(*) FROM {copy}),"
                       f" (SELECT COUNT(*) FROM (SELECT * FROM {table} EXCEPT SELECT * FROM {copy}) AS extra)")
        ours, kept, extra = cursor.fetchone()
    return ours == kept > 0 and extra == 0


def test_the_migrated_rows_are_kept_beside_their_tables():
    for table in KEPT:
        assert same_rows(table), table
    assert PolicyRule.objects.filter(name="http-read").exists()


def test_a_test_changes_what_the_migrations_wrote():
    PolicyRule.objects.all().delete()
    PolicyVersion.objects.update(version=999)
    Permission.objects.filter(codename__startswith="view_").delete()
    ContentType.objects.filter(app_label="policy").delete()
    ContentType.objects.create(app_label="gone", model="thing")
    assert not PolicyRule.objects.exists()


def test_the_next_test_starts_on_the_rows_as_migrated_ids_included():
    for table in KEPT:
        assert same_rows(table), table
    assert not ContentType.objects.filter(app_label="gone").exists()
    assert ContentType.objects.get_for_model(PolicyRule).pk == ContentType.objects.get(
        app_label="policy", model="policyrule").pk
    assert PolicyVersion.objects.get().version != 999
