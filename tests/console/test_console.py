"""`paceline serve`'s web console in headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium): the page loads with the token, its numbers change
while the lane drains, an XSS payload from a job or an answer shows as text, a wrong
token is refused, a read-only token cannot act, and the redrive button moves dead
letters back. `/metrics` is read by Prometheus's own parser.

Run by ./scripts/test.sh; alone: PACELINE_BIN=target/debug/paceline .venv/bin/pytest tests/console
"""

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

ACT = "act-token-for-the-console-tests-0123456789"
READ = "read-token-for-the-console-tests-012345678"
XSS = '<img src=x onerror="window.__xss=1">'
GOOD_JOBS = 40
MISSING_JOBS = 5


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeApi(BaseHTTPRequestHandler):
    """Answers /items/N with JSON holding an XSS payload; /missing/N with 404 until
    `missing_found` is set (then 200)."""

    missing_found = False

    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.answer()

    def answer(self):
        status = 404 if self.path.startswith("/missing/") and not FakeApi.missing_found else 200
        body = json.dumps({"path": self.path, "note": XSS}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def request(base, method, path, token=ACT, body=None, content_type="application/json"):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"content-type": content_type}
    if token:
        headers["authorization"] = "Bearer " + token
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_for(what, check, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out waiting for " + what)


def start_serve(api_port, quota_lines):
    """`paceline serve` of a new embedded stack against the fake API, and its base URL."""
    folder = tempfile.mkdtemp(prefix="paceline-console-")
    config = os.path.join(folder, "paceline.toml")
    with open(config, "w") as f:
        f.write(
            f'[api]\nbase_url = "http://127.0.0.1:{api_port}"\n'
            + quota_lines
            + '[serve]\ntoken = { env = "CONSOLE_ACT" }\nread_token = { env = "CONSOLE_READ" }\n'
        )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, CONSOLE_ACT=ACT, CONSOLE_READ=READ)
    binary = os.environ.get("PACELINE_BIN", "target/debug/paceline")
    serve = subprocess.Popen([binary, "serve", "--config", config, "--listen", f"127.0.0.1:{port}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def listening():
        try:
            return request(base, "GET", "/v1/status")[0] == 200
        except urllib.error.URLError:
            assert serve.poll() is None, serve.communicate()[0]
            return False

    wait_for("serve to listen", listening)
    return base, serve


def stop_serve(serve):
    serve.terminate()
    output = serve.communicate(timeout=30)[0]
    assert serve.returncode == 0, output
    assert "run ended" in output, output


@pytest.fixture(scope="module")
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()


@pytest.fixture(scope="module")
def stack(api):
    base, serve = start_serve(api, '[quota]\ntiers = ["8/s"]\n')
    lines = [json.dumps({"id": f"item-{n}", "request": {"method": "GET", "path": f"/items/{n}"}}) for n in range(GOOD_JOBS)]
    lines += [json.dumps({"id": f"missing-{n}", "request": {"method": "POST", "path": f"/missing/{n}", "body": {"comment": XSS}}}) for n in range(MISSING_JOBS)]
    status, answer = request(base, "POST", "/v1/jobs", body="\n".join(lines).encode(), content_type="application/x-ndjson")
    assert status == 202, answer
    yield base
    stop_serve(serve)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,2000"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
    yield driver
    driver.quit()


def log_in(browser, base, token):
    browser.get(base + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(base + "/")
    field = browser.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()


def text(browser, element_id):
    return browser.find_element(By.ID, element_id).text


def click(browser, selector):
    """Clicks the element `selector` finds. The console redraws its tables as news comes:
    an element found just before a redraw is found again."""

    def clicked(b):
        try:
            b.find_element(By.CSS_SELECTOR, selector).click()
            return True
        except StaleElementReferenceException:
            return False

    WebDriverWait(browser, 10).until(clicked)


def test_a_wrong_token_gets_401_and_the_console_says_so(stack, browser):
    assert request(stack, "GET", "/v1/status", token="not-the-token")[0] == 401
    log_in(browser, stack, "not-the-token")
    WebDriverWait(browser, 10).until(lambda b: "wrong token" in text(b, "message"))
    assert not browser.find_element(By.ID, "console").is_displayed()


def test_the_page_loads_with_the_token_and_its_numbers_change_while_the_lane_drains(stack, browser):
    browser.get_log("browser")  # what the wrong token's test left
    log_in(browser, stack, ACT)
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "console").is_displayed())
    calls = lambda: int(text(browser, "calls-seen") or 0)
    first = wait_for("a first call event", lambda: calls() or None)
    wait_for("more calls as the lane drains", lambda: calls() > first + 5)
    assert browser.find_elements(By.CSS_SELECTOR, "#tiers canvas"), "the tier's live chart is drawn"
    assert "/ 8 used" in text(browser, "tiers")
    assert "8/s" in text(browser, "tiers")
    problems = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE" and "favicon" not in entry["message"]]
    assert not problems, problems


def test_a_job_s_xss_payload_shows_as_text_in_the_dead_letters_and_results(stack, browser):
    WebDriverWait(browser, 60).until(lambda b: "http_404" in text(b, "dlq-causes"))
    click(browser, "#dlq-records tr.selectable")
    detail = text(browser, "dlq-detail")
    assert "window.__xss=1" in detail and "<img src=x" in detail, detail
    browser.find_element(By.ID, "results-status").send_keys("2xx")
    browser.find_element(By.CSS_SELECTOR, "#results-search button").click()
    WebDriverWait(browser, 10).until(lambda b: "<img src=x" in text(b, "results"))
    assert browser.execute_script("return window.__xss") is None, "the payload ran"
    assert not browser.find_elements(By.CSS_SELECTOR, "main img"), "the payload became an element"


def test_a_read_only_token_sees_the_dead_letters_but_cannot_redrive_them(stack, browser):
    log_in(browser, stack, READ)
    WebDriverWait(browser, 30).until(lambda b: "http_404" in text(b, "dlq-causes"))
    click(browser, "#dlq-causes button.redrive")
    WebDriverWait(browser, 10).until(lambda b: "may only read" in text(b, "message"))
    summary = json.loads(request(stack, "GET", "/v1/dlq")[1])
    assert summary["total"] == MISSING_JOBS, summary


def test_the_redrive_button_moves_the_dead_letters_back_and_they_succeed(stack, browser):
    FakeApi.missing_found = True
    log_in(browser, stack, ACT)
    WebDriverWait(browser, 30).until(lambda b: "http_404" in text(b, "dlq-causes"))
    click(browser, "#dlq-causes button.redrive")
    WebDriverWait(browser, 10).until(lambda b: f"redrove {MISSING_JOBS} dead letter(s)" in text(b, "message"))

    def redriven_succeeded():
        page = json.loads(request(stack, "GET", "/v1/results?status=2xx&limit=1000")[1])
        return sum(1 for record in page["records"] if record["job_id"].startswith("missing-")) == MISSING_JOBS

    wait_for("the redriven jobs to succeed", redriven_succeeded, timeout=60)
    assert json.loads(request(stack, "GET", "/v1/dlq")[1])["total"] == 0


def test_metrics_parse_as_prometheus_text_and_count_the_calls(stack):
    status, body = request(stack, "GET", "/metrics", token=READ)
    assert status == 200
    families = {family.name: family for family in text_string_to_metric_families(body)}
    for name in ["paceline_calls", "paceline_tier_used", "paceline_tier_limit", "paceline_queue_jobs", "paceline_circuit_state", "paceline_dispatch_to_call_delay_seconds"]:
        assert name in families, sorted(families)
    calls = sum(sample.value for sample in families["paceline_calls"].samples if sample.name == "paceline_calls_total")
    assert calls >= GOOD_JOBS, body
    limits = {sample.labels["tier"]: sample.value for sample in families["paceline_tier_limit"].samples}
    assert limits == {"8/s": 8}


def test_the_lanes_table_shows_each_lane_s_backlog_and_rate(api, browser):
    base, serve = start_serve(api, '[quota]\ntiers = ["10/s"]\n[lanes]\ntiers = ["4/s"]\n')
    try:
        lines = [json.dumps({"id": f"{lane}-{n}", "lane": lane, "request": {"method": "GET", "path": f"/items/{n}"}}) for lane in ["acme", "globex"] for n in range(60)]
        assert request(base, "POST", "/v1/jobs", body="\n".join(lines).encode(), content_type="application/x-ndjson")[0] == 202
        log_in(browser, base, READ)
        # Read in one script: the table is drawn anew every second.
        script = 'return Array.from(document.querySelectorAll("#lanes tr"), (r) => Array.from(r.cells, (c) => c.textContent));'
        rows = lambda: {cells[0]: cells for cells in browser.execute_script(script)}
        WebDriverWait(browser, 30).until(lambda b: {"acme", "globex"} <= set(rows()))
        # Each lane paced at its own 4/s: the console's rate comes from the calls it sees.
        WebDriverWait(browser, 30).until(lambda b: all(float(rows()[lane][6]) >= 1.0 for lane in ["acme", "globex"]))
        assert rows()["acme"][2] == "4/s", rows()
    finally:
        stop_serve(serve)
