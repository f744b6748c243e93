from django.core.management.base import BaseCommand

from runs.invariants import find_violations


class Command(BaseCommand):
    help = "Check the run/audit reconciliation invariants; exit 1 and print each violation if any fails."

    def handle(self, *args, **options):
        violations = find_violations()
        for violation in violations:
            self.stdout.write(f"VIOLATION: {violation}")
        if violations:
            self.stderr.write(f"{len(violations)} violation(s)")
            raise SystemExit(1)
        self.stdout.write("reconcile: all invariants hold")
