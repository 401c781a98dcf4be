"""A step of the language-model engine, planned before it runs (vLLM's plan -> run -> apply).

`plan_step` sees each request as a few numbers (`Want`: the positions its KV rows hold, the
positions it wants before it decodes, the blocks it holds, its priority and arrival) and the
pool as its free blocks, and decides for one step: who is admitted from the queue, who
decodes, which chunk of which text is read, and who gives its blocks back (preemption) or
fails because it cannot fit even alone. It touches no model and no tensor, so each rule is
tested on its own (tests/serving/test_plan.py); the engine (serving/scheduler.py) runs the
plan and applies its output.

The rules, in the order the function applies them:

1. Rows that decode take one position each (a speculative round: 1 + its drafts, `ahead`).
   Where the pool cannot give them their blocks, victims give theirs back (`_victims`, the
   one order of preemption): texts being read before rows that decode, the lowest priority
   (largest value) first, then the text with most left to read, then the latest arrival.
   The last row that decodes is never preempted: where even it cannot step, it fails.
2. Waiting requests join while the batch has room: lower priority value first, a preempted
   one before a new one of the same priority, then in arrival order.
3. Texts are read within the step's token budget (what decoding leaves). A text that fits
   in what is left is read to its end in this step, shortest first: a short prompt that
   arrives while a long one is read has its first token after one step. Texts that do not
   fit are read a chunk at a time in arrival order (so that no stream of later prompts
   starves the first): while rows decode, at most `budget // DECODING_SHARE` in all, less
   the rows' tokens and never less than `MIN_PIECE`, so that their steps stay short. A
   chunk is cut to the blocks the pool has; where it has none, a text with more left of
   no higher priority gives its blocks back, else the text waits for blocks (and fails
   where it could not fit in the whole pool, nothing else holding any).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MIN_PIECE = 16
"""The fewest tokens of texts read in chunks a step reads while rows decode."""

DECODING_SHARE = 32
"""While rows decode, texts read in chunks take at most budget // DECODING_SHARE tokens a step
(MIN_PIECE at least). On a CPU a prompt's token costs about what a decoding row's does, and
the rows' step reads the weights once for all of them: SmolLM2-135M (q4_1, two cores) steps
seven rows in ~25 ms, and a chunk at position ~600 adds ~55 ms at 16 tokens, ~300 ms at 121.
A 32nd of the default 512 keeps the rows' steps within ~3x their own cost, where a quarter
made them 13x; the long text is read at about a third of its own rate meanwhile (a larger
--step-tokens gives it more)."""


class Phase(enum.Enum):
    WAITING = "waiting"
    """Queued: holds no row and no block."""
    READING = "reading"
    """Holds a row whose text (a prompt, or a preempted text) is partly read."""
    DECODING = "decoding"
    """Read to its end: draws a token a step."""


@dataclass(frozen=True)
class Want:
    """One request as the plan sees it. `key` is the engine's handle for it."""

    key: int
    phase: Phase
    computed: int = 0
    """Positions its KV rows hold."""
    wanted: int = 0
    """Positions its text has: it decodes once it holds them all."""
    held: int = 0
    """Blocks it holds."""
    priority: int = 0
    """Lower first (as vLLM's `priority`)."""
    order: int = 0
    """Arrival: lower came first."""
    resumed: bool = False
    """Preempted before: waits ahead of new requests of its priority."""
    start: int | None = None
    """A name of its first block's tokens where the pool could share them (prefix cache): of
    two unread texts that start alike, the second waits a step and takes the first's."""

    @property
    def left(self) -> int:
        return self.wanted - self.computed


@dataclass(frozen=True)
class PoolView:
    """What the plan needs of the KV pool."""

    free: int
    """Blocks a request may take."""
    block_size: int
    context: int
    """The most positions a row holds (a text past it slides out of the pool)."""

    def blocks(self, positions: int) -> int:
        return -(-min(positions, self.context) // self.block_size)


@dataclass
class StepPlan:
    admit: list[int] = field(default_factory=list)
    """Waiting requests that take a row now (their text is read from this step on)."""
    decode: list[int] = field(default_factory=list)
    """Rows that draw a token (or run a speculative round) this step, in their order."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    """(request, n): read the next n tokens of its text."""
    preempt: list[tuple[int, str]] = field(default_factory=list)
    """(request, why): give its blocks back and wait to be read again."""
    fail: list[tuple[int, str]] = field(default_factory=list)
    """(request, why): cannot fit in the pool even alone."""

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.chunks)


def _victims(candidates: list[Want]) -> list[Want]:
    """The order in which requests give their blocks back (rule 1 of the module's text)."""
    return sorted(candidates, key=lambda w: (w.phase is Phase.DECODING, -w.priority,
                                             -w.left, -w.order))


def plan_step(wants: list[Want], pool: PoolView, budget: int, *, max_batch: int,
              ahead: int = 1) -> StepPlan:
    """Plan one step (see the module's text). budget: tokens the step reads at most,
    decoding's and texts' together; ahead: positions a decoding row adds (1, or 1 + drafts
    in a speculative round)."""
    plan = StepPlan()
    free = pool.free
    gone: set[int] = set()

    def preempt(victim: Want, why: str) -> None:
        nonlocal free
        plan.preempt.append((victim.key, why))
        gone.add(victim.key)
        free += victim.held

    # 1. Rows that decode, and the blocks their step needs.
    decoding = sorted((w for w in wants if w.phase is Phase.DECODING), key=lambda w: w.order)
    reading = [w for w in wants if w.phase is Phase.READING]

    def short() -> int:
        need = sum(max(0, pool.blocks(w.computed + ahead) - w.held)
                   for w in decoding if w.key not in gone)
        return need - free

    while decoding and short() > 0:
        holders = [w for w in reading + decoding if w.key not in gone and w.held]
        movable = [w for w in holders if w.phase is Phase.READING
                   or sum(d.key not in gone for d in decoding) > 1]
        if not movable:
            last = next(w for w in decoding if w.key not in gone)
            plan.fail.append((last.key, f"{last.computed + ahead} positions fill the KV pool"))
            gone.add(last.key)
            free += last.held
            continue
        preempt(_victims(movable)[0], "rows that decode need its blocks")
    plan.decode = [w.key for w in decoding if w.key not in gone]

    # 2. Admission.
    running = len(plan.decode) + sum(w.key not in gone for w in reading)
    queue = sorted((w for w in wants if w.phase is Phase.WAITING),
                   key=lambda w: (w.priority, not w.resumed, w.order))
    admitted = queue[: max(0, max_batch - running)]
    plan.admit = [w.key for w in admitted]
    reading = [w for w in reading if w.key not in gone] + admitted

    # 3. Reading, within what decoding leaves of the budget.
    left = budget - len(plan.decode) * ahead
    piece = (max(budget // DECODING_SHARE - len(plan.decode), MIN_PIECE) if plan.decode
             else budget)
    starting: set[int] = set()
    readable = []  # in order of priority, then arrival
    for w in sorted(reading, key=lambda w: (w.priority, w.order)):
        if w.computed == 0 and w.start is not None:
            if w.start in starting:
                continue  # it takes the blocks of the one read now, next step
            starting.add(w.start)
        readable.append(w)
    holders = {w.key: w for w in reading if w.held}

    def take(w: Want, n: int) -> int:
        """n tokens of w's text, cut to the blocks the pool has (a victim found where it
        has none); the tokens given."""
        nonlocal free
        while True:
            room = (w.held + free) * pool.block_size - w.computed
            if min(n, room) > 0:
                n = min(n, room)
                free -= max(0, pool.blocks(w.computed + n) - w.held)
                return n
            chunked = {k for k, _ in plan.chunks}
            later = [o for o in holders.values() if o.key != w.key and o.key not in gone
                     and o.key not in chunked and o.priority >= w.priority and o.left > w.left]
            if not later:
                alone = not plan.decode and not any(
                    o.key != w.key and o.key not in gone for o in holders.values())
                if alone and pool.blocks(w.wanted) > w.held + free:
                    plan.fail.append((w.key, f"{w.wanted} positions do not fit in the KV pool"))
                    gone.add(w.key)
                return 0
            preempt(_victims(later)[0], "a text with less left to read needs its blocks")

    # Texts that fit are read whole, shortest first.
    whole: set[int] = set()
    for w in sorted((w for w in readable if w.left <= left), key=lambda w: (w.priority, w.left)):
        if w.key in gone or w.left > left:
            continue
        n = take(w, w.left)
        if n:
            plan.chunks.append((w.key, n))
            whole.add(w.key)
            left -= n
    # The rest a chunk at a time, in order of arrival.
    for w in readable:
        if w.key in gone or w.key in whole:
            continue
        n = min(left, piece, w.left)
        if n <= 0:
            break
        n = take(w, n)
        if n:
            plan.chunks.append((w.key, n))
            left -= n
            piece -= n
    plan.chunks = [(k, n) for k, n in plan.chunks if k not in gone]
    return plan
