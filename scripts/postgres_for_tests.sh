#!/usr/bin/env bash
# A throwaway PostgreSQL server on loopback for the tests that run Dagster on PostgreSQL
# (eagle_pipeline_tests/defs/test_postgres_instance.py). Needs Debian's `postgresql` package (initdb, pg_ctl).
#   scripts/postgres_for_tests.sh start DIR   -> prints the connection URL (export it as EAGLE_TEST_POSTGRES_URL)
#   scripts/postgres_for_tests.sh stop DIR
# The server trusts local connections and listens on 127.0.0.1 only; its data lives in DIR and nowhere else.
set -euo pipefail
cmd=${1:?start|stop}
dir=${2:?data directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -x "$bin/initdb" ] || { echo "PostgreSQL is not installed (apt-get install -y postgresql)" >&2; exit 1; }
# PostgreSQL refuses to run as root: as root, run it as the package's `postgres` user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case "$cmd" in
  start)
    # A free loopback port unless one is given (a fixed one may be taken by another server on this machine).
    port=${EAGLE_TEST_POSTGRES_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    [ -f "$dir/PG_VERSION" ] || as_pg "$bin/initdb" -D "$dir" -A trust -U eagle --no-sync >"$dir.initdb.log" 2>&1
    as_pg "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start >/dev/null
    echo "postgresql://eagle@127.0.0.1:$port/postgres"
    ;;
  stop)
    as_pg "$bin/pg_ctl" -D "$dir" -m fast -w stop >/dev/null 2>&1 || true
    ;;
  *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
