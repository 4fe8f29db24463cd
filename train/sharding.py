"""Where every array lives: a (data, fsdp, tensor) device mesh and a PartitionSpec plan.

The plan is computed from each array's shape, so the target, the draft and the optimiser state
(whose moments have their parameters' shapes) all follow the same rule with no annotations inside
the model files: a matrix's largest dimension divisible by the fsdp axis is split over `fsdp`
(ZeRO-3 / FSDP: XLA gathers it where it is used), another dimension over `tensor` when that axis
is larger than 1; small arrays (norms, biases) are replicated. The batch is split over data and
fsdp together. One code path: a 1-device mesh makes every spec trivially replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from longspec_jax.errors import UserError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # both shard the batch; fsdp also shards parameters
REPLICATE_BELOW = 2**14  # elements: smaller arrays are cheaper to copy everywhere than to gather


def maybe_initialize_distributed() -> None:
    """Multi-host runs: `jax.distributed.initialize` when the environment says so. Either set
    JAX_COORDINATOR_ADDRESS (host:port), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every host, or
    launch under a cluster JAX detects by itself (SLURM, Open MPI) with more than one task."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        try:
            num_processes, process_id = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise UserError(
                "JAX_COORDINATOR_ADDRESS is set: also set JAX_NUM_PROCESSES and JAX_PROCESS_ID (integers) on every host"
            ) from None
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], num_processes, process_id)
    elif any(int(os.environ.get(v, "1")) > 1 for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")):
        jax.distributed.initialize()


def resolve_mesh_shape(mesh: tuple[int, int, int], num_devices: int) -> tuple[int, int, int]:
    """Fill in a -1 axis so the mesh uses all devices; check the product."""
    sizes = list(mesh)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise UserError(
                f"mesh {tuple(mesh)} does not divide {num_devices} devices: set --set mesh=data,fsdp,tensor"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise UserError(
            f"mesh {tuple(sizes)} needs {math.prod(sizes)} devices, {num_devices} available: "
            "set --set mesh=data,fsdp,tensor"
        )
    return tuple(sizes)


def make_mesh(mesh: tuple[int, int, int], devices=None) -> Mesh:
    devices = jax.devices() if devices is None else list(devices)
    shape = resolve_mesh_shape(mesh, len(devices))
    return jax.make_mesh(shape, AXES, (AxisType.Auto,) * 3, devices=devices)


def spec_for_shape(shape: tuple[int, ...], fsdp: int, tensor: int, min_elements: int = REPLICATE_BELOW) -> P:
    """The plan's rule (see the module docstring) for one array shape."""
    if len(shape) < 2 or math.prod(shape) < min_elements:
        return P()
    axes: list = [None] * len(shape)
    by_size = sorted(range(len(shape)), key=lambda i: -shape[i])
    if fsdp > 1:
        for i in by_size:
            if shape[i] % fsdp == 0:
                axes[i] = "fsdp"
                break
    if tensor > 1:
        for i in by_size:
            if axes[i] is None and shape[i] % tensor == 0:
                axes[i] = "tensor"
                break
    return P(*axes)


def param_shardings(tree, mesh: Mesh, min_elements: int = REPLICATE_BELOW):
    """NamedShardings for a pytree of arrays / ShapeDtypeStructs, by `spec_for_shape`."""
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    return jax.tree.map(lambda x: NamedSharding(mesh, spec_for_shape(tuple(x.shape), fsdp, tensor, min_elements)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [accumulation steps, sequences, seq_len]: the sequences split over data x fsdp."""
    return NamedSharding(mesh, P(None, BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows of a batch -> global arrays sharded by `batch_sharding` (multi-host safe)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


# ---- memory plan: computed from shapes, nothing allocated ------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Estimated peak bytes per device of one training step."""

    target_weights: float
    draft_state: float
    gathered_weights: float
    activations: float
    capacity: float

    @property
    def total(self) -> float:
        return self.target_weights + self.draft_state + self.gathered_weights + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def describe(self) -> str:
        gb = 1e9
        return (
            f"per device: target {self.target_weights / gb:.2f} GB + draft state {self.draft_state / gb:.2f} GB"
            f" + gathered layer weights {self.gathered_weights / gb:.2f} GB + activations"
            f" {self.activations / gb:.2f} GB = {self.total / gb:.2f} GB of {self.capacity / gb:.1f} GB"
        )


def _sharded_bytes(tree, fsdp: int, tensor: int, bytes_per_element: float | None = None) -> float:
    total = 0.0
    for x in jax.tree.leaves(tree):
        spec = spec_for_shape(tuple(x.shape), fsdp, tensor)
        shards = math.prod({"fsdp": fsdp, "tensor": tensor}.get(a, 1) for a in spec if a is not None)
        per = np.dtype(x.dtype).itemsize if bytes_per_element is None else bytes_per_element
        total += math.prod(x.shape) * per / shards
    return total


def memory_plan(
    model,
    target_shapes,
    draft_shapes,
    *,
    mesh_shape,
    seq_len: int,
    micro_batch_size: int,
    compute_bytes: int,
    loss_chunk_tokens: int,
    window: int,
    capacity_bytes: float,
) -> MemoryPlan:
    """Peak memory per device, from parameter shapes (eval_shape) and the step's activation sizes.

    Assumes a flash attention for the target and the draft's cross-attention (no [L, L] scores),
    which is what the GPU path uses; the draft's windowed self-attention keeps [L, 2W] float32
    scores. The draft state is float32 master weights + gradients + two Adam moments (16 bytes a
    parameter) plus its compute-dtype copy; activations are the micro-batch's, for the target's
    largest layer (forward only) and the draft block's saved residuals (forward + backward), plus
    one chunk of the cross-entropy's logits.
    """
    data, fsdp, tensor = mesh_shape
    target = _sharded_bytes(target_shapes, fsdp, tensor, compute_bytes)
    draft_state = _sharded_bytes(draft_shapes, fsdp, tensor, 16 + compute_bytes)
    # FSDP gathers a layer's weights where they are used: allow two target layers in flight
    # (the next one's gather overlaps) and the whole draft block during its forward/backward.
    draft_elements = sum(math.prod(x.shape) for x in jax.tree.leaves(draft_shapes))
    gathered = (2 * _layer_elements(model) + 2 * draft_elements) * compute_bytes / tensor
    tokens = micro_batch_size * seq_len
    h, f = model.hidden_size, model.intermediate_size
    qd, kvd = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    target_act = tokens * (2 * h + 2 * qd + 2 * kvd + 3 * f) * compute_bytes
    draft_saved = tokens * (10 * h + 6 * qd + 4 * kvd + 4 * f) * compute_bytes
    window_scores = tokens * model.num_heads * 2 * min(window, seq_len) * 4 * 2  # scores and probabilities
    loss_chunk = loss_chunk_tokens * model.vocab_size * 4 * 3  # logits, softmax, gradient (float32)
    activations = 1.25 * (target_act + draft_saved + window_scores + loss_chunk) / tensor  # 25%: XLA temporaries
    return MemoryPlan(target, draft_state, gathered, activations, capacity_bytes)


@functools.lru_cache(maxsize=16)
def parameter_shapes(model, dtype: str):
    """(target, draft) parameter ShapeDtypeStructs from eval_shape: no weights are made."""
    from flax import nnx

    from longspec_jax.draft import DraftBlock
    from longspec_jax.model import Transformer

    target = nnx.state(nnx.eval_shape(lambda: Transformer(model, dtype=dtype, rngs=nnx.Rngs(0))))
    draft = nnx.state(nnx.eval_shape(lambda: DraftBlock(model, rngs=nnx.Rngs(0))))
    return target, draft


def config_memory_plan(cfg) -> MemoryPlan:
    """The plan of `cfg`'s selected stage on the GPUs it names."""
    from longspec_jax.draft import DraftConfig

    stage = cfg.current
    target_shapes, draft_shapes = parameter_shapes(cfg.model, cfg.compute_dtype)
    return memory_plan(
        cfg.model,
        target_shapes,
        draft_shapes,
        mesh_shape=resolve_mesh_shape(cfg.mesh, cfg.num_gpus),
        seq_len=stage.seq_len,
        micro_batch_size=stage.micro_batch_size,
        compute_bytes=np.dtype(cfg.compute_dtype).itemsize,
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        window=DraftConfig().window,
        capacity_bytes=cfg.gpu_memory_gb * 1e9,
    )


def _layer_elements(model) -> int:
    h, f = model.hidden_size, model.intermediate_size
    qd, kvd = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return h * (2 * qd + 2 * kvd) + 3 * h * f
