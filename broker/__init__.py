"""prompt-broker: carries a coding agent's mid-turn questions to a person and the answer back.

The front door: everything a caller needs is importable from here.
"""

from broker.answers import map_text, render_content, verdict
from broker.checks import LIMITS
from broker.client import Broker
from broker.errors import (
    BadItem,
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    Fenced,
    PromptCancelled,
    PromptNotFound,
    PromptUnavailable,
    StaleAnswer,
    ThreadClosed,
    ThreadNotFound,
)
from broker.keys import Keys
from broker.models import Answer, Item, Kind, Option, Prompt, PromptState, Question, Routed
from broker.sessions import Grant, Session, Sessions, Waiting
from broker.settings import Settings
from broker.timing import Step, Timing, parse_duration

__all__ = [
    "LIMITS",
    "Answer",
    "BadItem",
    "Broker",
    "BrokerClosed",
    "BrokerError",
    "BrokerUnavailable",
    "Fenced",
    "Grant",
    "Item",
    "Keys",
    "Kind",
    "Option",
    "Prompt",
    "PromptCancelled",
    "PromptNotFound",
    "PromptState",
    "PromptUnavailable",
    "Question",
    "Routed",
    "Session",
    "Sessions",
    "Settings",
    "StaleAnswer",
    "Step",
    "ThreadClosed",
    "ThreadNotFound",
    "Timing",
    "Waiting",
    "map_text",
    "parse_duration",
    "render_content",
    "verdict",
]
__version__ = "0.1.0"
