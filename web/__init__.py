"""prompt-broker's person side: the HTTP API, its event streams, identities and the web inbox.

It imports the library (`broker`) only, never the runtime (`workers`).
"""

from web.app import create_app
from web.settings import ApiSettings, Identity, hash_token

__all__ = ["ApiSettings", "Identity", "create_app", "hash_token"]
