"""Draw the figures train_example.py logs (its metrics file, one JSON line per logged step) as a PNG: the training
and held-out loss against the unigram baseline, and the learning rate. Needs matplotlib (pip install matplotlib),
which get_strategy.py and the tests do not.

    python docs/plot_metrics.py ckpt/metrics.jsonl curves.png
"""

import argparse
import json
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", help="the example's metrics file (its --metrics_path)")
    parser.add_argument("png", nargs="?", default="curves.png", help="the picture to write")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, no screen
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("docs/plot_metrics.py needs matplotlib: pip install matplotlib")
    rows = [json.loads(line) for line in open(args.metrics)]

    def series(field):  # (steps, values) of the rows that measured field
        pairs = [(row["step"], row[field]) for row in rows if row.get(field) is not None]
        return [step for step, _ in pairs], [value for _, value in pairs]

    figure, losses = plt.subplots(figsize=(8, 4.5))
    losses.plot(*series("train_loss"), label="training loss (mean over ranks of the logged step)")
    losses.plot(*series("val_loss"), "o-", label="held-out loss")
    unigram = series("unigram_loss")[1]
    if unigram:
        losses.axhline(unigram[-1], linestyle="--", color="gray", label="unigram baseline (byte frequencies)")
    losses.set_xlabel("optimizer step")
    losses.set_ylabel("cross-entropy, nats per byte")
    rate = losses.twinx()
    rate.plot(*series("lr"), ":", color="tab:green", label="learning rate (right)")
    rate.set_ylabel("learning rate")
    handles = losses.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    losses.legend(handles, [h.get_label() for h in handles], loc="upper right")
    figure.tight_layout()
    figure.savefig(args.png, dpi=100)
    print(f"wrote {args.png} from {len(rows)} logged steps")


if __name__ == "__main__":
    main()
