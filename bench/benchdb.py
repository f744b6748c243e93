"""The benches' own PostgreSQL databases: created when missing (never the
test suite's database), kept between invocations as a deployment's is."""


def ensure_database(url: str) -> None:
    if not url.startswith("postgres"):
        return
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin_url = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
