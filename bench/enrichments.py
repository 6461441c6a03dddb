"""What each enrichment costs: 1,000,000 clickstream events through a destination's program
in-process (one Python process, one core, as one Spark task runs it), without enrichments and
with each one alone, then all of them; plus the two choices behind them, measured:

* ``bot_detect``: ``crawler-user-agents`` against ``crawlerdetect`` (when installed) over
  100,000 user agents (about 1,000 distinct, 3% crawlers), each distinct agent checked once,
  as the task does;
* ``campaign``: the SQL (``regexp_extract`` per parameter) against a DuckDB function over Arrow
  that parses each distinct URL once in Python, over the same URLs.

Run from the repository root::

    .venv/bin/python bench/enrichments.py              # 1,000,000 events, about 3 minutes
    .venv/bin/python bench/enrichments.py --quick      # 100,000 events

The events differ in page URL (a third with utm parameters, a tenth with a click id),
referrer, IP address (about 20,000) and user agent (about 1,000); every one has its own
messageId, so the fingerprint keeps them all.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))

from _common import arguments, print_table, progress
from headwater.bus import context
from headwater.testing.pipeline import source_table

KEY_ENV = "HW_BENCH_PII_KEY"
CASES: dict[str, list[dict[str, Any]]] = {
    "none": [],
    "bot_detect": [{"name": "bot_detect"}],
    "referrer": [{"name": "referrer"}],
    "campaign": [{"name": "campaign"}],
    "ip_anonymize": [{"name": "ip_anonymize"}],
    "pii_pseudonymize": [
        {"name": "pii_pseudonymize", "fields": ["/userId", "/context/traits/email"]}
    ],
    "fingerprint": [{"name": "fingerprint", "fields": ["/messageId"]}],
}
CASES["all six"] = [r for rules in CASES.values() for r in rules]
BROWSERS = ("Chrome", "Firefox", "Safari", "Edg", "OPR")
SYSTEMS = (
    "Windows NT 10.0; Win64; x64",
    "Macintosh; Intel Mac OS X 14_5",
    "X11; Linux x86_64",
    "Linux; Android 14; Pixel 8",
    "iPhone; CPU iPhone OS 17_5 like Mac OS X",
)
CRAWLERS = (
    "Mozilla/5.0 (compatible; Googlebot/2.1; +http://www.google.com/bot.html)",
    "Mozilla/5.0 (compatible; bingbot/2.0; +http://www.bing.com/bingbot.htm)",
    "Mozilla/5.0 (compatible; AhrefsBot/7.0; +http://ahrefs.com/robot/)",
    "Mozilla/5.0 (compatible; YandexBot/3.0; +http://yandex.com/bots)",
    "facebookexternalhit/1.1 (+http://www.facebook.com/externalhit_uatext.php)",
    "python-requests/2.32.3",
    "curl/8.5.0",
    "Mozilla/5.0 AppleWebKit/537.36 (KHTML, like Gecko; compatible; GPTBot/1.2; "
    "+https://openai.com/gptbot)",
)
REFERRERS = (
    None,
    "https://www.google.com/",
    "https://www.google.de/search?q=boots",
    "https://t.co/x1",
    "https://l.facebook.com/l.php?u=x",
    "https://mail.google.com/mail/u/0/",
    "https://shop.example.com/cart",
    "https://blog.partner.example/post",
)


def agents(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct browser user agents."""
    out: set[str] = set()
    while len(out) < n:
        version = f"{rng.randint(100, 130)}.0.{rng.randint(0, 6000)}.{rng.randint(0, 200)}"
        browser = rng.choice(BROWSERS)
        out.add(
            f"Mozilla/5.0 ({rng.choice(SYSTEMS)}) AppleWebKit/537.36 (KHTML, like Gecko) "
            f"{browser}/{version} Safari/537.36"
        )
    return sorted(out)


def user_agent(rng: random.Random, people: list[str]) -> str:
    return rng.choice(CRAWLERS) if rng.random() < 0.03 else rng.choice(people)


def page_url(rng: random.Random) -> str:
    url = f"https://shop.example.com/p/{rng.randint(1, 400)}"
    params = []
    if rng.random() < 0.33:
        params += [
            f"utm_source={rng.choice(['google', 'news%20letter', 'x'])}",
            f"utm_medium={rng.choice(['cpc', 'email', 'social'])}",
            f"utm_campaign=spring+sale+{rng.randint(1, 20)}",
        ]
    if rng.random() < 0.1:
        params.append(f"{rng.choice(['gclid', 'fbclid', 'msclkid'])}={rng.getrandbits(40):x}")
    return url + ("?" + "&".join(params) if params else "")


def workload(n: int, seed: int = 11) -> pa.Table:
    """``n`` events in the source's layout."""
    rng = random.Random(seed)
    people = agents(rng, 970)
    events, each = [], []
    for i in range(n):
        events.append(
            {
                "messageId": f"m-{i}",
                "type": "track",
                "event": rng.choice(["view", "add_to_cart", "checkout"]),
                "userId": f"u-{rng.randint(1, 50_000)}",
                "context": {
                    "page": {"url": page_url(rng), "referrer": rng.choice(REFERRERS)},
                    "traits": {"email": f"p{rng.randint(1, 50_000)}@example.com"},
                },
                "properties": {"price": rng.randint(1, 500), "sku": f"SKU-{rng.randint(1, 999)}"},
            }
        )
        ip = f"81.2.{rng.randint(0, 79)}.{rng.randint(1, 254)}"
        if rng.random() < 0.05:
            ip = f"2001:db8:{rng.randint(0, 99):x}::{rng.randint(1, 9999):x}"
        each.append(
            {
                context.CLIENT_IP: ip,
                context.USER_AGENT: user_agent(rng, people),
                context.EVENT_ID: f"ev-{i}",
            }
        )
    return source_table(events, each=each)


def run_case(source: pa.Table, rules: list[dict[str, Any]], root: Path) -> float:
    """Seconds to run ``source`` through a DuckDB destination's program with ``rules``
    (planned from its first 20,000 rows, as a writer learns)."""
    from headwater.config.model import HeadwaterConfig
    from headwater.destinations import open_destination
    from headwater.pipeline.plan import Knowledge, plan
    from headwater.pipeline.task import LEARN, WRITE, TaskRun

    spec = {"id": "wh", "type": "duckdb", "path": str(root / "wh.duckdb"), "enrichment": rules}
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(root / "data"), "pipeline": {"destinations": [spec]}}
    )
    dest_config = config.pipeline.destinations[0]
    destination = open_destination(dest_config, config.data_dir)
    known, sample = Knowledge(), source.slice(0, 20_000)
    try:
        for _ in range(4):
            program = plan(known, dest_config, destination, config.pipeline, root).program
            found = TaskRun(program, "wh", LEARN).run(sample.to_batches())
            if not known.learn(found.leaves, found.seen, dest_config):
                break
        program = plan(known, dest_config, destination, config.pipeline, root).program
        landed = [0]

        def count(tables: dict[str, pa.Table]) -> None:
            landed[0] += sum(t.num_rows for t in tables.values())

        start = time.perf_counter()
        TaskRun(program, "wh", WRITE, count).run(source.to_batches(max_chunksize=10_000))
        elapsed = time.perf_counter() - start
        assert landed[0] == source.num_rows, (landed[0], source.num_rows)
        return elapsed
    finally:
        destination.close()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bot_libraries(rng: random.Random) -> list[list[Any]]:
    """Each library over 100,000 agents (every distinct one checked once, uncached)."""
    import crawleruseragents

    people = agents(rng, 970)
    sample = [user_agent(rng, people) for _ in range(100_000)]
    distinct = sorted(set(sample))
    libraries: dict[str, Callable[[str], bool]] = {
        "crawler-user-agents": lambda a: bool(crawleruseragents.matching_crawlers(a)),
    }
    try:
        from crawlerdetect import CrawlerDetect
    except ImportError:
        progress("crawlerdetect is not installed (pip install crawlerdetect): not compared")
    else:
        libraries["crawlerdetect"] = CrawlerDetect().isCrawler
    rows = []
    for name, check in libraries.items():
        seconds = timed(lambda check=check: [check(a) for a in distinct])
        bots = sum(check(a) for a in distinct)
        missed = [c for c in CRAWLERS if not check(c)]
        rows.append([name, len(distinct), seconds * 1000, bots, ", ".join(missed) or "-"])
    return rows


def campaign_ways(urls: list[str]) -> list[list[Any]]:
    """The SQL way and the distinct-URL function over the same URLs (1 thread)."""
    from urllib.parse import parse_qs, urlsplit

    import duckdb

    from headwater.pipeline.steps.lookup import map_distinct

    names = ["utm_source", "utm_medium", "utm_campaign", "utm_term", "utm_content", "gclid"]
    names += ["fbclid", "msclkid", "dclid", "ttclid", "li_fat_id", "twclid"]
    con = duckdb.connect()
    con.execute("SET threads = 1")
    con.register("urls", pa.table({"url": urls}))

    def by_sql() -> None:
        cols = ", ".join(
            f"url_decode(replace(NULLIF(regexp_extract(url, '[?&]{n}=([^&#]*)', 1), ''), '+', ' '))"
            for n in names
        )
        con.sql(f"SELECT {cols} FROM urls").to_arrow_table()

    spec = tuple((n, pa.string()) for n in names)

    def parse(url: Any) -> tuple[Any, ...]:
        query = parse_qs(urlsplit(url).query)
        return tuple((query.get(n) or [None])[0] for n in names)

    con.create_function(
        "hw_campaign_udf",
        lambda u: map_distinct(u, parse, spec),
        ["VARCHAR"],
        "STRUCT(" + ", ".join(f"{n} VARCHAR" for n in names) + ")",
        type="arrow",
        side_effects=False,
    )

    def by_udf() -> None:
        con.sql("SELECT hw_campaign_udf(url) AS c FROM urls").to_arrow_table()

    return [
        ["SQL regexp_extract", len(urls), timed(by_sql)],
        ["distinct-URL function", len(urls), timed(by_udf)],
    ]


def main() -> None:
    parser = arguments(__doc__, quick="100,000 events instead of 1,000,000", output=False)
    args = parser.parse_args()
    n = 100_000 if args.quick else 1_000_000
    os.environ.setdefault(KEY_ENV, "bench-key")
    os.environ.setdefault("HW_PII_KEY", os.environ[KEY_ENV])
    progress(f"making {n:,} events")
    source = workload(n)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name, rules in CASES.items():
            progress(f"case {name}")
            seconds = run_case(source, rules, Path(tmp) / name.replace(" ", "_"))
            rows.append([name, n / seconds, seconds])
    base = rows[0][2]
    table = [[r[0], r[1], r[2], (r[2] - base) * 1_000_000 / n] for r in rows]
    heads = ["enrichment", "events/s", "seconds", "extra s per 1M events"]
    print(print_table(heads, table))
    print()
    heads = ["bot list", "distinct agents", "ms (all distinct)", "bots", "sample crawlers missed"]
    print(print_table(heads, bot_libraries(random.Random(3))))
    print()
    rng = random.Random(5)
    urls = [page_url(rng) for _ in range(n)]
    print(print_table(["campaign as", "URLs", "seconds"], campaign_ways(urls)))


if __name__ == "__main__":
    main()
