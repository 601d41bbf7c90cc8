"""The feed's stages and the set-up's options, each built alone (no TrainLoop)."""

import threading
import time

import numpy as np
import pytest

from flax_loop.data.feed import LAST, MANY, MANY_LAST, ONE, SHORTER, BatchFeed
from flax_loop.data.prefetch import GAVE_UP
from flax_loop.data.readahead import PROBE_READS, ReadAhead
from flax_loop.data.source import CheckedBatches
from flax_loop.errors import BatchError, ConfigError, DataExhaustedError
from flax_loop.parallel import Placement


def batch(size=8, features=3, value=0.0):
    return np.full((size, features), value, np.float32), np.zeros(size, np.int32)


def value(checked_batch):
    """The value a test batch was made with (its first input's first entry)."""
    return float(np.asarray(checked_batch[0][0]).ravel()[0])


# --- CheckedBatches --------------------------------------------------------


def test_checked_batches_name_the_step_of_a_batch_that_does_not_match_the_first():
    wider = batch(features=4)
    checked = CheckedBatches([batch(), wider, (wider[0][..., None], wider[1])], Placement())
    checked.accept_first(checked.read(for_step=1))
    assert checked.spec.batch_size == 8
    assert checked.read(for_step=2)[0][0].shape == (8, 4)  # another size: a bucket
    assert [spec.shapes for spec in checked.other_shapes] == [((8, 4), (8,))]
    with pytest.raises(BatchError, match=r"step 3 differs .* in its leaf 0.*ranks"):
        checked.read(for_step=3)  # another rank


def test_batches_of_any_structure_pass_as_their_leaves_and_a_changed_one_is_named():
    from flax_loop.data.batch import BatchTree

    def image(value=0.0, features=3):
        return {"image": np.full((8, features), value, np.float32), "label": np.zeros(8, np.int32)}

    other_rank = {"image": np.zeros((8, 3, 1), np.float32), "label": np.zeros(8, np.int32)}
    stream = [image(), image(1.0), other_rank, {"image": np.zeros((8, 3))}]
    checked = CheckedBatches(stream, Placement(), BatchTree())
    checked.accept_first(checked.read(for_step=1))
    second = checked.read(for_step=2)  # the same structure and spec: its leaves as they are
    assert second[1] == () and second[0][0] is stream[1]["image"]
    with pytest.raises(BatchError, match=r"step 3 .*leaf 0.*\(8, 3, 1\)"):
        checked.read(for_step=3)  # another rank
    with pytest.raises(BatchError, match="step 4.*structure differs"):  # a key less
        checked.read(for_step=4)


def test_a_shorter_last_batch_is_kept_when_it_splits_and_the_next_epoch_follows():
    checked = CheckedBatches([batch(value=1), batch(value=2), batch(size=4, value=3)], Placement())
    checked.accept_first(checked.read(1))
    read = [checked.read(step) for step in range(2, 6)]
    assert [value(b) for b in read] == [2, 3, 1, 2]
    assert read[1][0][0].shape == (4, 3)


def test_a_shorter_last_batch_that_does_not_split_is_dropped_and_noted_once():
    import io

    from rich.console import Console

    from flax_loop.log import set_console

    set_console(Console(file=(out := io.StringIO()), width=300))
    placement = Placement()
    assert placement.n_local_shards == 4  # the suite's forced CPU devices
    checked = CheckedBatches([batch(value=1), batch(size=3, value=2)], placement)
    checked.accept_first(checked.read(1))
    assert [value(checked.read(step)) for step in (2, 3, 4)] == [1, 1, 1]
    assert out.getvalue().count("last batch holds 3 examples") == 1


def test_an_empty_stream_and_a_used_generator_are_told_apart():
    with pytest.raises(DataExhaustedError, match="empty"):
        CheckedBatches([], Placement()).accept_first(None)
    used = (b for b in [batch()])
    list(used)
    checked = CheckedBatches(used, Placement())
    with pytest.raises(DataExhaustedError, match="already run to its end"):
        checked.accept_first(checked.read(1))


def test_data_that_cannot_be_iterated_is_a_config_error():
    with pytest.raises(ConfigError, match="int"):
        CheckedBatches(3, Placement())


# --- ReadAhead -------------------------------------------------------------


class Slow:
    """Batches read slowly, remembering the thread that read each."""

    def __init__(self, n, seconds):
        self.n, self.seconds, self.threads, self.position = n, seconds, [], 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position == self.n:
            raise StopIteration
        time.sleep(self.seconds)
        self.threads.append(threading.current_thread().name)
        self.position += 1
        return batch(value=self.position)

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


def test_prefetch_0_reads_inline_and_records_no_states():
    reading = ReadAhead(CheckedBatches([batch()] * 3, Placement()), prefetch=0, depth=3)
    (first, state), before = reading.first()
    assert state is None and before is None
    assert reading.read(2)[1] is None and not reading.threaded


def test_the_default_policy_probes_then_keeps_a_fast_source_inline():
    checked = CheckedBatches([batch(value=v) for v in range(20)], Placement())
    reading = ReadAhead(checked, prefetch=None, depth=3)
    (_, state), before = reading.first()
    assert before == {"flax_loop/epoch": {"epoch": 0, "batches": 0}}
    assert state == {"flax_loop/epoch": {"epoch": 0, "batches": 1}}
    recorded = [reading.read(step)[1] for step in range(2, PROBE_READS + 1)]
    assert recorded[-1] == {"flax_loop/epoch": {"epoch": 0, "batches": PROBE_READS}}
    assert not reading.threaded  # decided: inline
    assert reading.read(PROBE_READS + 1)[1] is None  # no states recorded any more


def test_the_default_policy_moves_a_slow_source_to_a_thread_that_records_states():
    source = Slow(PROBE_READS + 4, seconds=0.002)
    checked = CheckedBatches(source, Placement())
    reading = ReadAhead(checked, prefetch=None, depth=3)
    checked.accept_first(reading.first()[0][0])
    for step in range(2, PROBE_READS + 1):
        reading.read(step)
    assert reading.threaded
    reading.last_step = PROBE_READS + 3
    items = [reading.read(step) for step in range(PROBE_READS + 1, PROBE_READS + 4)]
    assert [state["position"] for _, state in items] == [9, 10, 11]
    assert set(source.threads[PROBE_READS:]) == {"flax_loop-prefetch"}
    reading.drop()


def test_a_thread_gives_up_waiting_when_asked_and_keeps_the_read_for_later():
    release = threading.Event()

    class Blocking(Slow):
        """The second read waits until the test releases it."""

        def __next__(self):
            if self.position == 1:
                release.wait(timeout=30)
            return super().__next__()

    source = Blocking(5, seconds=0)
    checked = CheckedBatches(source, Placement())
    reading = ReadAhead(checked, prefetch=1, depth=1)
    checked.accept_first(reading.first()[0][0])
    reading.give_up = lambda: True  # a stop was requested: nobody waits for the read
    assert reading.read(2) is GAVE_UP
    assert source.position == 1  # the read was still in progress
    release.set()
    reading.give_up = None
    assert reading.read(2)[1] == {"position": 2}  # the read in progress, kept
    reading.drop()


def test_a_source_that_fails_on_the_thread_is_read_inline_instead(capsys):
    class MainThreadOnly:
        def __init__(self):
            self.n = 0

        def __iter__(self):
            return self

        def __next__(self):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("not from another thread")
            self.n += 1
            return batch(value=self.n)

    checked = CheckedBatches(MainThreadOnly(), Placement())
    reading = ReadAhead(checked, prefetch=2, depth=2)
    checked.accept_first(reading.first()[0][0])
    item = reading.read(2)
    assert value(item[0]) == 2 and not reading.threaded


# --- BatchFeed over the stages ---------------------------------------------


def test_the_feed_groups_what_the_plan_asks_and_puts_back_an_untaken_dispatch():
    feed = BatchFeed([batch(value=v) for v in range(1, 11)], Placement(), steps_per_dispatch=3)
    stacked, n, variant, last = feed.take(3, remaining=7, stopping=False, next_step=1)
    assert (n, variant, last, stacked[0][0].shape) == (3, MANY, False, (3, 8, 3))
    feed.untake()
    again = feed.take(3, remaining=7, stopping=False, next_step=1)
    np.testing.assert_array_equal(again[0][0][0], stacked[0][0])
    closing = feed.take(4, remaining=4, stopping=False, next_step=4)
    assert closing[1:] == (4, MANY_LAST, True)
    assert feed.state(7) == {"flax_loop/epoch": {"epoch": 0, "batches": 7}}


def test_single_steps_a_stop_and_the_shorter_last_batch():
    data = [batch(value=1), batch(value=2), batch(size=4, value=3)]
    feed = BatchFeed(iter(data), Placement(), steps_per_dispatch=1)
    assert feed.take(1, remaining=5, stopping=False, next_step=1)[1:] == (1, ONE, False)
    assert feed.take(1, remaining=4, stopping=False, next_step=2)[1:] == (1, ONE, False)
    assert feed.take(1, remaining=3, stopping=False, next_step=3)[1:] == (1, SHORTER, True)
    assert feed.take(1, remaining=2, stopping=False, next_step=4) is None
    feed = BatchFeed([batch()] * 4, Placement(), steps_per_dispatch=1)
    assert feed.take(1, remaining=5, stopping=True, next_step=1)[1:] == (1, LAST, True)
    assert feed.take(1, remaining=4, stopping=True, next_step=2) is None


def test_a_restored_feed_reads_on_from_the_saved_position():
    data = [batch(value=v) for v in range(1, 6)]
    feed = BatchFeed(data, Placement(), steps_per_dispatch=1)
    for step in (1, 2):
        feed.take(1, remaining=3 - step, stopping=False, next_step=step)
    saved = feed.state(2)
    other = BatchFeed(data, Placement(), steps_per_dispatch=1)
    other.restore(saved, stdout=False)
    taken = other.take(1, remaining=1, stopping=False, next_step=3)
    assert value(taken[0]) == 3


# --- the set-up's options --------------------------------------------------


@pytest.mark.parametrize(
    "options, named",
    [
        ({"steps_per_dispatch": 0}, "steps_per_dispatch"),
        ({"nonfinite": "ignore"}, "nonfinite"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"ema_decay": "0.9"}, "ema_decay"),
        ({"prefetch": -1}, "prefetch"),
        ({"fsdp_min_bytes": -1}, "fsdp_min_bytes"),
        ({"profile": 3}, "profile"),
        ({"sharding": "zero3"}, "sharding"),
    ],
)
def test_each_bad_option_is_refused_by_name(options, named):
    from flax_loop.run.options import Options

    with pytest.raises(ConfigError, match=named):
        Options(**options)


def test_options_are_checked_once_and_frozen():
    import dataclasses

    from flax_loop.run.options import Options

    options = Options(steps_per_dispatch=4, prefetch=2)
    assert (options.steps_per_dispatch, options.prefetch, options.nonfinite) == (4, 2, "raise")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.prefetch = 3
