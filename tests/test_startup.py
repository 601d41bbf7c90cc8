"""A restarted run compiles nothing: JAX's persistent compilation cache (README: "Start fast")."""

import os
import subprocess
import sys
import textwrap
import types

import jax
import numpy as np

from tests.flags import xla_flags
from tests.helpers import ROOT

PROGRAM = textwrap.dedent(
    """
    import time
    started = time.perf_counter()
    import jax
    hits, compiles = [], []
    jax.monitoring.register_event_listener(
        lambda name, **kwargs: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, duration, **kwargs: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None
    )
    from tests.helpers import digits_loop
    loop = digits_loop(n_steps=2, devices=jax.devices()[:2])
    checkpoint = loop.next_checkpoint()
    loop.compiled.wait()  # the variants the first checkpoint did not need
    print(f"HITS {len(hits)} COMPILES {len(compiles)} STEP {checkpoint.step}")
    """
)


def set_up(cache_dir):
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "XLA_FLAGS": xla_flags(2),
    }
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("HITS"))
    _, hits, _, compiles, _, step = line.split()
    assert step == "1"
    return int(hits), int(compiles)


def test_a_second_process_set_up_hits_the_persistent_cache(tmp_path):
    # JAX reports a compilation event whether it compiled or took the result
    # from the cache; cache hits are counted apart.
    first_hits, first_compilations = set_up(tmp_path / "cache")
    assert first_hits == 0 and first_compilations >= 4  # init, the step variants, ...
    assert os.listdir(tmp_path / "cache")
    second_hits, second_compilations = set_up(tmp_path / "cache")
    assert second_compilations == first_compilations
    assert second_hits == first_compilations  # every one came from the cache


RESTARTED = textwrap.dedent(
    """
    import jax, logging, sys
    lines = []  # JAX's compiler says of every program whether the cache had it
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    compiler = logging.getLogger("jax._src.compiler")
    compiler.setLevel(logging.DEBUG)
    compiler.addHandler(handler)
    from flax_loop import CheckpointFileReader, CheckpointFileWriter
    from tests.helpers import MLP, digits_loop
    model = MLP()
    reader = CheckpointFileReader(dir=sys.argv[1], target=model.init)
    loop = digits_loop(model, init=reader, n_steps=int(sys.argv[2]), n_steps_per_checkpoint=4,
                       devices=jax.devices()[:1], stdout=True)
    write = CheckpointFileWriter(output_dir=sys.argv[1])
    for checkpoint in loop:
        write(checkpoint)
    loop.compiled.wait()
    # the step's programs: its variants (packed state), the state's copy and packing
    steps = [line for line in lines if any(f"'jit_{name}'" in line for name in ("packed_fn", "copy", "pack"))]
    hits = sum("cache hit" in line for line in steps)
    misses = sum("CACHE MISS" in line for line in steps)
    print("HITS", hits, "MISSES", misses, "FOLDER", jax.config.jax_compilation_cache_dir)
    """
)


def test_a_restarted_run_takes_its_programs_from_the_default_cache(tmp_path):
    """Nothing set: the cache is in the user's cache folder, and a script run
    again (resuming from its files) takes every program from it and says so
    (the seconds saved: benchmarks/startup.py)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    env.update(XDG_CACHE_HOME=str(tmp_path / "user-cache"), XLA_FLAGS=xla_flags(1))

    def run(n_steps):
        result = subprocess.run(
            [sys.executable, "-c", RESTARTED, str(tmp_path / "ckpts"), str(n_steps)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        words = result.stdout.split("HITS")[-1].split()
        return int(words[0]), int(words[2]), words[4], " ".join(result.stdout.split())

    hits, misses, folder, said = run(8)
    assert folder == str(tmp_path / "user-cache" / "flax_loop" / "jax")
    assert hits == 0 and misses >= 3 and "from the cache" not in said
    assert any(name.endswith("-cache") for name in os.listdir(folder))
    hits, misses, _, said = run(16)  # a new process, resumed from step 8
    assert "Resumed from step 8" in said and "programs from the cache" in said
    assert misses == 0 and hits >= 3  # every program of the step came from the cache


def test_the_cache_folder_is_trimmed_oldest_first(tmp_path):
    from flax_loop.run.compile_cache import trim

    for age, name in enumerate(["old", "middle", "new"]):
        entry = tmp_path / f"{name}-cache"
        entry.write_bytes(b"x" * 100)
        os.utime(entry, (1_000_000 + age, 1_000_000 + age))
    (tmp_path / "other").write_bytes(b"x" * 1000)  # not an entry: kept
    trim(tmp_path, 250)
    assert sorted(os.listdir(tmp_path)) == ["middle-cache", "new-cache", "other"]


def test_set_up_traces_the_models_init_once(tmp_path):
    # The state's shapes (jax.eval_shape) and the state (jit) come from one
    # trace of init: JAX reuses it; a resumed run only takes the shapes.
    from flax_loop import CheckpointFileReader, CheckpointFileWriter
    from tests.helpers import MLP, digits_loop

    model = MLP()
    calls = []

    def init(*args, **kwargs):
        calls.append(1)
        return model.init(*args, **kwargs)

    loop = digits_loop(model, init=init, n_devices=2, n_steps=2)
    assert len(calls) == 1
    CheckpointFileWriter(output_dir=str(tmp_path))(loop.next_checkpoint())
    calls.clear()
    digits_loop(model, init=init, n_devices=2, sharding="fsdp", fsdp_min_bytes=0)
    assert len(calls) == 1  # shapes for the layout, then the state in it
    calls.clear()
    digits_loop(model, init=CheckpointFileReader(dir=str(tmp_path), target=init), n_devices=2)
    assert len(calls) == 1  # the shapes to restore into; the file holds the rest


def test_a_variant_the_cadence_never_calls_compiles_when_first_called():
    # A checkpoint every step calls only the interval's last step: the single
    # step is not compiled at set-up, nor beside the first steps.
    from tests.helpers import digits_loop

    loop = digits_loop(n_devices=1, n_steps=6)
    assert [c.step for c in loop.run(3)] == [1, 2, 3]
    programs = loop.compiled.programs
    status = loop.compiled.status()
    assert status["one"] == "on first call"  # no future on the background thread
    assert status["last"] == "compiled"
    assert status["close"] == "on first call"  # the separate close: not even lowered
    loop.n_steps_per_checkpoint = 3  # now steps 4 and 5 are single steps
    (changed,) = list(loop)
    assert changed.step == 6 and isinstance(programs["one"], jax.stages.Compiled)
    _, straight = list(digits_loop(n_devices=1, n_steps=6, n_steps_per_checkpoint=3))
    for a, b in zip(jax.tree.leaves(changed.model_params), jax.tree.leaves(straight.model_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same steps, same bits


def test_init_compiled_for_a_short_compilation_gives_the_same_values(monkeypatch):
    # The state is created by a program compiled once at a lower XLA
    # optimization level on CPU (flax_loop/programs/once.py::run_once): its values
    # are those of init compiled with XLA's defaults (level 3), bit for bit.
    import flax.linen as nn
    import optax

    import flax_loop.programs.once
    from flax_loop.programs.once import run_once_options
    from flax_loop.random import init_key
    from flax_loop.run.initial import initial_state, initialize_model

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.Conv(8, (3, 3))(x.reshape(-1, 8, 8, 1))
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
            x = nn.Dropout(0.3, deterministic=not train)(x.reshape(x.shape[0], -1))
            x = nn.LayerNorm()(nn.Dense(32, kernel_init=nn.initializers.orthogonal())(x))
            kernel_init = nn.initializers.variance_scaling(2, "fan_in", "uniform")
            return nn.Dense(10, kernel_init=kernel_init)(x)

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert run_once_options() is None  # a level the user set is kept
    monkeypatch.setenv("XLA_FLAGS", "")  # run_once_options reads it at each compilation
    assert run_once_options() == {"xla_backend_optimization_level": 2}
    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    optimizer = optax.adamw(1e-3)
    labels = ["params", "dropout"]
    key = jax.random.key(3)
    start = initial_state(Net().init, optimizer, key, (x,), labels, mutable_collections=True)

    def reference(key, x):
        params, model_state = initialize_model(Net().init, init_key(key), (x,), labels, True)
        return params, model_state, optimizer.init(params)

    defaults = {"xla_backend_optimization_level": 3}
    expected = jax.jit(reference).lower(key, x).compile(compiler_options=defaults)(key, x)
    got = (start.model_params, start.model_state, start.optimizer_state)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The options reach the compilation: at level 0 this net's conv kernel
    # rounds differently, so the equality above is not that of one program.
    level_0 = {"xla_backend_optimization_level": 0}
    monkeypatch.setattr(flax_loop.programs.once, "run_once_options", lambda: level_0)
    other = initial_state(Net().init, optimizer, key, (x,), labels, mutable_collections=True)
    assert not all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(other.model_params), jax.tree.leaves(start.model_params))
    )


def test_the_step_is_traced_once_for_every_variant():
    # The model and the loss run in Python once per loop: every variant (the
    # first dispatch's, the others on the background thread, one a changed
    # cadence calls later) inlines that one trace of the step (each tracing
    # it apart would be 5 traces here).
    from tests.helpers import MLP, digits_loop

    model, traced = MLP(), []

    def apply(*args, **kwargs):
        traced.append(1)
        return model.apply(*args, **kwargs)

    counting = types.SimpleNamespace(init=model.init, apply=apply)
    loop = digits_loop(
        counting, n_devices=2, n_steps=12, n_steps_per_checkpoint=6, steps_per_dispatch=4
    )
    loop.compiled.wait()
    assert {"many", "many_last"} <= set(loop.compiled.programs)
    assert len(traced) == 1
    assert loop.next_checkpoint().step == 6
    loop.n_steps_per_checkpoint = 3  # a closing call of 3 steps, then of 3 again
    assert [c.step for c in loop] == [9, 12]
    assert len(traced) == 1
