"""The exact SQL tally issues, run on the current ClickHouse engine (chdb, in process) and on the
local ClickHouse server (18.16), against the same sample data: every statement must be accepted by
both and every read must answer the same. A fold step must not change what the view shows.

    python tests/current_clickhouse.py path/to/tally [http://127.0.0.1:8123]

Exit status 1 on any failure; the last line is `sqlcheck: N passed, N failed`.
"""

import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

T0 = 1_790_000_400  # 2026-09-21 14:20:00 UTC: a minute and a 10-minute boundary
DAY = "20260921"
MS = 1000


class Server:
    """ClickHouse over HTTP, one statement per request."""

    def __init__(self, url):
        self.url = url.rstrip("/")
        self.name = "server"

    def version(self):
        return self.query("SELECT version()")

    def query(self, sql):
        params = urllib.parse.urlencode({"wait_end_of_query": "1", "default_format": "TSV"})
        request = urllib.request.Request(f"{self.url}/?{params}", data=sql.encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(e.read().decode()) from None


class Embedded:
    """The current engine in process (chdb), with its own data directory."""

    def __init__(self, path):
        from chdb import session

        self.session = session.Session(path)
        self.name = "chdb"

    def version(self):
        return self.query("SELECT version()")

    def query(self, sql):
        result = self.session.query(sql, "TSV")
        error = getattr(result, "error_message", None)
        if callable(error):
            error = error()
        if error:
            raise RuntimeError(error)
        return result.bytes().decode() if hasattr(result, "bytes") else str(result)


def catalog(tally, database, atomic, frm=0, as_of="0:20,1:8", table="revenue_agg", config=None,
            replicated=False):
    args = [
        tally, "schema", "--print-sql", "--database", database, "--table", table,
        "--from", str(frm), "--to", str(T0 + 600), "--as-of", as_of,
        "--day", DAY, "--data-partition", str(T0 // 600),
    ]
    if atomic:
        args.append("--atomic")
    if config:
        args += ["--config", config]
    if replicated:
        args.append("--replicated")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def runner(engine, check, label=""):
    """A statement runner on `engine` that records each statement's success in `check`."""
    def run(name, sql):
        try:
            out = engine.query(sql)
            check.that(True, f"{label}{name}")
            return out
        except RuntimeError as e:
            check.that(False, f"{engine.name} rejected {label}{name}: {str(e)[:400]}\n  {sql[:400]}")
            return ""
    return run


def run_steps(run, statements, wanted):
    """Runs, in catalog order, the statements whose name `wanted` accepts."""
    for s in statements:
        if wanted(s["name"]):
            run(s["name"], s["sql"])


def sample_data(db):
    """Committed batches of two writers with their own epoch numbers (writer A commits partitions
    0 and 1, then writer B takes partition 1 over and numbers its epochs from 1 again); one batch
    written twice, one never committed."""
    t = f"{db}.revenue_agg"
    rows = {
        # (version, partition, window start, customer, currency, orders, revenue)
        "a1": [(10, 0, T0, "c1", "EUR", 3, "30.5"), (10, 0, T0 + 60, "c2", "USD", 1, "9.99"),
               (8, 1, T0, "c1", "EUR", 2, "1.25")],
        "a2": [(20, 0, T0, "c1", "EUR", 5, "50.5"), (20, 0, T0 + 120, "c1", "EUR", 1, "1")],
        "b1": [(15, 1, T0 + 60, "c2", "USD", 4, "4.4"), (15, 1, T0 + 600, "c3", "GBP", 1, "2")],
    }
    commits = [
        # (batch, epoch, partitions, from offsets, to offsets, watermarks, max window start)
        ("a1", 1, [0, 1], [0, 0], [10, 8], [(T0 + 30) * MS, (T0 + 20) * MS], T0 + 60),
        ("a2", 2, [0, 1], [10, 8], [20, 8], [(T0 + 900) * MS, (T0 + 20) * MS], T0 + 120),
        ("b1", 1, [1], [8], [15], [(T0 + 800) * MS], T0 + 600),
    ]

    def data_insert(batch):
        values = ", ".join(
            f"({v}, {p}, toDateTime({w}), toDateTime({w + 60}), '{c}', '{cur}', {o}, {r})"
            for v, p, w, c, cur, o, r in batch
        )
        return f"INSERT INTO {t}_data VALUES {values}"

    statements = [data_insert(rows[b]) for b in ("a1", "a2", "b1")]
    statements.append(data_insert(rows["a2"]))  # a retried write of a committed batch
    statements.append(data_insert([(30, 0, T0, "c1", "EUR", 100, "100")]))  # never committed
    for batch, epoch, parts, frm, to, wms, max_ws in commits:
        ids = ",".join(f"{p}:{o}" for p, o in zip(parts, to))
        statements.append(
            f"INSERT INTO {t}_commits (batch_id, job, epoch, partitions, from_offsets, to_offsets, watermarks, "
            f"max_window_start, row_count, event_count, revenue_sum, dead_letters, committed_at) VALUES "
            f"('it/orders[{ids}]', 'it', {epoch}, {parts}, {frm}, {to}, {wms}, toDateTime({max_ws}), "
            f"{len(rows[batch])}, {sum(r[5] for r in rows[batch])}, 0, 0, toDateTime({T0}))"
        )
    return statements


EXPECTED_VIEW_AT = [
    f"{T0}\tc1\tEUR\t7\t51.75",
    f"{T0 + 60}\tc2\tUSD\t1\t9.99",
    f"{T0 + 120}\tc1\tEUR\t1\t1",
]

EXPECTED_VIEW = [
    f"{T0}\tc1\tEUR\t7\t51.75",
    f"{T0 + 60}\tc2\tUSD\t5\t14.39",
    f"{T0 + 120}\tc1\tEUR\t1\t1",
    f"{T0 + 600}\tc3\tGBP\t1\t2",
]


def normal(tsv):
    """Sorted lines, decimals without trailing zeros (servers print Decimal scale differently)."""

    def number(field):
        if "." in field and field.replace(".", "", 1).lstrip("-").isdigit():
            field = field.rstrip("0").rstrip(".")
        return field

    return sorted("\t".join(number(f) for f in line.split("\t")) for line in tsv.splitlines() if line)


class Check:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def that(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            print(f"FAIL: {what}")


def scenario(engine, database, check):
    """Runs the scenario on one engine; returns {step name: normalised answer}."""
    atomic = engine.name == "chdb"
    statements = catalog(TALLY, database, atomic)
    by_name = {s["name"]: s["sql"] for s in statements}
    # Publishes as of every committed batch, from the frontiers before and after the fold.
    everything = "0:20,1:15"
    publish_all = [s for s in catalog(TALLY, database, atomic, as_of=everything) if s["name"].startswith("publish.")]
    publish_after = [s for s in catalog(TALLY, database, atomic, frm=T0 + 600, as_of=everything)
                     if s["name"].startswith("publish.")]
    answers = {}

    run = runner(engine, check)

    lease_db = f"{database}__revenue_agg__read1"
    engine.query(f"DROP DATABASE IF EXISTS {lease_db}")
    engine.query(f"DROP DATABASE IF EXISTS {database}")
    for s in statements:
        if s["name"].startswith("create."):
            run(s["name"], s["sql"])
    # The read side's claim of generation 1: its database, lease, beat and log row.
    for s in statements:
        if s["name"].startswith("claim."):
            run(s["name"], s["sql"])
    answers["claimed.read.generations"] = normal(run("read.generations", by_name["read.generations"]))
    check.that(answers["claimed.read.generations"] == [lease_db],
               f"{engine.name}: generations after the claim: {answers['claimed.read.generations']}")
    answers["claimed.read.holder"] = normal(run("read.holder", by_name["read.holder"]))
    check.that(answers["claimed.read.holder"] == ["sqlcheck"],
               f"{engine.name}: holder: {answers['claimed.read.holder']}")
    for i, sql in enumerate(sample_data(database)):
        run(f"sample.{i}", sql)
    # Readers see nothing before a publish; a publish as of a cut shows exactly that cut.
    answers["unpublished.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["unpublished.read.view"] == [],
               f"{engine.name}: the view before any publish: {answers['unpublished.read.view']}")
    for s in statements:
        if s["name"].startswith("publish."):
            run(s["name"], s["sql"])
    answers["published_at.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["published_at.read.view"] == normal("\n".join(EXPECTED_VIEW_AT)),
               f"{engine.name}: view published at 0:20,1:8: {answers['published_at.read.view']}")
    answers["published_at.read.published"] = normal(run("read.published", by_name["read.published"]))
    check.that(answers["published_at.read.published"] == ["0\t[0,1]\t[20,8]"],
               f"{engine.name}: the snapshot's cut: {answers['published_at.read.published']}")
    for s in publish_all:
        run(s["name"], s["sql"])
    # Every read before the fold.
    for s in statements:
        if s["name"].startswith("read."):
            answers["before." + s["name"]] = normal(run(s["name"], s["sql"]))
    check.that(answers["before.read.view"] == normal("\n".join(EXPECTED_VIEW)),
               f"{engine.name}: view before folding: {answers['before.read.view']}")
    # As of writer A's second batch: writer B's later batch of partition 1 is not counted.
    check.that(answers["before.read.view_at"] == normal("\n".join(EXPECTED_VIEW_AT)),
               f"{engine.name}: view at 0:20,1:8: {answers['before.read.view_at']}")
    check.that(answers["before.read.committed_offsets"] == normal("0\t20\n1\t15"),
               f"{engine.name}: committed offsets: {answers['before.read.committed_offsets']}")
    # Rebuilding the commit log with its key (as for a log of the earlier layout) keeps its rows.
    for s in statements:
        if s["name"].startswith("migrate."):
            run(s["name"], s["sql"])
    answers["migrated.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["migrated.read.view"] == answers["before.read.view"],
               f"{engine.name}: migrating the commit log changed the view: {answers['migrated.read.view']}")
    # The fold step: fold, log, install, drop the folded versions.
    for s in statements:
        if s["name"].split(".")[0] in ("fold", "install") or s["name"] == "drop.versions":
            run(s["name"], s["sql"])
    view_after = normal(run("read.view", by_name["read.view"]))
    answers["after.read.view"] = view_after
    check.that(view_after == answers["before.read.view"],
               f"{engine.name}: folding changed the view: {view_after}")
    answers["after.read.count_final"] = normal(run("read.count_final", by_name["read.count_final"]))
    check.that(answers["after.read.count_final"] == ["3"],
               f"{engine.name}: three windows folded: {answers['after.read.count_final']}")
    answers["after.read.logged_frontiers"] = normal(run("read.logged_frontiers", by_name["read.logged_frontiers"]))
    # A publish from the new frontier holds only the window still open; the view is the same.
    for s in publish_after:
        run(s["name"], s["sql"])
    answers["republished.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["republished.read.view"] == view_after,
               f"{engine.name}: publishing from the new frontier changed the view: {answers['republished.read.view']}")
    answers["republished.live"] = normal(run("live", f"SELECT count() FROM {database}.revenue_agg_live"))
    check.that(answers["republished.live"] == ["1"],
               f"{engine.name}: rows published from the new frontier: {answers['republished.live']}")
    # A step that died after inserting folded rows: the repair rebuilds the folded table without
    # the rows at or after the frontier (the day holding them copied, the day before, folded
    # earlier, linked whole) and swaps it in.
    run("earlier_day", f"INSERT INTO {database}.revenue_agg_final VALUES "
                       f"(toDateTime({T0 - 86400}), toDateTime({T0 - 86340}), 'c9', 'EUR', 2, 3.5)")
    view_before_repair = normal(run("read.view", by_name["read.view"]))
    check.that(view_before_repair == sorted(view_after + [f"{T0 - 86400}\tc9\tEUR\t2\t3.5"]),
               f"{engine.name}: the earlier day's folded row: {view_before_repair}")
    run("leftover", f"INSERT INTO {database}.revenue_agg_final VALUES "
                    f"(toDateTime({T0 + 600}), toDateTime({T0 + 660}), 'c3', 'GBP', 9, 9)")
    for s in statements:
        if s["name"].startswith("repair."):
            run(s["name"], s["sql"])
    answers["repaired.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["repaired.read.view"] == view_before_repair,
               f"{engine.name}: repair changed the view: {answers['repaired.read.view']}")
    answers["repaired.read.count_final"] = normal(run("read.count_final", by_name["read.count_final"]))
    check.that(answers["repaired.read.count_final"] == ["4"],
               f"{engine.name}: repair left {answers['repaired.read.count_final']} folded rows")
    # Retention drops the folded day; the unfolded window and the day before stay.
    run("drop.retained", by_name["drop.retained"])
    answers["retained.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["retained.read.view"] == normal(f"{EXPECTED_VIEW[3]}\n{T0 - 86400}\tc9\tEUR\t2\t3.5"),
               f"{engine.name}: after retention: {answers['retained.read.view']}")
    # A new version's takeover: the windows before the frontier kept as the view shows them,
    # the job's view (here `revenue_agg_taken`) swapped for one over the version's own view
    # (here the view itself) from the frontier on and the kept windows before it; the takeover
    # logged for a later holder of the read side to read.
    run("takeover.job_view", f"CREATE VIEW {database}.revenue_agg_taken AS SELECT 1 AS x")
    for s in statements:
        if s["name"].startswith("takeover."):
            run(s["name"], s["sql"])
    read_taken = by_name["read.view"].replace(f" FROM {database}.revenue_agg", f" FROM {database}.revenue_agg_taken")
    check.that(read_taken != by_name["read.view"], f"read.view names the view: {by_name['read.view']}")
    answers["taken.view"] = normal(run("taken", read_taken))
    check.that(answers["taken.view"] == answers["retained.read.view"],
               f"{engine.name}: the taken-over view differs from the view: {answers['taken.view']}")
    answers["taken.kept"] = normal(run("kept", f"SELECT count() FROM {database}.revenue_agg_kept"))
    answers["taken.read.taken_over_by"] = normal(run("read.taken_over_by", by_name["read.taken_over_by"]))
    check.that(answers["taken.read.taken_over_by"] == ["version 2 sqlcheck"],
               f"{engine.name}: the takeover's log row: {answers['taken.read.taken_over_by']}")
    # The release drops the generation's database; from then on the server refuses every
    # statement of that generation that changes what readers see (the fence).
    for s in statements:
        if s["name"].startswith("release."):
            run(s["name"], s["sql"])
    answers["released.read.generations"] = normal(run("read.generations", by_name["read.generations"]))
    check.that(answers["released.read.generations"] == [],
               f"{engine.name}: generations after the release: {answers['released.read.generations']}")
    # Every statement that creates, fills or swaps in what readers see; not the drops of
    # leftovers, which name the fenced database with IF EXISTS.
    swaps = ("RENAME TABLE", "EXCHANGE TABLES")
    fenced = [s for s in statements
              if s["name"] in ("publish.0", "publish.2", "fold.stage", "fold.attach", "fold.log",
                               "install.2", "install.3", "repair.1")
              or (s["name"].split(".")[0] in ("publish", "repair") and s["sql"].startswith(swaps))]
    check.that(len(fenced) == 10, f"{engine.name}: fenced statements {[s['name'] for s in fenced]}")
    for s in fenced:
        try:
            engine.query(s["sql"])
            check.that(False, f"{engine.name}: a fenced generation's {s['name']} was accepted")
        except RuntimeError as e:
            check.that("read1" in str(e), f"{engine.name}: {s['name']} refused for another reason: {str(e)[:200]}")
    answers["fenced.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["fenced.read.view"] == answers["retained.read.view"],
               f"{engine.name}: the fenced statements changed the view: {answers['fenced.read.view']}")
    engine.query(f"DROP DATABASE IF EXISTS {database}")
    return answers


PAGE_VIEWS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "config", "page_views.toml")

EXPECTED_PAGE_VIEWS = [
    # (window start, page, country, device, views, fastest, slowest, mean): partition 0's newest
    # version (5 views, sum 700) merged with partition 1's (2 views, sum 700).
    f"{T0}\t/home\tde\tmobile\t7\t80\t500\t200",
    f"{T0 + 60}\t/home\tus\ttablet\t1\t7\t7\t7",
    f"{T0 + 600}\t/cart\tfr\tdesktop\t1\t50\t50\t50",
]


def page_views_scenario(engine, database, check):
    """config/page_views.toml's shape (three keys; count, min, max and avg kept as sum and count):
    its tables, publish, fold and view on one engine. Returns {step name: normalised answer}."""
    atomic = engine.name == "chdb"
    everything = "0:20,1:15"
    statements = catalog(TALLY, database, atomic, as_of=everything, table="page_views", config=PAGE_VIEWS_CONFIG)
    by_name = {s["name"]: s["sql"] for s in statements}
    publish_after = [s for s in catalog(TALLY, database, atomic, frm=T0 + 600, as_of=everything, table="page_views",
                                        config=PAGE_VIEWS_CONFIG) if s["name"].startswith("publish.")]
    answers = {}

    run = runner(engine, check, "page_views ")

    engine.query(f"DROP DATABASE IF EXISTS {database}__page_views__read1")
    engine.query(f"DROP DATABASE IF EXISTS {database}")
    run_steps(run, statements, lambda name: name.startswith("create."))
    run_steps(run, statements, lambda name: name.startswith("claim."))
    t = f"{database}.page_views"
    versions = [
        # (version, partition, window start, page, country, device, views, min, max, sum, count)
        (10, 0, T0, "/home", "de", "mobile", 3, 100, 300, 600, 3),
        (10, 0, T0 + 600, "/cart", "fr", "desktop", 1, 50, 50, 50, 1),
        (20, 0, T0, "/home", "de", "mobile", 5, 80, 300, 700, 5),
        (15, 1, T0, "/home", "de", "mobile", 2, 90, 500, 700, 2),
        (15, 1, T0 + 60, "/home", "us", "tablet", 1, 7, 7, 7, 1),
        (30, 1, T0, "/home", "de", "mobile", 100, 1, 1000, 1, 100),  # never committed
    ]
    values = ", ".join(
        f"({v}, {p}, toDateTime({w}), toDateTime({w + 300}), '{pg}', '{c}', '{d}', {n}, {lo}, {hi}, {sm}, {ct})"
        for v, p, w, pg, c, d, n, lo, hi, sm, ct in versions
    )
    run("sample.versions", f"INSERT INTO {t}_data VALUES {values}")
    for batch, epoch, parts, frm, to, max_ws in (("a", 1, [0], [0], [10], T0 + 600), ("b", 2, [0], [10], [20], T0),
                                                 ("c", 1, [1], [0], [15], T0 + 60)):
        ids = ",".join(f"{p}:{o}" for p, o in zip(parts, to))
        run(f"sample.commit_{batch}",
            f"INSERT INTO {t}_commits (batch_id, job, epoch, partitions, from_offsets, to_offsets, watermarks, "
            f"max_window_start, row_count, event_count, revenue_sum, dead_letters, committed_at) VALUES "
            f"('pv/views[{ids}]', 'pv', {epoch}, {parts}, {frm}, {to}, [{(T0 + 900) * MS}], toDateTime({max_ws}), "
            f"1, 1, 0, 0, toDateTime({T0}))")
    run_steps(run, statements, lambda name: name.startswith("publish."))
    answers["page_views.published.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["page_views.published.read.view"] == normal("\n".join(EXPECTED_PAGE_VIEWS)),
               f"{engine.name}: page_views view: {answers['page_views.published.read.view']}")
    answers["page_views.read.view_at"] = normal(run("read.view_at", by_name["read.view_at"]))
    check.that(answers["page_views.read.view_at"] == answers["page_views.published.read.view"],
               f"{engine.name}: page_views answer as of the cut: {answers['page_views.read.view_at']}")
    run_steps(run, statements, lambda name: name.split(".")[0] in ("fold", "install") or name == "drop.versions")
    run_steps(run, publish_after, lambda name: True)
    answers["page_views.folded.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["page_views.folded.read.view"] == answers["page_views.published.read.view"],
               f"{engine.name}: folding changed the page_views view: {answers['page_views.folded.read.view']}")
    answers["page_views.folded.count_final"] = normal(run("read.count_final", by_name["read.count_final"]))
    check.that(answers["page_views.folded.count_final"] == ["2"],
               f"{engine.name}: page_views windows folded: {answers['page_views.folded.count_final']}")
    engine.query(f"DROP DATABASE IF EXISTS {database}__page_views__read1")
    engine.query(f"DROP DATABASE IF EXISTS {database}")
    return answers


ORDERS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "config", "orders.toml")
H0 = T0 - T0 % 3600  # orders' windows are hours

EXPECTED_ORDERS = [
    # (window start, customer, orders, revenue): c1's rows were all retracted (count 0 in both
    # partitions' newest versions): the view leaves the group out.
    f"{H0}\tc3\t1\t7.5",
    f"{H0 + 3600}\tc2\t1\t5",
]


def orders_scenario(engine, database, check):
    """config/orders.toml's shape, a job of changes: a group whose rows were all retracted
    (count 0 in each partition's newest version) is left out of the published answer, of the
    folded rows and of the view. Returns {step name: normalised answer}."""
    atomic = engine.name == "chdb"
    everything = "0:20,1:25"
    statements = catalog(TALLY, database, atomic, as_of=everything, table="orders", config=ORDERS_CONFIG)
    by_name = {s["name"]: s["sql"] for s in statements}
    answers = {}

    run = runner(engine, check, "orders ")

    engine.query(f"DROP DATABASE IF EXISTS {database}__orders__read1")
    engine.query(f"DROP DATABASE IF EXISTS {database}")
    run_steps(run, statements, lambda name: name.startswith("create."))
    run_steps(run, statements, lambda name: name.startswith("claim."))
    t = f"{database}.orders"
    versions = [
        # (version, partition, window start, customer, orders, revenue)
        (10, 0, H0, "c1", 2, "30.00"),
        (20, 0, H0, "c1", 0, "0.00"),
        (10, 0, H0 + 3600, "c2", 1, "5.00"),
        (15, 1, H0, "c1", 1, "2.00"),
        (15, 1, H0, "c3", 1, "7.50"),
        (25, 1, H0, "c1", 0, "0.00"),
    ]
    values = ", ".join(
        f"({v}, {p}, toDateTime({w}), toDateTime({w + 3600}), '{c}', {n}, toDecimal64('{r}', 2))"
        for v, p, w, c, n, r in versions
    )
    run("sample.versions", f"INSERT INTO {t}_data VALUES {values}")
    for batch, epoch, parts, frm, to, max_ws in (("a", 1, [0], [0], [10], H0 + 3600), ("b", 2, [0], [10], [20], H0),
                                                 ("c", 1, [1], [0], [15], H0), ("d", 2, [1], [15], [25], H0)):
        ids = ",".join(f"{p}:{o}" for p, o in zip(parts, to))
        run(f"sample.commit_{batch}",
            f"INSERT INTO {t}_commits (batch_id, job, epoch, partitions, from_offsets, to_offsets, watermarks, "
            f"max_window_start, row_count, event_count, revenue_sum, dead_letters, committed_at) VALUES "
            f"('o/orders[{ids}]', 'o', {epoch}, {parts}, {frm}, {to}, [{(H0 + 9 * 3600) * MS}], toDateTime({max_ws}), "
            f"1, 1, 0, 0, toDateTime({T0}))")
    run_steps(run, statements, lambda name: name.startswith("publish."))
    answers["orders.published.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["orders.published.read.view"] == normal("\n".join(EXPECTED_ORDERS)),
               f"{engine.name}: orders view: {answers['orders.published.read.view']}")
    answers["orders.read.view_at"] = normal(run("read.view_at", by_name["read.view_at"]))
    check.that(answers["orders.read.view_at"] == answers["orders.published.read.view"],
               f"{engine.name}: orders answer as of the cut: {answers['orders.read.view_at']}")
    run_steps(run, statements, lambda name: name.split(".")[0] in ("fold", "install") or name == "drop.versions")
    answers["orders.folded.read.view"] = normal(run("read.view", by_name["read.view"]))
    check.that(answers["orders.folded.read.view"] == answers["orders.published.read.view"],
               f"{engine.name}: folding changed the orders view: {answers['orders.folded.read.view']}")
    answers["orders.folded.count_final"] = normal(run("read.count_final", by_name["read.count_final"]))
    check.that(answers["orders.folded.count_final"] == ["1"],
               f"{engine.name}: orders windows folded (c3 only; c1 is empty): {answers['orders.folded.count_final']}")
    engine.query(f"DROP DATABASE IF EXISTS {database}__orders__read1")
    engine.query(f"DROP DATABASE IF EXISTS {database}")
    return answers


def replicated_scenario(engine, database, check):
    """A job on a replicated cluster, on the current engine: it runs no coordinator in process,
    so each replicated CREATE must get as far as asking for one (code 225: the engine and its
    arguments accepted), the cluster's tables answer with the columns tally reads, the remote
    read of a member's macros parses, and SYNC REPLICA parses (refused on a table that is not
    replicated, code 36). The cluster tests run the same statements on 18.16 replicas."""
    db = f"{database}_replicated"
    engine.query(f"CREATE DATABASE IF NOT EXISTS {db}")
    for s in catalog(TALLY, db, True, replicated=True):
        name, sql = s["name"], s["sql"]
        if name.startswith("create.") and "ReplicatedMergeTree" in sql:
            sql = sql.replace("{shard}", "1").replace("{replica}", "r1")
            try:
                engine.query(sql)
                check.that(False, f"{engine.name}: {name} created a replicated table without a coordinator")
            except RuntimeError as e:
                check.that("Code: 225" in str(e), f"{engine.name} rejected {name}: {str(e)[:300]}")
        elif name == "cluster.members":
            try:
                engine.query(sql)
                check.that(True, name)
            except RuntimeError as e:
                check.that(False, f"{engine.name} rejected {name}: {str(e)[:300]}")
        elif name == "cluster.member_macro":
            try:
                engine.query(f"EXPLAIN SYNTAX {sql}")
                check.that(True, name)
            except RuntimeError as e:
                check.that(False, f"{engine.name} rejected {name}: {str(e)[:300]}")
        elif name.startswith("cluster.sync"):
            for t in ("revenue_agg_data", "revenue_agg_commits"):
                engine.query(f"CREATE TABLE IF NOT EXISTS {db}.{t} (x UInt8) ENGINE = MergeTree ORDER BY x")
            try:
                engine.query(sql)
                check.that(False, f"{engine.name}: {name} ran on a table that is not replicated")
            except RuntimeError as e:
                check.that("Code: 36" in str(e), f"{engine.name} rejected {name}: {str(e)[:300]}")


def main():
    global TALLY
    TALLY = sys.argv[1]
    url = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8123"
    check = Check()
    database = f"tally_sqlcheck_{os.getpid()}"
    with tempfile.TemporaryDirectory() as path:
        engines = [Embedded(path), Server(url)]
        results = {}
        for engine in engines:
            version = engine.version().strip()
            print(f"{engine.name}: ClickHouse {version}")
            results[engine.name] = scenario(engine, database, check)
            results[engine.name].update(page_views_scenario(engine, database, check))
            results[engine.name].update(orders_scenario(engine, database, check))
            if engine.name == "chdb":
                replicated_scenario(engine, database, check)
    # Engine-specific reads: the database engine, and part names.
    skip = ("read.database_engine", "read.partitions", "read.beat_age")
    current, old = results["chdb"], results["server"]
    for key in sorted(current):
        if key.endswith(skip):
            continue
        check.that(current[key] == old.get(key),
                   f"{key} differs: chdb {current[key]} vs 18.16 {old.get(key)}")
    print(f"sqlcheck: {check.passed} passed, {check.failed} failed")
    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
