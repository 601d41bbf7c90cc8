r"""`DispatchPlan`: which compiled variant runs how many steps, for every interval.

An interval of `every` steps (`n_steps_per_checkpoint`) is dispatched as
compiled calls. With one step a dispatch, each step is a call of `ONE`,
and the interval's last step a call of `LAST`, which also returns its
gradients and closes the interval (its statistics come back with it). With
`steps_per_dispatch=K`, whole groups of K steps run as `MANY` (a scan), and
the steps that remain, if more than one, as one call of `MANY_LAST`, which
closes the interval as `LAST` does:

>>> from flax_loop.plan import DispatchPlan
>>> DispatchPlan(every=3).dispatches()
[('one', 1), ('one', 1), ('last', 1)]
>>> DispatchPlan(every=100, steps_per_dispatch=32).dispatches()
[('many', 32), ('many', 32), ('many', 32), ('many_last', 4)]
>>> DispatchPlan(every=97, steps_per_dispatch=32).dispatches()
[('many', 32), ('many', 32), ('many', 32), ('last', 1)]

The plan is what the loop intends; the data may cut a dispatch short: a
stream that ends, a stop request, or a stream's shorter last batch (`SHORTER`,
compiled for its size) turn the rest of an interval into single steps, the
last of them closing it. `variant` names the variant of what was read.
"""

from dataclasses import dataclass, field

ONE = "one"
r"""One step."""

LAST = "last"
r"""One step that ends the interval: it also returns the gradients and the
interval's statistics, and resets them."""

MANY = "many"
r"""`steps_per_dispatch` steps in one call (a `jax.lax.scan` over stacked batches)."""

MANY_LAST = "many_last"
r"""The steps that end an interval in one call: a scan of all but the last,
then the last as `LAST` runs it."""

SHORTER = "shorter"
r"""One step on a stream's shorter last batch, compiled for its size."""

VARIANTS = (ONE, LAST, MANY, MANY_LAST)
r"""The variants compiled for the batch size (`SHORTER` is compiled per size)."""


@dataclass(frozen=True)
class DispatchPlan:
    r"""The dispatches of an interval of `every` steps at `steps_per_dispatch`.

    Args:
        every: the steps between checkpoints.
        steps_per_dispatch: the steps of a whole group.
    """

    every: int
    steps_per_dispatch: int = 1
    closing_steps: int = field(init=False)
    r"""the steps of the one call that ends a whole interval, if several;
    else 0 (the interval ends with a single `LAST` step)."""

    def __post_init__(self) -> None:
        every, many = self.every, self.steps_per_dispatch
        tail = every - many * ((every - 1) // many) if many > 1 else 0
        object.__setattr__(self, "closing_steps", tail if tail > 1 else 0)

    def group(self, remaining: int) -> int:
        r"""How many steps the next dispatch of an interval with `remaining`
        steps to go stacks (1: a single step).

        Whole groups while more than a group remains; the closing group when
        exactly its steps remain; single steps otherwise (an interval cut
        short by `n_steps`, or that a stop or a resume began elsewhere).

        >>> plan = DispatchPlan(every=100, steps_per_dispatch=32)
        >>> plan.group(100), plan.group(36), plan.group(4), plan.group(3)
        (32, 32, 4, 1)
        """
        many = self.steps_per_dispatch
        if many > 1 and (remaining > many or remaining == self.closing_steps):
            return min(remaining, many)
        return 1

    def dispatches(self, remaining: int | None = None) -> list[tuple[str, int]]:
        r"""`(variant, steps)` of every dispatch of an interval of `remaining`
        steps (a whole interval by default), when the data cuts none short:
        a list as long as the interval's dispatches (the loop asks `group`
        one dispatch at a time instead)."""
        remaining = self.every if remaining is None else remaining
        planned = []
        while remaining:
            n_steps = self.group(remaining)
            remaining -= n_steps
            planned.append((variant(n_steps, last=not remaining, short=False), n_steps))
        return planned

    def needed(self) -> list[str]:
        r"""The variants a whole interval calls, the first dispatch's first,
        then `LAST` (which ends an interval a stop cuts short too).

        >>> DispatchPlan(1).needed(), DispatchPlan(10).needed()
        (['last'], ['one', 'last'])
        >>> DispatchPlan(100, 32).needed(), DispatchPlan(32, 32).needed()
        (['many', 'many_last', 'last'], ['many_last', 'last'])
        """
        # in closed form: an interval may be 10**9 steps long
        if self.steps_per_dispatch == 1:
            return [LAST] if self.every == 1 else [ONE, LAST]
        needed = [MANY] if self.every > self.steps_per_dispatch else []
        return needed + ([MANY_LAST] if self.closing_steps else []) + [LAST]


def variant(n_steps: int, last: bool, short: bool) -> str:
    r"""The variant that runs a dispatch of `n_steps` read batches: `last`
    when it ends the interval, `short` for a stream's shorter last batch.

    >>> variant(1, last=False, short=False), variant(4, last=True, short=False)
    ('one', 'many_last')
    """
    if short:
        return SHORTER
    if n_steps > 1:
        return MANY_LAST if last else MANY
    return LAST if last else ONE
