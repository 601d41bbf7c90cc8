"""The dispatch plan, the feed's groups and the saved-state record, tested as
rooms of their own (no TrainLoop), and a cadence changed between intervals."""

import jax
import numpy as np
import pytest

from flax_loop.checkpoint import Checkpoint, CheckpointFile, SavedState
from flax_loop.data.feed import (
    LAST,
    MANY,
    MANY_LAST,
    ONE,
    SHORTER,
    BatchFeed,
    DispatchPlan,
    variant,
)
from flax_loop.parallel import Placement
from tests.helpers import ResumableBatches, digits_loop, digits_split


@pytest.mark.parametrize(
    "every, per_dispatch, dispatches, needed",
    [
        (1, 1, [(LAST, 1)], [LAST]),
        (3, 1, [(ONE, 1), (ONE, 1), (LAST, 1)], [ONE, LAST]),
        (1, 4, [(LAST, 1)], [LAST]),
        (3, 4, [(MANY_LAST, 3)], [MANY_LAST, LAST]),
        (4, 4, [(MANY_LAST, 4)], [MANY_LAST, LAST]),
        (5, 4, [(MANY, 4), (LAST, 1)], [MANY, LAST]),
        (6, 4, [(MANY, 4), (MANY_LAST, 2)], [MANY, MANY_LAST, LAST]),
        (8, 4, [(MANY, 4), (MANY_LAST, 4)], [MANY, MANY_LAST, LAST]),
        (100, 32, [(MANY, 32)] * 3 + [(MANY_LAST, 4)], [MANY, MANY_LAST, LAST]),
        (97, 32, [(MANY, 32)] * 3 + [(LAST, 1)], [MANY, LAST]),
    ],
)
def test_the_plan_of_an_interval(every, per_dispatch, dispatches, needed):
    plan = DispatchPlan(every, per_dispatch)
    assert plan.dispatches() == dispatches
    assert plan.needed() == needed


@pytest.mark.parametrize("per_dispatch", [1, 2, 3, 4, 7, 32])
def test_every_plan_covers_its_interval_and_ends_with_a_closing_call(per_dispatch):
    for every in range(1, 80):
        plan = DispatchPlan(every, per_dispatch)
        planned = plan.dispatches()
        assert sum(n for _, n in planned) == every
        *body, (closing, n_closing) = planned
        assert closing in (LAST, MANY_LAST)
        assert all(name in (ONE, MANY) for name, _ in body)
        assert all(n == per_dispatch for name, n in body if name == MANY)
        assert n_closing == (plan.closing_steps or 1)
        assert plan.needed() == list(dict.fromkeys([name for name, _ in planned] + [LAST]))
        # an interval cut short (n_steps, a stop, a resume) that is not a
        # closing group's size ends in single steps, compiled for any cadence
        for remaining in range(1, every + 1):
            n = plan.group(remaining)
            assert 1 <= n <= min(remaining, per_dispatch)
            assert n == 1 or remaining > per_dispatch or remaining == plan.closing_steps


def test_a_long_interval_is_planned_without_listing_it():
    plan = DispatchPlan(10**9 + 4, 32)
    assert plan.needed() == [MANY, MANY_LAST, LAST] and plan.closing_steps == 4
    assert (plan.group(10**9), plan.group(4), plan.group(3)) == (32, 4, 1)


def test_variant_names_what_was_read():
    assert [variant(1, last, False) for last in (False, True)] == [ONE, LAST]
    assert [variant(4, last, False) for last in (False, True)] == [MANY, MANY_LAST]
    assert variant(1, True, short=True) == variant(1, False, short=True) == SHORTER


def test_the_feed_takes_the_groups_the_plan_says():
    # 10 steps a checkpoint at 4 a dispatch: 4, 4, then a closing group of 2
    # that reads nothing past it (the data state of the checkpoint).
    x, y, _, _ = digits_split()
    source = ResumableBatches(x, y, 8)
    feed = BatchFeed(source, Placement(jax.devices()[:1]), steps_per_dispatch=4, prefetch=0)
    plan = DispatchPlan(10, 4)
    expected = ResumableBatches(x, y, 8)
    step, taken = 0, []
    while step < 10:
        remaining = 10 - step
        batch, n_steps, name, last = feed.take(plan.group(remaining), remaining, False, step + 1)
        for index in range(n_steps):
            want_x, want_y = next(expected)
            np.testing.assert_array_equal(batch[0][0][index], want_x)
            np.testing.assert_array_equal(batch[1][0][index], want_y)
        taken.append((name, n_steps, last))
        step += n_steps
    assert taken == [(MANY, 4, False), (MANY, 4, False), (MANY_LAST, 2, True)]
    assert feed.state(10) == {"position": 10}


def test_the_feed_reads_single_steps_when_the_stream_cuts_a_group_short():
    x, y, _, _ = digits_split()
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 48, 8)]  # 6 batches, one epoch
    feed = BatchFeed(iter(data), Placement(jax.devices()[:1]), steps_per_dispatch=4, prefetch=0)
    plan = DispatchPlan(8, 4)
    first = feed.take(plan.group(8), 8, False, 1)
    assert first[1:] == (4, MANY, False)
    # 2 batches left for a planned group of 4: single steps, the last closes
    second, third = (feed.take(plan.group(4), 4 - k, False, 5 + k) for k in range(2))
    assert (second[1:], third[1:]) == ((1, ONE, False), (1, LAST, True))
    assert feed.take(plan.group(2), 2, False, 7) is None


def test_the_saved_state_is_one_record_for_every_form():
    arrays = {"model_params": {"w": np.ones(3)}, "model_state": {}, "optimizer_state": ()}
    carried = {"ema_params": {"w": np.zeros(3)}}
    saved = SavedState(**arrays, step=4, carried=carried, data_state={"p": 4})
    checkpoint = Checkpoint.from_saved(
        saved, grads={}, loss=0.5, n_completed_steps=2, elapsed_time=0.1
    )
    file = CheckpointFile.from_saved(checkpoint, metrics={"eval": {"accuracy": 1.0}})
    for form in (checkpoint, file):
        assert form.saved_state() == saved
    assert (checkpoint.step, file.step, file.data_state) == (4, 4, {"p": 4})
    doubled = file.map_arrays(lambda trees: jax.tree.map(lambda a: a * 2, trees))
    np.testing.assert_array_equal(doubled.model_params["w"], 2 * np.ones(3))
    np.testing.assert_array_equal(doubled.ema_params["w"], np.zeros(3))
    assert (doubled.step, doubled.metrics, doubled.data_state) == (4, file.metrics, {"p": 4})
    np.testing.assert_array_equal(file.model_params["w"], np.ones(3))  # a copy was changed


def test_a_cadence_changed_between_intervals_keeps_its_groups_and_its_bits():
    # 4 steps a dispatch: checkpoints every 6 (4 + a closing group of 2), then
    # every 7 from step 6 (7: one closing step; 14: 4 + a closing group of 3,
    # compiled when first called). The same bits as single steps.
    def run(per_dispatch):
        x, y, _, _ = digits_split()
        loop = digits_loop(
            data=ResumableBatches(x, y, 32),
            n_devices=1,
            n_steps=14,
            n_steps_per_checkpoint=6,
            steps_per_dispatch=per_dispatch,
            prefetch=0,
        )
        loop.compiled.wait()
        programs, called = loop.compiled.programs, []

        def counting(name, program):
            def counted(state, batch, key):
                stacked = name in (MANY, MANY_LAST)
                called.append((name, np.shape(jax.tree.leaves(batch)[0])[0] if stacked else 1))
                return program(state, batch, key)

            return counted

        for name in (ONE, LAST, MANY, MANY_LAST):
            if name in programs:
                programs[name] = counting(name, programs[name])
        checkpoints = [loop.next_checkpoint()]
        loop.n_steps_per_checkpoint = 7
        if MANY_LAST in programs:  # the new cadence's closing group, compiled on first call
            programs[MANY_LAST] = counting(MANY_LAST, programs[MANY_LAST])
        checkpoints += list(loop)
        return checkpoints, called

    (single, _), (grouped, called) = run(1), run(4)
    assert [c.step for c in grouped] == [c.step for c in single] == [6, 7, 14]
    assert called == [
        (MANY, 4),
        (MANY_LAST, 2),
        (LAST, 1),
        (MANY, 4),
        (MANY_LAST, 3),
    ]
    for a, b in zip(single, grouped):
        assert a.data_state == b.data_state == {"position": a.step}
        for u, v in zip(jax.tree.leaves(a.model_params), jax.tree.leaves(b.model_params)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
        np.testing.assert_array_equal(a.losses, b.losses)
