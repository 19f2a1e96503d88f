"""Built-in long-context curve: short (220) and long (1024) measured in one run, pipelined."""

import json

from mlx_redrafter.llm.load import load_model
from mlx_redrafter.step.curve import BUCKET_SIZES, BUILTIN_COSTS
from mlx_redrafter.tuning.calibrate import measure_curve

model, tok = load_model("default")
c = measure_curve(model, budget_s=240, long_share=0.5, max_rounds=40)
print("rounds", c.rounds)
print("short", " ".join(f"{n}:{x:.2f}" for n, x in enumerate(c.costs, 1)))
print("long ", " ".join(f"{n}:{c.long_costs[n - 1]:.2f}" for n in BUCKET_SIZES))
print("ratio", " ".join(f"{n}:{c.long_costs[n - 1] / c.costs[n - 1]:.3f}" for n in BUCKET_SIZES))
print(
    "scaled builtin", {n: round(BUILTIN_COSTS[n - 1] * c.long_costs[n - 1] / c.costs[n - 1], 2) for n in BUCKET_SIZES}
)
json.dump(c.to_dict(), open("/tmp/exp/long_builtin.json", "w"))
