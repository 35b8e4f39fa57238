"""Every Redis key and channel name prompt-broker uses, and nothing else builds one.

All keys of a thread share one hash tag, so each script touches one slot (Redis Cluster ready).
With the default prefix `pp`:

- `pp:{T}:items` (stream): the thread, in order. Fields `id`, `author`, `type`, `body` (JSON
  content and metadata); the entry id's time is the item's `created_at`. A `pending_prompt`
  entry also carries `match`: what answer mapping needs (labels, case-folded labels).
- `pp:{T}:prompt:<prompt_id>` (hash): one prompt. `kind`, `state`, `item`, `sid` (its entry in
  the stream, where its questions are), `created`; once resolved `answers` or `reason`,
  `source`, `answer_item`, `text`, `resolved`; then `delivered` (and `delivery`, the token of the
  attempt that handed it over: at most once), `granted` and `grant_item` (its one-shot grant was
  minted, and spent by that item: each at most once, ever) and `audit_item`.
- `pp:{T}:active` (string): the id of the thread's one active prompt: the lock.
- `pp:{T}:inbox` (list): items (JSON) posted while no prompt was active.
- `pp:{T}:session` (hash): the agent session driving the thread (owner, epoch, status, `wait`:
  the prompt its agent awaits, `delivered`: the prompt whose answer its running turn was handed,
  `grant`, `interrupted`: a cut-off turn, for the next turn to tell, ...).
- `pp:{T}:agent:<name>` (list): a harness's own session data (e.g. Claude Code transcripts),
  zlib-compressed batches (workers/runtime/agent_store.py); `pp:{T}:agents` (set) names them.
- `pp:{T}:prompts` (sorted set): audited prompts whose stream entry was trimmed while their
  record remains, and `pp:{T}:idems` (sorted set): the thread's idempotency records
  (`pp:{T}:idem:<hash>`). With the `pending_prompt` entries still in the stream they let a
  closing thread's keys be found without a scan and given the `closed_ttl` expiry. The stream
  is trimmed by broker/lua/_retain.lua's policy, never past a prompt not yet audited.
- `pp:{T}:wake` (channel): the doorbell: resolutions and queued items, as JSON.
- `pp:open` (sorted set): `T/prompt_id` of open prompts by creation time (ms).
- `pp:audit` (sorted set): `T/prompt_id` of resolutions whose audit item is not yet posted.
- `pp:leases` (sorted set): thread id -> when it was left without a holder (ms): threads to be
  claimed (new, released, or freed by a restarted replica). A held thread is not in it.
- `pp:due` (sorted set): `T/prompt_id` of open prompts with a timing -> when the next step is due.

  These four are bucketed (broker/indexes.py): with `buckets` N > 1 (16 by default on a
  cluster), index `pp:open` is the N keys `pp:open:0` .. `pp:open:<N-1>`, and a thread's members
  live in the bucket whose slot is the nearest at or below the thread's (`bucket_of`), so mostly
  on the thread's own primary; with one bucket (the default on one server) the
  index is the one key `pp:open`, as it always was.
- `pp:replicas` (sorted set): replica id -> its last heartbeat (ms, server time).
- `{pp:replicas}:records` (hash): replica id -> `<incarnation>|<deadline ms, server time>`: the
  replica records, the only thing a heartbeat writes. Its hash tag puts it in the slot of
  `pp:replicas`, so beat.lua writes both in one step on a cluster too.
- `pp:holds:<replica id>:<incarnation>` (set): the threads that incarnation claimed, for adopters
  to find when its record expires.
- `pp:audit:queue` (sorted set): the arq queue of audit jobs (arq's `arq:job:*` keys hold them).

`pp:open`, `pp:audit`, `pp:leases`, `pp:due` and `pp:holds:*` are discovery indexes: the
per-thread records decide (a session names its holder and the holder's incarnation), and a sweep
rebuilds the indexes from them (`Sessions.rebuild_leases` for the lease ones, the timekeeper's
rescan for `pp:due`). Nothing that holds an open prompt ever
has a TTL.
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass

from redis.crc import key_slot

from broker.errors import BadItem

__all__ = [
    "AUTO_CLUSTER_BUCKETS",
    "MAX_BUCKETS",
    "Keys",
    "ThreadKeys",
    "bucket_of",
    "check_prompt_id",
    "check_thread_id",
]

#: Buckets per discovery index on a Redis Cluster when the setting says 0 (auto).
AUTO_CLUSTER_BUCKETS = 16
#: The most buckets an index may have; the sweep looks this far for buckets a former count left.
MAX_BUCKETS = 256

_THREAD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
_PROMPT_ID = re.compile(r"prm_[0-9A-HJKMNP-TV-Z]{26}")
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def check_thread_id(thread_id: object, field: str = "thread_id") -> str:
    """Return `thread_id` if it is a usable thread id, else raise `BadItem` naming `field`."""
    if not isinstance(thread_id, str) or not _THREAD_ID.fullmatch(thread_id):
        raise BadItem(
            field,
            f"{thread_id!r} is not a thread id (1-128 of A-Z a-z 0-9 . _ : @ -, "
            "starting with a letter or digit)",
        )
    return thread_id


def check_prompt_id(prompt_id: object, field: str = "prompt_id") -> str:
    """Return `prompt_id` if it has the shape `prm_<ULID>`, else raise `BadItem` naming `field`."""
    if not isinstance(prompt_id, str) or not _PROMPT_ID.fullmatch(prompt_id):
        raise BadItem(field, f"{prompt_id!r} is not a prompt id (prm_ followed by a ULID)")
    return prompt_id


def bucket_of(index: str, thread_id: str, buckets: int) -> int:
    """The bucket of index `index` that holds a thread's members: the bucket whose key's slot is
    the nearest at or below the thread's slot, going round past slot 0 (the same in every
    process: the slots are CRC16's, as Redis Cluster's).

    A cluster gives each primary runs of neighbouring slots, so a thread's bucket is mostly on
    the primary that holds the thread: the index writes beside a thread's script go in the
    same round trip, to the same node. With N buckets and P primaries about P/N of threads
    fall in a bucket across a boundary; they are still right, only a step more for that node.
    """
    if buckets <= 1:
        return 0
    slots, order = _bucket_slots(index, buckets)
    return order[bisect.bisect_right(slots, key_slot(thread_id.encode())) - 1]


@functools.lru_cache(maxsize=256)
def _bucket_slots(index: str, buckets: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The slots of index `index`'s bucket keys in ascending order, and the bucket at each."""
    pairs = sorted((key_slot(f"{index}:{i}".encode()), i) for i in range(buckets))
    return tuple(s for s, _ in pairs), tuple(i for _, i in pairs)


@dataclass(frozen=True, slots=True)
class ThreadKeys:
    """The keys of one thread."""

    thread_id: str
    base: str  # "<prefix>:{<thread_id>}:"

    @property
    def items(self) -> str:
        return self.base + "items"

    @property
    def active(self) -> str:
        return self.base + "active"

    @property
    def inbox(self) -> str:
        return self.base + "inbox"

    @property
    def session(self) -> str:
        return self.base + "session"

    @property
    def wake(self) -> str:
        return self.base + "wake"

    def prompt(self, prompt_id: str) -> str:
        return self.base + "prompt:" + prompt_id

    @property
    def prompts(self) -> str:
        return self.base + "prompts"

    @property
    def agents(self) -> str:
        return self.base + "agents"

    @property
    def idems(self) -> str:
        return self.base + "idems"

    @property
    def timing(self) -> str:
        """The thread's timing for its prompts (broker/timing.py), a hash: `spec`."""
        return self.base + "timing"

    def agent(self, name: str) -> str:
        """A harness's own durable data (e.g. a Claude Code transcript), a list of JSON."""
        return self.base + "agent:" + name


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (tests give each run its own)."""

    prefix: str = "pp"
    # On a Redis Cluster every key arq touches for the audit jobs shares one slot, so arq
    # (which cannot span slots) works on the one primary owning it, and enqueueing stays one
    # script. The slot is that of arq's one fixed key, `arq:abort` (its transactions name it),
    # reached with the hash tag `{arq:abort}` (`audit_slot`).
    cluster: bool = False
    # Buckets per discovery index (`open`, `audit`, `leases`, `due`); 0: auto, 1 on one server
    # and `AUTO_CLUSTER_BUCKETS` on a cluster. Every process of a deployment must agree on it.
    buckets: int = 0

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise BadItem("key_prefix", f"{self.prefix!r} is not a usable key prefix")
        if not 0 <= self.buckets <= MAX_BUCKETS:
            raise BadItem("index_buckets", f"{self.buckets} is not 0 to {MAX_BUCKETS}")
        if self.buckets == 0:
            auto = AUTO_CLUSTER_BUCKETS if self.cluster else 1
            object.__setattr__(self, "buckets", auto)

    def bucket(self, index: str, i: int) -> str:
        """Bucket `i` of an index named `index` (`open` ...): the index's name itself when it
        has one bucket, else `<index>:<i>`."""
        return index if self.buckets == 1 else f"{index}:{i}"

    def stray_buckets(self, index: str) -> list[str]:
        """The names a former bucket count may have left an index under, for the sweep."""
        if self.buckets == 1:
            return [f"{index}:{i}" for i in range(MAX_BUCKETS)]
        return [index] + [f"{index}:{i}" for i in range(self.buckets, MAX_BUCKETS)]

    def thread(self, thread_id: str) -> ThreadKeys:
        return ThreadKeys(thread_id, f"{self.prefix}:{{{check_thread_id(thread_id)}}}:")

    # The four discovery indexes' names (broker/indexes.py reads and writes them by bucket).
    @property
    def open(self) -> str:
        return f"{self.prefix}:open"

    @property
    def audit(self) -> str:
        return f"{self.prefix}:audit"

    @property
    def due(self) -> str:
        """Prompts with a timing, scored by when their next step is due (broker/timing.py)."""
        return f"{self.prefix}:due"

    @property
    def leases(self) -> str:
        return f"{self.prefix}:leases"

    @property
    def replicas(self) -> str:
        return f"{self.prefix}:replicas"

    @property
    def replica_records(self) -> str:
        """The replica records (a hash), in the slot of `replicas`."""
        return f"{{{self.prefix}:replicas}}:records"

    def holds(self, replica: str, incarnation: str) -> str:
        """The threads one incarnation of a replica claimed (a set; a discovery index)."""
        return f"{self.prefix}:holds:{replica}:{incarnation}"

    @property
    def session_pattern(self) -> str:
        """Matches every session record (the lease indexes' rebuild scans it)."""
        return f"{self.prefix}:{{*}}:session"

    @property
    def audit_queue(self) -> str:
        return f"{self.audit_slot}{self.prefix}:audit:queue"

    @property
    def audit_slot(self) -> str:
        """What starts every arq key name of ours on a cluster (its hash tag); '' otherwise."""
        return "{arq:abort}:" if self.cluster else ""

    @property
    def prompt_pattern(self) -> str:
        """Matches every prompt record (the index-rebuilding sweep scans it)."""
        return f"{self.prefix}:{{*}}:prompt:*"

    def audit_job_id(self, thread_id: str, prompt_id: str) -> str:
        """The arq job id of a prompt's audit job: one per prompt, so enqueueing is idempotent."""
        return f"{self.audit_slot}{self.prefix}:audit:{thread_id}/{prompt_id}"

    @staticmethod
    def member(thread_id: str, prompt_id: str) -> str:
        """An index member: `T/prompt_id`."""
        return f"{thread_id}/{prompt_id}"

    @staticmethod
    def split_member(member: str) -> tuple[str, str]:
        thread_id, _, prompt_id = member.rpartition("/")
        return thread_id, prompt_id
