"""Draw the README's headline figure from committed numbers: python docs/make_figures.py

Reads results/cpu/results.json (the cpu-scale reproduction: `reproduce.py --scale cpu`, the smoke model,
2 layers x 128, on a 2-core CPU; see results/cpu/results.md) and writes docs/figures/contextual_score.png.
No training, no data: every point is a held-out number that the runs logged at their evaluations.
"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"taco": ("TACO", "C1"), "mlm": ("MLM", "C0"), "electra": ("ELECTRA", "C2"), "cocolm": ("COCO-LM", "C3")}


def curve(run, key):
    points = [(p["step"], p[key]) for p in run["curves"] if key in p]
    return [s for s, _ in points], [v for _, v in points]


def main():
    runs = json.loads((ROOT / "results/cpu/results.json").read_text())["runs"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, (label, color) in RUNS.items():
        ax.plot(*curve(runs[name], "contextual_score"), marker="o", ms=3, label=label, color=color)
    # The held-out MLM loss is left out: ELECTRA's and COCO-LM's main models have no MLM head to score.
    ax.set(xlabel="training step", ylabel="contextual score (held-out)",
           title="Token states that know their own sequence: TACO vs MLM, ELECTRA, COCO-LM")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    out = ROOT / "docs/figures/contextual_score.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
