"""Training beyond `loss(*outputs, *targets)`: losses that call the model,
trainable subsets, several optimizers, frozen models, sown values.

Each program is a small port of a published kind (a DCGAN, a DDPM, the Flax
NNX LoRA guide, knowledge distillation, a mixture of experts' load-balancing
loss) and is compared with the same algorithm written by hand in plain JAX
on the same data: bit for bit on one device (the DCGAN, two programs XLA
0.12 rounds apart, to 1e-6), to float tolerance on four.
The hand-written steps derive their keys as the loop documents it:
`fold_in(run key, 1)` for training, then the step, then the device; the
model's RNG collections fold in their index, `rng` folds in 2**31 - 1, a
later call of the model in one step folds in the call's index, and a later
optimizer's loss folds in its index.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    TrainLoop,
    TrainTask,
)
from flax_loop.errors import ConfigError
from tests.helpers import cross_entropy, digits_split

X, Y, _, _ = digits_split()
X = X.astype(np.float32)
BATCH = 32
SEED = 3


def stream(kind: str = "dict"):
    r"""Batches in order: dicts `{"image", "label"}`, pairs, or images alone."""
    for i in itertools.count():
        start = (i * BATCH) % (len(X) - BATCH)
        x, y = X[start : start + BATCH], Y[start : start + BATCH]
        yield {"image": x, "label": y} if kind == "dict" else (x, y) if kind == "pair" else x


def batches(n: int, kind: str = "dict") -> list:
    return list(itertools.islice(stream(kind), n))


def step_keys(step: int, labels=(), device: int = 0):
    r"""The model's keys and the loss's `rng` of one step, as the loop derives them."""
    train = jax.random.fold_in(jax.random.key(SEED), 1)
    per_device = jax.random.fold_in(jax.random.fold_in(train, step), device)
    rngs = {label: jax.random.fold_in(per_device, i) for i, label in enumerate(labels)}
    return rngs, jax.random.fold_in(per_device, 2**31 - 1)


def init_key():
    return {"params": jax.random.fold_in(jax.random.fold_in(jax.random.key(SEED), 0), 0)}


def same(a, b):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def run(loop):
    *_, last = loop
    return last


# -- a loss that calls the model twice, draws from rng, reads the step --------


class NoisyNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
        x = nn.Dropout(0.2, deterministic=False)(nn.relu(x))
        return nn.Dense(10)(x)


def consistency_loss(model, batch, *, rng, step):
    x, y = batch["image"], batch["label"]
    noisy = model(x + 0.1 * jax.random.normal(rng, x.shape))
    clean = model(x)  # a second call: BatchNorm's statistics and new dropout
    weight = step.astype(jnp.float32) / 10
    return cross_entropy(noisy, y) + weight * jnp.mean((noisy - clean) ** 2)


def test_compute_loss_calls_the_model_twice_with_rng_and_step_as_written_by_hand():
    model, tx = NoisyNet(), optax.adam(1e-2)
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, tx, data=stream(), compute_loss=consistency_loss),
        rnkey=jax.random.key(SEED),
        input_sample=X[:BATCH],
        n_steps=8,
        n_steps_per_checkpoint=4,
        collections={"apply": ["dropout"]},
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = run(loop)

    variables = model.init(init_key(), X[:BATCH])
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, stats, opt_state, batch, step):
        rngs, rng = step_keys(step, ["dropout"])
        x, y = batch["image"], batch["label"]

        def loss_fn(params):
            noisy, new = model.apply(
                {"params": params, "batch_stats": stats},
                x + 0.1 * jax.random.normal(rng, x.shape),
                rngs=rngs,
                mutable=["batch_stats"],
            )
            second = {k: jax.random.fold_in(v, 1) for k, v in rngs.items()}
            clean, new = model.apply(
                {"params": params, **new}, x, rngs=second, mutable=["batch_stats"]
            )
            weight = (step - 1).astype(jnp.float32) / 10  # the loss's step counts from 0
            return cross_entropy(noisy, y) + weight * jnp.mean((noisy - clean) ** 2), new

        (_, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new["batch_stats"], opt_state

    for step, batch in enumerate(batches(8), start=1):
        params, stats, opt_state = step_fn(params, stats, opt_state, batch, jnp.int32(step))
    same(last.model_params, params)
    same(last.model_state["batch_stats"], stats)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_a_loss_that_reports_metrics_is_traced_once_for_every_program(n_devices):
    # The first lowering learns the metrics' names from the step's trace, and
    # the state then carries their sums: the programs lowered after it (the
    # state with its sums, a scan of steps, the interval's closing steps)
    # inline that one trace instead of running the model and the loss again.
    traced = []

    def loss(model, batch, *, rng, step):
        traced.append(batch["image"].shape)
        logits = model(batch["image"])
        right = (jnp.argmax(logits, -1) == batch["label"]).mean()
        return cross_entropy(logits, batch["label"]), {"accuracy": right}

    model = nn.Dense(10)
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), data=stream(), compute_loss=loss),
        rnkey=jax.random.key(SEED),
        input_sample=X[:BATCH],
        n_steps=8,
        n_steps_per_checkpoint=4,
        steps_per_dispatch=2,
        devices=jax.devices()[:n_devices],
        stdout=False,
    )
    checkpoints = list(loop)
    loop.compiled.wait()
    assert traced == [(BATCH, 64)]
    assert [c.step for c in checkpoints] == [4, 8]
    assert 0 < checkpoints[-1].train_metrics["accuracy"] <= 1


# -- a DDPM: timesteps and noise drawn from rng ---------------------------------

T = 50
BETAS = np.linspace(1e-4, 0.02, T, dtype=np.float32)
ALPHA_BARS = np.cumprod(1 - BETAS).astype(np.float32)


class Denoiser(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        embedding = jnp.sin(t[:, None] / T * jnp.arange(1, 9, dtype=jnp.float32))
        h = nn.gelu(nn.Dense(64)(jnp.concatenate([x, embedding], axis=-1)))
        return nn.Dense(x.shape[-1])(h)


def diffusion_loss(model, batch, *, rng, step):
    x = batch["image"] / 16.0
    t_key, noise_key = jax.random.split(rng)
    t = jax.random.randint(t_key, (x.shape[0],), 0, T)
    noise = jax.random.normal(noise_key, x.shape)
    alpha_bar = jnp.asarray(ALPHA_BARS)[t][:, None]
    noisy = jnp.sqrt(alpha_bar) * x + jnp.sqrt(1 - alpha_bar) * noise
    return jnp.mean((model(noisy, t.astype(jnp.float32)) - noise) ** 2)


def test_a_ddpm_loss_equals_the_hand_written_step_bitwise():
    model, tx = Denoiser(), optax.adamw(1e-3)
    sample = (X[:BATCH], np.zeros(BATCH, np.float32))
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, tx, data=stream(), compute_loss=diffusion_loss),
        rnkey=jax.random.key(SEED),
        input_sample=sample,
        n_steps=10,
        n_steps_per_checkpoint=5,
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = run(loop)

    params = model.init(init_key(), *sample)["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, batch, step):
        _, rng = step_keys(step)
        grads = jax.grad(lambda p: diffusion_loss(lambda *a: model.apply({"params": p}, *a),
                                                  batch, rng=rng, step=step - 1))(params)  # fmt: skip
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for step, batch in enumerate(batches(10), start=1):
        params, opt_state = step_fn(params, opt_state, batch, jnp.int32(step))
    same(last.model_params, params)
    assert np.isfinite(last.mean_loss) and last.mean_loss < 1.5


# -- a DCGAN: two optimizers, each over its own part ----------------------------

LATENT = 8


class DCGAN(nn.Module):
    def setup(self):
        self.generator = nn.Sequential(
            [
                nn.Dense(2 * 2 * 16),
                nn.relu,
                lambda h: h.reshape(h.shape[0], 2, 2, 16),
                nn.ConvTranspose(8, (3, 3), strides=(2, 2)),
                nn.relu,
                nn.ConvTranspose(1, (3, 3), strides=(2, 2)),
                jnp.tanh,
            ]
        )
        self.discriminator = nn.Sequential(
            [
                nn.Conv(8, (3, 3), strides=(2, 2)),
                nn.leaky_relu,
                nn.Conv(16, (3, 3), strides=(2, 2)),
                nn.leaky_relu,
                lambda h: h.reshape(h.shape[0], -1),
                nn.Dense(1),
            ]
        )

    def __call__(self, z, images):
        return self.discriminate(self.generate(z)), self.discriminate(images)

    def generate(self, z):
        return self.generator(z)

    def discriminate(self, images):
        return self.discriminator(images)[:, 0]


def as_images(x):
    return (x / 8.0 - 1.0).reshape(x.shape[0], 8, 8, 1)


def discriminator_loss(model, batch, *, rng, step):
    fake = model(jax.random.normal(rng, (batch.shape[0], LATENT)), method="generate")
    real_logits = model(as_images(batch), method="discriminate")
    fake_logits = model(jax.lax.stop_gradient(fake), method="discriminate")
    real = optax.sigmoid_binary_cross_entropy(real_logits, jnp.ones_like(real_logits))
    made = optax.sigmoid_binary_cross_entropy(fake_logits, jnp.zeros_like(fake_logits))
    return real.mean() + made.mean(), {"real_score": jax.nn.sigmoid(real_logits).mean()}


def generator_loss(model, batch, *, rng, step):
    fake = model(jax.random.normal(rng, (batch.shape[0], LATENT)), method="generate")
    logits = model(fake, method="discriminate")
    return optax.sigmoid_binary_cross_entropy(logits, jnp.ones_like(logits)).mean()


GAN_OPTIMIZERS = {
    "discriminator": optax.adam(2e-3, b1=0.5),
    "generator": optax.adam(2e-3, b1=0.5),
}
GAN_SAMPLE = (np.zeros((BATCH, LATENT), np.float32), np.zeros((BATCH, 8, 8, 1), np.float32))


def gan_task(data=None) -> TrainTask:
    return TrainTask(
        apply=DCGAN().apply,
        optimizer=GAN_OPTIMIZERS,
        data=stream("image") if data is None else data,
        compute_loss={"discriminator": discriminator_loss, "generator": generator_loss},
        trainable={"discriminator": "discriminator", "generator": "generator"},
    )


def gan_loop(n_steps, init=None, data=None, **options):
    return TrainLoop(
        init=init or DCGAN().init,
        task=gan_task(data),
        rnkey=jax.random.key(SEED),
        input_sample=GAN_SAMPLE,
        n_steps=n_steps,
        devices=jax.devices()[:1],
        stdout=False,
        **options,
    )


def hand_written_gan(n_steps):
    model = DCGAN()
    params = model.init(init_key(), *GAN_SAMPLE)["params"]
    d_tx, g_tx = GAN_OPTIMIZERS["discriminator"], GAN_OPTIMIZERS["generator"]
    d_state, g_state = d_tx.init(params["discriminator"]), g_tx.init(params["generator"])

    def bound(params):
        return lambda *args, **kwargs: model.apply({"params": params}, *args, **kwargs)

    @jax.jit
    def step_fn(params, d_state, g_state, images, step):
        _, rng = step_keys(step)

        def d_loss(d):
            whole = {**params, "discriminator": d}
            return discriminator_loss(bound(whole), images, rng=rng, step=step - 1)[0]

        # the loop materializes each gradient (so its variants agree): so here
        d_value, grads = jax.value_and_grad(d_loss)(params["discriminator"])
        grads = jax.lax.optimization_barrier(grads)
        updates, d_state = d_tx.update(grads, d_state, params["discriminator"])
        params = {**params, "discriminator": optax.apply_updates(params["discriminator"], updates)}

        def g_loss(g):  # against the discriminator just updated
            whole = {**params, "generator": g}
            return generator_loss(
                bound(whole), images, rng=jax.random.fold_in(rng, 1), step=step - 1
            )

        g_value, grads = jax.value_and_grad(g_loss)(params["generator"])
        grads = jax.lax.optimization_barrier(grads)
        updates, g_state = g_tx.update(grads, g_state, params["generator"])
        params = {**params, "generator": optax.apply_updates(params["generator"], updates)}
        return params, d_state, g_state, d_value + g_value

    for step, images in enumerate(batches(n_steps, "image"), start=1):
        params, d_state, g_state, _ = step_fn(params, d_state, g_state, images, jnp.int32(step))
    return params


@pytest.fixture(scope="module")
def gan_straight():
    """The last checkpoint of 20 DCGAN steps, checkpoints every 10, never interrupted."""
    return run(gan_loop(20, n_steps_per_checkpoint=10))


def test_a_dcgan_alternating_two_optimizers_equals_the_hand_written_step(gan_straight):
    last = gan_straight
    # The same bits on JAX 0.10 and 0.11; XLA 0.12 rounds one of the two
    # programs otherwise (one bias value 1 ulp apart after 20 steps, 6e-8
    # at most at other cadences). The generator's loss taken against the
    # discriminator before its update instead ends 2e-2 away.
    jax.tree.map(
        lambda ours, theirs: np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6),
        jax.device_get(last.model_params),
        jax.device_get(hand_written_gan(20)),
    )
    assert sorted(last.optimizer_state) == ["discriminator", "generator"]
    # each optimizer's state holds moments of its own part only
    d_mu = last.optimizer_state["discriminator"][0].mu
    assert jax.tree.leaves(d_mu["generator"]) == []
    assert len(jax.tree.leaves(d_mu["discriminator"])) == 6
    metrics = last.train_metrics
    assert {"discriminator_loss", "generator_loss", "discriminator_real_score"} <= set(metrics)
    assert metrics["loss"] == pytest.approx(
        metrics["discriminator_loss"] + metrics["generator_loss"], rel=1e-5
    )


def test_a_dcgan_resumes_from_its_checkpoint_bitwise(tmp_path, gan_straight):
    straight = gan_straight
    with CheckpointFileWriter(output_dir=str(tmp_path)) as write:
        for checkpoint in gan_loop(10, n_steps_per_checkpoint=10):
            write(checkpoint)
    data = stream("image")
    for _ in range(10):  # the stream as a resumed run's source is positioned
        next(data)
    reader = CheckpointFileReader(dir=str(tmp_path), target=DCGAN().init)
    resumed = run(gan_loop(20, init=reader, data=data, n_steps_per_checkpoint=10))
    assert resumed.step == 20
    same(resumed.model_params, straight.model_params)
    same(resumed.optimizer_state, straight.optimizer_state)


# -- LoRA: only the low-rank weights train --------------------------------------


class LoRANet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.LoRALinear(64, 32, lora_rank=4, rngs=rngs)
        self.out = nnx.LoRALinear(32, 10, lora_rank=4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def hand_written_lora(n_steps, tx):
    model = LoRANet(nnx.Rngs(0))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    opt_state = tx.init(lora)

    @jax.jit
    def step_fn(lora, opt_state, x, y):
        def loss_fn(lora):
            return cross_entropy(nnx.merge(graphdef, lora, rest)(x), y)

        grads = jax.grad(loss_fn)(lora)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state

    for x, y in batches(n_steps, "pair"):
        lora, opt_state = step_fn(lora, opt_state, x, y)
    return nnx.to_pure_dict(lora)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_lora_trains_only_the_low_rank_weights(n_devices, capsys):
    tx = optax.adam(1e-2)
    model = LoRANet(nnx.Rngs(0))
    base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loop = TrainLoop(
        init=model,
        task=TrainTask(model, tx, cross_entropy, stream("pair"), trainable=nnx.LoRAParam),
        rnkey=jax.random.key(SEED),
        n_steps=100,
        n_steps_per_checkpoint=50,
        steps_per_dispatch=10,
        devices=jax.devices()[:n_devices],
    )
    assert "552 of 2,962 train" in capsys.readouterr().out
    last = run(loop)
    params = jax.device_get(last.model_params)
    for layer in ("hidden", "out"):  # the base weights are bitwise unchanged
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(params[layer][name], base[layer][name])
    moments = last.optimizer_state[0].mu
    shapes = sorted(tuple(leaf.shape) for leaf in jax.tree.leaves(moments))
    assert shapes == [(4, 10), (4, 32), (32, 4), (64, 4)]
    expected = hand_written_lora(100, tx)
    lora = {layer: params[layer]["lora"] for layer in ("hidden", "out")}
    wanted = {layer: expected[layer]["lora"] for layer in ("hidden", "out")}
    if n_devices == 1:
        same(lora, wanted)
    else:  # the mean of 4 devices' gradients: float tolerance
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), lora, wanted
        )


# -- distillation from a frozen teacher -----------------------------------------


class Teacher(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


class Student(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def distillation_loss(model, batch, *, rng, step, frozen):
    x, y = batch
    soft = jax.nn.softmax(frozen["teacher"](x) / 2.0)
    student = model(x)
    distill = -(soft * jax.nn.log_softmax(student / 2.0)).sum(-1).mean()
    return 0.5 * distill + 0.5 * cross_entropy(student, y)


def test_distillation_from_a_frozen_teacher_in_evaluation_mode():
    tx = optax.sgd(0.05)
    teacher, student = Teacher(nnx.Rngs(1)), Student(nnx.Rngs(2))
    teacher_before = nnx.to_pure_dict(nnx.state(teacher, nnx.Param))
    loop = TrainLoop(
        init=student,
        task=TrainTask(
            student,
            tx,
            data=stream("pair"),
            compute_loss=distillation_loss,
            frozen={"teacher": teacher},
        ),
        rnkey=jax.random.key(SEED),
        n_steps=12,
        n_steps_per_checkpoint=6,
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = run(loop)
    assert sorted(last.saved_state().arrays()) == sorted(
        ["model_params", "model_state", "optimizer_state"]
    )  # the teacher is not saved
    same(nnx.to_pure_dict(nnx.state(teacher, nnx.Param)), teacher_before)  # nor changed

    teacher.eval()  # by hand: dropout off, so the teacher is deterministic
    graphdef, params = nnx.split(Student(nnx.Rngs(2)), nnx.Param)
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, x, y):
        grads = jax.grad(
            lambda p: distillation_loss(
                nnx.merge(graphdef, p), (x, y), rng=None, step=None, frozen={"teacher": teacher}
            )
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in batches(12, "pair"):
        params, opt_state = step_fn(params, opt_state, x, y)
    same(last.model_params, nnx.to_pure_dict(params))


# -- an auxiliary loss recorded with sow ----------------------------------------


class Experts(nn.Module):
    @nn.compact
    def __call__(self, x):
        gate = jax.nn.softmax(nn.Dense(4)(x))
        self.sow("intermediates", "balance", 4 * jnp.sum(gate.mean(0) ** 2))
        experts = jnp.stack([nn.Dense(10)(x) for _ in range(4)], axis=1)
        return jnp.einsum("be,bec->bc", gate, experts)


class NNXExperts(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate = nnx.Linear(64, 4, rngs=rngs)
        self.experts = nnx.Linear(64, 40, rngs=rngs)

    def __call__(self, x):
        gate = jax.nn.softmax(self.gate(x))
        self.sow(nnx.Intermediate, "balance", 4 * jnp.sum(gate.mean(0) ** 2))
        experts = self.experts(x).reshape(x.shape[0], 4, 10)
        return jnp.einsum("be,bec->bc", gate, experts)


def linen_moe_loss(model, batch, *, rng, step):
    x, y = batch
    logits = model(x)
    (balance,) = model.sown["intermediates"]["balance"]
    return cross_entropy(logits, y) + 0.1 * balance


def nnx_moe_loss(model, batch, *, rng, step):
    x, y = batch
    logits, sown = nnx.capture(model, nnx.Intermediate)(x)
    (balance,) = jax.tree.leaves(sown)
    return cross_entropy(logits, y) + 0.1 * balance


def test_a_sown_auxiliary_loss_reaches_the_gradient_linen():
    model, tx = Experts(), optax.adam(1e-2)
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, tx, data=stream("pair"), compute_loss=linen_moe_loss),
        rnkey=jax.random.key(SEED),
        n_steps=6,
        n_steps_per_checkpoint=3,
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = run(loop)
    assert "intermediates" not in last.model_state
    params = model.init(init_key(), X[:BATCH])["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, x, y):
        def loss_fn(params):
            logits, sown = model.apply({"params": params}, x, mutable=["intermediates"])
            return cross_entropy(logits, y) + 0.1 * sown["intermediates"]["balance"][0]

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in batches(6, "pair"):
        params, opt_state = step_fn(params, opt_state, x, y)
    same(last.model_params, params)


def test_a_sown_auxiliary_loss_reaches_the_gradient_nnx():
    tx = optax.adam(1e-2)
    model = NNXExperts(nnx.Rngs(0))
    loop = TrainLoop(
        init=model,
        task=TrainTask(model, tx, data=stream("pair"), compute_loss=nnx_moe_loss),
        rnkey=jax.random.key(SEED),
        n_steps=6,
        n_steps_per_checkpoint=3,
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = run(loop)
    graphdef, params = nnx.split(NNXExperts(nnx.Rngs(0)), nnx.Param)
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, x, y):
        grads = jax.grad(
            lambda p: nnx_moe_loss(nnx.merge(graphdef, p), (x, y), rng=None, step=None)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in batches(6, "pair"):
        params, opt_state = step_fn(params, opt_state, x, y)
    same(last.model_params, nnx.to_pure_dict(params))


@pytest.mark.parametrize("mutable", [["intermediates"], True])
def test_a_sowing_model_trains_with_a_plain_loss_whatever_is_mutable(mutable):
    # the sown values are not state: no LayoutChanged, and the same training
    model = Experts()
    task = TrainTask(model.apply, optax.adam(1e-2), cross_entropy, stream("pair"))
    options = dict(rnkey=jax.random.key(SEED), n_steps=3, devices=jax.devices()[:1], stdout=False)
    sown = run(TrainLoop(model.init, task, mutable_collections=mutable, **options))
    task = TrainTask(model.apply, optax.adam(1e-2), cross_entropy, stream("pair"))
    plain = run(TrainLoop(model.init, task, **options))
    assert "intermediates" not in sown.model_state
    same(sown.model_params, plain.model_params)


# -- what a wrong task is told ---------------------------------------------------


def test_wrong_general_tasks_get_clear_errors():
    model = Denoiser()

    def check(message, **task):
        fields = dict(apply=model.apply, optimizer=optax.sgd(0.1), data=stream())
        with pytest.raises(ConfigError, match=message):
            TrainLoop(
                init=model.init,
                task=TrainTask(**{**fields, **task}),
                rnkey=jax.random.key(0),
                input_sample=(X[:BATCH], np.zeros(BATCH, np.float32)),
                stdout=False,
            )

    check("both loss and compute_loss", loss=cross_entropy, compute_loss=diffusion_loss)
    check(
        "without loss",
    )
    check(r"missing rng, step", compute_loss=lambda model, batch: 0.0)
    check("names .'g'. but task.optimizer names .'d'.",
          optimizer={"d": optax.sgd(0.1)}, compute_loss={"g": diffusion_loss})  # fmt: skip
    check("task.optimizer must then be a dict", compute_loss={"d": diffusion_loss})
    check("selects none of the parameters", compute_loss=diffusion_loss, trainable="nothing")
    check("cannot use it", loss=cross_entropy, frozen={"teacher": {}})
    with pytest.raises(ConfigError, match="input_sample"):
        TrainLoop(
            init=model.init,
            task=TrainTask(model.apply, optax.sgd(0.1), data=stream(), compute_loss=diffusion_loss),
            rnkey=jax.random.key(0),
            stdout=False,
        )


class SowingTeacher(Teacher):
    def __call__(self, x):
        hidden = nnx.relu(self.hidden(x))
        self.sow(nnx.Intermediate, "features", hidden)
        return self.out(self.dropout(hidden))


def test_a_frozen_teacher_that_sows_its_features_feeds_the_loss():
    """The teacher's sown features reach the loss: the loss calls the
    module it looked up through `nnx.capture`, as TrainTask's documentation
    says (Flax deprecates reading what `sow` stored outside a capture)."""
    teacher, student = SowingTeacher(nnx.Rngs(1)), Student(nnx.Rngs(2))

    def feature_matching(model, batch, *, rng, step, frozen):
        x, y = batch
        teacher_model = frozen["teacher"]
        _, sown = nnx.capture(teacher_model, nnx.Intermediate)(x)
        (features,) = sown["features"].get_value()
        return cross_entropy(model(features), y)

    loop = TrainLoop(
        init=student,
        task=TrainTask(
            student,
            optax.sgd(0.05),
            data=stream("pair"),
            compute_loss=feature_matching,
            frozen={"teacher": teacher},
        ),
        rnkey=jax.random.key(SEED),
        n_steps=4,
        n_steps_per_checkpoint=4,
        devices=jax.devices()[:1],
        stdout=False,
    )
    last = loop.next_checkpoint()
    # by hand: the teacher in evaluation mode, its features sown and read
    teacher.eval()
    graphdef, params = nnx.split(Student(nnx.Rngs(2)), nnx.Param)
    tx = optax.sgd(0.05)
    opt_state = tx.init(params)

    @jax.jit
    def step_fn(params, opt_state, x, y):
        def loss_of(p):
            teacher_model = nnx.clone(teacher)
            return feature_matching(
                nnx.merge(graphdef, p),
                (x, y),
                rng=None,
                step=None,
                frozen={"teacher": teacher_model},
            )

        grads = jax.grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in batches(4, "pair"):
        params, opt_state = step_fn(params, opt_state, x, y)
    same(last.model_params, nnx.to_pure_dict(params))
