"""A first end-to-end check of the lifecycle on both backends."""

from broker import Broker


async def test_ask_answer_wait(broker: Broker) -> None:
    """An answer posted as text reaches the waiter mapped to the option's label."""
    q = {"question": "Target?", "options": [{"label": "staging"}, {"label": "production"}]}
    p = await broker.ask("t1", "ask_user_question", [q])
    routed = await broker.post_item("t1", {"content": [{"type": "text", "text": "2"}]})
    assert routed.outcome == "answered"
    answers = await broker.wait("t1", p.prompt_id, timeout=5)
    assert [a.answer for a in answers] == [["production"]]
