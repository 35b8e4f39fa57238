"""Handing a committed answer to the waits on the poster's own event loop (`hand_over`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from broker import Broker
from broker._waiter import _WAITING, hand_over
from tests.conftest import BrokerFactory
from tests.helpers import began_waiting, text

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}
NEVER = 3600.0  # a sweep interval far beyond every test's time limit


async def test_an_answer_posted_on_the_waits_loop_wakes_it_before_post_item_returns(
    make_broker: BrokerFactory,
) -> None:
    """A surface and an agent on one event loop (two Brokers): the reply of the post hands the
    answer to the wait (`hand_over`), which returns before `post_item` does, bell or no bell
    (the sweep an hour away); waits of two Brokers both get it; and once they end, nothing of
    them is left in the registry, answered or cancelled."""
    agent, other = await make_broker(sweep_interval=NEVER), await make_broker()
    surface = await make_broker()
    p = await agent.ask("t", "approval", [APPROVAL])
    order: list[str] = []

    async def waiting(b: Broker) -> list[Any]:
        answers = await b.wait("t", p.prompt_id)
        order.append("wait")
        return answers

    first = asyncio.create_task(waiting(agent))
    second = asyncio.create_task(waiting(other))
    cancelled = asyncio.create_task(other.wait("t", p.prompt_id))
    for b in (agent, other):
        await began_waiting(b, "t", p.prompt_id)
    assert len(_WAITING[p.prompt_id]) == 3
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    assert len(_WAITING[p.prompt_id]) == 2
    await surface.post_item("t", text("yes"))
    order.append("post")
    assert order == ["wait", "wait", "post"]
    for task in (first, second):
        (answer,) = await asyncio.wait_for(task, 5)
        assert answer.answer == ["Approve"]
    assert p.prompt_id not in _WAITING
    assert hand_over(p.prompt_id, "[]") is False


async def test_a_wait_on_another_event_loop_is_left_to_its_bell() -> None:
    """A future belongs to its loop: a wait registered from another loop (another thread's)
    is never resolved from this one."""
    resolved: list[Any] = []

    class Stub:
        def _resolve(self, wake: Any) -> bool:
            resolved.append(wake)
            return True

    other = asyncio.new_event_loop()
    try:
        _WAITING["prm_other"] = [(other, Stub())]  # type: ignore[list-item]
        assert hand_over("prm_other", "[]") is False
        assert resolved == []
        _WAITING["prm_other"].append((asyncio.get_running_loop(), Stub()))  # type: ignore[arg-type]
        assert hand_over("prm_other", "[]") is True
        assert resolved == [{"prompt_id": "prm_other", "state": "answered", "answers": []}]
    finally:
        _WAITING.pop("prm_other", None)
        other.close()
