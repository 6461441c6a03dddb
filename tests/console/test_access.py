"""Who gets in: every page and action needs a session an admin token opened; actions need the
session's CSRF token and the console's own origin; no secret is ever rendered."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import requests
from tests.console.conftest import TOKEN, Served

PAGES = ["/", "/live", "/destinations", "/destinations/warehouse", "/failed", "/webhooks"]
PAGES += ["/transport", "/config", "/live/record?topic=t&partition=0&offset=0"]


def test_without_a_session_every_page_is_refused(served: Served) -> None:
    anonymous = served.client(login=False)
    for path in PAGES:
        answer = anonymous.get(f"{served.url}{path}", allow_redirects=False)
        assert answer.status_code == 401, path
        assert TOKEN not in answer.text
    # a browser asking for a page is sent to the login page, and back after it
    answer = anonymous.get(
        f"{served.url}/failed?code=x", headers={"Accept": "text/html"}, allow_redirects=False
    )
    assert answer.status_code == 303
    location = urlsplit(answer.headers["Location"])
    assert location.path == "/login" and parse_qs(location.query)["next"] == ["/failed?code=x"]
    assert anonymous.get(f"{served.url}/healthz").text == "ok"


def test_a_wrong_token_a_forged_or_foreign_cookie_are_refused(served: Served) -> None:
    anonymous = served.client(login=False)
    wrong = anonymous.post(f"{served.url}/login", data={"token": "guess"}, allow_redirects=False)
    assert wrong.status_code == 401
    assert "hw_console" not in wrong.cookies
    good = served.client()
    cookie = good.cookies["hw_console"]
    forged = cookie[:-3] + ("AAA" if not cookie.endswith("AAA") else "BBB")
    for value in (forged, "1.2.3", "", cookie.replace(cookie.split(".")[0], "9999999999", 1)):
        anonymous.cookies.set("hw_console", value)
        assert anonymous.get(f"{served.url}/config").status_code == 401


def test_the_session_cookie_is_httponly_and_strict(served: Served) -> None:
    anonymous = served.client(login=False)
    answer = anonymous.post(
        f"{served.url}/login",
        data={"token": TOKEN, "next": "//evil.example/x"},
        allow_redirects=False,
    )
    assert answer.status_code == 303
    assert answer.headers["Location"] == "/"  # never sent to another site
    set_cookie = answer.headers["Set-Cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    page = anonymous.get(f"{served.url}/", headers={"Accept": "text/html"})
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert page.headers["X-Frame-Options"] == "DENY"


def test_actions_need_the_csrf_token_and_the_console_origin(served: Served) -> None:
    client = served.client()
    url = f"{served.url}/destinations/pause"
    csrf = served.csrf(client, "/destinations")
    no_token = client.post(url, data={"id": "warehouse"}, allow_redirects=False)
    assert no_token.status_code == 403 and "CSRF" in no_token.text
    other = requests.Session()
    other.cookies.update(client.cookies)
    foreign = other.post(
        url,
        data={"id": "warehouse", "csrf": csrf},
        headers={"Origin": "http://evil.example"},
        allow_redirects=False,
    )
    assert foreign.status_code == 403 and "Origin" in foreign.text
    from headwater.pipeline.status import paused

    assert paused(served.config) == {}
    done = client.post(url, data={"id": "warehouse", "csrf": csrf}, allow_redirects=False)
    assert done.status_code == 303
    assert set(paused(served.config)) == {"warehouse"}
    page = client.get(f"{served.url}/destinations", headers={"Accept": "text/html"}).text
    assert "Resume" in page
    client.post(f"{served.url}/destinations/resume", data={"id": "warehouse", "csrf": csrf})
    assert paused(served.config) == {}
    unknown = client.post(url, data={"id": "nope", "csrf": csrf}, allow_redirects=False)
    assert unknown.status_code == 400 and "warehouse" in unknown.text


def test_logging_out_ends_the_session(served: Served) -> None:
    client = served.client()
    csrf = served.csrf(client)
    client.post(f"{served.url}/logout", data={"csrf": csrf})
    assert client.get(f"{served.url}/config").status_code == 401


def test_the_configuration_is_shown_with_every_secret_masked(served: Served) -> None:
    client = served.client()
    page = client.get(f"{served.url}/config", headers={"Accept": "text/html"}).text
    assert "sekrit-api-key" not in page
    assert (
        "Authorization: &#39;***&#39;" in page
        or "Authorization: &#34;***&#34;" in page
        or ("Authorization: ***" in page)
    )
    for h in (
        served.config.console.admin_token_hashes + served.config.webhooks.sources[0].write_keys
    ):
        assert h.removeprefix("sha256:") not in page
    assert "warehouse" in page and "http://127.0.0.1:9/batch" in page
