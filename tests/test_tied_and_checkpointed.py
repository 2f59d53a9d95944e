"""Shared parameters and activation checkpointing through every built-in engine: a head tied to the token embedding
(GPT-2, Llama style) and one weight shared by two transformer blocks (two stage-3 units), each with and without
activation checkpointing (``zbench.cases.models.checkpoint_blocks``, applied before the engine wraps the model, as the
worker does). Each engine trains exactly like DDP on the same model.

Stage 3 used to crash its ranks (SIGSEGV) on a weight shared by two blocks: the second block's flat buffer read
the weight through the first block's freed storage. Shared weights now live in the root unit.
One world-2 process group (gloo) runs every engine and tie; the tests assert on what rank 0 wrote.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zbench.ports import free_port

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

#: Each implementation at each stage it runs (FSDP2 at 2 and 3), as ``name-sSTAGE``.
ENGINES = ("ddp-s0", "fsdp-s2", "fsdp-s3", "torch_zero-s1", "zero1-s1", "zero2-s2", "zero3-s3")
TIES = ("embedding", "blocks", "both", "embedding+ckpt", "both+ckpt")
STEPS = 6


def tie(model: torch.nn.Module, how: str) -> None:
    from zbench.cases.models import checkpoint_blocks

    if how.startswith(("embedding", "both")):
        model.head.weight = model.tok.weight
    if how.startswith(("blocks", "both")):
        model.blocks[1].fc.weight = model.blocks[0].fc.weight
    if how.endswith("+ckpt"):
        checkpoint_blocks(model)


def train(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from zbench.cases import registry
    from zbench.cases.models import build_model, rank_micro_batches, synthetic_batch
    from zbench.presets import get_config
    from zbench.protocol import TrainSpec

    results: dict[str, dict] = {}
    for engine_name in ENGINES:
        name, stage = engine_name.rsplit("-s", 1)
        implementation = registry.resolve(name)
        assert int(stage) in implementation.capabilities.stages, engine_name
        for how in TIES:
            model = build_model("tiny", seed=0)
            tie(model, how)
            try:
                engine = implementation.build(
                    model, TrainSpec(device=torch.device("cpu"), stage=int(stage)), dist.group.WORLD
                )
            except (ValueError, NotImplementedError) as exc:  # an up-front refusal with a reason is allowed
                results[f"{engine_name}/{how}"] = {"refused": str(exc)}
                continue
            losses = []
            for step in range(STEPS):
                batch = synthetic_batch(get_config("tiny"), seed=0, step=step, rows=4 * world)
                loss = engine.step(rank_micro_batches(batch, rank=rank, world=world, grad_accum=1))
                dist.all_reduce(loss := loss.clone())
                losses.append(float(loss) / world)
            params = engine.full_parameters()
            results[f"{engine_name}/{how}"] = {"losses": losses, "params": {k: v.tolist() for k, v in params.items()}}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tied") / "results.json"
    mp.spawn(train, args=(2, free_port(), str(out)), nprocs=2)
    return json.loads(out.read_text())


@pytest.mark.parametrize("how", TIES)
@pytest.mark.parametrize("engine", ENGINES[1:])
def test_trains_like_ddp_on_the_tied_model(trained, engine, how):
    case, ref = trained[f"{engine}/{how}"], trained[f"ddp-s0/{how}"]
    if "refused" in case:
        pytest.fail(f"{engine} refused a model with shared weights: {case['refused']}")
    assert case["params"].keys() == ref["params"].keys()  # a shared weight appears once, under its first name
    for a, b in zip(case["losses"], ref["losses"]):
        assert a == pytest.approx(b, rel=1e-5)
    for name, values in ref["params"].items():
        got, want = torch.tensor(case["params"][name]), torch.tensor(values)
        assert float((got - want).norm() / want.norm()) <= 1e-5, name
