"""List-scheduling model of the causal attention grids' order (CPU only).

Usage: python benchmarks/grid_order_model.py
For causal grids of G (batch, head) pairs with `blocks` CTAs each, CTA rank
r (0 = heaviest) costing 2 * (blocks - r) block products plus 4 for its
prologue, the CTAs are dealt in launch order to 132 SMs, one at a time per
SM, each to the SM that frees first (how the hardware hands out a grid). It
prints the finish time over the ideal (total work / 132) for (batch, head)
order, bands of 1, 4 and 8, and what the kernels ship
(`triton.heavy_first_band`), with the launch order decoded by the kernels'
own `triton.grid_position`. docs/benchmarks.md (2026-12-04 18:46) quotes it;
the model ignores L2, which is what bands are for.
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp

from tokamax.ops.attention import triton

SHAPES = {  # label: ((batch, head) pairs, CTAs per pair, heads per CTA)
    "GQA B4 T4096 N32 K8 dk/dv (4 query heads per CTA)": (32, 32, 4),
    "B8 T4096 N16 H128 (each kernel)": (128, 32, 1),
    "seed B32 T2048 N16 dk/dv": (512, 16, 1),
    "B1 T4096 N8": (8, 32, 1),
    "B1 T4096 N16": (16, 32, 1),
    "B1 T8192 N16": (16, 64, 1),
    "B1 T2048 N32, 192-row CTAs": (32, 11, 1),
}


def ranks(groups: int, blocks: int, band: int) -> list[int]:
  """The rank of each CTA in launch order (`triton.grid_position`)."""
  order = jax.vmap(lambda p: triton.grid_position(p, 1, groups, blocks, band)[2])
  return order(jnp.arange(groups * blocks, dtype=jnp.int32)).tolist()


SMS = 132  # H100/H200 SXM, the GPUs the model was checked against


def makespan_over_ideal(costs: list[float], sms: int = SMS) -> float:
  free = [0.0] * sms
  for c in costs:
    heapq.heappush(free, heapq.heappop(free) + c)
  return max(free) / (sum(costs) / sms)


def main():
  causal = triton.Spec(
      t=1, s=1, h=64, hv=64, hp=64, hvp=64, groups=1, scale=1.0, cap=None,
      causal=True, left=None, right=0, bias_dims=None, mask_dims=None,
      has_q_len=False, has_kv_len=False, precision=None)
  print("| shape | CTAs per SM | (batch, head) order | band 1 | band 4 | band 8 | shipped (band) |")
  print("|---|---|---|---|---|---|---|")
  for label, (groups, blocks, heads) in SHAPES.items():
    cost = lambda r: heads * 2 * (blocks - r) + 4
    tail = lambda band: makespan_over_ideal([cost(r) for r in ranks(groups, blocks, band)]) - 1
    shipped = triton.heavy_first_band(causal, groups, blocks, triton.HEAVY_FIRST_BAND,
                                      triton.HEAVY_FIRST_MAX_WAVES, triton.BAND_ONE_PER_HEAD,
                                      triton.BAND_ONE_MAX_WAVES)
    cells = [f"{100 * tail(b):.1f} %" for b in (blocks, 1, min(4, blocks), min(8, blocks))]
    print(f"| {label} | {groups * blocks / SMS:.1f} | {' | '.join(cells)} | "
          f"{100 * tail(shipped):.1f} % ({shipped}) |")


if __name__ == "__main__":
  main()
