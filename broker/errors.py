"""Every error the broker raises, under one root.

    BrokerError
    ├── BadItem              bad input: names the field; nothing was written
    ├── PromptUnavailable    the question could not be delivered; nobody refused; ask again
    ├── PromptCancelled      the prompt was cancelled (superseded, run ended): carries the reason
    ├── StaleAnswer          an answer named a prompt that is not the thread's active one
    ├── PromptNotFound       no such prompt on that thread
    ├── ThreadNotFound       no such thread (nothing was ever posted to it, no session)
    ├── ThreadClosed         the thread was closed: it takes no more items
    ├── Fenced               the caller's lease epoch moved on (another replica holds it)
    ├── BrokerUnavailable    Redis unreachable or refusing writes (OOM); says whether it took effect
    └── BrokerClosed         the broker was used after it was closed

`wait()` raises the builtin `TimeoutError` on timeout: the prompt stays open.
"""

from __future__ import annotations

__all__ = [
    "BadItem",
    "BrokerClosed",
    "BrokerError",
    "BrokerUnavailable",
    "Fenced",
    "PromptCancelled",
    "PromptNotFound",
    "PromptUnavailable",
    "StaleAnswer",
    "ThreadClosed",
    "ThreadNotFound",
]


class BrokerError(Exception):
    """The root of every error prompt-broker raises on purpose."""


class BadItem(BrokerError, ValueError):
    """Input that cannot be accepted. `field` says where (a dotted path); nothing was written."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class PromptUnavailable(BrokerError):
    """The question could not be delivered to a person.

    The message says so in the terms an agent needs: the question was not delivered, nobody
    refused, and asking again retries. It never says anyone denied anything.
    """

    def __init__(self, thread_id: str, cause: BaseException | str) -> None:
        self.thread_id = thread_id
        self.cause = cause
        super().__init__(
            f"the question could not be delivered to a person ({cause}); nobody refused it, "
            "and asking again will retry"
        )


class PromptCancelled(BrokerError):
    """The prompt was cancelled before anyone answered it: `reason` says why."""

    def __init__(self, prompt_id: str, reason: str) -> None:
        self.prompt_id = prompt_id
        self.reason = reason
        super().__init__(f"prompt {prompt_id} was cancelled: {reason or 'no reason given'}")


class StaleAnswer(BrokerError):
    """An answer named a prompt that is no longer the thread's active one; nothing was written.

    `state` is that prompt's real state: `answered`, `cancelled`, `pending` (open, but not the
    active one) or `unknown` (no such prompt on this thread). `active_prompt_id` is the prompt that
    is active now, if any.
    """

    def __init__(
        self, thread_id: str, prompt_id: str, state: str, active_prompt_id: str | None
    ) -> None:
        self.thread_id = thread_id
        self.prompt_id = prompt_id
        self.state = state
        self.active_prompt_id = active_prompt_id
        now = f"the active prompt is {active_prompt_id}" if active_prompt_id else "none is active"
        super().__init__(f"prompt {prompt_id} on thread {thread_id} is {state}; {now}")


class PromptNotFound(BrokerError, LookupError):
    """No prompt with that id exists on that thread."""

    def __init__(self, thread_id: str, prompt_id: str) -> None:
        self.thread_id = thread_id
        self.prompt_id = prompt_id
        super().__init__(f"no prompt {prompt_id} on thread {thread_id}")


class ThreadNotFound(BrokerError, LookupError):
    """No thread with that id exists: it has no items and no agent session. Nothing was written."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        super().__init__(
            f"no thread {thread_id} (nothing was ever posted to it and it has no session); "
            "post with create=True to start it"
        )


class ThreadClosed(BrokerError):
    """The thread was closed: it takes no more items, and nothing was written."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        super().__init__(f"thread {thread_id} is closed: it takes no more items")


class Fenced(BrokerError):
    """A fenced call was refused: the thread's lease epoch is no longer the caller's."""

    def __init__(self, thread_id: str, epoch: int, current: int | None) -> None:
        self.thread_id = thread_id
        self.epoch = epoch
        self.current = current
        super().__init__(
            f"thread {thread_id}: lease epoch {epoch} is stale (now {current}); "
            "another replica holds this thread"
        )


class BrokerUnavailable(BrokerError, ConnectionError):
    """Redis could not be reached, or refused to store anything (over `maxmemory`, a read-only
    replica). `took_effect` is False when the call certainly did nothing, None when that is
    unknown (the message says so), True when it was stored but not confirmed as asked (an
    answer fewer than `wait_replicas` replicas confirmed). `refused` is True when Redis
    answered but would not write."""

    def __init__(
        self, what: str, cause: BaseException, took_effect: bool | None, *, refused: bool = False
    ) -> None:
        self.cause = cause
        self.took_effect = took_effect
        self.refused = refused
        outcome = {
            True: "it took effect",
            False: "it did not take effect",
            None: "it may or may not have taken effect",
        }
        problem = "Redis refused to store it" if refused else "Redis could not be reached"
        if took_effect:  # stored, but not as safely as asked (PROMPT_BROKER_WAIT_REPLICAS)
            problem = "Redis did not confirm it"
        super().__init__(f"{what}: {problem} ({cause}); {outcome[took_effect]}")


class BrokerClosed(BrokerError, RuntimeError):
    """The broker was used after `aclose()` (or outside its `async with` block)."""

    def __init__(self) -> None:
        super().__init__("this Broker is closed; open a new one with Broker.from_url(...)")
