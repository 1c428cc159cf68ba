"""MI loss (including across gloo ranks), balance losses, uncertainty weighting, usage statistics."""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from squad.distributed import has_process_group, is_distributed
from squad.layers.context import ForwardContext, RouterStats
from squad.models.usage import ExpertUsage
from squad.train.losses import TaskWeighting, all_reduce_mass, balance_loss, mutual_information


def test_mi_independent_is_zero_and_separated_is_log_t():
    assert mutual_information(torch.ones(3, 4)).abs() < 1e-6
    assert torch.isclose(mutual_information(torch.eye(4) * 7), torch.tensor(math.log(4)), atol=1e-6)
    # a task with no tokens contributes nothing
    m = torch.tensor([[5.0, 0.0], [0.0, 5.0], [0.0, 0.0]])
    assert torch.isclose(mutual_information(m), torch.tensor(math.log(2)), atol=1e-6)


def test_mi_matches_direct_formula():
    mass = torch.rand(5, 7) * 10
    p = mass / mass.sum()
    pt, pe = p.sum(1), p.sum(0)
    direct = sum(p[i, j] * math.log(p[i, j] / (pt[i] * pe[j])) for i in range(5) for j in range(7))
    assert torch.isclose(mutual_information(mass), torch.tensor(float(direct)), atol=1e-6)


def _mass(w, x, task_ids):
    ctx = ForwardContext(task_ids=task_ids, num_tasks=3)
    probs = torch.softmax(x @ w, -1)  # [R, N, E]
    return ctx.per_task_sum(probs.sum(1))


def _rank_worker(rank, world, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    assert has_process_group() and is_distributed()
    usage = ExpertUsage(["a"])
    usage.update([RouterStats("l", "moe", None, torch.full((1, 2), rank + 1.0), torch.ones(1), 1)])
    usage.all_reduce()
    torch.manual_seed(0)
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(8, 4, 6)
    ids = torch.tensor([0, 1, 2, 0, 1, 1, 2, 0])
    half = slice(rank * 4, rank * 4 + 4)
    mass = all_reduce_mass(_mass(w, x[half], ids[half]))
    loss = mutual_information(mass)
    loss.backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    grad /= world  # data-parallel gradient averaging, as DeepSpeed does
    if rank == 0:
        torch.save({"loss": loss.detach(), "grad": grad, "usage": usage.counts["l"]}, out_file)
    dist.destroy_process_group()


@pytest.mark.slow
def test_mi_two_gloo_ranks_equal_one_rank():
    torch.manual_seed(0)
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(8, 4, 6)
    ids = torch.tensor([0, 1, 2, 0, 1, 1, 2, 0])
    loss = mutual_information(_mass(w, x, ids))
    loss.backward()
    with tempfile.TemporaryDirectory() as d:
        init, out = os.path.join(d, "init"), os.path.join(d, "out.pt")
        mp.spawn(_rank_worker, args=(2, init, out), nprocs=2, join=True)
        res = torch.load(out, weights_only=True)
    assert torch.allclose(res["loss"], loss.detach(), atol=1e-6)
    assert torch.allclose(res["grad"], w.grad, atol=1e-6)
    assert res["usage"].tolist() == [[3.0, 3.0]]  # ExpertUsage.all_reduce summed 1 + 2 over the ranks


def _one_rank_worker(rank, init_file):
    assert not has_process_group() and not is_distributed()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        assert has_process_group() and not is_distributed()  # a group of one rank: nothing to sum
        mass = torch.ones(2, 3)
        assert all_reduce_mass(mass) is mass
    finally:
        dist.destroy_process_group()


def test_one_rank_group_is_not_distributed():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_one_rank_worker, args=(os.path.join(d, "init"),), nprocs=1, join=True)


def _stats(mass, counts, k=1):
    return RouterStats("l", "moe", mass, counts, counts.sum(1) / k, k)


def test_switch_balance_uniform_is_one_and_skew_larger():
    uniform = _stats(torch.full((2, 4), 5.0), torch.full((2, 4), 5.0))
    assert torch.isclose(balance_loss([uniform], "switch"), torch.tensor(1.0))
    skew = _stats(torch.tensor([[17.0, 1, 1, 1], [1, 1, 1, 17]]), torch.tensor([[20.0, 0, 0, 0], [0, 0, 0, 20]]))
    assert balance_loss([skew], "switch", "per_task") > 3
    # across tasks the two skews cancel into a balanced total
    assert balance_loss([skew], "switch", "all") < balance_loss([skew], "switch", "per_task")
    assert balance_loss([uniform], "cv2") < 1e-6 < balance_loss([skew], "cv2")


@pytest.mark.parametrize("method", ["uncertainty", "uncertainty_log1p", "equal"])
def test_task_weighting(method):
    tw = TaskWeighting(["a", "b"], method)
    losses = {"a": torch.tensor(2.0), "b": torch.tensor(4.0)}
    total, weights = tw(losses)
    if method == "equal":
        assert total.item() == 6.0
    else:
        expected = 0.5 * 6.0 + (0.0 if method == "uncertainty" else 2 * math.log(2))
        assert math.isclose(total.item(), expected, rel_tol=1e-6)
        total.backward()
        assert tw.log_vars.grad is not None and (tw.log_vars.grad < 0).all()  # big losses → raise variance
    assert set(weights) == {"a", "b"}
    clamped, _ = TaskWeighting(["a"], "equal", clamp=10)({"a": torch.tensor(1e6)})
    assert clamped.item() == 10


def test_usage_accumulate_reset_state():
    usage = ExpertUsage(["a", "b"])
    s = RouterStats("blocks.1.mlp", "moe", torch.ones(2, 3), torch.tensor([[4.0, 0, 4], [0, 8, 0]]),
                    torch.tensor([4.0, 8.0]), 2)
    usage.update([s])
    usage.update([s])
    assert torch.allclose(usage.frequencies("a")["blocks.1.mlp"], torch.tensor([1.0, 0, 1], dtype=torch.float64))
    share = usage.selection_share()["blocks.1.mlp"]
    assert torch.allclose(share.sum(1), torch.ones(2, dtype=torch.float64))
    again = ExpertUsage.from_state_dict(usage.state_dict())
    assert torch.equal(again.counts["blocks.1.mlp"], usage.counts["blocks.1.mlp"])
    usage.reset()
    assert usage.counts["blocks.1.mlp"].sum() == 0
