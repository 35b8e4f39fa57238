"""The web inbox in a real browser: headless Chromium from the system packages, driven by
Playwright (its Python package only; the browser is Debian's `chromium`, never a download).

Each test serves the real app on a socket (uvicorn in the test's loop) over a real redis-server,
with scripted agents on in-process replicas where an agent must continue. Set
`PB_SCREENSHOTS=<folder>` to write each kind's screenshots there (docs/screenshots/ holds them).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker import Broker
from tests.conftest import ClientFactory
from tests.helpers import of_type, outputs, run_audit_worker, until
from tests.runtime.test_replica import Fleet, script, start_thread, tool
from web.app import create_app
from web.settings import ApiSettings, Identity
from web.testing import serving
from workers.agents import codex
from workers.agents.harness import approval_question

pytestmark = pytest.mark.real_redis

ALICE = "alice-token-0123456789"
CHROMIUM = next(
    (
        p
        for p in (os.environ.get("PB_CHROMIUM"), shutil.which("chromium"))
        if p and Path(p).exists()
    ),
    None,
)
#: CI (and .ci/run, which always sets PB_REQUIRE_REAL_REDIS) must run these, never skip them.
REQUIRED = bool(os.environ.get("CI") or os.environ.get("PB_REQUIRE_REAL_REDIS"))
SHOTS = os.environ.get("PB_SCREENSHOTS")

try:
    from playwright.async_api import Browser, Page, async_playwright, expect
except ImportError:  # pragma: no cover - the dev extra installs it
    async_playwright = None  # type: ignore[assignment]

if CHROMIUM is None or async_playwright is None:
    why = "no chromium on PATH" if CHROMIUM is None else "playwright is not installed"
    if REQUIRED:
        raise RuntimeError(f"the browser tests must run in CI: {why} (apt-get install chromium)")
    pytest.skip(f"{why}: the browser tests need Debian's chromium", allow_module_level=True)

TARGET = {
    "question": "Where should this deploy go?",
    "header": "Target",
    "options": [
        {"label": "staging", "description": "the test cluster"},
        {"label": "production", "description": "the real one"},
    ],
}
CARDS = {
    "question": "Which cards go on the dashboard?",
    "header": "Cards",
    "multiSelect": True,
    "options": [
        {"label": "KPI cards", "description": "the four headline numbers"},
        {"label": "Table", "description": "every row, sortable"},
        {"label": "Chart", "description": "a weekly trend"},
    ],
}
NAME = {
    "question": "What should the release be called?",
    "header": "Name",
    "options": [{"label": "v2.0", "description": "the next major"}],
}


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """A real redis-server only: a browser test is slow enough without running twice."""
    request.node.add_marker(pytest.mark.real_redis)
    return "real"


@pytest.fixture
async def base_url(person: Broker) -> AsyncIterator[str]:
    tokens = (
        Identity.model_validate({"name": "alice", "token": ALICE, "scopes": ["read", "answer"]}),
    )
    app = create_app(ApiSettings(tokens=tokens, heartbeat=1.0), broker=person)
    async with serving(app) as url:
        yield url


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    assert CHROMIUM is not None
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        _errors[b] = []
        try:
            yield b
        finally:
            await b.close()
        # An exception in the page's script, or anything the security policy blocked, fails
        # the test even where the page happened to look right.
        assert _errors.pop(b) == []


_errors: dict[Browser, list[str]] = {}


async def new_page(browser: Browser, width: int = 1200) -> Page:
    context = await browser.new_context(viewport={"width": width, "height": 860})
    page = await context.new_page()
    seen = _errors[browser]
    page.on("pageerror", lambda e: seen.append(f"page error: {e}"))
    page.on(
        "console",
        lambda m: seen.append(m.text) if "Content Security Policy" in m.text else None,
    )
    return page


async def open_inbox(browser: Browser, base_url: str, width: int = 1200) -> Page:
    """A fresh browser context, signed in through the page's own form."""
    page = await new_page(browser, width)
    await page.goto(base_url + "/")
    await page.get_by_label("Token").fill(ALICE)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#who-name")).to_have_text("Signed in as alice")
    await expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    return page


async def shot(page: Page, name: str) -> None:
    if SHOTS:
        # Playwright makes the folder itself.
        await page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def entry(page: Page, thread_id: str) -> Any:
    return page.locator(".group", has_text=thread_id).locator(".entry")


async def test_sign_in_refuses_a_bad_token(browser: Browser, base_url: str) -> None:
    """A wrong token is refused in the form; the right one opens the inbox, and the token
    is not left in the page."""
    page = await new_page(browser)
    await page.goto(base_url + "/")
    await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    await shot(page, "sign-in")
    await page.get_by_label("Token").fill("not-a-token")
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#signin-error")).to_have_text("That token was not accepted.")
    await page.get_by_label("Token").fill(ALICE)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#who-name")).to_have_text("Signed in as alice")
    assert await page.locator("#token").input_value() == ""
    await page.reload()  # the session cookie keeps it signed in
    await expect(page.locator("#who-name")).to_have_text("Signed in as alice")
    await page.get_by_role("button", name="Sign out").click()
    await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    await page.reload()  # the cookie is gone with the session
    await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    await expect(page).to_have_title("prompt-broker inbox")


async def test_approve_a_command_by_button_and_the_agent_continues(
    browser: Browser, base_url: str, fleet: Fleet, person: Broker
) -> None:
    """The approval pane shows the agent's real command and folder; Approve runs it."""
    await fleet.start("r1")
    await start_thread(
        person, "deploy", script(tool("make deploy", "deployed"), {"say": "all done"})
    )
    page = await open_inbox(browser, base_url)
    await expect(entry(page, "deploy")).to_have_count(1)
    await expect(page).to_have_title("(1) prompt-broker inbox")
    await entry(page, "deploy").click()
    await expect(page.locator("pre.cmd")).to_have_text("make deploy")
    await expect(page.locator("code.cwd")).to_have_text("/work/proj")
    await expect(page.locator("#thread-items .item.prompt")).to_have_count(1)
    await shot(page, "approval")
    await page.set_viewport_size({"width": 360, "height": 760})
    await shot(page, "approval-360")
    await page.set_viewport_size({"width": 1200, "height": 860})

    await page.get_by_role("button", name="Approve", exact=True).click()
    await expect(page.locator("#note")).to_contain_text("Sent.")
    await until(
        lambda: _has_output(person, "deploy", "all done"), "the agent to run the call and go on"
    )
    lines = outputs(await person.items("deploy"))
    assert "Ran Bash `make deploy`:\ndeployed" in lines
    [answer] = [i for i in await person.items("deploy") if i.metadata.get("answers")]
    assert answer.author == "alice"  # the token's name, not anything the page said
    assert answer.metadata["answers"][0]["answer"] == ["Approve"]
    await expect(entry(page, "deploy")).to_have_count(0)
    await expect(page).to_have_title("prompt-broker inbox")
    # the open thread view re-reads its items (agent output has no event of its own)
    await expect(page.locator("#thread-items")).to_contain_text("all done", timeout=8000)


async def _has_output(b: Broker, thread_id: str, words: str) -> bool:
    return any(words in line for line in outputs(await b.items(thread_id)))


async def test_a_three_question_form_is_answered_per_question(
    browser: Browser, base_url: str, fleet: Fleet, person: Broker, make_client: ClientFactory
) -> None:
    """Radio, checkboxes and an "Other" text go out as metadata.answers, one per question,
    and the audit item records each question's answer."""
    await fleet.start("r1")
    await start_thread(person, "dash", script({"ask": [TARGET, CARDS, NAME]}, {"say": "ok"}))
    page = await open_inbox(browser, base_url)
    await entry(page, "dash").click()
    form = page.locator("#answer-form")
    await expect(form.locator("fieldset")).to_have_count(3)
    await expect(form.get_by_role("radiogroup", name="Target")).to_be_visible()
    await expect(form.get_by_text("the test cluster")).to_be_visible()
    assert await form.locator("fieldset").nth(1).locator("input[type=checkbox]").count() == 4
    await form.get_by_label("production").check()
    await form.get_by_label("KPI cards").check()
    await form.get_by_label("Chart").check()
    await form.get_by_label("Other answer to: Name").fill("Aurora")
    await shot(page, "ask_user_question")
    await page.set_viewport_size({"width": 360, "height": 760})
    await shot(page, "ask_user_question-360")
    assert await page.evaluate("() => document.documentElement.scrollWidth") <= 360
    await page.set_viewport_size({"width": 1200, "height": 860})
    await form.get_by_role("button", name="Submit answers").click()
    await expect(page.locator("#note")).to_contain_text("Sent.")

    want = [
        {"question": TARGET["question"], "answer": ["production"]},
        {"question": CARDS["question"], "answer": ["KPI cards", "Chart"]},
        {"question": NAME["question"], "answer": ["Aurora"]},
    ]
    await until(lambda: _has_output(person, "dash", "ok"), "the agent to take the answers")
    [answer] = [i for i in await person.items("dash") if i.metadata.get("answers")]
    assert answer.metadata["answers"] == want and answer.text == ""  # structured, not text
    await person.settle()
    await _run_audit(person, make_client)
    [resolved] = of_type(await person.items("dash"), "pending_prompt_resolved")
    assert resolved.metadata["prompt"]["answers"] == want
    # The thread view shows it as a card, each question's answer under its header.
    card = page.locator("#thread-items .item.answered")
    await expect(card).to_contain_text("Cards: KPI cards, Chart", timeout=8000)
    await expect(card).to_contain_text("Name: Aurora")
    await shot(page, "thread")
    page_lines = outputs(await person.items("dash"))
    assert "Which cards go on the dashboard? KPI cards, Chart" in page_lines[0]


async def _run_audit(b: Broker, make_client: ClientFactory) -> None:
    """The arq audit worker, until its queue is empty (it posts the resolution items)."""
    from arq.connections import ArqRedis

    pool = ArqRedis(connection_pool=make_client(decode_responses=False).connection_pool)
    await run_audit_worker(b, pool)


async def test_a_prompt_answered_from_the_cli_retires_within_a_second(
    browser: Browser, base_url: str, person: Broker, real_redis_url: str
) -> None:
    """An open page drops a prompt the CLI answered, and says who answered and what."""
    p = await person.ask("ops", "approval", [_approval("rm -rf build")])
    await person.ask("other", "text", [{"question": "Anything else?"}])
    page = await open_inbox(browser, base_url)
    await expect(page).to_have_title("(2) prompt-broker inbox")
    await entry(page, "ops").click()
    await expect(page.locator("pre.cmd")).to_have_text("rm -rf build")
    env = os.environ | {
        "PROMPT_BROKER_REDIS_URL": real_redis_url,
        "PROMPT_BROKER_KEY_PREFIX": person.settings.key_prefix,
    }
    cli = Path(sys.executable).with_name("prompt-broker")
    proc = await asyncio.create_subprocess_exec(
        str(cli), "answer", "ops", "yes", "--author", "bob", "--prompt", p.prompt_id, env=env
    )
    assert await proc.wait() == 0
    answered = time.monotonic()
    await expect(entry(page, "ops")).to_have_count(0, timeout=1000)
    took = time.monotonic() - answered
    assert took < 1.0, f"the answered prompt stayed {took:.2f} s"
    await expect(page).to_have_title("(1) prompt-broker inbox")
    note = page.locator("#note")
    await expect(note).to_contain_text("Already answered by bob")
    await expect(note).to_contain_text("Approve")
    await expect(page.get_by_role("button", name="Approve", exact=True)).to_be_disabled()


def _approval(command: str, cwd: str = "/srv/app") -> dict[str, Any]:
    """A command approval exactly as the Codex harness asks it (its folder in the text)."""
    return codex.approval_question(codex.COMMAND, {"command": command, "cwd": cwd}).wire()


async def test_a_superseded_form_locks_and_keeps_its_draft(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """A newer prompt on the thread locks the form being filled, with the draft and a note."""
    await person.ask("plan", "ask_user_question", [TARGET, NAME])
    page = await open_inbox(browser, base_url)
    await entry(page, "plan").click()
    form = page.locator("#answer-form")
    await form.get_by_label("staging").check()
    await form.get_by_label("Other answer to: Name").fill("half-typed name")
    newer = await person.ask("plan", "text", [{"question": "Actually: what is the goal?"}])
    await expect(page.locator("#note")).to_contain_text("Superseded", timeout=2000)
    await expect(form).to_have_attribute("aria-disabled", "true")
    await expect(form.get_by_label("staging")).to_be_checked()
    await expect(form.get_by_label("staging")).to_be_disabled()
    other = form.get_by_label("Other answer to: Name")
    await expect(other).to_have_value("half-typed name")
    assert await other.evaluate("el => el.readOnly")
    await expect(form.get_by_role("button", name="Submit answers")).to_be_disabled()
    await expect(entry(page, "plan")).to_have_count(1)  # the newer one
    await shot(page, "superseded")
    await page.get_by_role("button", name="Open the newer prompt").click()
    await page.get_by_label("Your reply").fill("ship the dashboard")
    await shot(page, "text")
    await page.set_viewport_size({"width": 360, "height": 760})
    await shot(page, "text-360")
    await page.keyboard.press("Control+Enter")
    await expect(page.locator("#note")).to_contain_text("Sent.")
    got = await person.get_prompt("plan", newer.prompt_id)
    assert got is not None and got.state == "answered"


async def test_answering_what_someone_just_answered_shows_their_answer(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """With the live stream and the list both cut, a click on an answered prompt gets the
    API's 409 and shows who answered and what; the connection state says it is not live."""
    p = await person.ask("race", "ask_user_question", [TARGET])
    page = await open_inbox(browser, base_url)
    await entry(page, "race").click()
    await page.route("**/v1/events", lambda route: route.abort())
    await page.route("**/v1/prompts*", lambda route: route.abort())
    await page.evaluate("() => window.dispatchEvent(new Event('online'))")  # reconnect, refused
    await expect(page.locator("#conn")).not_to_have_attribute("data-state", "live")
    await person.post_item(
        "race",
        {
            "author": "carol",
            "content": [],
            "metadata": {"answers": [{"question": TARGET["question"], "answer": ["staging"]}]},
        },
    )
    await page.locator("#answer-form").get_by_label("production").check()
    await page.get_by_role("button", name="Submit answers").click()
    note = page.locator("#note")
    await expect(note).to_contain_text("Already answered by carol")
    await expect(note).to_contain_text("staging")
    await expect(note).not_to_contain_text("Sent.")
    got = await person.get_prompt("race", p.prompt_id)
    assert got is not None and got.answers is not None
    assert [a.answer for a in got.answers] == [["staging"]]  # the page's click wrote nothing


async def test_the_keyboard_path(browser: Browser, base_url: str, person: Broker) -> None:
    """j/k move, a approves, d denies, digits pick (moving on per question), Ctrl+Enter submits."""
    first = await person.ask("k1", "approval", [_approval("make build")])
    form_p = await person.ask("k2", "ask_user_question", [TARGET, CARDS])
    last = await person.ask("k3", "approval", [_approval("git push --force")])
    page = await open_inbox(browser, base_url)
    current = page.locator(".entry[aria-current=true]")
    await expect(current).to_contain_text("make build")  # the oldest is selected on a wide page
    await page.keyboard.press("j")
    await expect(current).to_contain_text("Where should this deploy go?")
    await page.keyboard.press("j")
    await expect(current).to_contain_text("git push --force")
    await page.keyboard.press("d")
    await expect(page.locator("#note")).to_contain_text("Sent.")
    await page.keyboard.press("k")
    await page.keyboard.press("k")
    await expect(current).to_contain_text("make build")
    await page.keyboard.press("a")
    await expect(page.locator("#note")).to_contain_text("Sent.")
    await page.keyboard.press("j")
    await expect(current).to_contain_text("Where should this deploy go?")
    await page.keyboard.press("2")  # production; focus goes on to the next question
    await page.keyboard.press("1")  # KPI cards
    await page.keyboard.press("3")  # Chart
    await page.keyboard.press("Control+Enter")
    await expect(page.locator("#note")).to_contain_text("Sent.")
    await expect(page).to_have_title("prompt-broker inbox")

    async def answers(thread_id: str, prompt_id: str) -> list[list[str]]:
        got = await person.get_prompt(thread_id, prompt_id)
        assert got is not None and got.answers is not None, thread_id
        return [a.answer for a in got.answers]

    assert await answers("k1", first.prompt_id) == [["Approve"]]
    assert await answers("k3", last.prompt_id) == [["Deny"]]
    assert await answers("k2", form_p.prompt_id) == [["production"], ["KPI cards", "Chart"]]


async def test_a_denial_carries_its_message(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """The optional message goes with Deny: as the answer's extra words and as the text."""
    p = await person.ask("deny", "approval", [_approval("terraform destroy")])
    page = await open_inbox(browser, base_url, width=360)
    await entry(page, "deny").click()
    # 360 px wide: nothing runs off the side
    assert await page.evaluate("() => document.documentElement.scrollWidth") <= 360
    await page.get_by_label("Message with a denial (optional)").fill("not on a Friday")
    await page.get_by_role("button", name="Deny").click()
    await expect(page.locator("#note")).to_contain_text("Sent.")
    got = await person.get_prompt("deny", p.prompt_id)
    assert got is not None and got.answers is not None
    assert got.answers[0].answer == ["Deny", "not on a Friday"]
    [item] = [i for i in await person.items("deny") if i.metadata.get("answers")]
    assert item.text == "not on a Friday"


async def test_without_the_stream_the_page_polls_and_says_so(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """The event stream cut: the state says so, and the fallback poll still shows new prompts."""
    page = await open_inbox(browser, base_url)
    await page.route("**/v1/events", lambda route: route.abort())
    await page.evaluate("() => window.dispatchEvent(new Event('online'))")  # reconnect, refused
    await expect(page.locator("#conn")).to_have_attribute("data-state", "polling")
    await expect(page.locator("#conn")).to_contain_text("Reconnecting")
    await person.ask("late", "approval", [_approval("make test")])
    await expect(entry(page, "late")).to_have_count(1, timeout=6000)  # one 3 s poll, and slack
    await page.unroute("**/v1/events")
    await page.evaluate("() => window.dispatchEvent(new Event('online'))")
    await expect(page.locator("#conn")).to_have_attribute("data-state", "live")


async def test_a_cancelled_prompt_locks_with_its_reason(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """A prompt cancelled while on screen is locked, with the reason it was cancelled."""
    await person.ask("stop", "text", [{"question": "What next?"}])
    page = await open_inbox(browser, base_url)
    await entry(page, "stop").click()
    await page.get_by_label("Your reply").fill("keep going")
    await person.cancel("stop", reason="the turn was stopped")
    note = page.locator("#note")
    await expect(note).to_contain_text("Cancelled.", timeout=2000)
    await expect(note).to_contain_text("the turn was stopped")
    await expect(page.get_by_label("Your reply")).to_have_value("keep going")
    await expect(page.get_by_role("button", name="Send reply")).to_be_disabled()
    await expect(page).to_have_title("prompt-broker inbox")


async def test_a_deadline_counts_down_and_an_escalation_and_a_reminder_show(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """A prompt with a deadline shows the time left on its card and in the detail pane, counting
    down; when a timekeeper reminds and escalates it, its card says "reminded" and "escalated
    to oncall" at once (from the event stream)."""
    from broker import Timing
    from workers.runtime.timekeeper import Timekeeper

    timed = await person.ask("timed", "approval", [_approval("make deploy")])
    await person.set_timing(
        "timed",
        Timing(deadline=7200, remind=(0.2,), escalate=0.3, escalate_to="oncall"),
        prompt_id=timed.prompt_id,
    )
    await person.ask("soon", "text", [{"question": "Ship it?"}])
    await person.set_timing("soon", Timing(deadline=40))
    page = await open_inbox(browser, base_url)
    card = entry(page, "timed")
    await expect(card.locator("time.deadline")).to_have_text(re.compile(r"expires in 1h 59m"))
    await expect(card).not_to_contain_text("escalated")
    await expect(card).not_to_contain_text("reminded")
    soon = entry(page, "soon").locator("time.deadline")
    await expect(soon).to_have_text(re.compile(r"expires in [0-9]+s"))
    await expect(soon).to_have_class(re.compile(r"\bsoon\b"))
    first = await soon.text_content()
    await expect(soon).not_to_have_text(first or "", timeout=3000)  # it counts down
    await card.click()
    flags = page.locator("#prompt-flags")
    await expect(flags.locator("time.deadline")).to_have_text(re.compile(r"expires in 1h 59m"))
    await asyncio.sleep(0.3)
    await Timekeeper(person).once()  # the reminder and the escalation, as one step
    await expect(card.locator(".badge.reminded")).to_have_text("reminded", timeout=3000)
    await expect(card.locator(".badge.escalated")).to_have_text("escalated to oncall")
    await expect(flags).to_contain_text("escalated to oncall")
    await expect(flags).to_contain_text("reminded")
    await expect(card).to_have_attribute("aria-label", re.compile("escalated to oncall; reminded"))
    await shot(page, "deadline")


async def test_a_file_change_shows_its_files_and_every_option(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """Codex's file-change approval: each file in monospace, the session's folder, and its
    third option (approve for the session) as a button of its own."""
    changes = [
        {"path": "src/app.py", "kind": {"type": "update"}},
        {"path": "src/new.py", "kind": {"type": "add"}},
    ]
    q = codex.approval_question(codex.FILE_CHANGE, {"reason": "Write the fix?"}, changes)
    await person.sessions.create("files", "scripted", "approval", {}, work_folder="/srv/repo")
    p = await person.ask("files", "approval", [q.wire()])
    page = await open_inbox(browser, base_url)
    await entry(page, "files").click()
    pane = page.locator("#answer-form")
    await expect(pane.locator(".intent")).to_have_text("Write the fix?")
    await expect(pane.locator("ul.files li")).to_have_text(
        ["src/app.py (update)", "src/new.py (add)"]
    )
    await expect(pane.locator("code.cwd")).to_have_text("/srv/repo")
    await pane.get_by_role("button", name=codex.SESSION_LABEL).click()
    await expect(page.locator("#note")).to_contain_text("Sent.")
    got = await person.get_prompt("files", p.prompt_id)
    assert got.answers is not None and got.answers[0].answer == [codex.SESSION_LABEL]


async def test_a_claude_edit_shows_the_file_and_the_session_folder(
    browser: Browser, base_url: str, person: Broker
) -> None:
    """Claude Code's approval for an edit names the file; the folder is the session's."""
    q = approval_question("Edit", {"file_path": "/srv/repo/app.py", "old_string": "a"}, "Claude")
    await person.sessions.create("edit", "scripted", "approval", {}, work_folder="/srv/repo")
    await person.ask("edit", "approval", [q.wire()])
    page = await open_inbox(browser, base_url, width=360)
    await expect(entry(page, "edit")).to_contain_text("Edit: /srv/repo/app.py")
    await entry(page, "edit").click()
    facts = page.locator("dl.facts")
    await expect(facts.locator("dt")).to_have_text(["Tool", "File", "Folder"])
    await expect(facts.locator("pre.cmd")).to_have_text("/srv/repo/app.py")
    await expect(facts.locator("code.cwd")).to_have_text("/srv/repo")
    await page.get_by_role("button", name="← All waiting prompts").click()
    await expect(entry(page, "edit")).to_be_visible()  # one pane at a time on a phone


async def test_the_inbox_served_by_prompt_broker_serve(
    browser: Browser, person: Broker, real_redis_url: str
) -> None:
    """The same page from the real `prompt-broker serve` process (its own Broker on Redis)."""
    from tests.conftest import free_port

    port = free_port()
    env = os.environ | {
        "PROMPT_BROKER_REDIS_URL": real_redis_url,
        "PROMPT_BROKER_KEY_PREFIX": person.settings.key_prefix,
        "PROMPT_BROKER_API_TOKENS": json.dumps(
            [{"name": "alice", "token": ALICE, "scopes": ["read", "answer"]}]
        ),
    }
    cli = Path(sys.executable).with_name("prompt-broker")
    proc = await asyncio.create_subprocess_exec(
        str(cli),
        "serve",
        "--port",
        str(port),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        await until(lambda: _ready(base), "prompt-broker serve to be ready", within=20)
        p = await person.ask("served", "approval", [_approval("make release")])
        page = await open_inbox(browser, base)
        await entry(page, "served").click()
        await expect(page.locator("pre.cmd")).to_have_text("make release")
        await page.keyboard.press("a")
        await expect(page.locator("#note")).to_contain_text("Sent.")
        got = await person.get_prompt("served", p.prompt_id)
        assert got.state == "answered" and got.answers is not None
        assert got.answers[0].answer == ["Approve"]
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 15)


async def _ready(base: str) -> bool:
    import httpx

    try:
        async with httpx.AsyncClient() as client:
            return (await client.get(base + "/readyz", timeout=1)).status_code == 200
    except httpx.HTTPError:
        return False
