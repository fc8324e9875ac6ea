"""Every candidate's evaluate JSON -> one table (markdown) and one JSON, into the results folder."""

import glob
import json
import os
import sys

out = sys.argv[1]
runs = {
    "lat_aedef_800": "AE 32 ch 2,000 steps (lr 1e-3); U-Net 800 steps, lr 1.5e-3",
    "lat_A": "AE 16 ch 400 steps (lr 1e-3); U-Net 800 steps, lr 1.5e-3",
    "lat_C": "AE 8 ch 800 steps (lr 2e-3); U-Net 800 steps, lr 1.5e-3",
    "lat_D": "AE 16 ch 800 steps (lr 2e-3); U-Net 800 steps, lr 1.5e-3",
    "lat_E": "AE 8 ch 800 (lr 2e-3); U-Net 1,000 steps, lr 1.5e-3",
    "lat_F": "AE 8 ch 800 (lr 2e-3); U-Net 1,000 steps, lr 3e-3",
    "lat_F1": "the same, training seed 1",
    "lat_G": "AE 8 ch 800 (lr 2e-3); U-Net 1,000 steps, lr 5e-3",
    "lat_G1": "the same, training seed 1",
    "lat_H": "AE 8 ch 800 (lr 2e-3); U-Net 560 steps of 256, lr 3e-3",
    "lat_J0": "AE 8 ch 800 (lr 2e-3); U-Net 1,000 steps, lr 3e-3, dropout 0",
    "lat_J1": "the same, training seed 1",
    "lat_K600": "the same as J, 600 steps",
    "lat_K1500": "the same as J, 1,500 steps",
    "lat_M": "J with Min-SNR 5 and uniform timesteps",
    "lat_M1": "the same, training seed 1",
    "lat_N": "J with Min-SNR 5 (importance-sampled timesteps): the recipe",
    "lat_N1": "the same, training seed 1",
    "lat_N600": "the recipe, 600 steps",
    "lat_N1500": "the recipe, 1,500 steps",
}
rows = []
for key, what in runs.items():
    scores = {}
    for f in sorted(glob.glob(f"/tmp/rs/{key}_eval*.json")):
        seed = json.load(open(f))["seed"]
        r = json.load(open(f))["rows"][0]
        scores[seed] = (r["confident"], r["frechet"], r["classes"], r["memorised"])
    if not scores:
        continue
    rows.append(dict(run=key, what=what, scores={str(k): v for k, v in scores.items()}))
json.dump(rows, open(os.path.join(out, "search.json"), "w"), indent=1)
for r in rows:
    cells = " | ".join(f"{v[0] * 100:.1f}%, {v[1]:.3f}" for k, v in sorted(r["scores"].items()))
    print(f"| {r['what']} | {cells} |")
