"""The shape of the MoC paper's accuracy study, on CPU: train the ``small`` GPT-MoE on a real
corpus (the Python standard library's sources, byte-level tokens) with the same seed and
data, inject crashes at fixed iterations, let torchrun's elastic agent restart the job
(scripts/run_elastic.sh), and compare checkpointing policies by final validation loss,
accumulated Proportion of Lost Tokens, checkpoint bytes and the training loop's stall.

    python experiments/accuracy.py --out runs/accuracy            # all policies
    python experiments/accuracy.py --policies no-faults,pec-k1    # a subset

Writes ``OUT/results.json``, ``OUT/table.md`` (also printed) and ``OUT/loss.png`` (needs
matplotlib: ``pip install -e .[bench]``); each run's log, metrics and event file stay
under ``OUT/<policy>/``.

Policies (faults at ``--faults``, the same for every policy but ``no-faults``):

- ``no-faults``: the reference, checkpoints as ``full`` but nothing fails;
- ``full``: MoC checkpoints of every expert every ``--save-interval`` iterations;
- ``pec-k1`` / ``pec-k2``: partial experts checkpointing, K = 1 / 2 of 8 experts per MoE
  layer per checkpoint (weights and optimizer state of the saved experts);
- ``pec-k1-w`` / ``pec-k2-w``: the paper's W variant (``--moc-pec-scope w``): PEC on the
  weights only, every expert's optimizer state saved every time;
- ``pec-k1-o`` / ``pec-k2-o``: the O variant (``--moc-pec-scope o``): PEC on the optimizer
  state only, every expert's weights saved every time;
- ``pec-k1-dynamic``: K = 1 with dynamic K (doubled after a recovery while the
  accumulated PLT is over 3.75 %);
- ``two-level``: a snapshot every iteration into the node keeper's memory with 4 experts
  per MoE layer, every 10th persisted with 1 expert per MoE layer; recovery from memory.

PLT counts an expert's tokens as lost since its older part's version: under the O
variant the weights' updates survive a recovery, the optimizer moments' do not.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron.data.stdlib_corpus import prepare_stdlib_corpus  # noqa: E402  (the quickstart's corpus)

POLICIES = {
    "no-faults": [],
    "full": [],
    "pec-k1": ["--moc-pec-k", "1"],
    "pec-k2": ["--moc-pec-k", "2"],
    "pec-k1-w": ["--moc-pec-k", "1", "--moc-pec-scope", "w"],
    "pec-k1-o": ["--moc-pec-k", "1", "--moc-pec-scope", "o"],
    "pec-k2-w": ["--moc-pec-k", "2", "--moc-pec-scope", "w"],
    "pec-k2-o": ["--moc-pec-k", "2", "--moc-pec-scope", "o"],
    "pec-k1-dynamic": ["--moc-pec-k", "1", "--moc-dynamic-k"],
    "two-level": ["--moc-two-level", "--moc-snapshot-interval", "1", "--moc-persist-interval",
                  "10", "--moc-k-snapshot", "4", "--moc-k-persist", "1"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/accuracy", help="Output directory (replaced).")
    p.add_argument("--policies", default=",".join(POLICIES), help="Comma list of policies.")
    p.add_argument("--iters", type=int, default=200, help="Training iterations.")
    p.add_argument("--save-interval", type=int, default=20,
                   help="Iterations between storage checkpoints (full and PEC policies).")
    p.add_argument("--faults", default="crash@75:rank=1,crash@145:rank=0",
                   help="Comma list of --moc-fault specs injected in every faulty policy.")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (expert-parallel 2).")
    p.add_argument("--eval-interval", type=int, default=25, help="Validation every N iterations.")
    p.add_argument("--data-prefix", default="data/stdlib",
                   help="Indexed dataset prefix; prepared from the standard library if missing.")
    return p


def run_policy(name: str, opts, data: str, out: str) -> dict:
    """One training job under scripts/run_elastic.sh; returns its measurements."""
    run_dir = os.path.join(out, name)
    os.makedirs(run_dir)
    ckpt = os.path.join(run_dir, "ckpt")
    shm = f"/dev/shm/moc-accuracy-{os.getuid()}-{name}"
    shutil.rmtree(shm, ignore_errors=True)
    faults = [] if name == "no-faults" else ["--moc-fault", *opts.faults.split(",")]
    cmd = ["bash", "scripts/run_elastic.sh", str(opts.nproc), "5",
           "--config", "configs/small.yaml", "--data-path", data,
           "--train-iters", str(opts.iters), "--lr-decay-iters", str(opts.iters),
           "--eval-interval", str(opts.eval_interval), "--eval-iters", "4",
           "--log-interval", "10", "--save", ckpt, "--load", ckpt,
           "--save-interval", str(opts.save_interval),
           "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
           "--moc-checkpoint", "--moc-shm-dir", shm, *POLICIES[name], *faults]
    start = time.time()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    wall = time.time() - start
    shutil.rmtree(shm, ignore_errors=True)
    if proc.returncode != 0:
        return {"policy": name, "ok": False, "wall_s": wall,
                "note": f"exit {proc.returncode}; see {run_dir}/log.txt"}
    return {"policy": name, "ok": True, "wall_s": wall, **measure(run_dir, ckpt)}


def measure(run_dir: str, ckpt: str) -> dict:
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    valid = [(r["iteration"], r["lm_loss"]) for r in metrics if r["kind"] == "valid"]
    train = {}
    for r in metrics:  # after a restart, the redone iterations replace the lost ones
        if r["kind"] == "train":
            train[r["iteration"]] = r["lm_loss"]
    events_path = os.path.join(ckpt, "moc-events.jsonl")
    events = [json.loads(line) for line in open(events_path)] if os.path.exists(events_path) else []
    recoveries = [e for e in events if e["kind"] == "recovery"]
    log = open(os.path.join(run_dir, "log.txt")).read()
    stalls = [float(s) for s in re.findall(r"saved checkpoint at iteration\s+\d+ to \S+ in "
                                           r"([0-9.]+) s", log)]
    sizes = []
    for tag in sorted(os.listdir(ckpt)):
        manifest = os.path.join(ckpt, tag, "manifest.json")
        if os.path.exists(manifest):
            files = json.load(open(manifest))["files"]
            sizes.append(sum(f["nbytes"] for f in files.values()))
    return {
        "final_valid_loss": valid[-1][1] if valid else None,
        "valid_curve": valid,
        "train_curve": sorted(train.items()),
        "recoveries": len(recoveries),
        "cumulative_plt": recoveries[-1]["cumulative_plt"] if recoveries else 0.0,
        "iterations_lost": sum(e.get("iterations_lost") or 0 for e in recoveries),
        "recovery_sources": [e.get("source") for e in recoveries],
        "load_s": [round(e.get("load_s", 0.0), 3) for e in recoveries],
        "restart_s": [round(e["seconds_since_progress"], 1) for e in recoveries
                      if e.get("seconds_since_progress") is not None],
        "checkpoint_mib_mean": statistics.mean(sizes) / 2**20 if sizes else None,
        "checkpoints": len(sizes),
        "stall_s_median": statistics.median(stalls) if stalls else None,
        "k_after": [e.get("k") for e in recoveries],
    }


def table(rows) -> str:
    head = ["policy", "final valid loss", "vs no-faults", "recoveries", "iterations lost",
            "accumulated PLT", "K after recoveries", "recovered from", "load (s)",
            "restart (s)", "ckpt MiB (mean)", "stall (s, median)", "wall (s)"]
    ref = next((r["final_valid_loss"] for r in rows if r["policy"] == "no-faults" and r["ok"]),
               None)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['policy']} | failed: {r['note']} |" + " |" * (len(head) - 2))
            continue
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append("| " + " | ".join([
            r["policy"], fmt(r["final_valid_loss"], ".4f"),
            "-" if ref is None else f"{r['final_valid_loss'] - ref:+.4f}", str(r["recoveries"]),
            str(r["iterations_lost"]), f"{100 * r['cumulative_plt']:.2f} %",
            ",".join(str(k) for k in r["k_after"]) or "-",
            ",".join(r["recovery_sources"]) or "-",
            ",".join(f"{s:.2f}" for s in r["load_s"]) or "-",
            ",".join(str(s) for s in r["restart_s"]) or "-",
            fmt(r["checkpoint_mib_mean"], ".2f"), fmt(r["stall_s_median"], ".3f"),
            f"{r['wall_s']:.0f}"]) + " |")
    return "\n".join(lines)


def plot(rows, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r["ok"]]
    ref = next((r for r in ok if r["policy"] == "no-faults"), None)
    fig, (ax_v, ax_d, ax_t) = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {name: f"C{i}" for i, name in enumerate(POLICIES)}  # one colour per policy
    for r in ok:
        color = colors[r["policy"]]
        if r["valid_curve"]:
            its, losses = zip(*sorted(dict(r["valid_curve"]).items()))
            ax_v.plot(its, losses, marker="o", label=r["policy"], color=color)
        if ref is None or r is ref:
            continue
        # The curves nearly coincide: differences from the fault-free run say more.
        base = dict(ref["valid_curve"])
        its = [i for i, _ in r["valid_curve"] if i in base]
        ax_d.plot(its, [dict(r["valid_curve"])[i] - base[i] for i in its], marker="o",
                  label=r["policy"], color=color)
        base_t, mine = dict(ref["train_curve"]), dict(r["train_curve"])
        its = [i for i in sorted(mine) if i in base_t]
        diff = [mine[i] - base_t[i] for i in its]
        smooth = [sum(diff[max(0, j - 9):j + 1]) / len(diff[max(0, j - 9):j + 1])
                  for j in range(len(diff))]
        ax_t.plot(its, smooth, label=r["policy"], linewidth=1, color=color)
    ax_v.set(title="validation loss", xlabel="iteration", ylabel="lm loss")
    ax_d.set(title="validation loss - no-faults run", xlabel="iteration")
    ax_t.set(title="training loss - no-faults run (10-iteration mean)", xlabel="iteration")
    for ax in (ax_d, ax_t):
        ax.axhline(0, color="grey", linewidth=0.5)
    for ax in (ax_v, ax_d, ax_t):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    opts = build_parser().parse_args()
    names = [n.strip() for n in opts.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        print(f"error: unknown policies {unknown}; choose from {sorted(POLICIES)}", file=sys.stderr)
        return 2
    data = prepare_stdlib_corpus(os.path.join(REPO, opts.data_prefix))
    out = os.path.abspath(opts.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    rows = []
    for name in names:
        print(f"[accuracy] {name} ...", flush=True)
        rows.append(run_policy(name, opts, data, out))
        print(f"[accuracy] {name}: {json.dumps({k: v for k, v in rows[-1].items() if 'curve' not in k})}",
              flush=True)
    json.dump({"options": vars(opts), "rows": rows}, open(os.path.join(out, "results.json"), "w"),
              indent=1)
    text = table(rows)
    open(os.path.join(out, "table.md"), "w").write(text + "\n")
    print(text)
    if plot(rows, os.path.join(out, "loss.png")):
        print(f"plot: {os.path.join(out, 'loss.png')}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
