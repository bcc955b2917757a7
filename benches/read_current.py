"""The read benchmark on the current ClickHouse engine (chdb, in process), on a copy of the tables
that `scripts/bench.sh --read` built through the real pipeline on the local server.

    python benches/read_current.py path/to/tally DATABASE [http://127.0.0.1:8123] [RUNS]

Copies the job's tables into chdb (Native format), installs the view with the same SQL tally
issues (`tally schema --print-sql`, Atomic database) at the server's fold frontier, builds the
ideal table (exactly the view's rows), checks both answer every query alike, and prints p50/p99
of each query on both and their ratio. In process, so no network or HTTP cost is included.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

TABLES = ["data", "commits", "final", "folds", "live"]


def server_query(url, sql, fmt="TSV"):
    params = urllib.parse.urlencode({"wait_end_of_query": "1", "default_format": fmt})
    request = urllib.request.Request(f"{url}/?{params}", data=sql.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        return response.read()


def main():
    tally, db = sys.argv[1], sys.argv[2]
    url = sys.argv[3] if len(sys.argv) > 3 else "http://127.0.0.1:8123"
    runs = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    from chdb import session

    frontier = server_query(url, f"SELECT toUInt32(frontier) FROM {db}.revenue_agg_folds "
                                 "ORDER BY frontier DESC LIMIT 1").decode().split() or ["0"]
    args = [tally, "schema", "--print-sql", "--database", db, "--table", "revenue_agg", "--atomic",
            "--to", frontier[0]]
    catalog = [json.loads(l) for l in subprocess.run(args, check=True, capture_output=True, text=True)
               .stdout.splitlines()]
    with tempfile.TemporaryDirectory() as path:
        s = session.Session(os.path.join(path, "chdb"))

        def q(sql):
            return s.query(sql, "TSV").bytes()

        for stmt in catalog:
            if stmt["name"].startswith("create."):
                q(stmt["sql"])
        for t in TABLES:
            native = os.path.join(path, f"{t}.native")
            with open(native, "wb") as f:
                f.write(server_query(url, f"SELECT * FROM {db}.revenue_agg_{t}", "Native"))
            q(f"INSERT INTO {db}.revenue_agg_{t} SELECT * FROM file('{native}', Native)")
        for stmt in catalog:
            if stmt["name"].startswith("install."):
                q(stmt["sql"])
        q(f"CREATE TABLE {db}.ideal ENGINE = MergeTree PARTITION BY toYYYYMMDD(window_start) "
          f"ORDER BY (window_start, customer_id, currency) AS SELECT * FROM {db}.revenue_agg")
        q(f"OPTIMIZE TABLE {db}.ideal FINAL")
        end = int(q(f"SELECT toUInt64(max(window_start)) FROM {db}.ideal").decode())
        customer = q(f"SELECT customer_id FROM {db}.ideal WHERE window_start >= toDateTime({end - 86400}) "
                     "GROUP BY customer_id ORDER BY sum(orders) DESC LIMIT 1").decode().strip()
        hour, day, week = end - 3600, end - 86400, end - 7 * 86400
        queries = [
            ("one customer, last hour", f"SELECT sum(orders), sum(revenue) FROM {{t}} WHERE customer_id = '{customer}' AND window_start >= toDateTime({hour})"),
            ("one customer, last 7 days, per day", f"SELECT toDate(window_start) AS d, sum(orders), sum(revenue) FROM {{t}} WHERE customer_id = '{customer}' AND window_start >= toDateTime({week}) GROUP BY d ORDER BY d"),
            ("all customers, last hour, per minute", f"SELECT window_start, sum(orders), sum(revenue) FROM {{t}} WHERE window_start >= toDateTime({hour}) GROUP BY window_start ORDER BY window_start"),
            ("totals, last day", f"SELECT count(), sum(orders), sum(revenue) FROM {{t}} WHERE window_start >= toDateTime({day})"),
            ("top 10 customers, last day", f"SELECT customer_id, sum(revenue) AS r FROM {{t}} WHERE window_start >= toDateTime({day}) GROUP BY customer_id ORDER BY r DESC, customer_id LIMIT 10"),
        ]
        version = q("SELECT version()").decode().strip()
        print(f"current engine: chdb, ClickHouse {version}, in process; {runs} runs per query")
        print(f"{'query':<38} {'view p50':>10} {'view p99':>10} {'ideal p50':>10} {'ideal p99':>10} {'ratio':>8}")
        for name, template in queries:
            on_view = template.replace("{t}", f"{db}.revenue_agg")
            on_ideal = template.replace("{t}", f"{db}.ideal")
            if q(on_view) != q(on_ideal):
                raise SystemExit(f"{name}: the view and the ideal table answer differently")
            v, i = [], []
            for _ in range(runs):
                for sql, out in ((on_view, v), (on_ideal, i)):
                    t0 = time.perf_counter()
                    q(sql)
                    out.append((time.perf_counter() - t0) * 1000)
            v.sort()
            i.sort()
            p99 = lambda xs: xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
            vm, im = statistics.median(v), statistics.median(i)
            print(f"{name:<38} {vm:>8.1f}ms {p99(v):>8.1f}ms {im:>8.1f}ms {p99(i):>8.1f}ms {vm / im:>7.2f}x")


if __name__ == "__main__":
    main()
