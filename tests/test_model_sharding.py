"""The model's own layout: annotated parameters on a ("batch", "model") mesh
(4 CPU devices as 2 x 2), compared with the replicated run."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    TrainLoop,
    TrainTask,
)
from flax_loop.errors import ConfigError
from tests.helpers import MLP, ResumableBatches, accuracy, cross_entropy, digits_split

VOCAB, LENGTH, WIDTH, HEADS = 32, 16, 32, 4


def split(init, names):
    return nnx.with_partitioning(init, names)


class Block(nnx.Module):
    """A pre-norm transformer block, its weights split over "model" the way
    Megatron-style tensor parallelism splits them: attention by heads, the
    MLP's first layer by columns and its second by rows."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        dense = nnx.initializers.xavier_uniform()
        zeros, ones = nnx.initializers.zeros_init(), nnx.initializers.ones_init()
        self.norm_1 = nnx.LayerNorm(
            WIDTH, scale_init=split(ones, ("model",)), bias_init=split(zeros, ("model",)), rngs=rngs
        )
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=WIDTH,
            kernel_init=split(dense, (None, "model")),
            bias_init=split(zeros, ("model",)),
            decode=False,
            rngs=rngs,
        )
        self.norm_2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(
            WIDTH,
            4 * WIDTH,
            kernel_init=split(dense, (None, "model")),
            bias_init=split(zeros, ("model",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            4 * WIDTH, WIDTH, kernel_init=split(dense, ("model", None)), rngs=rngs
        )
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.dropout(self.attention(self.norm_1(x), mask=mask))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm_2(x)))))


class TinyGPT(nnx.Module):
    """A one-block causal language model, annotated for a ("batch", "model") mesh."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        embedding = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(
            VOCAB, WIDTH, embedding_init=split(embedding, (None, "model")), rngs=rngs
        )
        self.positions = nnx.Embed(
            LENGTH, WIDTH, embedding_init=split(embedding, (None, "model")), rngs=rngs
        )
        self.blocks = nnx.List([Block(rngs)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(
            WIDTH,
            VOCAB,
            kernel_init=split(nnx.initializers.xavier_uniform(), ("model", None)),
            rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class Sequences(ResumableBatches):
    """Arithmetic sequences modulo VOCAB (start and stride drawn per row):
    each next token follows from the two before it. Resumable."""

    def __init__(self, n_rows: int = 256, batch_size: int = 8) -> None:
        rows = np.random.default_rng(0)
        start = rows.integers(0, VOCAB, (n_rows, 1))
        stride = rows.integers(1, 5, (n_rows, 1))
        tokens = (start + stride * np.arange(LENGTH + 1)) % VOCAB
        super().__init__(
            tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32), batch_size
        )


def mesh():
    return jax.make_mesh((2, 2), ("batch", "model"))


def build_gpt():
    with jax.set_mesh(mesh()):  # flax creates annotated variables in a mesh
        return TinyGPT(nnx.Rngs(0))


def specs(tree):
    return jax.tree.map(lambda leaf: leaf.sharding.spec, tree)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def gpt_run(n_steps=20, **options):
    """The model and its last checkpoint after `n_steps` steps, each an
    interval of its own: only the interval's closing step compiles (the
    layout is the subject here, not the cadence)."""
    model = build_gpt()
    loop = TrainLoop(
        model,
        # eps: attention's key bias has no gradient but rounding noise, which
        # Adam's default eps would scale up to full steps, different per layout.
        TrainTask(model, optax.adam(3e-3, eps=1e-4), next_token_loss, Sequences()),
        jax.random.key(0),
        n_steps_per_checkpoint=1,
        n_steps=n_steps,
        stdout=False,
        **options,
    )
    *_, last = loop
    return model, last


def test_an_annotated_nnx_transformer_is_laid_out_as_annotated_and_follows_replicated():
    model, split_run = gpt_run(mesh=mesh(), batch_axis="batch")  # sharding="model" by default
    params_state = nnx.state(model, nnx.Param)
    asked = nnx.to_pure_dict(nnx.get_partition_spec(params_state))
    laid = specs(split_run.model_params)
    assert laid == asked
    assert laid["blocks"][0]["attention"]["query"]["kernel"] == PartitionSpec(None, "model")
    assert laid["blocks"][0]["down"]["kernel"] == PartitionSpec("model", None)
    assert laid["norm"]["scale"] == PartitionSpec()
    mesh_axes = {leaf.sharding.mesh.axis_names for leaf in jax.tree.leaves(split_run.model_params)}
    assert mesh_axes == {("batch", "model")}
    # Adam's moments follow their parameters; its count is replicated.
    moments = split_run.optimizer_state[0]
    assert specs(moments.mu) == asked and specs(moments.nu) == asked
    assert moments.count.sharding.spec == PartitionSpec()
    # Shard 0 of the first MLP kernel holds half of its columns.
    kernel = split_run.model_params["blocks"][0]["up"]["kernel"]
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(WIDTH, 2 * WIDTH)}

    # The same mesh with every device holding the whole state: the same
    # batches, keys (dropout) and averaged gradients, to float tolerance.
    _, whole = gpt_run(mesh=mesh(), batch_axis="batch", sharding="replicated")
    assert specs(whole.model_params)["head"]["kernel"] == PartitionSpec()
    for a, b in zip(
        jax.tree.leaves(host(split_run.model_params)), jax.tree.leaves(host(whole.model_params))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert split_run.loss == pytest.approx(whole.loss, rel=1e-5)
    assert split_run.loss < 0.85 * np.log(VOCAB)  # it learns the sequences


class LogicalMLP(nn.Module):
    """A linen MLP whose kernels name logical axes, mapped by rules."""

    @nn.compact
    def __call__(self, x):
        dense = nn.initializers.lecun_normal()
        x = nn.Dense(
            64, kernel_init=nn.with_logical_partitioning(dense, ("embed", "mlp")), name="hidden"
        )(x)
        x = nn.relu(x)
        return nn.Dense(
            10, kernel_init=nn.with_logical_partitioning(dense, ("mlp", "vocab")), name="out"
        )(x)


RULES = [("embed", None), ("mlp", "model"), ("vocab", None)]
X, Y, X_TEST, Y_TEST = digits_split()


def linen_loop(n_steps=10, init=None, **options):
    """A checkpoint every step: only the interval's closing step compiles."""
    model = LogicalMLP()
    return TrainLoop(
        init or model.init,
        TrainTask(model.apply, optax.adam(1e-2), cross_entropy, ResumableBatches(X, Y, 32)),
        jax.random.key(0),
        n_steps_per_checkpoint=1,
        n_steps=n_steps,
        stdout=False,
        **options,
    )


def data_model_mesh():
    return jax.make_mesh((2, 2), ("data", "model"))


def test_linen_logical_annotations_follow_the_rules_resume_bitwise_and_evaluate(tmp_path):
    with nn.logical_axis_rules(RULES):
        straight = list(linen_loop(20, mesh=data_model_mesh()))[-1]
        first = linen_loop(10, mesh=data_model_mesh())
        with CheckpointFileWriter(output_dir=str(tmp_path)) as writer:
            writer(list(first)[-1])
        resumed = linen_loop(
            20,
            init=CheckpointFileReader(dir=str(tmp_path), target=LogicalMLP().init),
            mesh=data_model_mesh(),
        )
    assert specs(straight.model_params) == {
        "hidden": {"kernel": PartitionSpec(None, "model"), "bias": PartitionSpec()},
        "out": {"kernel": PartitionSpec("model", None), "bias": PartitionSpec()},
    }
    # Parameters are plain arrays (the annotations' boxes are set-up only).
    assert sorted(straight.model_params["hidden"]) == ["bias", "kernel"]
    assert resumed.step == 10
    ending = list(resumed)[-1]
    assert specs(ending.model_params) == specs(straight.model_params)
    for a, b in zip(
        jax.tree.leaves(host((ending.model_params, ending.optimizer_state))),
        jax.tree.leaves(host((straight.model_params, straight.optimizer_state))),
    ):
        np.testing.assert_array_equal(a, b)
    replicated = list(linen_loop(20, devices=jax.devices()[:2]))[-1]
    for a, b in zip(
        jax.tree.leaves(host(straight.model_params)), jax.tree.leaves(host(replicated.model_params))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    evaluate = EvalLoop(
        EvalTask(LogicalMLP().apply, {"accuracy": accuracy}, [(X_TEST, Y_TEST)]),
        rnkey=jax.random.key(1),
    )
    assert evaluate(straight).metrics["eval"]["accuracy"] == pytest.approx(
        evaluate(replicated).metrics["eval"]["accuracy"], abs=1e-6
    )


def test_a_batch_axis_of_another_name_is_the_default_run_bit_for_bit():
    def mlp_loop(**options):
        model = MLP()
        task = TrainTask(model.apply, optax.adam(1e-2), cross_entropy, ResumableBatches(X, Y, 32))
        return TrainLoop(model.init, task, jax.random.key(0), n_steps=10, stdout=False, **options)

    named = list(mlp_loop(mesh=jax.make_mesh((4,), ("batch",)), batch_axis="batch"))[-1]
    default = list(mlp_loop())[-1]
    for a, b in zip(
        jax.tree.leaves(host(named.model_params)), jax.tree.leaves(host(default.model_params))
    ):
        np.testing.assert_array_equal(a, b)


def test_an_annotated_model_without_a_mesh_trains_replicated():
    model, whole = gpt_run(n_steps=2, devices=jax.devices()[:1])
    assert {leaf.sharding.spec for leaf in jax.tree.leaves(whole.model_params)} == {PartitionSpec()}
    assert np.isfinite(whole.loss)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mesh": jax.make_mesh((4,), ("data",))}, "no axis 'model'.*logical_axis_rules"),
        ({"sharding": "model"}, "no axis 'model'"),
        (
            {"mesh": jax.make_mesh((2, 2), ("data", "model")), "batch_axis": "batch"},
            "'batch' axis.*batch_axis",
        ),
        ({"batch_axis": 0}, "batch_axis must be the name"),
    ],
    ids=["axis-the-mesh-lacks", "model-without-mesh", "no-batch-axis", "batch-axis-not-a-name"],
)
def test_layouts_the_mesh_cannot_hold_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        gpt_run(n_steps=1, **options)


def test_a_logical_name_without_a_rule_and_an_unannotated_model_are_config_errors():
    with pytest.raises(ConfigError, match="no axis 'embed'"):
        linen_loop(1, mesh=data_model_mesh())  # no nn.logical_axis_rules in force
    with pytest.raises(ConfigError, match="annotates none"):
        TrainLoop(
            nn.Dense(10).init,
            TrainTask(
                nn.Dense(10).apply, optax.sgd(0.1), cross_entropy, ResumableBatches(X, Y, 32)
            ),
            jax.random.key(0),
            mesh=data_model_mesh(),
            sharding="model",
            stdout=False,
        )
