"""DeepSpeed's gradient bucket buffers, read off real engines, against what ``zbench tune`` adds for them to a
DeepSpeed estimate (``zbench.tune.deepspeed_estimate.bucket_buffer_bytes``).

Stage 3 allocates its bucket whole when it builds and keeps it (190.7 MiB at the 50M-element default, on every
rank: not divided by the ranks), where its stand-in, the reference engine, reduces block by block into no standing
buffer: the estimate must add it. Stages 1-2 hold their bucket during backward only (two of them with
``overlap_comm``), the first of which the stand-in's flat groups hold too. Each engine trains one step of ``tiny``
at world 2 on gloo; a hook on every parameter's gradient reads the buffers during backward.

Runs where DeepSpeed is installed (the ``deepspeed`` extra, which ``.ci/run`` installs); skipped otherwise.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import launch_rank_scripts

pytestmark = pytest.mark.heavy  # the heavy tier: `python -m pytest -m heavy`

#: (stage, options): the buckets small where their size is an option, stage 3 at DeepSpeed's default in zbench.
SETUPS = [(1, {"bucket_size": 20_000}), (2, {"bucket_size": 20_000, "overlap_comm": True}), (3, {})]
WORLD = 2


def test_the_bucket_buffers_an_estimate_adds_are_the_ones_deepspeed_holds(tmp_path):
    pytest.importorskip("deepspeed")
    from zbench.implementations.deepspeed_zero import BUCKET_ELEMENTS
    from zbench.plan.trace.plan import make_case
    from zbench.tune.deepspeed_estimate import BUCKETED_STAGES, bucket_buffer_bytes

    (ranks,) = launch_rank_scripts(__file__, (WORLD,), tmp_path, label="deepspeed buffers").values()
    for rank in ranks.values():
        for (stage, options), (between_steps, in_backward) in zip(SETUPS, rank["buffers"], strict=True):
            case = make_case("tiny", "deepspeed", stage, "none", gpus=WORLD, precision="fp32", micro_batch=2,
                             seq_len=32, device="cpu", checkpointing=False, options=options)  # fmt: skip
            added = bucket_buffer_bytes(case)
            if stage in BUCKETED_STAGES:
                bucket = options["bucket_size"] * 4
                assert between_steps == 0  # released after backward: a peak, not a standing buffer
                assert in_backward == bucket + added  # the stand-in's flat group holds the first
                assert added == (bucket if options.get("overlap_comm") else 0)
            else:
                assert between_steps == in_backward == added == BUCKET_ELEMENTS * 4


def _rank(world: int, rank: int, out: object) -> None:
    import datetime
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from tests.conftest import hand_back_and_exit
    from zbench.cases import registry
    from zbench.cases.models import build_model
    from zbench.protocol import TrainSpec

    out = Path(str(out))
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    deepspeed = registry.resolve("deepspeed")
    found = []
    for stage, options in SETUPS:
        model = build_model("tiny", seed=0)
        engine = deepspeed.build(model, TrainSpec(device=torch.device("cpu"), stage=stage, options=options),
                                 dist.group.WORLD)  # fmt: skip
        seen: list[int] = []

        def read(grad: torch.Tensor, engine: object = engine, seen: list[int] = seen) -> None:
            seen.append(engine.buffer_bytes().get("device", 0))  # type: ignore[attr-defined]

        for p in model.parameters():
            p.register_hook(read)
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(rank))
        engine.step([(tokens[:, :-1], tokens[:, 1:])])
        found.append((engine.buffer_bytes().get("device", 0), max(seen)))
        engine.close()
    hand_back_and_exit({"buffers": found}, out, rank)


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
