"""The collectives' bytes, counts and ring steps, on HLO lines of every replica-group form XLA and
libtpu print (the lines below are taken from compiled programs, operands and metadata shortened), and
on programs compiled for 8 fake CPU devices and for a TPU slice (libtpu)."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlver_jax.aot import step_time
from rlver_jax.aot.collectives import (Link, collective_bytes, collective_links, exposed_links,
                                       group_size)

# (line, devices in the program, devices in a group, bytes one device moves: by hand)
_FORMS = [
    # listed; a combined all-reduce: both arrays of its tuple, 2 x 128 f32, 2 x 3/4 of them
    ("%all-reduce.171 = (f32[1,1,2,64]{3,2,1,0:T(2,128)}, f32[1,1,2,64]{3,2,1,0:T(2,128)}) all-reduce("
     "%b.540, %b.539), channel_id=29, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, "
     "to_apply=%add.2.clone", 8, 4, 2 * 3 / 4 * 1024),
    # iota: devices 0..7 as [2,4], groups of 4: 3/4 of a 1 MiB bf16 weight
    ("%all-gather.1 = bf16[1024,512]{1,0:T(8,128)(2,1)} all-gather(%param.1), channel_id=2, "
     "replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true", 8, 4, 3 / 4 * 2**20),
    # iota of a transposed [2,4]: groups of 2
    ("%all-gather.2 = bf16[16,1024]{1,0:T(8,128)(2,1)} all-gather(%f.3), channel_id=3, "
     "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}, use_global_device_ids=true", 8, 2, 16 * 1024),
    ("%all-gather.34 = s32[2,1,3]{2,1,0:T(1,128)} all-gather(%fusion.123), channel_id=57, "
     "replica_groups=[4,2]<=[2,2,2]T(1,0,2), dimensions={0}, use_global_device_ids=true", 8, 2, 12),
    # named mesh axes
    ("%all-reduce = f32[1]{0:T(128)} all-reduce(%bitcast), channel_id=1, replica_groups=mesh['axis_0'=2,"
     "'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%region_3.2.clone", 8, 4, 6),
    # ... with a device order between: the 4-way all-gather that used to count 0
    ("%all-gather = f32[64,256]{1,0:T(8,128)} all-gather(%f), channel_id=1, replica_groups=mesh['axis_0'=4,"
     "'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, "
     "use_global_device_ids=true", 8, 4, 3 / 4 * 64 * 256 * 4),
    ("%all-reduce.149 = (f32[]{:T(128)}, f32[]{:T(128)}, f32[]{:T(128)}) all-reduce(%m.24, %m.22, %m.28), "
     "channel_id=109, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_0','axis_1'}, use_global_device_ids=true, to_apply=%region_12.14.clone", 8, 8, 2 * 7 / 8 * 12),
    # no groups: every device of the program (32 here)
    ("%all-reduce.3 = f32[1000]{0} all-reduce(%g), channel_id=4, replica_groups={}, to_apply=%add",
     32, 32, 2 * 31 / 32 * 4000),
    # a tuple all-to-all (XLA:CPU's form): the whole buffer, 3/4 of it leaves
    ("%all-to-all = (f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}) all-to-all(%s, %s.1, "
     "%s.2, %s.3), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}", 8, 4, 3 / 4 * 4 * 2048),
    ("%reduce-scatter = f32[250]{0} reduce-scatter(%r), replica_groups={{0,1,2,3}}, dimensions={0}",
     4, 4, 3 * 1000),
]


@pytest.mark.parametrize("line,devices,n,expected", _FORMS, ids=[
    "listed-combined", "iota", "iota-transposed", "iota-3d", "mesh", "mesh-device_ids",
    "mesh-device_ids-2-axes", "none", "all-to-all-tuple", "reduce-scatter-listed"])
def test_bytes_and_group_size_of_each_replica_group_form_by_hand(line, devices, n, expected):
  assert group_size(line, devices) == n
  assert collective_bytes("  " + line, devices) == pytest.approx(expected)


def test_async_starts_count_their_results_once_and_counts_and_steps_by_kind():
  hlo = "\n".join([
      # (operands, results, context): the result, 32 x 64 f32, once; the -done is not a transfer
      "  %collective-permute-start = (f32[32,64]{1,0:T(8,128)}, f32[32,64]{1,0:T(8,128)}, u32[]{:S(2)}, "
      "u32[]{:S(2)}) collective-permute-start(%p), channel_id=1, "
      "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
      "  %collective-permute-done = f32[32,64]{1,0:T(8,128)} collective-permute-done(%cp-start)",
      # combined: (operands), (results): results of 16 f32 + 8 bf16, half of them received
      "  %all-gather-start = ((f32[8]{0}, bf16[4]{0}), (f32[16]{0}, bf16[8]{0})) all-gather-start(%q, %r), "
      "replica_groups={{0,1}}, dimensions={0}",
      "  %all-gather-done = (f32[16]{0}, bf16[8]{0}) all-gather-done(%all-gather-start)",
      # two 8-way all-reduces: 2 x 7 ring steps each
      "  %all-reduce.1 = f32[1000]{0} all-reduce(%g), replica_groups=[1,8]<=[8], to_apply=%add",
      "  %all-reduce.2 = bf16[10]{0} all-reduce(%h), replica_groups={}, to_apply=%add",
      # groups of one device: no transfer, no op
      "  %all-reduce.3 = f32[64]{0} all-reduce(%k), replica_groups={{0},{1},{2},{3}}, to_apply=%add",
      "  %fusion = f32[64]{0} fusion(%all-reduce.3), kind=kLoop"])
  assert collective_bytes(hlo, 8) == pytest.approx(8192 + 40 + 7 / 4 * 4020)
  assert collective_links(hlo, 8) == {
      "collective-permute": Link(1, 32 * 64 * 4, 1),
      "all-gather": Link(1, (64 + 16) / 2, 1),
      "all-reduce": Link(2, 2 * 7 / 8 * (4000 + 20), 2 * 14)}


def test_exposed_collectives_are_synchronous_or_async_with_no_work_before_their_use():
  """A scheduled computation: which collectives' link time nothing overlaps, by hand."""
  hlo = "\n".join([
      "%body (p: f32[1000]) -> f32[1000] {",
      # synchronous, consumed at once: exposed (2 x 7/8 x 4,000 B, 14 ring steps)
      "  %all-reduce.1 = f32[1000]{0} all-reduce(%g), replica_groups=[1,8]<=[8], to_apply=%add",
      "  %c = f32[1000]{0} fusion(%all-reduce.1), kind=kLoop",
      # async with a fusion between start and done: hidden behind it
      "  %all-gather-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%q), replica_groups=[1,8]<=[8], "
      "dimensions={0}",
      "  %d = f32[1000]{0} fusion(%c), kind=kLoop",
      "  %all-gather-done = f32[64]{0} all-gather-done(%all-gather-start)",
      # async with only bookkeeping between: exposed (7/8 x 256 B, 7 ring steps)
      "  %all-gather-start.2 = (f32[8]{0}, f32[64]{0}) all-gather-start(%d), replica_groups=[1,8]<=[8], "
      "dimensions={0}",
      "  %b = f32[8,8]{1,0} bitcast(%d)",
      "  %all-gather-done.2 = f32[64]{0} all-gather-done(%all-gather-start.2)",
      # synchronous, its user later: the stream still waits for it
      "  %all-reduce.2 = bf16[10]{0} all-reduce(%h), replica_groups={}, to_apply=%add",
      "  %e = f32[1000]{0} fusion(%d), kind=kLoop",
      "  ROOT %t = (f32[1000]{0}, bf16[10]{0}) tuple(%e, %all-reduce.2)",
      "}"])
  assert exposed_links(hlo, 8) == Link(3, 7000 + 7 / 8 * 256 + 2 * 7 / 8 * 20, 14 + 7 + 14)
  total = collective_links(hlo, 8)
  assert total["all-gather"].ops == 2 and total["all-reduce"].ops == 2


def _gather_over_4_of_8(devices):
  """x sharded 4 ways over mesh axis b of a (2, 4) mesh, replicated: an all-gather in groups of 4."""
  mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("a", "b"))
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("b", None)))
  fn = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
  return step_time.compiled_cost(fn, (x,), mesh), fn.lower(x).compile().as_text()


_GATHERED = 3 * 16 * 256 * 4  # each device receives the 3 shards of 16 x 256 f32 it lacks


def test_a_compiled_all_gather_over_4_of_8_cpu_devices_counts_by_hand():
  cost, text = _gather_over_4_of_8(jax.devices("cpu"))
  assert " all-gather(" in text and "device_ids=" in text   # the form that used to count 0
  assert cost.link_bytes == _GATHERED
  assert (cost.link_ops, cost.link_hops) == (1, 3)  # one all-gather, 3 ring steps
  assert (cost.exposed_bytes, cost.exposed_ops) == (_GATHERED, 1)   # synchronous: nothing overlaps


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_compiled_all_gather_over_4_of_8_tpu_chips_counts_by_hand():
  from rlver_jax.aot.topology import get_topology
  cost, text = _gather_over_4_of_8(get_topology("v5p:2x2x2"))
  assert " all-gather(" in text
  assert cost.link_bytes == _GATHERED
  assert (cost.link_ops, cost.link_hops) == (1, 3)  # one all-gather, 3 ring steps
  assert (cost.exposed_bytes, cost.exposed_ops) == (_GATHERED, 1)   # synchronous: nothing overlaps
