"""SMP's degree semantics as a table: no processes.

The messages of lightning_smp.degree (and of the static ``device_mesh`` check, which turns a mesh tuple into a
degree) are asserted here in full; the tests of the layers above assert the error type and the parameter only.
"""

import pytest
from torch.distributed.fsdp import ShardingStrategy

from lightning_smp import HybridShardConfigError, resolve_layout, valid_degrees
from lightning_smp.config.options import check_device_mesh
from lightning_smp.degree import check_degree, check_sharding_strategy, reconcile_degree, resolve_strategy_layout
from lightning_smp.engines.fsdp1.flat import flat_param_numel, local_shard_numel
from lightning_smp.names import (
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    REPLICATE_AXIS,
    SHARD_AXIS,
    SHARD_GRAD_OP,
    SHARDING_STRATEGIES,
)

#: The advice closing each static degree error.
NOT_AN_INTEGER_FIX = (" Fix: pass a whole number, 0 for native FSDP behaviour, 1 for no sharding, or the number of"
                      " ranks in a shard group (>= 2).")
NEGATIVE_FIX = (" Fix: pass 0 for native FSDP behaviour, 1 for no sharding, or the number of ranks in a shard group"
                " (>= 2).")


@pytest.mark.parametrize(
    ("world", "degree", "requested", "per_node", "expected"),
    [
        # degree 0: native FSDP behaviour
        pytest.param(4, 0, HYBRID_SHARD, 4, (1, 4, FULL_SHARD), id="0_hybrid_one_node_is_full_shard"),
        pytest.param(8, 0, HYBRID_SHARD, 4, (2, 4, HYBRID_SHARD), id="0_hybrid_two_nodes"),
        pytest.param(8, 0, HYBRID_SHARD_ZERO2, 4, (2, 4, HYBRID_SHARD_ZERO2), id="0_zero2_two_nodes"),
        pytest.param(4, 0, HYBRID_SHARD_ZERO2, 4, (1, 4, SHARD_GRAD_OP), id="0_zero2_one_node"),
        pytest.param(8, 0, FULL_SHARD, 4, (1, 8, FULL_SHARD), id="0_full_shard_everyone"),
        pytest.param(8, 0, SHARD_GRAD_OP, 4, (1, 8, SHARD_GRAD_OP), id="0_shard_grad_op_everyone"),
        pytest.param(8, 0, NO_SHARD, 4, (8, 1, NO_SHARD), id="0_no_shard"),
        pytest.param(4, 0, HYBRID_SHARD, 1, (4, 1, NO_SHARD), id="0_hybrid_one_device_per_node"),
        # degree 1: no sharding, whole-world replication
        pytest.param(4, 1, HYBRID_SHARD, 4, (4, 1, NO_SHARD), id="1_hybrid"),
        pytest.param(4, 1, HYBRID_SHARD_ZERO2, 4, (4, 1, NO_SHARD), id="1_zero2"),
        pytest.param(4, 1, FULL_SHARD, 4, (4, 1, NO_SHARD), id="1_full_shard"),
        # degree >= 2: shard groups of that size
        pytest.param(4, 2, HYBRID_SHARD, 4, (2, 2, HYBRID_SHARD), id="2_of_4"),
        pytest.param(8, 2, HYBRID_SHARD_ZERO2, 8, (4, 2, HYBRID_SHARD_ZERO2), id="2_of_8_zero2"),
        pytest.param(8, 4, FULL_SHARD, 8, (2, 4, HYBRID_SHARD), id="full_shard_overridden"),
        pytest.param(8, 4, SHARD_GRAD_OP, 8, (2, 4, HYBRID_SHARD), id="shard_grad_op_overridden"),
        pytest.param(8, 4, NO_SHARD, 8, (2, 4, HYBRID_SHARD), id="no_shard_overridden"),
        pytest.param(16, 8, HYBRID_SHARD, 4, (2, 8, HYBRID_SHARD), id="8_spans_two_nodes_of_4"),
        # degree == world size: one replica, no size-1 all-reduce
        pytest.param(4, 4, HYBRID_SHARD, 4, (1, 4, FULL_SHARD), id="4_of_4"),
        pytest.param(4, 4, HYBRID_SHARD_ZERO2, 4, (1, 4, SHARD_GRAD_OP), id="4_of_4_zero2"),
        pytest.param(2, 2, FULL_SHARD, 1, (1, 2, FULL_SHARD), id="2_of_2_full"),
        pytest.param(1, 1, HYBRID_SHARD, 1, (1, 1, NO_SHARD), id="single_rank"),
    ],
)
def test_resolve_layout(world, degree, requested, per_node, expected):
    layout = resolve_layout(world, degree, requested, devices_per_node=per_node)
    assert (layout.replicate, layout.shard, layout.sharding_strategy) == expected
    assert layout.replicate * layout.shard == world
    # the FSDP name must exist in torch
    ShardingStrategy[layout.sharding_strategy]


@pytest.mark.parametrize(
    ("degree", "requested", "overridden"),
    [(2, FULL_SHARD, True), (2, SHARD_GRAD_OP, True), (2, NO_SHARD, True), (2, HYBRID_SHARD, False),
     (2, HYBRID_SHARD_ZERO2, False), (0, FULL_SHARD, False), (1, FULL_SHARD, False)],
)
def test_override_flag(degree, requested, overridden):
    assert resolve_layout(4, degree, requested).overridden is overridden


def test_groups_are_consecutive_shards_and_strided_replicas():
    layout = resolve_layout(8, 2)
    assert [layout.shard_group(r) for r in (0, 1, 5)] == [[0, 1], [0, 1], [4, 5]]
    assert [layout.replicate_group(r) for r in (0, 1, 5)] == [[0, 2, 4, 6], [1, 3, 5, 7], [1, 3, 5, 7]]
    assert layout.fsdp_axis == "both"
    assert resolve_layout(8, 1).fsdp_axis == REPLICATE_AXIS
    assert resolve_layout(8, 8).fsdp_axis == SHARD_AXIS


def test_valid_degrees():
    assert valid_degrees(8) == [0, 1, 2, 4, 8]
    assert valid_degrees(6) == [0, 1, 2, 3, 6]
    assert valid_degrees(1) == [0, 1]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        pytest.param(-1, "hybrid_shard_degree=-1 is negative." + NEGATIVE_FIX, id="negative"),
        pytest.param(True, "hybrid_shard_degree=True (bool) is not an integer." + NOT_AN_INTEGER_FIX, id="bool"),
        pytest.param(2.5, "hybrid_shard_degree=2.5 (float) is not an integer." + NOT_AN_INTEGER_FIX, id="float"),
        pytest.param("2", "hybrid_shard_degree='2' (str) is not an integer." + NOT_AN_INTEGER_FIX, id="string"),
        pytest.param(None, "hybrid_shard_degree=None (NoneType) is not an integer." + NOT_AN_INTEGER_FIX, id="none"),
    ],
)
def test_static_degree_errors(value, fragment):
    with pytest.raises(HybridShardConfigError, match="Fix:") as err:
        check_degree(value)
    assert str(err.value) == fragment
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("world", "degree", "message"),
    [
        pytest.param(8, 3, "hybrid_shard_degree=3 does not divide world_size=8 (num_nodes x devices). "
                     "Valid degrees for this world size: 0, 1, 2, 4, 8. Fix: pick one of them or change"
                     " devices/num_nodes.", id="3_of_8"),
        pytest.param(4, 8, "hybrid_shard_degree=8 is larger than world_size=4 (num_nodes x devices). "
                     "Valid degrees for this world size: 0, 1, 2, 4. Fix: lower hybrid_shard_degree or add"
                     " devices/nodes.", id="8_of_4"),
        pytest.param(6, 4, "hybrid_shard_degree=4 does not divide world_size=6 (num_nodes x devices). "
                     "Valid degrees for this world size: 0, 1, 2, 3, 6. Fix: pick one of them or change"
                     " devices/num_nodes.", id="4_of_6"),
    ],
)
def test_world_size_errors(world, degree, message):
    with pytest.raises(HybridShardConfigError) as err:
        resolve_layout(world, degree)
    assert str(err.value) == message


def test_sharding_strategy_names():
    assert check_sharding_strategy("hybrid_shard") == HYBRID_SHARD
    assert check_sharding_strategy(ShardingStrategy._HYBRID_SHARD_ZERO2) == HYBRID_SHARD_ZERO2
    with pytest.raises(HybridShardConfigError) as err:
        check_sharding_strategy("HALF_SHARD")
    assert str(err.value) == (f"sharding_strategy='HALF_SHARD' is not a sharding strategy. Valid values:"
                              f" {', '.join(SHARDING_STRATEGIES)}.")


def test_a_degree_must_agree_with_the_mesh_or_group_it_comes_with():
    assert reconcile_degree("device_mesh", None, 2) == 2  # nothing implied: the degree as given
    assert reconcile_degree("device_mesh", 4, None) == 4
    assert reconcile_degree("device_mesh", 4, 0) == 4
    assert reconcile_degree("process_group", 4, 4) == 4
    for source in ("device_mesh", "process_group"):
        with pytest.raises(HybridShardConfigError) as err:
            reconcile_degree(source, 4, 2)
        assert str(err.value) == (f"hybrid_shard_degree=2 contradicts {source}, whose shard group has 4 rank(s)."
                                  " Fix: pass only one of them, or make them agree (hybrid_shard_degree=4).")


def test_a_given_mesh_shape_must_fit_the_world():
    assert resolve_strategy_layout(1, 4, 2, HYBRID_SHARD, mesh_shape=(2, 2)).mesh_shape == (2, 2)
    with pytest.raises(HybridShardConfigError) as err:
        resolve_strategy_layout(1, 4, 2, HYBRID_SHARD, mesh_shape=(1, 2))
    assert str(err.value) == ("device_mesh of shape (1, 2) does not fit world_size=4 (num_nodes=1 x devices=4)."
                              " Fix: use shape (2, 2) or pass hybrid_shard_degree instead.")


@pytest.mark.parametrize("mesh", [(2, 0), (2,), (2, True), [1, 2, 3]])
def test_a_device_mesh_tuple_is_two_positive_integers(mesh):
    assert check_device_mesh((2, 4)) == (None, 4)  # the shard degree it implies
    with pytest.raises(HybridShardConfigError) as err:
        check_device_mesh(mesh)
    assert str(err.value) == (f"device_mesh={mesh!r} must be a tuple (replicas, shard_degree) of two positive"
                              " integers. Fix: e.g. device_mesh=(2, 4), or pass hybrid_shard_degree=4 instead.")


@pytest.mark.parametrize(
    ("numels", "group", "aligned", "flat"),
    [
        # 528 + 33 -> pad 33 to 36 (4-element alignment for fp32) -> 564 + 132 + 4 = 700, divisible by 2 and 4
        pytest.param([528, 33, 132, 4], 2, True, 700, id="tiny_model_2"),
        pytest.param([528, 33, 132, 4], 8, True, 704, id="tiny_model_8"),
        pytest.param([528, 33, 132, 4], 3, True, 702, id="tiny_model_3"),
        pytest.param([528, 33, 132, 4], 4, False, 697, id="unaligned"),
        pytest.param([5], 4, True, 8, id="one_param"),
    ],
)
def test_flat_param_numel(numels, group, aligned, flat):
    assert flat_param_numel(numels, group, aligned=aligned) == flat


def test_local_shard_numel():
    numels = [528, 33, 132, 4]
    assert local_shard_numel(numels, 2) == 350
    assert local_shard_numel(numels, 4) == 175
    # NO_SHARD over 4 ranks: the whole flat parameter, padded to the group size
    assert local_shard_numel(numels, 1, group_size=4) == 700
    # use_orig_params=False: no alignment, the last chunk is padded
    assert local_shard_numel(numels, 4, aligned=False) == 175
