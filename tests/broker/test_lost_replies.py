"""A script ran, and its reply was lost on the way back (a timeout, a connection dropped by a
failover): the step is not made a second time. redis-py's cluster client retries a command
that failed so, blindly; an ask or an answer run twice would be a second prompt, or the
person's words queued again as a message. The Broker finds out what happened instead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import Broker
from tests.conftest import BrokerFactory, cluster_runs_wanted

APPROVAL = {"question": "Deploy?", "options": [{"label": "Approve"}, {"label": "Deny"}]}

ON_CLUSTER = [pytest.param("cluster", marks=pytest.mark.cluster)] if cluster_runs_wanted() else []


@pytest.fixture(params=[pytest.param("real", marks=pytest.mark.real_redis), *ON_CLUSTER])
def backend(request: pytest.FixtureRequest) -> str:
    """Real connections only: the fault is in redis-py's connection (fakeredis has none)."""
    return str(request.param)


@pytest.fixture
def lose_reply(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Arm with `lose["sha"] = <script sha>`: the next reply to that script is read from the
    server (the script has run) and then lost, as a timeout."""
    lose: dict[str, Any] = {"sha": None, "lost": 0}
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    async def sending(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes | str) else b"".join(command)
        data = data.encode() if isinstance(data, str) else data
        self._pb_losing = bool(lose["sha"]) and lose["sha"].encode() in data  # type: ignore[attr-defined]
        await send(self, command, check_health)

    async def reading(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        reply = await read(self, *args, **kwargs)
        if getattr(self, "_pb_losing", False):
            self._pb_losing = False  # type: ignore[attr-defined]
            lose["sha"], lose["lost"] = None, lose["lost"] + 1
            await self.disconnect()
            raise RedisTimeoutError("Timeout reading from the socket (a test's lost reply)")
        return reply

    monkeypatch.setattr(AbstractConnection, "send_packed_command", sending)
    monkeypatch.setattr(AbstractConnection, "read_response", reading)
    yield lose


async def loaded(b: Broker, name: str) -> str:
    """The script's sha, once every primary has it (no NOSCRIPT in the way of the fault)."""
    script = b._scripts.by_name[name]
    if isinstance(b.redis, RedisCluster):
        await b.redis.execute_command(  # type: ignore[no-untyped-call]
            "SCRIPT LOAD", script.source, target_nodes=RedisCluster.PRIMARIES
        )
    else:
        await b.redis.script_load(script.source)
    return script.sha


async def test_an_answer_whose_reply_was_lost_is_made_once(
    make_broker: BrokerFactory, lose_reply: dict[str, Any]
) -> None:
    """The route's reply lost: post_item still says `answered`, and the thread holds the
    person's words once, with nothing queued."""
    b: Broker = await make_broker()
    p = await b.ask("t", "approval", [APPROVAL])
    lose_reply["sha"] = await loaded(b, "route")
    routed = await b.post_item("t", {"content": [{"type": "text", "text": "yes"}]})
    assert lose_reply["lost"] == 1
    assert (routed.outcome, routed.prompt_id) == ("answered", p.prompt_id)
    said = [i for i in await b.items("t") if i.content and i.content[0].get("text") == "yes"]
    assert len(said) == 1
    assert await b.redis.llen(b.thread("t").inbox) == 0
    assert (await b.get_prompt("t", p.prompt_id)).state == "answered"


async def test_an_ask_whose_reply_was_lost_is_made_once(
    make_broker: BrokerFactory, lose_reply: dict[str, Any]
) -> None:
    """The ask's reply lost: the ask returns the prompt it made, and no second prompt
    superseded it."""
    b: Broker = await make_broker()
    lose_reply["sha"] = await loaded(b, "ask")
    p = await b.ask("t", "approval", [APPROVAL])
    assert lose_reply["lost"] == 1
    opened = await b.open_prompts()
    assert [o.prompt_id for o in opened] == [p.prompt_id]
    asked = [i for i in await b.items("t") if (i.metadata or {}).get("type") == "pending_prompt"]
    assert len(asked) == 1
