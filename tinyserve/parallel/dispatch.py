"""Which layers each pipeline stage holds: contiguous ranges chosen from each layer's bytes and each
stage's memory budget.

Stage 0 also holds the embedding, the final norm and the LM head (parallel/group.py says why), so it
takes fewer layers. The split minimizes the fullest stage's share of its budget (bytes / budget), so
equal budgets get equal bytes and a rank with half the memory gets half the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class StageSplit:
    layers: tuple[range, ...]  # stage -> its layers
    stage_bytes: tuple[int, ...]  # stage -> the weight bytes it holds (over all its tensor ranks)

    def describe(self, budgets: list[int]) -> str:
        return "; ".join(f"stage {s}: layers {r.start}-{r.stop - 1} ({len(r)}), {b / MIB:.1f} MiB of weights "
                         f"({b / budget:.1%} of its {budget / MIB:.0f} MiB)"
                         for s, (r, b, budget) in enumerate(zip(self.layers, self.stage_bytes, budgets)))


def split_layers(layer_bytes: list[int], first_stage_bytes: int, budgets: list[int]) -> StageSplit:
    """One contiguous range of at least one layer per stage (len(budgets) stages), minimizing the largest
    (stage bytes / stage budget); stage 0's bytes include first_stage_bytes. ValueError when a stage
    would exceed its budget, or there are fewer layers than stages."""
    num_layers, num_stages = len(layer_bytes), len(budgets)
    if num_layers < num_stages:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the model has {num_layers}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def load(stage: int, start: int, stop: int) -> float:
        fixed = first_stage_bytes if stage == 0 else 0
        return (fixed + prefix[stop] - prefix[start]) / budgets[stage]

    # best[s][i]: the least possible fullest share placing layers 0..i-1 on stages 0..s; cut[s][i] its start
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for i in range(1, num_layers + 1):
        best[0][i] = load(0, 0, i)
    for s in range(1, num_stages):
        for i in range(s + 1, num_layers + 1):
            for j in range(s, i):  # stage s takes layers j..i-1
                share = max(best[s - 1][j], load(s, j, i))
                if share < best[s][i]:
                    best[s][i], cut[s][i] = share, j
    stops = [num_layers]
    for s in range(num_stages - 1, 0, -1):
        stops.append(cut[s][stops[-1]])
    bounds = [0] + stops[::-1]
    layers = tuple(range(bounds[s], bounds[s + 1]) for s in range(num_stages))
    stage_bytes = tuple((first_stage_bytes if s == 0 else 0) + prefix[r.stop] - prefix[r.start]
                        for s, r in enumerate(layers))
    split = StageSplit(layers, stage_bytes)
    if best[num_stages - 1][num_layers] > 1:
        raise ValueError(f"the model's weights do not fit the ranks' memory: {split.describe(budgets)}")
    return split
