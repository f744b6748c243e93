import json

from django.core.management.base import BaseCommand, CommandError
from django.db.models import F

from runs.audit_hash import row_content
from runs.models import AuditLog, Tenant


class Command(BaseCommand):
    help = ("Write one tenant's audit log (or the installation's, of no tenant: policy rules, groups) as JSON "
            "lines, in chain order, each with its hash; tools/verify_audit.py checks the file offline.")

    def add_arguments(self, parser):
        chain = parser.add_mutually_exclusive_group(required=True)
        chain.add_argument("--tenant", help="the tenant's id or name")
        chain.add_argument("--no-tenant", action="store_true",
                           help="the chain of rows of no tenant (admin changes to installation-wide objects)")
        parser.add_argument("--output", help="a file to write (default: standard output)")

    def handle(self, *args, tenant=None, no_tenant=False, output=None, **options):
        if no_tenant:
            found, rows = None, AuditLog.objects.filter(tenant_id__isnull=True)
        else:
            found = Tenant.objects.filter(pk=int(tenant)) if tenant.isdigit() else Tenant.objects.filter(name=tenant)
            found = found.first()
            if found is None:
                raise CommandError(f"no tenant {tenant!r}")
            rows = AuditLog.objects.filter(tenant=found)
        rows = rows.order_by("chain_lane", F("chain_seq").asc(nulls_last=True), "pk")
        stream = open(output, "w", encoding="utf-8") if output else self.stdout
        count = 0
        try:
            for row in rows.iterator(chunk_size=2000):
                line = {"id": row.pk, **row_content(row), "row_hash": row.row_hash}
                stream.write(json.dumps(line, sort_keys=True, ensure_ascii=False) + "\n")
                count += 1
        finally:
            if output:
                stream.close()
        of = "no tenant" if found is None else f"tenant {found.pk} ({found.name})"
        self.stderr.write(f"exported {count} audit rows of {of}")
